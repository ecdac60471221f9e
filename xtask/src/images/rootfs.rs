//! The guest root filesystem: Debian trixie (`mmdebstrap --variant=minbase` plus
//! `guest-image/rootfs/packages`), customized by `guest-image/rootfs/customize.sh`, packed with
//! `mkfs.ext4 -d` into a sparse image. No Docker, no loop mounts; needs root (mmdebstrap's root
//! mode keeps file ownership right). Never touches anything outside its cache temp dir.
//!
//! The Debian mirror is the one the machine's apt sources name for the suite, or for the
//! host's own release when they name no trixie source (`apt_sources`).
//!
//! Cache key = sha256(recipe version, suite, mirror, variant, headroom, package list,
//! customize.sh). The Debian archive moves on: `--rebuild rootfs` refreshes the same key.

use super::cache::{Begin, Cache, Entry};
use crate::util::{Step, fmt_dur, is_root, output, recipe_key, repo_root, run_logged, sha256_file};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bump when the build procedure below changes in a way that changes the output.
const RECIPE_VERSION: &str = "rootfs-1";
/// Debian 13, as close to the spec's Ubuntu 24.04 guest as Debian gets (issue 18 item 10).
const SUITE: &str = "trixie";
const VARIANT: &str = "minbase";
/// Free space left in the image on top of what the files use.
const HEADROOM_BYTES: u64 = 1 << 30;
const LABEL: &str = "tryboxi-root";
pub const FILE: &str = "rootfs.ext4";

fn recipe_dir() -> PathBuf {
    repo_root().join("guest-image/rootfs")
}

/// Package names from the list file: one per line, `#` comments, blank lines ignored.
pub fn parse_packages(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

pub fn build(cache: &Cache, force: bool) -> Result<Entry> {
    let dir = recipe_dir();
    let packages_text = std::fs::read(dir.join("packages"))
        .with_context(|| format!("reading {}", dir.join("packages").display()))?;
    let customize = dir.join("customize.sh");
    let customize_text =
        std::fs::read(&customize).with_context(|| format!("reading {}", customize.display()))?;
    // The machine's own Debian mirror (its apt sources), never one written here. It stays in
    // the key as before (on a machine using deb.debian.org the key did not change).
    let mirror = crate::apt_sources::debian_mirror(SUITE)?;
    let key = recipe_key(&[
        ("recipe", RECIPE_VERSION.as_bytes()),
        ("suite", SUITE.as_bytes()),
        ("mirror", mirror.as_bytes()),
        ("variant", VARIANT.as_bytes()),
        ("headroom", &HEADROOM_BYTES.to_le_bytes()),
        ("packages", &packages_text),
        ("customize", &customize_text),
    ]);
    if !force && let Some(e) = cache.lookup("rootfs", &key) {
        println!("==> rootfs: cached (built {})", e.meta.built_at);
        return Ok(e);
    }
    if !is_root() {
        bail!("building the rootfs needs root (mmdebstrap keeps file ownership): use sudo");
    }
    let packages = parse_packages(&String::from_utf8_lossy(&packages_text));
    let step = Step::start_expect(
        format!("rootfs: mmdebstrap {SUITE} ({} packages)", packages.len()),
        "~1-2 min; cached afterwards",
    );
    let pending = match cache.begin("rootfs", &key)? {
        Begin::Build(p) => p,
        Begin::Done(e) => return Ok(e),
    };
    let tree = pending.dir.join("root");
    let log = pending.log.clone();

    run_logged(
        Command::new("mmdebstrap")
            .arg("--mode=root")
            .arg(format!("--variant={VARIANT}"))
            .arg(format!("--include={}", packages.join(",")))
            .arg("--aptopt=Acquire::Retries \"3\"")
            .arg("--dpkgopt=path-exclude=/usr/share/man/*")
            .arg("--dpkgopt=path-exclude=/usr/share/info/*")
            .arg("--dpkgopt=path-exclude=/usr/share/doc/*")
            .arg("--dpkgopt=path-include=/usr/share/doc/*/copyright")
            .arg(SUITE)
            .arg(&tree)
            .arg(&mirror),
        "mmdebstrap",
        &log,
    )?;
    let t = std::time::Instant::now();
    run_logged(
        Command::new("sh").arg(&customize).arg(&tree),
        "customize.sh",
        &log,
    )?;
    let used = du_bytes(&tree)?;
    let size = (used + HEADROOM_BYTES).div_ceil(1 << 20) << 20;
    let img = pending.dir.join(FILE);
    // Create the file sparse at its full size; mkfs.ext4 only writes what it uses.
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(size))
        .with_context(|| format!("creating sparse {}", img.display()))?;
    run_logged(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-L", LABEL, "-d"])
            .arg(&tree)
            .arg(&img),
        "mkfs.ext4",
        &log,
    )?;
    std::fs::remove_dir_all(&tree).context("removing the unpacked rootfs tree")?;
    let sha = sha256_file(&img)?;
    println!(
        "    customize + mkfs.ext4 + sha256: {} (used {} MiB, image {} MiB, sparse)",
        fmt_dur(t.elapsed()),
        used >> 20,
        size >> 20
    );
    let mut extra = serde_json::Map::new();
    extra.insert("suite".into(), SUITE.into());
    extra.insert("used_bytes".into(), used.into());
    extra.insert("packages".into(), packages.into());
    let elapsed = step.elapsed();
    let entry = pending.commit(FILE, sha, elapsed, extra)?;
    step.done(&format!("{} MiB image", entry.meta.size >> 20));
    Ok(entry)
}

/// Disk usage of a tree in bytes (allocated blocks, like `du`).
fn du_bytes(dir: &Path) -> Result<u64> {
    let out = output(
        Command::new("du")
            .args(["-s", "-x", "--block-size=1"])
            .arg(dir),
        "du",
    )?;
    out.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("parsing du output {out:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_list_ignores_comments_and_blank_lines() {
        let p = parse_packages("# header\nbash\n\n  git  # vcs\n#x\ncurl\n");
        assert_eq!(p, vec!["bash", "git", "curl"]);
    }

    #[test]
    fn shipped_package_list_has_what_agents_need() {
        let text = std::fs::read_to_string(recipe_dir().join("packages")).unwrap();
        let p = parse_packages(&text);
        for want in [
            "bash",
            "git",
            "python3",
            "build-essential",
            "curl",
            "iproute2",
        ] {
            assert!(p.iter().any(|x| x == want), "missing {want}");
        }
        // Node comes from the `node` template only (tests/sched_e2e.rs checks a base sandbox
        // has no `node`).
        for unwanted in ["nodejs", "npm"] {
            assert!(
                !p.iter().any(|x| x == unwanted),
                "{unwanted} is in the base"
            );
        }
    }
}
