//! Templates: which root filesystem a sandbox boots. `base` is the rootfs itself; every other
//! template is a qcow2 layer over it built from `guest-image/templates/<name>/` by
//! `cargo xtask images` and listed in the image manifest as `template.<name>`.
//!
//! Owns: `template: auto` (pick by the repo's files), resolving a name to a disk image, and the
//! `GET /v1/templates` listing.
//! Never: builds images (xtask does).

use std::path::{Path, PathBuf};

use super::{Service, ServiceError};
use crate::api;
use crate::vmm::Images;

/// The template every image set has: the base rootfs.
pub const BASE: &str = "base";

/// `auto`: the template a repo asks for by its files, in this order: `package.json` -> node,
/// `pyproject.toml` / `requirements.txt` / `setup.py` -> python, `go.mod` -> go,
/// `Cargo.toml` -> rust, else base. Only the repo's top directory is looked at.
pub fn detect(repo: &Path) -> &'static str {
    let has = |f: &str| repo.join(f).is_file();
    if has("package.json") {
        "node"
    } else if has("pyproject.toml") || has("requirements.txt") || has("setup.py") {
        "python"
    } else if has("go.mod") {
        "go"
    } else if has("Cargo.toml") {
        "rust"
    } else {
        BASE
    }
}

/// What to tell the user when `auto` wanted `wanted` for a repo and the sandbox got `got`
/// (the wanted layer is not in the installed images): how to build and install it.
pub fn fallback_note(wanted: &str, got: &str) -> Option<String> {
    (wanted != got).then(|| {
        format!(
            "note: this repo asks for the `{wanted}` template, which is not installed; the sandbox \
             runs on `{got}`. Build it with `cargo xtask images --template {wanted}` and install \
             it with `tryboxi install --artifacts _out` (new sandboxes get it)."
        )
    })
}

/// Template name -> disk image, from the manifest (`base` -> the rootfs, `template.<n>` -> a layer).
pub fn available(images: &Images) -> Vec<(String, PathBuf)> {
    let mut out = vec![(BASE.to_owned(), images.rootfs.clone())];
    for a in &images.manifest.artifacts {
        if let Some(name) = a.name.strip_prefix("template.")
            && name != BASE
            && let Some(file) = crate::vmm::images::checked_file_name(&a.file)
        {
            out.push((name.to_owned(), images.dir.join(file)));
        }
    }
    out
}

/// Which template a create gets and why (`requested` is the request's field, `None` = auto).
/// An explicit name must exist; `auto` falls back to base when the detected one is not built
/// (base has build-essential, not the go/rust toolchains).
pub fn resolve(
    images: &Images,
    requested: Option<&str>,
    repo: Option<&Path>,
) -> Result<(String, PathBuf), ServiceError> {
    let avail = available(images);
    let find = |n: &str| avail.iter().find(|(name, _)| name == n).cloned();
    match requested {
        None | Some("auto") | Some("") => {
            // No repo to look at: the base template.
            let want = repo.map_or(BASE, detect);
            Ok(find(want).unwrap_or_else(|| {
                tracing::info!(wanted = want, "template `{want}` is not built; using base");
                avail[0].clone()
            }))
        }
        Some(n) => find(n).ok_or_else(|| {
            ServiceError::BadRequest(format!(
                "no template `{n}`; available: auto, {} (build more with `cargo xtask images`)",
                avail
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        }),
    }
}

impl Service {
    /// `GET /v1/templates`.
    pub fn list_templates(&self) -> Result<api::TemplateList, ServiceError> {
        let images = self.images()?;
        let templates = available(&images)
            .into_iter()
            .map(|(name, path)| {
                let file = path
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let a = images.manifest.artifacts.iter().find(|a| a.file == file);
                api::Template {
                    name,
                    file,
                    size: a.map(|a| a.size).unwrap_or(0),
                    sha256: a.map(|a| a.sha256.clone()).unwrap_or_default(),
                }
            })
            .collect();
        Ok(api::TemplateList { templates })
    }

    /// The disk image of a sandbox's template (restore and fork boot the same one).
    pub(super) fn template_rootfs(
        &self,
        images: &Images,
        template: &str,
    ) -> Result<PathBuf, ServiceError> {
        // Sandboxes created before templates existed recorded `auto`: they booted the base.
        let template = if template == "auto" { BASE } else { template };
        available(images)
            .into_iter()
            .find(|(n, _)| n == template)
            .map(|(_, p)| p)
            .ok_or_else(|| {
                ServiceError::Unavailable(format!(
                    "the sandbox's template `{template}` is not in the installed images"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_detects_by_repo_files_in_order() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(detect(d.path()), "base");
        std::fs::write(d.path().join("Cargo.toml"), "").unwrap();
        assert_eq!(detect(d.path()), "rust");
        std::fs::write(d.path().join("go.mod"), "").unwrap();
        assert_eq!(detect(d.path()), "go");
        std::fs::write(d.path().join("requirements.txt"), "").unwrap();
        assert_eq!(detect(d.path()), "python");
        std::fs::write(d.path().join("package.json"), "{}").unwrap();
        assert_eq!(detect(d.path()), "node");
        let p = tempfile::tempdir().unwrap();
        std::fs::write(p.path().join("pyproject.toml"), "").unwrap();
        assert_eq!(detect(p.path()), "python");
        // A directory named like a marker file does not count.
        let q = tempfile::tempdir().unwrap();
        std::fs::create_dir(q.path().join("package.json")).unwrap();
        assert_eq!(detect(q.path()), "base");
    }

    fn images(dir: &Path, templates: &[&str]) -> Images {
        let img = dir.join("images");
        std::fs::create_dir_all(&img).unwrap();
        let mut arts = vec![];
        for (name, file) in [
            ("kernel", "vmlinuz"),
            ("initramfs", "initramfs.cpio.gz"),
            ("rootfs", "rootfs.ext4"),
        ] {
            std::fs::write(img.join(file), "x").unwrap();
            arts.push(serde_json::json!({"name":name,"file":file,"size":1,"sha256":"00"}));
        }
        for t in templates {
            let file = format!("template-{t}.qcow2");
            std::fs::write(img.join(&file), "x").unwrap();
            arts.push(serde_json::json!({"name":format!("template.{t}"),"file":file,"size":1,"sha256":"11"}));
        }
        std::fs::write(
            img.join("manifest.json"),
            serde_json::json!({"version":1,"artifacts":arts}).to_string(),
        )
        .unwrap();
        Images::load(dir).unwrap()
    }

    #[test]
    fn resolve_explicit_auto_and_fallback() {
        let d = tempfile::tempdir().unwrap();
        let imgs = images(d.path(), &["node", "python"]);
        let repo = tempfile::tempdir().unwrap();
        let (n, p) = resolve(&imgs, None, Some(repo.path())).unwrap();
        assert_eq!(
            (n.as_str(), p.file_name().unwrap()),
            ("base", "rootfs.ext4".as_ref())
        );
        std::fs::write(repo.path().join("package.json"), "{}").unwrap();
        let (n, p) = resolve(&imgs, Some("auto"), Some(repo.path())).unwrap();
        assert_eq!(n, "node");
        assert!(p.ends_with("template-node.qcow2"));
        let (n, _) = resolve(&imgs, Some("python"), Some(repo.path())).unwrap();
        assert_eq!(n, "python");
        let e = resolve(&imgs, Some("cobol"), Some(repo.path())).unwrap_err();
        assert!(
            e.to_string()
                .contains("available: auto, base, node, python"),
            "{e}"
        );
        // auto for a Go repo: no go template built -> base.
        let g = tempfile::tempdir().unwrap();
        std::fs::write(g.path().join("go.mod"), "").unwrap();
        let got = resolve(&imgs, None, Some(g.path())).unwrap().0;
        assert_eq!(got, "base");
        // ... and the CLI says so, with the commands that build and install it.
        let note = fallback_note(detect(g.path()), &got).expect("a note");
        assert!(
            note.contains("`go` template")
                && note.contains("cargo xtask images --template go")
                && note.contains("tryboxi install"),
            "{note}"
        );
        assert_eq!(fallback_note("node", "node"), None);
        // No workspace at all (an E2B-style sandbox): auto is the base, even with a node
        // template built.
        let (n, p) = resolve(&imgs, Some("auto"), None).unwrap();
        assert_eq!(
            (n.as_str(), p.file_name().unwrap()),
            ("base", "rootfs.ext4".as_ref())
        );
    }
}
