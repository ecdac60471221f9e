//! Empty qcow2 overlays, written directly (no `qemu-img` process).
//!
//! Owns one thing: creating a new, empty qcow2 v3 image whose backing file is a given image,
//! exactly what `qemu-img create -f qcow2 -F <fmt> -b <backing> <file>` makes. Every sandbox
//! create, restore, fork child and pool VM needs one; spawning `qemu-img` for it cost ~20 ms of
//! wall time (and as much CPU) on the restore path, writing four clusters costs well under 1 ms.
//! Reading or changing an image that QEMU has written is not done here: QEMU owns that.
//!
//! Layout (cluster size 64 KiB, refcounts 16 bits, as `qemu-img` defaults to):
//!
//! | cluster | content |
//! |---|---|
//! | 0 | header (v3, 112 bytes), header extensions (backing format, end), backing file name |
//! | 1 | refcount table: one entry, pointing at cluster 2 |
//! | 2 | refcount block: clusters 0..=3 have refcount 1 |
//! | 3 | L1 table: all zero (nothing allocated; every read goes to the backing file) |
//!
//! The file is written under a temporary name and renamed into place, so a crash never leaves a
//! half-written overlay under the final name.

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const MAGIC: u32 = 0x5146_49fb; // "QFI\xfb"
const VERSION: u32 = 3;
const CLUSTER_BITS: u32 = 16;
const CLUSTER: u64 = 1 << CLUSTER_BITS;
/// 2^4 = 16-bit refcounts.
const REFCOUNT_ORDER: u32 = 4;
/// The v3 header with the compression type byte, padded to a multiple of 8.
const HEADER_LEN: u32 = 112;
/// Header extension: the backing file's format name.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// QEMU refuses backing file names longer than this.
const MAX_BACKING_NAME: usize = 1023;
/// One L1 cluster covers this much guest disk (8192 L2 tables of 8192 clusters).
const MAX_SIZE: u64 = (CLUSTER / 8) * (CLUSTER / 8) * CLUSTER;

#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("backing file {0}: not a qcow2 image (bad magic)")]
    NotQcow2(String),
    #[error("backing file name is {0} bytes; qcow2 allows at most {MAX_BACKING_NAME}")]
    NameTooLong(usize),
    #[error("backing format {0:?} is not one this writer names (raw or qcow2)")]
    Format(String),
    #[error("a virtual size of {0} bytes is 0 or over the {MAX_SIZE} this writer supports")]
    Size(u64),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Qcow2Error + '_ {
    move |source| Qcow2Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The virtual size of `backing` read as `fmt`: a raw image's file length, a qcow2 image's
/// `size` header field.
pub fn virtual_size(backing: &Path, fmt: &str) -> Result<u64, Qcow2Error> {
    match fmt {
        "raw" => Ok(std::fs::metadata(backing).map_err(io(backing))?.len()),
        "qcow2" => {
            use std::os::unix::fs::FileExt;
            let f = std::fs::File::open(backing).map_err(io(backing))?;
            let mut h = [0u8; 32];
            f.read_exact_at(&mut h, 0).map_err(io(backing))?;
            if u32::from_be_bytes(h[0..4].try_into().expect("4 bytes")) != MAGIC {
                return Err(Qcow2Error::NotQcow2(backing.display().to_string()));
            }
            Ok(u64::from_be_bytes(h[24..32].try_into().expect("8 bytes")))
        }
        other => Err(Qcow2Error::Format(other.to_owned())),
    }
}

/// The backing file name a qcow2 image records (as written: QEMU resolves a relative name
/// against the image's directory), `None` for an image without one or a file that is not
/// qcow2. Reads at most the header and [`MAX_BACKING_NAME`] bytes.
pub fn backing_file(file: &Path) -> Result<Option<std::path::PathBuf>, Qcow2Error> {
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).map_err(io(file))?;
    let mut h = [0u8; 20];
    if f.read_exact_at(&mut h, 0).is_err()
        || u32::from_be_bytes(h[0..4].try_into().expect("4 bytes")) != MAGIC
    {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
    if offset == 0 || len == 0 {
        return Ok(None);
    }
    if len > MAX_BACKING_NAME {
        return Err(Qcow2Error::NameTooLong(len));
    }
    let mut name = vec![0u8; len];
    f.read_exact_at(&mut name, offset).map_err(io(file))?;
    Ok(Some(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(
        &name,
    ))))
}

/// The bytes of an empty overlay of `size` bytes over `backing` (format `fmt`).
fn image(backing: &[u8], fmt: &str, size: u64) -> Result<Vec<u8>, Qcow2Error> {
    if !matches!(fmt, "raw" | "qcow2") {
        return Err(Qcow2Error::Format(fmt.to_owned()));
    }
    if size == 0 || size > MAX_SIZE {
        return Err(Qcow2Error::Size(size));
    }
    if backing.len() > MAX_BACKING_NAME {
        return Err(Qcow2Error::NameTooLong(backing.len()));
    }
    // Guest bytes one L2 table maps: CLUSTER / 8 entries of one cluster each.
    let per_l2 = (CLUSTER / 8) * CLUSTER;
    let l1_size = size.div_ceil(per_l2) as u32;
    let (refcount_table, refcount_block, l1) = (CLUSTER, 2 * CLUSTER, 3 * CLUSTER);
    let clusters = 4u64;

    let mut img = vec![0u8; (clusters * CLUSTER) as usize];
    let mut h: Vec<u8> = Vec::with_capacity(HEADER_LEN as usize);
    h.extend(MAGIC.to_be_bytes());
    h.extend(VERSION.to_be_bytes());
    let backing_offset_at = h.len();
    h.extend(0u64.to_be_bytes()); // backing_file_offset, set below
    h.extend((backing.len() as u32).to_be_bytes());
    h.extend(CLUSTER_BITS.to_be_bytes());
    h.extend(size.to_be_bytes());
    h.extend(0u32.to_be_bytes()); // crypt_method
    h.extend(l1_size.to_be_bytes());
    h.extend(l1.to_be_bytes());
    h.extend(refcount_table.to_be_bytes());
    h.extend(1u32.to_be_bytes()); // refcount_table_clusters
    h.extend(0u32.to_be_bytes()); // nb_snapshots
    h.extend(0u64.to_be_bytes()); // snapshots_offset
    h.extend(0u64.to_be_bytes()); // incompatible_features
    h.extend(0u64.to_be_bytes()); // compatible_features
    h.extend(0u64.to_be_bytes()); // autoclear_features
    h.extend(REFCOUNT_ORDER.to_be_bytes());
    h.extend(HEADER_LEN.to_be_bytes());
    h.push(0); // compression_type: zlib
    h.resize(HEADER_LEN as usize, 0);
    // Extensions: the backing format (padded to 8 bytes), then the end marker.
    h.extend(EXT_BACKING_FORMAT.to_be_bytes());
    h.extend((fmt.len() as u32).to_be_bytes());
    h.extend(fmt.as_bytes());
    h.resize(h.len().next_multiple_of(8), 0);
    h.extend([0u8; 8]);
    let backing_offset = h.len() as u64;
    h.extend(backing);
    h[backing_offset_at..backing_offset_at + 8].copy_from_slice(&backing_offset.to_be_bytes());
    img[..h.len()].copy_from_slice(&h);

    // Refcount table -> the one refcount block; that block counts the four clusters.
    let rt = refcount_table as usize;
    img[rt..rt + 8].copy_from_slice(&refcount_block.to_be_bytes());
    let rb = refcount_block as usize;
    for c in 0..clusters as usize {
        img[rb + 2 * c..rb + 2 * c + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    // The L1 table (cluster 3) stays all zero.
    Ok(img)
}

/// Create `file` as an empty qcow2 image over `backing` (format `fmt`: `raw` or `qcow2`), the
/// virtual size taken from the backing image. `backing` is recorded as given (QEMU resolves a
/// relative name against `file`'s directory). Replaces an existing `file`.
pub fn create_overlay(backing: &Path, fmt: &str, file: &Path) -> Result<(), Qcow2Error> {
    let size = virtual_size(backing, fmt)?;
    let bytes = image(backing.as_os_str().as_bytes(), fmt, size)?;
    let mut tmp_name = file.as_os_str().to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp_name);
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        std::fs::rename(&tmp, file)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(io(file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn have(tool: &str) -> bool {
        Command::new(tool).arg("--version").output().is_ok()
    }

    fn qemu_img_json(args: &[&str], file: &Path) -> serde_json::Value {
        let out = Command::new("qemu-img")
            .args(args)
            .arg(file)
            .output()
            .expect("qemu-img");
        assert!(
            out.status.success(),
            "qemu-img {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json")
    }

    fn qemu_img_check(file: &Path, when: &str) {
        let check = Command::new("qemu-img")
            .args(["check", "-q"])
            .arg(file)
            .output()
            .unwrap();
        assert!(check.status.success(), "{when}: {check:?}");
    }

    fn qemu_io(file: &Path, cmd: &str) -> std::process::Output {
        Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", cmd])
            .arg(file)
            .output()
            .expect("qemu-io")
    }

    #[test]
    fn header_fields_and_refcounts() {
        let img = image(b"/base/rootfs.ext4", "raw", 1_615_855_616).unwrap();
        assert_eq!(img.len(), 4 * CLUSTER as usize);
        assert_eq!(&img[0..4], b"QFI\xfb");
        let be32 = |o: usize| u32::from_be_bytes(img[o..o + 4].try_into().unwrap());
        let be64 = |o: usize| u64::from_be_bytes(img[o..o + 8].try_into().unwrap());
        assert_eq!(be32(4), 3);
        assert_eq!(be64(24), 1_615_855_616);
        assert_eq!(be32(36), 4, "1.5 GiB needs 4 L1 entries of 512 MiB");
        let off = be64(8) as usize;
        assert_eq!(&img[off..off + be32(16) as usize], b"/base/rootfs.ext4");
        assert_eq!(be32(HEADER_LEN as usize), EXT_BACKING_FORMAT);
        assert_eq!(be64(CLUSTER as usize), 2 * CLUSTER);
        let rb = 2 * CLUSTER as usize;
        let counts: Vec<u16> = (0..5)
            .map(|c| u16::from_be_bytes(img[rb + 2 * c..rb + 2 * c + 2].try_into().unwrap()))
            .collect();
        assert_eq!(counts, [1, 1, 1, 1, 0]);
        assert!(img[3 * CLUSTER as usize..].iter().all(|&b| b == 0));
    }

    #[test]
    fn refuses_bad_input() {
        assert!(matches!(
            image(&[b'a'; 1024], "raw", 1 << 20),
            Err(Qcow2Error::NameTooLong(1024))
        ));
        assert!(matches!(image(b"x", "vmdk", 1), Err(Qcow2Error::Format(_))));
        assert!(matches!(image(b"x", "raw", 0), Err(Qcow2Error::Size(0))));
        assert!(matches!(
            image(b"x", "raw", MAX_SIZE + 1),
            Err(Qcow2Error::Size(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let not = dir.path().join("not.qcow2");
        std::fs::write(&not, [0u8; 64]).unwrap();
        assert!(matches!(
            virtual_size(&not, "qcow2"),
            Err(Qcow2Error::NotQcow2(_))
        ));
    }

    #[test]
    fn backing_file_reads_what_was_written_and_ignores_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let top = dir.path().join("top.qcow2");
        create_overlay(&base, "raw", &top).unwrap();
        assert_eq!(backing_file(&top).unwrap(), Some(base.clone()));
        // Not qcow2, or too short for a header: no backing file.
        assert_eq!(backing_file(&base).unwrap(), None);
        std::fs::write(dir.path().join("short"), b"QFI").unwrap();
        assert_eq!(backing_file(&dir.path().join("short")).unwrap(), None);
        // A hostile length is refused before anything is allocated.
        let mut img = std::fs::read(&top).unwrap();
        img[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        let bad = dir.path().join("bad.qcow2");
        std::fs::write(&bad, &img).unwrap();
        assert!(matches!(
            backing_file(&bad),
            Err(Qcow2Error::NameTooLong(_))
        ));
    }

    /// QEMU's own tools accept the image, see the backing chain, read through it and write to it.
    #[test]
    fn qemu_reads_and_writes_the_overlay() {
        if !have("qemu-img") || !have("qemu-io") {
            eprintln!("skipping: qemu-img/qemu-io not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.raw");
        let mut raw = vec![0u8; 3 << 20];
        raw[1 << 20..(1 << 20) + 4096].fill(0x5a);
        std::fs::write(&base, &raw).unwrap();
        // raw -> qcow2 -> qcow2, as rootfs -> frozen layer -> overlay.
        let mid = dir.path().join("mid.qcow2");
        create_overlay(&base, "raw", &mid).unwrap();
        let w = qemu_io(&mid, "write -P 0xab 0 64k");
        assert!(w.status.success(), "{w:?}");
        let top = dir.path().join("top.qcow2");
        create_overlay(&mid, "qcow2", &top).unwrap();

        let info = qemu_img_json(&["info", "--output=json", "--backing-chain"], &top);
        let chain = info.as_array().unwrap();
        assert_eq!(chain.len(), 3, "{info}");
        assert_eq!(chain[0]["virtual-size"], 3 << 20);
        assert_eq!(chain[0]["backing-filename"], mid.to_str().unwrap());
        assert_eq!(chain[0]["backing-filename-format"], "qcow2");
        assert_eq!(chain[1]["backing-filename-format"], "raw");
        qemu_img_check(&top, "fresh");

        // Reads go through to both backing layers; a write lands in the top only.
        for (cmd, ok) in [
            ("read -P 0xab 0 64k", true),
            ("read -P 0x5a 1M 4k", true),
            ("read -P 0x00 2M 4k", true),
            ("read -P 0x5a 0 4k", false),
        ] {
            let r = qemu_io(&top, cmd);
            let text = String::from_utf8_lossy(&r.stdout).to_string();
            assert_eq!(
                !text.contains("Pattern verification failed"),
                ok,
                "{cmd}: {text}"
            );
        }
        assert!(qemu_io(&top, "write -P 0xcd 1M 4k").status.success());
        let r = qemu_io(&top, "read -P 0xcd 1M 4k");
        assert!(!String::from_utf8_lossy(&r.stdout).contains("failed"));
        let r = qemu_io(&mid, "read -P 0x5a 1M 4k");
        assert!(!String::from_utf8_lossy(&r.stdout).contains("failed"));
        qemu_img_check(&top, "after a write");
    }
}
