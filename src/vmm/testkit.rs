//! Test fixtures for the real-QEMU tests: the guest kernel from `TRYBOXI_ARTIFACTS`, a tiny
//! test initramfs built from `testdata/test_init.c`, and checks that nothing is left running.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::images::Images;
use super::qemu::QemuDriver;

/// Real-VM tests run one at a time: the build machines have two cores.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The artifacts dir from `TRYBOXI_ARTIFACTS`, or why the test must skip.
pub(crate) fn artifacts() -> Result<PathBuf, String> {
    let dir = std::env::var_os("TRYBOXI_ARTIFACTS")
        .ok_or("TRYBOXI_ARTIFACTS is not set (point it at a dir holding images/vmlinuz)")?;
    Ok(PathBuf::from(dir))
}

/// The guest kernel: from the manifest if there is one, else `images/vmlinuz`.
pub(crate) fn kernel() -> Result<PathBuf, String> {
    let dir = artifacts()?;
    if let Ok(im) = Images::load(&dir) {
        return Ok(im.kernel);
    }
    let k = dir.join("images/vmlinuz");
    if k.is_file() {
        Ok(k)
    } else {
        Err(format!("no guest kernel at {}", k.display()))
    }
}

pub(crate) fn driver() -> Result<QemuDriver, String> {
    QemuDriver::new("qemu-system-x86_64").map_err(|e| format!("no usable QEMU: {e}"))
}

/// The test initramfs (built once per test run into `target/vmm-testdata`).
pub(crate) fn test_initramfs() -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT.get_or_init(build_initramfs).clone()
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn build_initramfs() -> Result<PathBuf, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("building the test initramfs needs root (mknod dev/console)".into());
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/vmm/testdata/test_init.c");
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/vmm-testdata");
    std::fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
    let stage = tempfile::tempdir().map_err(|e| e.to_string())?;
    let s = stage.path();
    for d in ["dev", "proc"] {
        std::fs::create_dir(s.join(d)).map_err(|e| e.to_string())?;
    }
    run(Command::new("gcc")
        .args(["-static", "-Os", "-o"])
        .arg(s.join("init"))
        .arg(&src))?;
    run(Command::new("mknod")
        .arg(s.join("dev/console"))
        .args(["c", "5", "1"]))?;
    let out = out_dir.join("initramfs.cpio.gz");
    run(Command::new("sh")
        .arg("-c")
        .arg("find . | cpio --quiet -o -H newc | gzip -1 > \"$0\"")
        .arg(&out)
        .current_dir(s))?;
    Ok(out)
}

/// A small raw "rootfs" for the overlay (the test init never mounts it).
pub(crate) fn fake_rootfs(dir: &Path) -> PathBuf {
    let p = dir.join("base.raw");
    let f = std::fs::File::create(&p).expect("create base.raw");
    f.set_len(16 << 20).expect("size base.raw");
    p
}

/// Pids of live (non-zombie) processes whose command line mentions `needle`.
pub(crate) fn processes_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.as_os_str().as_encoded_bytes();
    let mut found = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(c) = std::fs::read(e.path().join("cmdline"))
            && c.windows(needle.len()).any(|w| w == needle)
        {
            found.push(pid);
        }
    }
    found
}

/// Wait (bounded) until `path` contains `needle`. The guest writes the console at its own
/// pace, so there is no event to wait on but the file itself.
pub(crate) async fn wait_for_text(path: &Path, needle: &str, within: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if std::fs::read(path)
            .map(|b| String::from_utf8_lossy(&b).contains(needle))
            .unwrap_or(false)
        {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

macro_rules! skip_unless {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(why) => {
                println!("SKIPPED: {why}");
                return;
            }
        }
    };
}
pub(crate) use skip_unless;
