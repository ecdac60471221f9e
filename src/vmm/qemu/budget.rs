//! The disk budget of a VM's writable root layer: the qcow2 overlay's file never grows past a
//! set size, and a guest write that would need more is an I/O error in the guest.
//!
//! How: QEMU's `raw` format driver with a `size` shows its file as a region of exactly that
//! many bytes and refuses (ENOSPC) any write past its end. The overlay's qcow2 node sits on
//! such a `raw` node over the file, so qcow2's cluster allocations past the budget fail, and
//! with `werror=report` the guest sees an I/O error for that write (its VM lives on, as on a
//! full data root). `raw` needs its file to be at least `size` long, so the overlay file is
//! first extended, sparse, to the budget: qcow2 allocates clusters from its refcounts, not at
//! the end of the file, so the extension costs no disk and changes nothing it reads.
//! A layer file already longer than the budget (made under a larger setting) keeps its length
//! as its cap: a budget never truncates a layer.
//!
//! Owns: sizing a layer file for its budget, the `-drive` and `blockdev-add` options of a
//! budgeted layer, and reading the layer's file back out of QEMU's `json:` filenames.
//! Never: the backing layers (read-only to the guest) or the guest's other disks.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::vmm::VmmError;

/// Make `file` (a qcow2 layer the VM is about to write) fit a budget of `budget` bytes: extend
/// it sparse to the budget if it is shorter. Returns the cap to give QEMU (`None`: no budget).
pub(crate) fn cap_layer(file: &Path, budget: Option<u64>) -> Result<Option<u64>, VmmError> {
    let Some(budget) = budget else {
        return Ok(None);
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .map_err(super::io_err(file))?;
    let len = f.metadata().map_err(super::io_err(file))?.len();
    if len >= budget {
        if len > budget {
            tracing::info!(
                layer = %file.display(),
                len,
                budget,
                "disk layer already past the budget: capped at its length"
            );
        }
        return Ok(Some(len));
    }
    // Sparse: no block is written or reserved.
    f.set_len(budget).map_err(super::io_err(file))?;
    Ok(Some(budget))
}

/// The `-drive` options naming the root layer `file` (escaped by the caller) with a cap:
/// everything before the file name and after it.
pub(crate) fn drive_prefix(cap: Option<u64>) -> String {
    match cap {
        Some(n) => format!(
            "driver=qcow2,file.driver=raw,file.size={n},file.file.driver=file,\
             file.file.filename="
        ),
        None => "file=".to_owned(),
    }
}

/// The `blockdev-add` arguments of a new active layer `file` (node `node`), opened as the
/// `-drive` of a VM opens its root layer (see `args.rs`): no flushes (`cache=unsafe`), guest
/// discards punched out of the file, and `backing: null` (`blockdev-snapshot` attaches it).
pub(crate) fn blockdev_add(node: &str, file: &Path, cap: Option<u64>) -> Value {
    let cache = json!({ "direct": false, "no-flush": true });
    let leaf = json!({
        "driver": "file",
        "filename": file,
        "cache": cache,
        "discard": "unmap",
    });
    let child = match cap {
        Some(n) => json!({
            "driver": "raw",
            "size": n,
            "cache": cache,
            "discard": "unmap",
            "file": leaf,
        }),
        None => leaf,
    };
    json!({
        "driver": "qcow2",
        "node-name": node,
        "cache": cache,
        "discard": "unmap",
        "backing": null,
        "file": child,
    })
}

/// The layer file behind `name`, a filename as QEMU reports it: a plain path, or a
/// `json:{...}` pseudo-filename (a layer opened with options, e.g. through `raw` with a size),
/// whose innermost `file` child with a `filename` is the file.
pub(crate) fn layer_path(name: &str) -> Option<PathBuf> {
    let Some(j) = name.strip_prefix("json:") else {
        return (!name.is_empty()).then(|| PathBuf::from(name));
    };
    let mut v: Value = serde_json::from_str(j).ok()?;
    // Bounded: a layer has a handful of levels.
    for _ in 0..8 {
        if let Some(f) = v.get("filename").and_then(Value::as_str) {
            return Some(PathBuf::from(f));
        }
        v = v.get("file")?.clone();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_short_layer_is_extended_sparse_and_a_long_one_keeps_its_length() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("disk.qcow2");
        std::fs::write(&f, vec![1u8; 4096]).unwrap();
        assert_eq!(cap_layer(&f, None).unwrap(), None);
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 4096);
        let budget = 64 << 20;
        assert_eq!(cap_layer(&f, Some(budget)).unwrap(), Some(budget));
        let md = std::fs::metadata(&f).unwrap();
        assert_eq!(md.len(), budget);
        assert!(md.blocks() * 512 < 1 << 20, "extension must be sparse");
        assert_eq!(std::fs::read(&f).unwrap()[..4096], [1u8; 4096]);
        // A lower budget never truncates.
        assert_eq!(cap_layer(&f, Some(1 << 20)).unwrap(), Some(budget));
        assert_eq!(std::fs::metadata(&f).unwrap().len(), budget);
    }

    #[test]
    fn layer_files_are_read_from_plain_and_json_filenames() {
        assert_eq!(
            layer_path("/v/disk.qcow2"),
            Some(PathBuf::from("/v/disk.qcow2"))
        );
        let j = r#"json:{"driver": "qcow2", "file": {"driver": "raw", "size": 4294967296, "file": {"driver": "file", "filename": "/v/d,1.qcow2"}}}"#;
        assert_eq!(layer_path(j), Some(PathBuf::from("/v/d,1.qcow2")));
        assert_eq!(layer_path("json:{\"driver\": \"raw\"}"), None);
        assert_eq!(layer_path("json:{nope"), None);
        assert_eq!(layer_path(""), None);
    }

    #[test]
    fn a_budgeted_blockdev_puts_raw_with_the_cap_between_qcow2_and_the_file() {
        let v = blockdev_add("rootl1", Path::new("/v/next.qcow2"), Some(1 << 30));
        assert_eq!(v["node-name"], "rootl1");
        assert_eq!(v["backing"], Value::Null);
        assert_eq!(v["file"]["driver"], "raw");
        assert_eq!(v["file"]["size"], 1u64 << 30);
        assert_eq!(v["file"]["file"]["filename"], "/v/next.qcow2");
        let v = blockdev_add("rootl2", Path::new("/v/n.qcow2"), None);
        assert_eq!(v["file"]["driver"], "file");
        assert_eq!(
            drive_prefix(Some(7)),
            "driver=qcow2,file.driver=raw,file.size=7,file.file.driver=file,file.file.filename="
        );
        assert_eq!(drive_prefix(None), "file=");
    }
}
