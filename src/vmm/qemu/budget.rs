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
//! The budget is the sandbox's, not each layer's: a new layer (after a checkpoint, a pause, a
//! restore) gets what the sandbox's frozen layers leave of the budget (their allocated
//! blocks), and at least [`MIN_LAYER`]. Its frozen layers are those in its own directory that
//! something still needs: the ones below the new layer (found by walking the qcow2 backing
//! chain) and the ones its snapshots and fork bases keep with their chains, even when they are
//! off the chain the VM writes through (after a restore of an older snapshot). Each checkpoint
//! directory names the layer it froze in a [`FROZEN_LAYER_FILE`]; a pause's does not count (a
//! resume or restore replaces it). So snapshots, pauses and restores never multiply the
//! budget: all the root disk layers a sandbox holds come to at most the budget (plus
//! [`MIN_LAYER`] per layer started at the budget). A layer nothing needs any more (the one a
//! restore abandons, deleted after it) is not counted. Layers in other directories (a fork
//! child's parent) are the parent's, counted there.
//!
//! The guest is what the budget holds back; QEMU enforces it (the `raw` node's size), so a
//! QEMU taken over by its guest is not bound by it, and may as well rewrite the names in its
//! checkpoint directories.
//!
//! Owns: sizing a layer file for its budget, the sandbox's share of it, the `-drive` and
//! `blockdev-add` options of a budgeted layer, reading a layer's backing file name from its
//! qcow2 header, and reading the layer's file back out of QEMU's `json:` filenames.
//! Never: writing the backing layers (read-only to the guest) or the guest's other disks.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::vmm::VmmError;

/// The smallest cap a new layer gets when the layers below it already hold the budget: an
/// empty overlay's four 64 KiB metadata clusters and room for a few more, so the VM runs and
/// its first write past the budget is an I/O error in the guest.
pub(crate) const MIN_LAYER: u64 = 1 << 20;
/// Longest backing chain walked; a sandbox's chain grows by one per checkpoint, pause or
/// restore, and a header naming itself (or a cycle) must not loop.
const MAX_CHAIN: usize = 4096;
/// qcow2 header fields (big-endian): magic at 0, backing file name offset (u64) at 8 and
/// length (u32) at 16.
const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
/// QEMU refuses backing file names longer than this; a header saying more is not QEMU's.
const MAX_BACKING_NAME: u64 = 1023;
/// A backing file name lies in the header cluster (64 KiB) of the images QEMU and
/// [`crate::vmm::qcow2`] write; one past it is not read.
const MAX_HEADER: u64 = 64 << 10;

/// The backing file of the qcow2 image `layer`, resolved against its directory when relative;
/// `None` when it has none or its header is not one QEMU writes (bounded reads only: a header
/// is read from a file a compromised QEMU could have written).
pub(crate) fn backing_of(layer: &Path) -> Option<PathBuf> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::ffi::OsStrExt;
    let mut f = std::fs::File::open(layer).ok()?;
    let mut h = [0u8; 20];
    f.read_exact(&mut h).ok()?;
    if h[..4] != QCOW2_MAGIC {
        return None;
    }
    let off = u64::from_be_bytes(h[8..16].try_into().ok()?);
    let len = u64::from(u32::from_be_bytes(h[16..20].try_into().ok()?));
    if off == 0 || len == 0 || len > MAX_BACKING_NAME || off.saturating_add(len) > MAX_HEADER {
        return None;
    }
    f.seek(SeekFrom::Start(off)).ok()?;
    let mut name = vec![0u8; len as usize];
    f.read_exact(&mut name).ok()?;
    let p = PathBuf::from(std::ffi::OsStr::from_bytes(&name));
    Some(if p.is_absolute() {
        p
    } else {
        layer.parent()?.join(p)
    })
}

/// File in a checkpoint directory naming (by file name, in the VM's directory) the root layer
/// the checkpoint froze: what keeps it counted after the VM's chain moved elsewhere.
pub(crate) const FROZEN_LAYER_FILE: &str = "layer";
/// Directories of a VM's directory whose checkpoints keep their frozen layers (a pause's
/// `paused/` is not one: its layer is below the layer that replaces it, or abandoned).
const KEEPING_DIRS: [&str; 2] = ["snapshots", "forks"];
/// Most checkpoint directories read per keeping directory.
const MAX_CHECKPOINTS: usize = 4096;
/// Longest file name read from a [`FROZEN_LAYER_FILE`].
const MAX_LAYER_NAME: u64 = 255;

/// Record in the checkpoint directory `dest` that it freezes `layer` (when the layer is in the
/// VM's directory `vm_dir`; a layer elsewhere is not the sandbox's to count).
pub(crate) fn mark_frozen_layer(dest: &Path, layer: &Path, vm_dir: &Path) -> Result<(), VmmError> {
    let (Ok(home), Ok(real)) = (std::fs::canonicalize(vm_dir), std::fs::canonicalize(layer)) else {
        return Ok(());
    };
    let Some(name) = real
        .file_name()
        .filter(|_| real.parent() == Some(home.as_path()))
    else {
        return Ok(());
    };
    let file = dest.join(FROZEN_LAYER_FILE);
    std::fs::write(&file, name.as_encoded_bytes()).map_err(super::io_err(&file))
}

/// The layer a checkpoint directory names (see [`mark_frozen_layer`]): a plain file name
/// (bounded read), resolved in `home`.
fn frozen_layer_of(checkpoint: &Path, home: &Path) -> Option<PathBuf> {
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    let f = std::fs::File::open(checkpoint.join(FROZEN_LAYER_FILE)).ok()?;
    let mut name = Vec::new();
    f.take(MAX_LAYER_NAME + 1).read_to_end(&mut name).ok()?;
    let name = std::ffi::OsStr::from_bytes(&name);
    let plain = Path::new(name)
        .file_name()
        .is_some_and(|n| n == name && name.len() as u64 <= MAX_LAYER_NAME);
    plain.then(|| home.join(name))
}

/// Bytes the sandbox's frozen root layers hold on the host (allocated blocks) once `layer` is
/// its new active one: the layers below `layer` in its backing chain and those the
/// checkpoints in `vm_dir`'s [`KEEPING_DIRS`] keep, with their chains, each once. Only layers
/// in `vm_dir` itself count: a walk ends at the first layer elsewhere (the base image, a
/// parent's layers), after which none is the sandbox's; `layer` itself never counts.
pub(crate) fn held_below(layer: &Path, vm_dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(home) = std::fs::canonicalize(vm_dir) else {
        return 0;
    };
    let mut seen = std::collections::HashSet::new();
    if let Ok(me) = std::fs::canonicalize(layer) {
        seen.insert(me);
    }
    let mut held = 0u64;
    let mut walk = |mut next: Option<PathBuf>| {
        for _ in 0..MAX_CHAIN {
            let Some(p) = next else { break };
            let Ok(real) = std::fs::canonicalize(&p) else {
                break;
            };
            // Elsewhere, or counted already with the rest of its chain.
            if real.parent() != Some(home.as_path()) || seen.contains(&real) {
                break;
            }
            let Ok(md) = std::fs::metadata(&real) else {
                break;
            };
            if !md.is_file() {
                break;
            }
            held = held.saturating_add(md.blocks().saturating_mul(512));
            next = backing_of(&real);
            seen.insert(real);
        }
    };
    walk(backing_of(layer));
    for keeping in KEEPING_DIRS {
        let Ok(rd) = std::fs::read_dir(home.join(keeping)) else {
            continue;
        };
        for e in rd.flatten().take(MAX_CHECKPOINTS) {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                walk(frozen_layer_of(&e.path(), &home));
            }
        }
    }
    held
}

/// The cap of a new root layer `layer` of the VM in `vm_dir` under a sandbox budget of
/// `budget` bytes: what the layers below it there leave, and at least [`MIN_LAYER`].
pub(crate) fn layer_share(layer: &Path, vm_dir: &Path, budget: Option<u64>) -> Option<u64> {
    let budget = budget?;
    let held = held_below(layer, vm_dir);
    let share = budget.saturating_sub(held).max(MIN_LAYER);
    if share < budget {
        tracing::debug!(layer = %layer.display(), held, budget, share, "disk budget: the layers below hold part of it");
    }
    Some(share)
}

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

    /// A file of `n` allocated bytes (written, not sparse), appended to `p`.
    fn grow(p: &Path, n: usize) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
        f.write_all(&vec![7u8; n]).unwrap();
        f.sync_all().unwrap();
    }

    #[test]
    fn a_new_layer_gets_what_the_sandboxs_frozen_layers_leave_of_the_budget() {
        let root = tempfile::tempdir().unwrap();
        let images = root.path().join("images");
        let vm = root.path().join("vm");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::create_dir_all(&vm).unwrap();
        // The base image (elsewhere: never the sandbox's) and a parent's layer in another
        // directory, as a fork child has.
        let base = images.join("rootfs.ext4");
        std::fs::write(&base, vec![0u8; 8 << 20]).unwrap();
        let parent = images.join("parent.qcow2");
        crate::vmm::qcow2::create_overlay(&base, "raw", &parent).unwrap();
        grow(&parent, 4 << 20);
        // The sandbox's chain: disk.qcow2 (frozen by a snapshot) <- disk-s1 (frozen by a
        // pause) <- disk-s2 (the new layer).
        let l0 = vm.join("disk.qcow2");
        crate::vmm::qcow2::create_overlay(&parent, "qcow2", &l0).unwrap();
        assert_eq!(backing_of(&l0), Some(parent.clone()));
        assert_eq!(backing_of(&parent), Some(base.clone()));
        assert_eq!(backing_of(&base), None, "a raw image has no qcow2 header");
        // A fresh layer has nothing of the sandbox's below it: the whole budget.
        let budget = 64 << 20;
        assert_eq!(held_below(&l0, &vm), 0);
        assert_eq!(layer_share(&l0, &vm, Some(budget)), Some(budget));
        assert_eq!(layer_share(&l0, &vm, None), None);
        grow(&l0, 20 << 20);
        let l1 = vm.join("disk-s1.qcow2");
        crate::vmm::qcow2::create_overlay(&l0, "qcow2", &l1).unwrap();
        grow(&l1, 30 << 20);
        let l2 = vm.join("disk-s2.qcow2");
        crate::vmm::qcow2::create_overlay(&l1, "qcow2", &l2).unwrap();
        let held = held_below(&l2, &vm);
        // l0 and l1 (each >= its data; headers and filesystem rounding add a little), never
        // the parent's layer or the base.
        assert!((50 << 20..52 << 20).contains(&held), "held {held}");
        assert_eq!(layer_share(&l2, &vm, Some(budget)), Some(budget - held));
        // At the budget: the smallest layer, never zero and never the whole budget again.
        grow(&l1, 20 << 20);
        assert_eq!(layer_share(&l2, &vm, Some(budget)), Some(MIN_LAYER));
        // A relative backing name resolves against the layer's directory.
        let rel = vm.join("disk-rel.qcow2");
        std::fs::write(&rel, header_naming(b"disk-s1.qcow2")).unwrap();
        assert_eq!(backing_of(&rel), Some(l1.clone()));
    }

    #[test]
    fn layers_kept_by_snapshots_off_the_chain_count_and_an_abandoned_one_does_not() {
        let root = tempfile::tempdir().unwrap();
        let vm = root.path().join("vm");
        std::fs::create_dir_all(&vm).unwrap();
        let base = root.path().join("rootfs.ext4");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let budget = 64 << 20;
        // snap_1 froze disk.qcow2 (20 MiB); the VM wrote disk-snap_1 (16 MiB) and snap_2
        // froze it; then the VM wrote disk-snap_2 (8 MiB) and was restored to snap_1: the new
        // layer disk-r1 is over disk.qcow2, disk-snap_1 is off its chain but snap_2 keeps it,
        // and disk-snap_2 is abandoned (nothing needs it; the restore deletes it next).
        let l0 = vm.join("disk.qcow2");
        crate::vmm::qcow2::create_overlay(&base, "raw", &l0).unwrap();
        grow(&l0, 20 << 20);
        let l1 = vm.join("disk-snap_1.qcow2");
        crate::vmm::qcow2::create_overlay(&l0, "qcow2", &l1).unwrap();
        grow(&l1, 16 << 20);
        let l2 = vm.join("disk-snap_2.qcow2");
        crate::vmm::qcow2::create_overlay(&l1, "qcow2", &l2).unwrap();
        grow(&l2, 8 << 20);
        for (snap, layer) in [("snap_1", &l0), ("snap_2", &l1)] {
            let cp = vm.join("snapshots").join(snap);
            std::fs::create_dir_all(&cp).unwrap();
            mark_frozen_layer(&cp, layer, &vm).unwrap();
        }
        let r1 = vm.join("disk-r1.qcow2");
        crate::vmm::qcow2::create_overlay(&l0, "qcow2", &r1).unwrap();
        let size = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
        let (s0, s1) = (size(&l0), size(&l1));
        assert_eq!(
            held_below(&r1, &vm),
            s0 + s1,
            "the abandoned layer counted, or snap_2's not"
        );
        assert_eq!(layer_share(&r1, &vm, Some(budget)), Some(budget - s0 - s1));
        // A fork base keeps its layer the same way; a pause's checkpoint does not (its layer
        // is below the one that replaces it, or abandoned).
        for (dir, layer) in [("forks/f_1", &l2), ("paused", &l2)] {
            let cp = vm.join(dir);
            std::fs::create_dir_all(&cp).unwrap();
            mark_frozen_layer(&cp, layer, &vm).unwrap();
            if dir == "paused" {
                std::fs::remove_dir_all(vm.join("forks")).unwrap();
            }
            let held = held_below(&r1, &vm);
            match dir {
                "paused" => assert_eq!(held, s0 + s1),
                _ => assert_eq!(held, s0 + s1 + size(&l2)),
            }
        }
        // Each layer once, whoever keeps it; the new layer never counts itself.
        let cp = vm.join("snapshots").join("snap_3");
        std::fs::create_dir_all(&cp).unwrap();
        mark_frozen_layer(&cp, &r1, &vm).unwrap();
        assert_eq!(held_below(&r1, &vm), s0 + s1);
        // A name that is not a plain file name in the directory is not followed; a layer in
        // another directory is not marked.
        for name in ["../vm/disk-snap_2.qcow2", "/etc/passwd", "", "a/b"] {
            std::fs::write(cp.join(FROZEN_LAYER_FILE), name).unwrap();
            assert_eq!(held_below(&r1, &vm), s0 + s1, "{name:?}");
        }
        std::fs::write(cp.join(FROZEN_LAYER_FILE), vec![b'x'; 4096]).unwrap();
        assert_eq!(held_below(&r1, &vm), s0 + s1);
        std::fs::remove_file(cp.join(FROZEN_LAYER_FILE)).unwrap();
        mark_frozen_layer(&cp, &base, &vm).unwrap();
        assert!(!cp.join(FROZEN_LAYER_FILE).exists());
    }

    /// A qcow2 v3 header whose backing file name (at offset 512) is `name`.
    fn header_naming(name: &[u8]) -> Vec<u8> {
        header(512, name.len() as u32, name)
    }

    fn header(off: u64, len: u32, name: &[u8]) -> Vec<u8> {
        let mut h = b"QFI\xfb".to_vec();
        h.extend_from_slice(&3u32.to_be_bytes());
        h.extend_from_slice(&off.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        h.resize(4096, 0);
        h[512..512 + name.len()].copy_from_slice(name);
        h
    }

    #[test]
    fn hostile_headers_are_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("disk.qcow2");
        // Past the header cluster, too long, zero, or past the end of the file: no backing.
        for (off, len) in [
            (u64::MAX - 2, 16),
            (512, 4096),
            (0, 8),
            (512, 0),
            (4090, 100),
        ] {
            std::fs::write(&f, header(off, len, b"x")).unwrap();
            assert_eq!(backing_of(&f), None, "offset {off} length {len}");
        }
        // A layer naming itself: the walk ends at once (the new layer never counts itself).
        std::fs::write(&f, header_naming(b"disk.qcow2")).unwrap();
        assert_eq!(backing_of(&f), Some(f.clone()));
        assert_eq!(held_below(&f, d.path()), 0);
        // A cycle below it: each layer of it once.
        let (a, b) = (d.path().join("disk-a.qcow2"), d.path().join("disk-b.qcow2"));
        std::fs::write(&f, header_naming(b"disk-a.qcow2")).unwrap();
        std::fs::write(&a, header_naming(b"disk-b.qcow2")).unwrap();
        std::fs::write(&b, header_naming(b"disk-a.qcow2")).unwrap();
        use std::os::unix::fs::MetadataExt;
        let blocks = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
        assert_eq!(held_below(&f, d.path()), blocks(&a) + blocks(&b));
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
