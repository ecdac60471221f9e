//! `cargo xtask dist`: the static release binary in `_out/bin/tryboxi` and its argv[0]
//! symlinks. Builds in `target/dist` so RUSTFLAGS never invalidate normal dev builds.

use crate::elf;
use crate::util::{Step, out_dir, repo_root, run_inherit};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

pub const TARGET: &str = "x86_64-unknown-linux-gnu";
/// Names the one binary answers to (besides `tryboxi` and `init`).
pub const ALIASES: &[&str] = &["sandboxd", "sandboxctl", "sandbox-mcp"];

/// Builds and installs the binary; returns the path of `_out/bin/tryboxi`.
pub fn run() -> Result<PathBuf> {
    let step = Step::start_expect(
        "dist: static release build of tryboxi",
        "~4-6 min from scratch on 2 cores, seconds when nothing changed",
    );
    let root = repo_root();
    let target_dir = root.join("target").join("dist");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run_inherit(
        Command::new(cargo)
            .current_dir(&root)
            .args(["build", "--release", "--bin", "tryboxi", "--target", TARGET])
            .arg("--target-dir")
            .arg(&target_dir)
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env("RUSTFLAGS", "-C target-feature=+crt-static"),
        "cargo build (static release)",
    )?;
    let built = target_dir.join(TARGET).join("release").join("tryboxi");
    let bytes = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    if !elf::is_static(&bytes).with_context(|| format!("inspecting {}", built.display()))? {
        bail!(
            "{} has a PT_INTERP header (dynamically linked); the guest's /init must be static",
            built.display()
        );
    }

    let bin_dir = out_dir().join("bin");
    std::fs::create_dir_all(&bin_dir).with_context(|| format!("creating {}", bin_dir.display()))?;
    let dest = bin_dir.join("tryboxi");
    let tmp = bin_dir.join(".tryboxi.tmp");
    std::fs::copy(&built, &tmp).with_context(|| format!("copying to {}", tmp.display()))?;
    std::fs::rename(&tmp, &dest).with_context(|| format!("installing {}", dest.display()))?;
    for alias in ALIASES {
        let link = bin_dir.join(alias);
        if std::fs::read_link(&link).ok().as_deref() == Some(std::path::Path::new("tryboxi")) {
            continue;
        }
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("tryboxi", &link)
            .with_context(|| format!("creating symlink {}", link.display()))?;
    }
    step.done(&format!(
        "{} bytes, static, {}",
        bytes.len(),
        dest.strip_prefix(&root).unwrap_or(&dest).display()
    ));
    Ok(dest)
}
