//! The guest kernel, one of two ([`Flavor`]):
//!
//! - `built` (default): `tinyconfig` + our fragment (`guest-image/kernel/config-fragment`),
//!   built from Debian's `linux-source-6.12` tarball (bookworm-security) with our patches
//!   (`guest-image/kernel/patches/*.patch`, applied in name order with `patch -p1`; each says
//!   why it exists). Everything built in, no modules. Cache key = sha256(fragment, patches,
//!   linux-source package version, recipe version). Fails the build if any option the
//!   fragment asks for did not survive `make olddefconfig`, or a patch does not apply: a
//!   silently dropped option or patch is a bug.
//! - `packaged`: Debian's signed cloud kernel ([`PACKAGED_META`]), fetched with `apt-get
//!   download` from the machine's own apt sources and unpacked with `dpkg-deb -x` (never
//!   installed), plus the modules of `guest-image/kernel/packaged-modules` (see [`super::modules`])
//!   in the entry's `modules/` for the initramfs. Cache key = sha256(recipe version, package
//!   name and version, module list). It has no `virtio_mmio.device=` command-line devices
//!   (`CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` is off), so it finds the virtio-mmio devices
//!   through ACPI: the VM must run `microvm,acpi=on` (recorded as `acpi` in the manifest).
//!
//! Never touches the source tarball, the host's /boot, or anything outside its temp dir.

use super::cache::{Begin, Cache, Entry};
use crate::deps::package_version;
use crate::util::{Step, output, recipe_key, repo_root, run_logged, sha256_file};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bump when the build procedure below changes in a way that changes the output.
const RECIPE_VERSION: &str = "kernel-1";
const SOURCE_PACKAGE: &str = "linux-source-6.12";
const SOURCE_TARBALL: &str = "/usr/src/linux-source-6.12.tar.xz";
pub const FILE: &str = "vmlinuz";
const PACKAGED_RECIPE: &str = "kernel-packaged-1";
/// The meta package whose one dependency is the current packaged cloud kernel (6.12, from
/// bookworm-security on Debian 12).
pub const PACKAGED_META: &str = "linux-image-6.12-cloud-amd64";
/// The entry directory holding a packaged kernel's modules for the initramfs.
pub const MODULES_DIR: &str = "modules";

/// Which kernel `cargo xtask images` puts into the images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    #[default]
    Built,
    Packaged,
}

impl Flavor {
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Built => "built",
            Flavor::Packaged => "packaged",
        }
    }
}

/// The packaged kernel's modules directory in a kernel entry, if it has one.
pub fn modules_of(e: &Entry) -> Option<PathBuf> {
    let d = e.dir.join(MODULES_DIR);
    d.is_dir().then_some(d)
}

/// Whether the VM must describe its devices through ACPI for this kernel.
pub fn needs_acpi(e: &Entry) -> bool {
    e.meta.extra.get("flavor").and_then(|v| v.as_str()) == Some("packaged")
}

pub fn build_flavor(cache: &Cache, flavor: Flavor, force: bool) -> Result<Entry> {
    match flavor {
        Flavor::Built => build(cache, force),
        Flavor::Packaged => build_packaged(cache, force),
    }
}

/// The package the meta package depends on now, and its candidate version (apt's own view).
fn packaged_candidate() -> Result<(String, String)> {
    let deps = output(
        Command::new("apt-cache").args(["depends", PACKAGED_META]),
        "apt-cache depends",
    )?;
    let pkg = deps
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .map(str::to_owned)
        .with_context(|| format!("{PACKAGED_META} has no dependency in apt's lists"))?;
    let policy = output(
        Command::new("apt-cache").args(["policy", &pkg]),
        "apt-cache policy",
    )?;
    let version = policy
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate: "))
        .filter(|v| *v != "(none)")
        .map(str::to_owned)
        .with_context(|| format!("no candidate version of {pkg} (run apt-get update)"))?;
    Ok((pkg, version))
}

fn build_packaged(cache: &Cache, force: bool) -> Result<Entry> {
    let list_file = super::modules::list_path();
    let list = std::fs::read_to_string(&list_file)
        .with_context(|| format!("reading {}", list_file.display()))?;
    let (pkg, version) = packaged_candidate()?;
    let key = recipe_key(&[
        ("recipe", PACKAGED_RECIPE.as_bytes()),
        ("package", pkg.as_bytes()),
        ("version", version.as_bytes()),
        ("modules", list.as_bytes()),
    ]);
    if !force && let Some(e) = cache.lookup("kernel", &key) {
        println!(
            "==> kernel: cached ({pkg} {version}, fetched {})",
            e.meta.built_at
        );
        return Ok(e);
    }
    let step = Step::start(format!(
        "kernel: fetching {pkg} {version} (apt-get download + dpkg-deb -x, seconds)"
    ));
    let pending = match cache.begin("kernel", &key)? {
        Begin::Build(p) => p,
        Begin::Done(e) => return Ok(e),
    };
    let work = pending.dir.join("pkg");
    std::fs::create_dir(&work)?;
    let log = pending.log.clone();
    run_logged(
        Command::new("apt-get")
            .current_dir(&work)
            .args(["download", &format!("{pkg}={version}")]),
        "apt-get download",
        &log,
    )?;
    let deb = std::fs::read_dir(&work)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no .deb")?;
    let root = work.join("root");
    run_logged(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root),
        "dpkg-deb -x",
        &log,
    )?;
    let moddir = single_subdir(&root.join("lib/modules"))?;
    let release = moddir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::fs::copy(
        root.join(format!("boot/vmlinuz-{release}")),
        pending.dir.join(FILE),
    )
    .context("copying the packaged vmlinuz")?;
    std::fs::copy(
        root.join(format!("boot/config-{release}")),
        pending.dir.join("config"),
    )
    .context("copying the packaged config")?;
    let order = super::modules::collect(&moddir, &list, &pending.dir.join(MODULES_DIR))?;
    std::fs::remove_dir_all(&work).context("removing the unpacked package")?;
    let sha = sha256_file(&pending.dir.join(FILE))?;
    let mut extra = serde_json::Map::new();
    extra.insert("version".into(), release.clone().into());
    extra.insert("flavor".into(), "packaged".into());
    extra.insert("package".into(), pkg.into());
    extra.insert("package_version".into(), version.into());
    extra.insert("modules".into(), order.len().into());
    let elapsed = step.elapsed();
    let entry = pending.commit(FILE, sha, elapsed, extra)?;
    step.done(&format!(
        "Linux {release}, {} bytes, {} modules for the initramfs",
        entry.meta.size,
        order.len()
    ));
    Ok(entry)
}

pub fn fragment_path() -> PathBuf {
    repo_root().join("guest-image/kernel/config-fragment")
}

/// The kernel patches, in the order they are applied: `(file name, contents)`.
pub fn patches() -> Result<Vec<(String, Vec<u8>)>> {
    let dir = repo_root().join("guest-image/kernel/patches");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = e?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name.ends_with(".patch") {
            let text =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            out.push((name.to_string(), text));
        }
    }
    out.sort();
    Ok(out)
}

pub fn build(cache: &Cache, force: bool) -> Result<Entry> {
    let fragment_file = fragment_path();
    let fragment = std::fs::read(&fragment_file)
        .with_context(|| format!("reading {}", fragment_file.display()))?;
    let src_version = package_version(SOURCE_PACKAGE)?;
    let patches = patches()?;
    let patch_keys: Vec<(String, &[u8])> = patches
        .iter()
        .map(|(name, text)| (format!("patch:{name}"), text.as_slice()))
        .collect();
    let mut parts: Vec<(&str, &[u8])> = vec![
        ("recipe", RECIPE_VERSION.as_bytes()),
        ("fragment", &fragment),
        ("linux-source", src_version.as_bytes()),
    ];
    parts.extend(patch_keys.iter().map(|(k, v)| (k.as_str(), *v)));
    let key = recipe_key(&parts);
    if !force && let Some(e) = cache.lookup("kernel", &key) {
        println!(
            "==> kernel: cached (Linux {}, built {})",
            e.meta
                .extra
                .get("version")
                .and_then(|v| v.as_str())
                .unwrap_or("?"),
            e.meta.built_at
        );
        return Ok(e);
    }

    let step = Step::start_expect(
        format!("kernel: building {SOURCE_PACKAGE} {src_version}"),
        "~6 min on 2 idle cores, longer on a busy machine; cached afterwards",
    );
    let pending = match cache.begin("kernel", &key)? {
        Begin::Build(p) => p,
        Begin::Done(e) => return Ok(e),
    };
    let work = pending.dir.join("build");
    std::fs::create_dir(&work)?;
    let log = pending.log.clone();

    println!("    extracting {SOURCE_TARBALL}");
    run_logged(
        Command::new("tar")
            .arg("-xJf")
            .arg(SOURCE_TARBALL)
            .arg("-C")
            .arg(&work),
        "tar",
        &log,
    )?;
    let src = single_subdir(&work)?;
    for (name, _) in &patches {
        println!("    patching: {name}");
        let file = repo_root().join("guest-image/kernel/patches").join(name);
        run_logged(
            Command::new("patch")
                .current_dir(&src)
                .args(["-p1", "--forward", "--batch", "-i"])
                .arg(&file),
            &format!("patch {name}"),
            &log,
        )?;
    }
    let make = |args: &[&str], what: &str| -> Result<()> {
        run_logged(
            Command::new("make")
                .current_dir(&src)
                .args(args)
                .env("KBUILD_BUILD_USER", "tryboxi")
                .env("KBUILD_BUILD_HOST", "tryboxi")
                .env("KBUILD_BUILD_TIMESTAMP", "1970-01-01"),
            what,
            &log,
        )
    };
    println!("    configuring: tinyconfig + fragment + olddefconfig");
    make(&["tinyconfig"], "make tinyconfig")?;
    run_logged(
        Command::new("scripts/kconfig/merge_config.sh")
            .current_dir(&src)
            .args(["-m", ".config"])
            .arg(&fragment_file),
        "merge_config",
        &log,
    )?;
    make(&["olddefconfig"], "make olddefconfig")?;
    let config = std::fs::read_to_string(src.join(".config")).context("reading final .config")?;
    let problems = check_config(&String::from_utf8_lossy(&fragment), &config);
    if !problems.is_empty() {
        bail!(
            "the kernel config dropped or changed options the fragment asks for \
             (fix {}: add their dependencies or remove them):\n  {}",
            fragment_file.display(),
            problems.join("\n  ")
        );
    }
    println!("    config verified: every fragment option is in the final .config");

    let jobs = format!(
        "-j{}",
        std::thread::available_parallelism().map_or(2, |n| n.get())
    );
    make(&[&jobs, "bzImage"], "make bzImage")?;
    let version = output(
        Command::new("make")
            .current_dir(&src)
            .args(["-s", "kernelrelease"]),
        "make kernelrelease",
    )?;
    std::fs::copy(src.join("arch/x86/boot/bzImage"), pending.dir.join(FILE))
        .context("copying bzImage")?;
    std::fs::write(pending.dir.join("config"), &config)?;
    std::fs::remove_dir_all(&work).context("removing kernel build tree")?;
    let sha = sha256_file(&pending.dir.join(FILE))?;
    let mut extra = serde_json::Map::new();
    extra.insert("version".into(), version.clone().into());
    extra.insert("flavor".into(), "built".into());
    extra.insert("source_package".into(), SOURCE_PACKAGE.into());
    extra.insert("source_version".into(), src_version.into());
    let elapsed = step.elapsed();
    let entry = pending.commit(FILE, sha, elapsed, extra)?;
    step.done(&format!("Linux {version}, {} bytes", entry.meta.size));
    Ok(entry)
}

fn single_subdir(dir: &Path) -> Result<PathBuf> {
    let mut dirs = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.path());
    match (dirs.next(), dirs.next()) {
        (Some(d), None) => Ok(d),
        _ => bail!("expected exactly one directory in {}", dir.display()),
    }
}

/// What the fragment asks for that the final `.config` does not have: every `CONFIG_X=v` line
/// must appear verbatim, and every `# CONFIG_X is not set` must not be enabled.
pub fn check_config(fragment: &str, config: &str) -> Vec<String> {
    let have: std::collections::HashMap<&str, &str> = config
        .lines()
        .filter_map(|l| l.strip_prefix("CONFIG_")?.split_once('='))
        .collect();
    let mut problems = Vec::new();
    for line in fragment.lines().map(str::trim) {
        if let Some((name, want)) = line.strip_prefix("CONFIG_").and_then(|l| l.split_once('=')) {
            match have.get(name) {
                Some(got) if *got == want => {}
                Some(got) => problems.push(format!("CONFIG_{name}: wanted {want}, got {got}")),
                None => problems.push(format!("CONFIG_{name}: wanted {want}, but it is not set")),
            }
        } else if let Some(name) = line
            .strip_prefix("# CONFIG_")
            .and_then(|l| l.strip_suffix(" is not set"))
            && let Some(got) = have.get(name)
        {
            problems.push(format!("CONFIG_{name}: wanted off, got {got}"));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_option_is_reported() {
        let frag = "CONFIG_A=y\nCONFIG_B=y\n";
        let cfg = "CONFIG_A=y\n# CONFIG_B is not set\n";
        assert_eq!(
            check_config(frag, cfg),
            vec!["CONFIG_B: wanted y, but it is not set"]
        );
    }

    #[test]
    fn option_that_must_be_off_but_is_on_is_reported() {
        let frag = "# CONFIG_PCI is not set\nCONFIG_N=64\n";
        let cfg = "CONFIG_PCI=y\nCONFIG_N=8\n";
        assert_eq!(
            check_config(frag, cfg),
            vec![
                "CONFIG_PCI: wanted off, got y",
                "CONFIG_N: wanted 64, got 8"
            ]
        );
    }

    #[test]
    fn satisfied_fragment_has_no_problems() {
        let frag = "# comment\nCONFIG_A=y\n# CONFIG_C is not set\n";
        assert!(check_config(frag, "CONFIG_A=y\nCONFIG_D=m\n").is_empty());
    }

    #[test]
    fn shipped_fragment_lists_the_options_that_matter() {
        let frag = std::fs::read_to_string(fragment_path()).unwrap();
        for opt in [
            "VIRTIO_MMIO_CMDLINE_DEVICES",
            "VIRTIO_BLK",
            "VIRTIO_CONSOLE",
            "VIRTIO_VSOCKETS",
            "EXT4_FS",
            "DEVTMPFS",
            "SERIAL_8250_CONSOLE",
            "BLK_DEV_INITRD",
            "RD_GZIP",
            "UNIX98_PTYS",
        ] {
            assert!(
                frag.contains(&format!("\nCONFIG_{opt}=y\n")),
                "missing {opt}"
            );
        }
        for off in ["PCI", "ACPI", "CMDLINE_BOOL"] {
            assert!(
                frag.contains(&format!("# CONFIG_{off} is not set")),
                "{off} must be off"
            );
        }
        assert!(
            !frag
                .lines()
                .any(|l| l.starts_with("CONFIG_") && l.ends_with("=m"))
        );
    }
}
