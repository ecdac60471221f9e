//! `cargo xtask images`: the guest kernel, rootfs, initramfs and template layers
//! (`template.<name>`: qcow2 over the rootfs, see [`template`]).
//!
//! Each is built into the cache outside the checkout ([`cache`], keyed by a recipe hash) and
//! then placed into `_out/images/` (hard link, or a sparse copy across filesystems) next to a
//! `manifest.json` the daemon reads. A run with nothing changed only stats files. Never
//! modifies a finished cache entry.

pub mod cache;
pub mod initramfs;
pub mod kernel;
pub mod modules;
pub mod rootfs;
pub mod template;

use crate::util::{Step, out_dir};
use anyhow::{Context, Result};
use cache::Entry;
use serde::Serialize;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Serialize)]
pub struct Manifest {
    pub version: u32,
    pub artifacts: Vec<ManifestArtifact>,
    pub kernel_version: String,
    /// `built` or `packaged` (see [`kernel::Flavor`]).
    pub kernel_flavor: String,
    /// The VM must run `microvm,acpi=on`: the packaged kernel finds its virtio-mmio devices
    /// through ACPI only. Absent (false) for the built kernel, which runs with `acpi=off`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub acpi: bool,
    /// Recipe hash (cache key) of each artifact, by name.
    pub recipes: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub struct ManifestArtifact {
    /// `kernel`, `rootfs` or `initramfs`.
    pub name: String,
    /// File name inside `_out/images/`.
    pub file: String,
    pub size: u64,
    pub sha256: String,
    pub recipe: String,
    pub built_at: String,
    pub build_seconds: f64,
}

/// Which artifacts to rebuild even if the cache has them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Rebuild {
    pub kernel: bool,
    pub rootfs: bool,
}

/// What `cargo xtask images` builds beyond the defaults.
#[derive(Debug, Default, Clone, Copy)]
pub struct Choice {
    pub kernel: kernel::Flavor,
}

/// The static binary and every image with the defaults (nothing forced, no extra templates):
/// what demo and bench need before they start; the binary's path.
pub fn dist_and_defaults() -> Result<std::path::PathBuf> {
    let bin = crate::dist::run()?;
    run(
        &bin,
        Rebuild::default(),
        &Default::default(),
        Default::default(),
    )?;
    Ok(bin)
}

/// Builds or reuses all three artifacts; returns `_out/images/`.
pub fn run(
    binary: &Path,
    rebuild: Rebuild,
    templates: &template::Wanted,
    choice: Choice,
) -> Result<PathBuf> {
    // mmdebstrap, linux-source, e2fsprogs...: a fresh machine has none of them (a dpkg-query
    // when all are there).
    crate::deps::debian()?;
    let cache = cache::Cache::from_env();
    println!("    image cache: {}", cache.root.display());
    let kernel = kernel::build_flavor(&cache, choice.kernel, rebuild.kernel)?;
    let initramfs = initramfs::build(&cache, binary, kernel::modules_of(&kernel).as_deref())?;
    let rootfs = rootfs::build(&cache, rebuild.rootfs)?;
    let templates = template::build_all(&cache, &rootfs, templates)?;

    let step = Step::start("images: placing into _out/images");
    let dir = out_dir().join("images");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let template_names: Vec<String> = templates
        .iter()
        .map(|(n, _)| format!("template.{n}"))
        .collect();
    let mut parts: Vec<(&str, &Entry)> = vec![
        ("kernel", &kernel),
        ("rootfs", &rootfs),
        ("initramfs", &initramfs),
    ];
    for (name, (_, e)) in template_names.iter().zip(&templates) {
        parts.push((name.as_str(), e));
    }
    for (_, e) in &parts {
        place(&e.file_path(), &dir.join(&e.meta.file))?;
    }
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        kernel_version: kernel
            .meta
            .extra
            .get("version")
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string(),
        kernel_flavor: choice.kernel.name().into(),
        acpi: kernel::needs_acpi(&kernel),
        recipes: parts
            .iter()
            .map(|(n, e)| (n.to_string(), e.meta.key.clone()))
            .collect(),
        artifacts: parts.iter().map(|(n, e)| artifact(n, e)).collect(),
    };
    let text = serde_json::to_string_pretty(&manifest)? + "\n";
    let path = dir.join("manifest.json");
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        let tmp = dir.join(".manifest.json.tmp");
        std::fs::write(&tmp, &text)?;
        std::fs::rename(&tmp, &path)?;
    }
    step.done(&path.display().to_string());
    Ok(dir)
}

fn artifact(name: &str, e: &Entry) -> ManifestArtifact {
    ManifestArtifact {
        name: name.into(),
        file: e.meta.file.clone(),
        size: e.meta.size,
        sha256: e.meta.sha256.clone(),
        recipe: e.meta.key.clone(),
        built_at: e.meta.built_at.clone(),
        build_seconds: e.meta.build_seconds,
    }
}

/// Makes `dst` the same content as `src`: a hard link when possible (same inode = nothing to
/// do), else a sparse copy. Atomic: `dst` is replaced by rename.
fn place(src: &Path, dst: &Path) -> Result<()> {
    let s = std::fs::metadata(src).with_context(|| format!("stat {}", src.display()))?;
    if let Ok(d) = std::fs::metadata(dst)
        && d.dev() == s.dev()
        && d.ino() == s.ino()
    {
        return Ok(());
    }
    let name = dst.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dst.with_file_name(format!(".{}.tmp", name.unwrap_or_default()));
    let _ = std::fs::remove_file(&tmp);
    if std::fs::hard_link(src, &tmp).is_err() {
        crate::util::run_inherit(
            Command::new("cp").arg("--sparse=always").arg(src).arg(&tmp),
            "cp",
        )?;
    }
    std::fs::rename(&tmp, dst).with_context(|| format!("installing {}", dst.display()))?;
    Ok(())
}
