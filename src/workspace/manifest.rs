//! The sync base of one sandbox: the manifest last synced and the content of what was sent.
//!
//! Layout (in the sandbox's directory of the data root):
//! `workspace/manifest.json` (the [`Manifest`], replaced atomically) and
//! `workspace/blobs/<aa>/<sha256>` (content-addressed copies of every synced file, written once,
//! never changed). Owns that directory; never touches the host repo.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::WorkspaceError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    File,
    Dir,
    Symlink,
}

/// One synced path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub kind: Kind,
    pub mode: u32,
    /// Host size and mtime when synced: an unchanged stat means unchanged content.
    pub size: u64,
    pub mtime_ns: i64,
    /// SHA-256 of the content sent (files; for `.git/config` the sanitized content).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// Symlink target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// Size and mtime the file has in the VM right after the sync (seconds, nanoseconds):
    /// a VM file with another stat may have changed.
    #[serde(default)]
    pub guest_size: u64,
    #[serde(default)]
    pub guest_mtime: i64,
    #[serde(default)]
    pub guest_nsec: u32,
}

impl Entry {
    pub fn file(mode: u32, size: u64, mtime_ns: i64, sha256: String) -> Entry {
        Entry {
            kind: Kind::File,
            mode,
            size,
            mtime_ns,
            sha256,
            link: None,
            guest_size: size,
            guest_mtime: mtime_ns.div_euclid(1_000_000_000),
            guest_nsec: 0,
        }
    }
}

/// Path (relative, `/`-separated) -> entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub entries: BTreeMap<String, Entry>,
}

/// The on-disk sync base of a sandbox.
#[derive(Debug, Clone)]
pub struct Base {
    dir: PathBuf,
}

impl Base {
    /// `dir` is `<sandbox dir>/workspace`.
    pub fn new(dir: PathBuf) -> Base {
        Base { dir }
    }

    fn manifest_path(&self) -> PathBuf {
        self.dir.join("manifest.json")
    }

    pub fn blob_path(&self, sha256: &str) -> PathBuf {
        let pre = sha256.get(..2).unwrap_or("00");
        self.dir.join("blobs").join(pre).join(sha256)
    }

    /// The manifest last synced; empty before the first sync.
    pub fn load(&self) -> Result<Manifest, WorkspaceError> {
        let p = self.manifest_path();
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| WorkspaceError::CorruptBase(p, e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
            Err(e) => Err(WorkspaceError::io("read", p)(e)),
        }
    }

    /// Replace the manifest atomically (temp file, fsync, rename). Every blob and pack it names
    /// is already durable (they are fsynced when written).
    pub fn save(&self, m: &Manifest) -> Result<(), WorkspaceError> {
        self.save_identified(m).map(|_| ())
    }

    /// [`Base::save`], returning the identity of the file written.
    fn save_identified(&self, m: &Manifest) -> Result<FileId, WorkspaceError> {
        let p = self.manifest_path();
        let json = serde_json::to_vec(m)
            .map_err(|e| WorkspaceError::CorruptBase(p.clone(), e.to_string()))?;
        write_file(&p, &json, 0o600, true)
    }

    /// Store `data` under its hash (no-op when present), durably. Returns the hash.
    pub fn put_blob(&self, data: &[u8]) -> Result<String, WorkspaceError> {
        let sha = super::sha256(data);
        let p = self.blob_path(&sha);
        if !p.exists() {
            write_file(&p, data, 0o600, true)?;
        }
        Ok(sha)
    }

    /// Store the archive of one sync as a pack: `index` names each file's content in it
    /// (SHA-256, offset, length). Returns the pack's files (archive, index).
    ///
    /// Atomic (temp file + rename: a killed daemon leaves a whole pack or none) but not fsynced:
    /// a pack only matters while the VM it describes lives, and a host crash ends that VM too
    /// (its disk is `cache=unsafe`); every read checks the content's hash. An fsync of a first
    /// sync's 100 MB pack was ~300 ms of the sync (`cargo xtask bench` (e)).
    pub fn put_pack(
        &self,
        archive: &[u8],
        index: &[(String, u64, u64)],
    ) -> Result<Vec<PathBuf>, WorkspaceError> {
        if index.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.dir.join("packs");
        let mut rnd = [0u8; 8];
        let _ = getrandom::fill(&mut rnd);
        let id = hex::encode(rnd);
        let tar = dir.join(format!("{id}.tar"));
        write_file(&tar, archive, 0o600, false)?;
        let idx: BTreeMap<&str, (u64, u64)> = index
            .iter()
            .map(|(sha, off, len)| (sha.as_str(), (*off, *len)))
            .collect();
        let json = serde_json::to_vec(&idx)
            .map_err(|e| WorkspaceError::CorruptBase(dir.clone(), e.to_string()))?;
        let idx_path = dir.join(format!("{id}.idx"));
        write_file(&idx_path, &json, 0o600, false)?;
        Ok(vec![tar, idx_path])
    }

    /// The content with this hash from the packs, if one holds it.
    fn packed(&self, sha256: &str) -> Result<Option<Vec<u8>>, WorkspaceError> {
        use std::os::unix::fs::FileExt;
        let dir = self.dir.join("packs");
        let Ok(rd) = std::fs::read_dir(&dir) else {
            return Ok(None);
        };
        for ent in rd.flatten() {
            let p = ent.path();
            if p.extension().is_none_or(|e| e != "idx") {
                continue;
            }
            let raw = std::fs::read(&p).map_err(WorkspaceError::io("read", &p))?;
            let idx: BTreeMap<String, (u64, u64)> = serde_json::from_slice(&raw)
                .map_err(|e| WorkspaceError::CorruptBase(p.clone(), e.to_string()))?;
            let Some((off, len)) = idx.get(sha256) else {
                continue;
            };
            let pack = p.with_extension("tar");
            let f = std::fs::File::open(&pack).map_err(WorkspaceError::io("open", &pack))?;
            let mut buf = vec![0u8; *len as usize];
            f.read_exact_at(&mut buf, *off)
                .map_err(WorkspaceError::io("read", &pack))?;
            if super::sha256(&buf) != sha256 {
                return Err(WorkspaceError::CorruptBase(
                    pack,
                    format!("content of {sha256} does not match its hash"),
                ));
            }
            return Ok(Some(buf));
        }
        Ok(None)
    }

    pub fn blob(&self, sha256: &str) -> Result<Vec<u8>, WorkspaceError> {
        let p = self.blob_path(sha256);
        match std::fs::read(&p) {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match self.packed(sha256)? {
                Some(d) => Ok(d),
                None => Err(WorkspaceError::io("read the sync base blob", p)(e)),
            },
            Err(e) => Err(WorkspaceError::io("read the sync base blob", p)(e)),
        }
    }
}

/// Write `data` to `path` atomically: a temp file in the same directory, exact mode, fsync,
/// rename. A crash leaves the old content or the new one, never a mix.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), WorkspaceError> {
    write_file(path, data, mode, true).map(|_| ())
}

/// Temp file + rename; `durable` also fsyncs the file before the rename. Returns the identity
/// of the file written (taken before the rename, so it is this file's whatever happens next).
fn write_file(
    path: &Path,
    data: &[u8],
    mode: u32,
    durable: bool,
) -> Result<FileId, WorkspaceError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(WorkspaceError::io("create", dir))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let mut rnd = [0u8; 6];
    let _ = getrandom::fill(&mut rnd);
    let tmp = dir.join(format!(".{name}.tryboxi-{}", hex::encode(rnd)));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))?;
        if durable {
            f.sync_all()?;
        }
        let id = FileId::of(&f.metadata()?);
        std::fs::rename(&tmp, path).map(|()| id)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(WorkspaceError::io("write", path))
}

/// What tells one version of the manifest file from another: every save writes a new file
/// (a new inode) and renames it over the old one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileId {
    fn of(md: &std::fs::Metadata) -> FileId {
        FileId {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
        }
    }
}

/// Sync bases kept at most by a [`ManifestCache`].
const CACHED_MANIFESTS: usize = 32;
/// Entries kept at most by a [`ManifestCache`], all bases together (~250 bytes each in memory).
const CACHED_ENTRIES: usize = 400_000;

/// The manifests this process last read or wrote, by file: a sync of a big tree does not parse
/// (nor a no-change sync re-serialize) tens of thousands of entries each time. An entry is
/// used only while the manifest file is still the very file it was read from or written to
/// (same device, inode, size and mtime), so a base replaced by anyone else (a restore, a fork,
/// another process) is read again.
#[derive(Default)]
pub struct ManifestCache(Mutex<HashMap<PathBuf, (FileId, Arc<Manifest>)>>);

impl ManifestCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (FileId, Arc<Manifest>)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Base::load`], from memory while the file is unchanged.
    pub fn load(&self, base: &Base) -> Result<Arc<Manifest>, WorkspaceError> {
        let p = base.manifest_path();
        let id = match std::fs::metadata(&p) {
            Ok(md) => FileId::of(&md),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.lock().remove(&p);
                return Ok(Arc::new(Manifest::default()));
            }
            Err(e) => return Err(WorkspaceError::io("read", p)(e)),
        };
        if let Some((cached, m)) = self.lock().get(&p)
            && *cached == id
        {
            return Ok(m.clone());
        }
        let m = Arc::new(base.load()?);
        // Cached only if the file read is still the one stat'ed (not replaced meanwhile).
        if std::fs::metadata(&p).is_ok_and(|md| FileId::of(&md) == id) {
            self.insert(p, id, m.clone());
        }
        Ok(m)
    }

    /// [`Base::save`], keeping `m` as the cached manifest of `base`.
    pub fn save(&self, base: &Base, m: Arc<Manifest>) -> Result<(), WorkspaceError> {
        let p = base.manifest_path();
        match base.save_identified(&m) {
            Ok(id) => {
                self.insert(p, id, m);
                Ok(())
            }
            Err(e) => {
                self.lock().remove(&p);
                Err(e)
            }
        }
    }

    fn insert(&self, p: PathBuf, id: FileId, m: Arc<Manifest>) {
        self.insert_within(p, id, m, CACHED_MANIFESTS, CACHED_ENTRIES);
    }

    /// Keep `m`, dropping others so that at most `bases` manifests of at most `entries`
    /// entries in all stay.
    fn insert_within(
        &self,
        p: PathBuf,
        id: FileId,
        m: Arc<Manifest>,
        bases: usize,
        entries: usize,
    ) {
        let mut c = self.lock();
        c.remove(&p);
        if m.entries.len() > entries {
            return;
        }
        let over = |c: &HashMap<PathBuf, (FileId, Arc<Manifest>)>| {
            c.len() >= bases
                || c.values().map(|(_, m)| m.entries.len()).sum::<usize>() + m.entries.len()
                    > entries
        };
        if over(&c) {
            // Bases of removed sandboxes first, then any.
            c.retain(|k, _| k.exists());
        }
        while over(&c) {
            let Some(k) = c.keys().next().cloned() else {
                break;
            };
            c.remove(&k);
        }
        c.insert(p, (id, m));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_round_trips_manifest_and_blobs() {
        let d = tempfile::tempdir().unwrap();
        let b = Base::new(d.path().join("workspace"));
        assert_eq!(b.load().unwrap(), Manifest::default());
        let sha = b.put_blob(b"hello").unwrap();
        assert_eq!(b.blob(&sha).unwrap(), b"hello");
        let mut m = Manifest::default();
        m.entries
            .insert("a".into(), Entry::file(0o644, 5, 1_500_000_000_123, sha));
        b.save(&m).unwrap();
        assert_eq!(b.load().unwrap(), m);
        assert_eq!(m.entries["a"].guest_mtime, 1500);
    }

    #[test]
    fn packed_contents_are_found_by_hash_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let b = Base::new(d.path().join("workspace"));
        let archive = b"xxxxhelloyyworld".to_vec();
        let (h, w) = (
            super::super::sha256(b"hello"),
            super::super::sha256(b"world"),
        );
        b.put_pack(&archive, &[(h.clone(), 4, 5), (w.clone(), 11, 5)])
            .unwrap();
        assert_eq!(b.blob(&h).unwrap(), b"hello");
        assert_eq!(b.blob(&w).unwrap(), b"world");
        assert!(b.blob(&super::super::sha256(b"nope")).is_err());
        let loose = b.put_blob(b"loose").unwrap();
        assert_eq!(b.blob(&loose).unwrap(), b"loose");
    }

    #[test]
    fn cache_serves_the_saved_manifest_until_the_file_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let b = Base::new(d.path().join("workspace"));
        let cache = ManifestCache::default();
        assert_eq!(*cache.load(&b).unwrap(), Manifest::default());
        let mut m = Manifest::default();
        m.entries
            .insert("a".into(), Entry::file(0o644, 1, 1, "x".into()));
        let m = Arc::new(m);
        cache.save(&b, m.clone()).unwrap();
        assert!(Arc::ptr_eq(&cache.load(&b).unwrap(), &m), "from memory");
        assert_eq!(b.load().unwrap(), *m, "and on disk");
        // Someone else (a restore, a fork) replaces the file: read again.
        let mut other = Manifest::default();
        other
            .entries
            .insert("b".into(), Entry::file(0o600, 2, 2, "y".into()));
        b.save(&other).unwrap();
        let got = cache.load(&b).unwrap();
        assert_eq!(*got, other);
        assert!(Arc::ptr_eq(&cache.load(&b).unwrap(), &got), "then cached");
        std::fs::remove_file(d.path().join("workspace/manifest.json")).unwrap();
        assert_eq!(*cache.load(&b).unwrap(), Manifest::default());
    }

    #[test]
    fn cache_stays_bounded() {
        let d = tempfile::tempdir().unwrap();
        let cache = ManifestCache::default();
        for i in 0..CACHED_MANIFESTS + 5 {
            let b = Base::new(d.path().join(format!("w{i}")));
            cache.save(&b, Arc::new(Manifest::default())).unwrap();
        }
        assert_eq!(cache.lock().len(), CACHED_MANIFESTS);
        // By entries too: at most 10 here, so a base of 6 leaves room for no other such.
        let small = ManifestCache::default();
        let mut six = Manifest::default();
        for i in 0..6 {
            six.entries
                .insert(format!("f{i}"), Entry::file(0o644, 0, 0, String::new()));
        }
        let six = Arc::new(six);
        let id = FileId::of(&std::fs::metadata(d.path()).unwrap());
        for i in 0..3 {
            small.insert_within(format!("m{i}").into(), id, six.clone(), 8, 10);
        }
        small.insert_within("empty".into(), id, Arc::new(Manifest::default()), 8, 10);
        let c = small.lock();
        let mut kept: Vec<_> = c.keys().map(|k| k.display().to_string()).collect();
        kept.sort();
        assert_eq!(kept, ["empty", "m2"]);
        drop(c);
        // A base over the limit by itself is not kept at all.
        let mut eleven = (*six).clone();
        for i in 6..11 {
            eleven
                .entries
                .insert(format!("f{i}"), Entry::file(0o644, 0, 0, String::new()));
        }
        small.insert_within("m2".into(), id, Arc::new(eleven), 8, 10);
        assert!(!small.lock().contains_key(Path::new("m2")));
    }

    #[test]
    fn corrupt_manifest_is_reported_not_ignored() {
        let d = tempfile::tempdir().unwrap();
        let b = Base::new(d.path().to_path_buf());
        std::fs::write(d.path().join("manifest.json"), b"{oops").unwrap();
        assert!(matches!(b.load(), Err(WorkspaceError::CorruptBase(..))));
    }
}
