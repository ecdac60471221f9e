//! Guest images: where the kernel, the initramfs and the base rootfs are, and whether they
//! are intact.
//!
//! Owns: reading `<artifacts>/images/manifest.json` (format fixed by the image builder) and
//! checking the files it lists (sizes cheaply, sha256 on demand).
//! Never: writes or repairs images (the builder does), or follows a manifest entry outside the
//! images directory.
//!
//! ```json
//! {"version":1,"artifacts":[{"name":"kernel","file":"vmlinuz","size":N,"sha256":"..."}, ...]}
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The manifest version this build understands.
pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "cannot read the image manifest {path}: {source} (build the guest images, or point the \
         artifacts directory at them)"
    )]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the image manifest {path} is invalid: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error(
        "the image manifest {path} has version {found}; this tryboxi reads version {MANIFEST_VERSION} (rebuild the images)"
    )]
    Version { path: PathBuf, found: u32 },
    #[error(
        "the images in {path} were built with `cargo xtask images --kernel packaged`, whose \
         kernel needs `microvm,acpi=on`; this tryboxi runs VMs with `acpi=off` and would not \
         find their disks: rebuild them with `cargo xtask images --kernel built`"
    )]
    NeedsAcpi { path: PathBuf },
    #[error("the image manifest {path} lists no `{name}` artifact")]
    Missing { path: PathBuf, name: &'static str },
    #[error("image file {path} is missing or unreadable: {source} (rebuild the images)")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "image file {path} has {found} bytes, the manifest says {expected} (rebuild the images)"
    )]
    Size {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error(
        "image file {path} has sha256 {found}, the manifest says {expected} (the file is corrupt or was replaced: rebuild the images)"
    )]
    Hash {
        path: PathBuf,
        expected: String,
        found: String,
    },
}

/// One entry of the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub name: String,
    pub file: String,
    pub size: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub artifacts: Vec<Artifact>,
    /// Set by `cargo xtask images --kernel packaged`: the kernel finds its virtio-mmio devices
    /// through ACPI only, so its VMs need `microvm,acpi=on`. This driver runs `acpi=off`
    /// (see docs/VMM.md, "Kernel plan") and refuses such images rather than hang at boot.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub acpi: bool,
}

/// The three guest images, resolved to absolute paths.
#[derive(Debug, Clone)]
pub struct Images {
    /// `<artifacts>/images`
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub rootfs: PathBuf,
    pub manifest: Manifest,
}

impl Images {
    /// Read the current set's `manifest.json` (`<artifacts_dir>/images/`, or the set
    /// `images.current` names: `image_sets`) and resolve the kernel, initramfs and rootfs.
    /// The files must exist; their contents are checked by [`Images::verify`].
    pub fn load(artifacts_dir: &Path) -> Result<Images, ImageError> {
        Images::load_dir(&super::image_sets::current_dir(artifacts_dir))
    }

    /// [`Images::load`] of one set's directory.
    pub fn load_dir(set_dir: &Path) -> Result<Images, ImageError> {
        let dir = std::path::absolute(set_dir).map_err(|source| ImageError::Read {
            path: set_dir.to_owned(),
            source,
        })?;
        let path = dir.join("manifest.json");
        let text = std::fs::read(&path).map_err(|source| ImageError::Read {
            path: path.clone(),
            source,
        })?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|e| ImageError::Invalid {
                path: path.clone(),
                detail: e.to_string(),
            })?;
        if manifest.version != MANIFEST_VERSION {
            return Err(ImageError::Version {
                path,
                found: manifest.version,
            });
        }
        if manifest.acpi {
            return Err(ImageError::NeedsAcpi { path: dir });
        }
        let find = |name: &'static str| -> Result<PathBuf, ImageError> {
            let a = manifest
                .artifacts
                .iter()
                .find(|a| a.name == name)
                .ok_or_else(|| ImageError::Missing {
                    path: path.clone(),
                    name,
                })?;
            let file = checked_file_name(&a.file).ok_or_else(|| ImageError::Invalid {
                path: path.clone(),
                detail: format!(
                    "artifact `{name}` names file {:?}: only a plain file name in the images directory is allowed",
                    a.file
                ),
            })?;
            let p = dir.join(file);
            std::fs::metadata(&p).map_err(|source| ImageError::File {
                path: p.clone(),
                source,
            })?;
            Ok(p)
        };
        Ok(Images {
            kernel: find("kernel")?,
            initramfs: find("initramfs")?,
            rootfs: find("rootfs")?,
            dir,
            manifest,
        })
    }

    /// Check every listed file's size and, when `hashes` is set, its sha256 (reads every
    /// byte: seconds for a rootfs, so only `doctor` asks for it).
    pub fn verify(&self, hashes: bool) -> Result<(), ImageError> {
        for a in &self.manifest.artifacts {
            let Some(file) = checked_file_name(&a.file) else {
                continue; // `load` already refused the three we use; others are informative.
            };
            let path = self.dir.join(file);
            let found = std::fs::metadata(&path)
                .map_err(|source| ImageError::File {
                    path: path.clone(),
                    source,
                })?
                .len();
            if found != a.size {
                return Err(ImageError::Size {
                    path,
                    expected: a.size,
                    found,
                });
            }
            if hashes {
                let found = sha256_file(&path)?;
                if !found.eq_ignore_ascii_case(&a.sha256) {
                    return Err(ImageError::Hash {
                        path,
                        expected: a.sha256.clone(),
                        found,
                    });
                }
            }
        }
        Ok(())
    }
}

/// A manifest `file` must be a single normal path component.
pub fn checked_file_name(file: &str) -> Option<&str> {
    let mut comps = Path::new(file).components();
    match (comps.next(), comps.next()) {
        (Some(std::path::Component::Normal(_)), None) => Some(file),
        _ => None,
    }
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String, ImageError> {
    let mut h = Sha256::new();
    sha256_update(&mut h, path)?;
    Ok(hex::encode(h.finalize()))
}

/// Feed a whole file into `h`.
pub(crate) fn sha256_update(h: &mut Sha256, path: &Path) -> Result<(), ImageError> {
    let err = |source| ImageError::File {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(err)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(err)?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_set(root: &Path, files: &[(&str, &str, &[u8])]) -> Manifest {
        let dir = root.join("images");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let mut artifacts = Vec::new();
        for (name, file, data) in files {
            std::fs::write(dir.join(file), data).expect("write");
            artifacts.push(Artifact {
                name: (*name).into(),
                file: (*file).into(),
                size: data.len() as u64,
                sha256: hex::encode(Sha256::digest(data)),
            });
        }
        let m = Manifest {
            version: 1,
            artifacts,
            acpi: false,
        };
        write_manifest(root, &m);
        m
    }

    /// `images/manifest.json` under `root` says `m`.
    fn write_manifest(root: &Path, m: &Manifest) {
        std::fs::write(
            root.join("images/manifest.json"),
            serde_json::to_vec(m).expect("json"),
        )
        .expect("write manifest");
    }

    const SET: &[(&str, &str, &[u8])] = &[
        ("kernel", "vmlinuz", b"kernel bytes"),
        ("rootfs", "rootfs.ext4", b"rootfs bytes!"),
        ("initramfs", "initramfs.cpio.gz", b"initramfs"),
    ];

    #[test]
    fn load_resolves_the_three_images_and_verify_passes() {
        let t = tempfile::tempdir().expect("tempdir");
        write_set(t.path(), SET);
        let im = Images::load(t.path()).expect("load");
        assert!(im.kernel.is_absolute());
        assert_eq!(
            im.kernel.file_name().and_then(|s| s.to_str()),
            Some("vmlinuz")
        );
        assert_eq!(im.rootfs, im.dir.join("rootfs.ext4"));
        assert_eq!(im.initramfs, im.dir.join("initramfs.cpio.gz"));
        im.verify(true).expect("verify with hashes");
    }

    #[test]
    fn images_of_the_packaged_kernel_are_refused_with_the_way_out() {
        let t = tempfile::tempdir().expect("tempdir");
        let mut m = write_set(t.path(), SET);
        m.acpi = true;
        write_manifest(t.path(), &m);
        let e = Images::load(t.path()).expect_err("needs acpi");
        assert!(matches!(e, ImageError::NeedsAcpi { .. }), "{e}");
        assert!(e.to_string().contains("--kernel built"), "{e}");
        // The field is absent from a built kernel's manifest, and such images load.
        let text = std::fs::read_to_string(t.path().join("images/manifest.json")).unwrap();
        assert!(text.contains("\"acpi\":true"));
        m.acpi = false;
        write_manifest(t.path(), &m);
        let text = std::fs::read_to_string(t.path().join("images/manifest.json")).unwrap();
        assert!(!text.contains("acpi"));
        Images::load(t.path()).expect("built-kernel images load");
    }

    #[test]
    fn size_and_hash_mismatches_are_reported() {
        let t = tempfile::tempdir().expect("tempdir");
        write_set(t.path(), SET);
        let im = Images::load(t.path()).expect("load");
        // Same size, different content: only the hash check sees it.
        std::fs::write(im.dir.join("rootfs.ext4"), b"ROOTFS BYTES!").expect("write");
        im.verify(false).expect("sizes still match");
        assert!(matches!(im.verify(true), Err(ImageError::Hash { .. })));
        std::fs::write(im.dir.join("vmlinuz"), b"short").expect("write");
        assert!(matches!(
            im.verify(false),
            Err(ImageError::Size {
                expected: 12,
                found: 5,
                ..
            })
        ));
    }

    #[test]
    fn manifest_paths_outside_the_images_dir_are_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let mut m = write_set(t.path(), SET);
        m.artifacts[0].file = "../vmlinuz".into();
        write_manifest(t.path(), &m);
        assert!(matches!(
            Images::load(t.path()),
            Err(ImageError::Invalid { .. })
        ));
    }

    #[test]
    fn missing_artifact_and_wrong_version_are_reported() {
        let t = tempfile::tempdir().expect("tempdir");
        write_set(t.path(), &SET[..2]);
        assert!(matches!(
            Images::load(t.path()),
            Err(ImageError::Missing {
                name: "initramfs",
                ..
            })
        ));
        let mut m = write_set(t.path(), SET);
        m.version = 2;
        write_manifest(t.path(), &m);
        assert!(matches!(
            Images::load(t.path()),
            Err(ImageError::Version { found: 2, .. })
        ));
        assert!(matches!(
            Images::load(&t.path().join("nope")),
            Err(ImageError::Read { .. })
        ));
    }
}
