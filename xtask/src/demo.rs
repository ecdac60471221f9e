//! `cargo xtask demo`: the main job on a fresh machine. Installs what is needed, builds the
//! binary and images (cached), starts the daemon on a scratch data root (outside the repo),
//! creates a sandbox for a repo, runs commands in it, removes it and stops the daemon. CI runs
//! it too (step `demo`), so the README's first command cannot break unseen.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::daemon::Daemon;
use crate::util;

pub fn run(repo: Option<std::path::PathBuf>) -> Result<()> {
    crate::deps::run()?;
    let bin = crate::images::dist_and_defaults()?;
    with_built(&bin, &repo.unwrap_or_else(util::repo_root))
}

/// The demo with the binary `bin` and the images in `_out` already built (CI's step `demo`).
pub fn with_built(bin: &std::path::Path, repo: &std::path::Path) -> Result<()> {
    let out = util::out_dir();
    let repo = repo.to_path_buf();
    let home = demo_home(&repo);
    println!(
        "\n==> installing the guest images into the data root {}",
        home.display()
    );
    // A scratch install: the images go into the demo's data root, the programs below
    // `_out/demo-root` (not the host's /usr/local) and no service is started.
    let st = Command::new(bin)
        .args(["install", "--no-service", "--artifacts"])
        .arg(&out)
        .arg("--destdir")
        .arg(out.join("demo-root"))
        .env("TRYBOXI_HOME", &home)
        .status()?;
    if !st.success() {
        bail!("tryboxi install failed");
    }
    println!("\n==> starting the daemon");
    let d = Daemon::start(bin, &home, &home.join("artifacts"), "")?;
    let res = session(bin, &d, &repo);
    println!("\n==> stopping the daemon");
    d.stop()?;
    res
}

/// The demo's scratch data root: outside the repo, because a folder that holds the data root
/// is never a workspace (the daemon refuses it: a sync would copy the VMs' own files into a VM).
/// On disk under /var/tmp (VM RAM files live there; /tmp may be RAM), one per user and checkout.
fn demo_home(repo: &std::path::Path) -> std::path::PathBuf {
    use sha2::Digest;
    let key = hex::encode(sha2::Sha256::digest(repo.as_os_str().as_encoded_bytes()));
    // SAFETY: `getuid` has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::path::PathBuf::from("/var/tmp").join(format!("tryboxi-demo-{uid}-{}", &key[..12]))
}

fn session(bin: &std::path::Path, d: &Daemon, repo: &std::path::Path) -> Result<()> {
    let cli = |args: &[&str]| -> Result<std::process::Output> {
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("'{a}'")
                } else {
                    a.to_string()
                }
            })
            .collect();
        println!("$ tryboxi {}", shown.join(" "));
        let o = Command::new(bin)
            .args(args)
            .env("TRYBOXI_HOME", &d.home)
            .output()?;
        print!("{}", String::from_utf8_lossy(&o.stdout));
        eprint!("{}", String::from_utf8_lossy(&o.stderr));
        Ok(o)
    };
    cli(&["doctor"])?;
    println!(
        "\n==> creating a sandbox for {} (boots a microVM)",
        repo.display()
    );
    let started = std::time::Instant::now();
    let o = cli(&["create", "-w", &repo.display().to_string()])?;
    if !o.status.success() {
        bail!("create failed; daemon log: {}", d.log.display());
    }
    println!("   (ready in {})", util::fmt_dur(started.elapsed()));
    let id = String::from_utf8(o.stdout)?
        .split_whitespace()
        .next()
        .context("no id")?
        .to_owned();
    let o = cli(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "uname -a; cat /etc/os-release | head -2; nproc; free -m | head -2",
    ])?;
    let o2 = cli(&["exec", &id, "--", "sh", "-c", "echo to-stderr >&2; exit 3"])?;
    println!("   (exit code {:?}, expected 3)", o2.status.code());
    cli(&["ls"])?;
    cli(&["rm", &id])?;
    if !o.status.success() || o2.status.code() != Some(3) {
        bail!(
            "the demo's commands did not behave as expected; daemon log: {}",
            d.log.display()
        );
    }
    println!("\n==> demo done");
    Ok(())
}
