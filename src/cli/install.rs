//! `tryboxi install --artifacts DIR`: copy guest images (as built by `cargo xtask images`) into
//! the data root, verified against their manifest, replacing the installed set atomically.

use std::path::Path;

use crate::config::Paths;
use crate::error::TopError;
use crate::vmm::Images;

pub fn run(artifacts: &Path) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    let src = Images::load(artifacts)
        .map_err(|e| TopError::Usage(format!("{e} (build them with `cargo xtask images`)")))?;
    println!("verifying {} ...", src.dir.display());
    src.verify(true).map_err(|e| TopError::Other(e.into()))?;
    let dest_root = paths.artifacts_dir();
    std::fs::create_dir_all(&dest_root).map_err(|e| TopError::Other(e.into()))?;
    let staging = dest_root.join(format!(".images-{}", std::process::id()));
    let _ = crate::safefs::remove_under(&paths.root, &staging);
    std::fs::create_dir_all(&staging).map_err(|e| TopError::Other(e.into()))?;
    let mut files: Vec<&str> = src
        .manifest
        .artifacts
        .iter()
        .map(|a| a.file.as_str())
        .collect();
    files.push("manifest.json");
    for f in files {
        let (from, to) = (src.dir.join(f), staging.join(f));
        // A hard link costs nothing (images are immutable once built: never written in place);
        // else copy. The small manifest is always copied, so it is the data root's own file.
        if f == "manifest.json" || std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to)
                .map_err(|e| TopError::Other(anyhow::anyhow!("copy {}: {e}", from.display())))?;
        }
        println!("  {f}");
    }
    let dest = dest_root.join("images");
    let old = dest_root.join(format!(".old-{}", std::process::id()));
    if dest.exists() {
        std::fs::rename(&dest, &old).map_err(|e| TopError::Other(e.into()))?;
    }
    std::fs::rename(&staging, &dest).map_err(|e| TopError::Other(e.into()))?;
    let _ = crate::safefs::remove_under(&paths.root, &old);
    Images::load(&dest_root)
        .and_then(|i| i.verify(false))
        .map_err(|e| TopError::Other(e.into()))?;
    println!("installed guest images into {}", dest.display());
    Ok(())
}
