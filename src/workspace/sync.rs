//! The delta of a host -> VM sync: what changed since the sync base, as one tar archive of
//! changed paths plus a list of deletions, and the manifest to record once the VM has it.
//!
//! Owns the comparison host scan vs base and the archive format the guest's `Untar` reads.
//! Never changes the host repo; the base is only written by [`Base::save`] after the caller
//! delivered the archive.

use std::collections::HashSet;
use std::path::Path;

use super::manifest::{Entry, Kind, Manifest};
use super::rules::{HostEntry, Scan, Skip};
use super::{WorkspaceError, gitconfig};

/// A computed sync, ready to send.
pub struct Delta {
    /// Tar archive of every added or changed path (directories, files, symlinks).
    pub archive: Vec<u8>,
    /// Paths gone from the host (a deleted directory is one entry, its content implied).
    pub delete: Vec<String>,
    /// The base to record once the VM has unpacked `archive` and applied `delete`.
    pub manifest: Manifest,
    /// Files changed on both sides since the base: left as the VM has them.
    pub kept_vm_changes: Vec<String>,
    /// SHA-256, offset and length of each file's content in `archive`: store it with
    /// [`Base::put_pack`] (while it goes to the VM; the manifest naming it only once the VM has it).
    pub pack_index: Vec<(String, u64, u64)>,
    /// Whether `manifest` differs from the stored base (else there is nothing to save).
    pub changed: bool,
    /// Entries in `archive` (directories included).
    pub entries: u64,
    pub files_sent: u64,
    pub bytes_sent: u64,
    pub unchanged: u64,
    /// Files left out because they hold a stored secret's value: (path, secret name). The
    /// VM and the base keep what they had there.
    pub secret_values_skipped: Vec<(String, String)>,
}

/// Read a host file as it goes into the VM (git config files sanitized: see
/// [`gitconfig::is_git_config`]), taking its size from
/// `budget` (bytes this sync may still read). `None` when it is no regular file any more
/// (removed, or swapped for a symlink, FIFO or device since the scan: the next sync sees
/// what it became). Never follows a symlink at the last component and never reads more than
/// the size the file has when opened.
fn read_for_vm(root: &Path, rel: &str, budget: &Budget) -> Result<Option<Vec<u8>>, WorkspaceError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt;
    let p = root.join(rel);
    let f = std::fs::OpenOptions::new()
        .read(true)
        // O_NONBLOCK: opening a FIFO swapped in must not wait for a writer.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&p);
    let f = match f {
        Ok(f) => f,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ELOOP) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(WorkspaceError::io("read", &p)(e)),
    };
    let md = f.metadata().map_err(WorkspaceError::io("read", &p))?;
    if !md.is_file() {
        return Ok(None);
    }
    budget.take(md.len())?;
    let mut data = Vec::with_capacity(md.len() as usize);
    f.take(md.len())
        .read_to_end(&mut data)
        .map_err(WorkspaceError::io("read", &p))?;
    if gitconfig::is_git_config(root, rel) {
        return Ok(Some(
            gitconfig::sanitize(&String::from_utf8_lossy(&data)).into_bytes(),
        ));
    }
    Ok(Some(data))
}

/// What one sync may still read (`sync.max_sync_mib`), shared by the reading threads.
struct Budget {
    left: std::sync::atomic::AtomicU64,
    max: u64,
}

impl Budget {
    fn take(&self, n: u64) -> Result<(), WorkspaceError> {
        use std::sync::atomic::Ordering::Relaxed;
        self.left
            .fetch_update(Relaxed, Relaxed, |l| l.checked_sub(n))
            .map(|_| ())
            .map_err(|_| over_sync_cap(self.max, "grew past it while being read"))
    }
}

/// The error of a sync over `sync.max_sync_mib`.
fn over_sync_cap(max: u64, what: &str) -> WorkspaceError {
    WorkspaceError::TooBig(format!(
        "the workspace files to send {what}: over sync.max_sync_mib ({} MiB); leave big \
         paths out (`.gitignore`, `sync.exclude`, `--exclude`) or raise the limit",
        max >> 20
    ))
}

/// Content and SHA-256 of a file as it goes into the VM; `None`: no regular file any more.
type Read = Result<Option<(Vec<u8>, String)>, WorkspaceError>;

/// Read and hash `paths`, spread over the CPUs (a first sync reads the whole repo).
fn read_all<'a>(
    root: &Path,
    paths: &[&'a str],
    budget: &Budget,
) -> std::collections::HashMap<&'a str, Read> {
    let read = |rel: &str| -> Read {
        let Some(d) = read_for_vm(root, rel, budget)? else {
            return Ok(None);
        };
        let sha = super::sha256(&d);
        Ok(Some((d, sha)))
    };
    if paths.len() < 64 {
        return paths.iter().map(|p| (*p, read(p))).collect();
    }
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8);
    let chunk = paths.len().div_ceil(n);
    std::thread::scope(|s| {
        let hs: Vec<_> = paths
            .chunks(chunk)
            .map(|c| s.spawn(move || c.iter().map(|p| (*p, read(p))).collect::<Vec<_>>()))
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

fn header(kind: tar::EntryType, mode: u32, size: u64, mtime_ns: i64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(mtime_ns.div_euclid(1_000_000_000).max(0) as u64);
    h.set_uid(0);
    h.set_gid(0);
    h
}

/// Compare the host scan with the base, read what changed and build the archive (the caller
/// stores it as a pack of the base with [`Delta::pack_index`] once the VM has it). A file whose stat (size, mtime, mode) is unchanged is not read.
#[cfg(test)]
pub fn compute(
    root: &Path,
    scan: &Scan,
    base: &super::manifest::Base,
) -> Result<Delta, WorkspaceError> {
    compute_keeping(
        root,
        scan,
        &base.load()?,
        &HashSet::new(),
        &Skip::default(),
        u64::MAX,
        &crate::secrets::scan::Scanner::default(),
    )
}

/// Every path of the host scan and of the base once, in order, with what each side has there
/// (both are sorted maps: one pass, no lookups).
fn merged<'a>(
    scan: &'a Scan,
    old: &'a Manifest,
) -> impl Iterator<Item = (&'a String, Option<&'a HostEntry>, Option<&'a Entry>)> {
    let mut h = scan.entries.iter().peekable();
    let mut o = old.entries.iter().peekable();
    std::iter::from_fn(move || match (h.peek(), o.peek()) {
        (Some((hk, _)), Some((ok, _))) => match hk.cmp(ok) {
            std::cmp::Ordering::Less => h.next().map(|(k, v)| (k, Some(v), None)),
            std::cmp::Ordering::Greater => o.next().map(|(k, v)| (k, None, Some(v))),
            std::cmp::Ordering::Equal => {
                let (k, hv) = h.next()?;
                let (_, ov) = o.next()?;
                Some((k, Some(hv), Some(ov)))
            }
        },
        (Some(_), None) => h.next().map(|(k, v)| (k, Some(v), None)),
        (None, Some(_)) => o.next().map(|(k, v)| (k, None, Some(v))),
        (None, None) => None,
    })
}

/// The base entry still describes the host path: same kind, mode and link, and for files
/// the same size and mtime (content unchanged without reading it).
fn same_stat(h: &HostEntry, p: &Entry) -> bool {
    p.kind == h.kind
        && p.mode == h.mode
        && p.link == h.link
        && (h.kind == Kind::Dir || (p.size == h.size && p.mtime_ns == h.mtime_ns))
}

/// Files of the base whose host stat changed: before overwriting them the caller checks
/// whether the VM changed them too (see [`compute_keeping`]).
pub fn overwrite_candidates(scan: &Scan, old: &Manifest) -> Vec<String> {
    merged(scan, old)
        .filter(|(_, h, p)| {
            matches!((h, p), (Some(h), Some(p)) if h.kind == Kind::File
                && p.kind == Kind::File
                && (p.size != h.size || p.mtime_ns != h.mtime_ns))
        })
        .map(|(rel, _, _)| rel.clone())
        .collect()
}

/// Like [`compute`], but files in `vm_changed` (changed in the VM since the base) are not
/// overwritten when the host changed them too: their base stays, so diff shows the VM's
/// change and apply merges both. They are listed in [`Delta::kept_vm_changes`].
/// Paths of the base that `skip` matches stay as they are (not sent, not deleted); the scan
/// is expected to have left them out.
/// At most `max_bytes` of file content is read (`sync.max_sync_mib`): over it, by the scan's
/// sizes, [`WorkspaceError::TooBig`] before any file is read.
/// A file holding a value `values` finds (a stored secret, or an encoding of it) is not sent:
/// listed in [`Delta::secret_values_skipped`], the VM and the base keep what they had.
#[allow(clippy::too_many_arguments)]
pub fn compute_keeping(
    root: &Path,
    scan: &Scan,
    old: &Manifest,
    vm_changed: &HashSet<String>,
    skip: &Skip,
    max_bytes: u64,
    values: &crate::secrets::scan::Scanner,
) -> Result<Delta, WorkspaceError> {
    let mut secret_values_skipped = Vec::new();
    let mut kept_vm_changes = Vec::new();
    let mut pack_index = Vec::new();
    // Built in path order, so the map is bulk-built at the end.
    let mut out: Vec<(String, Entry)> = Vec::with_capacity(scan.entries.len());
    let (mut files_sent, mut bytes_sent, mut unchanged, mut entries) = (0u64, 0u64, 0u64, 0u64);
    let tar_err = |rel: &str| {
        let rel = rel.to_owned();
        move |e: std::io::Error| WorkspaceError::Io {
            what: "archive",
            path: rel.into(),
            source: e,
        }
    };
    let mut announced = 0u64;
    let to_read: Vec<&str> = merged(scan, old)
        .filter(|(rel, h, p)| {
            h.is_some_and(|h| h.kind == Kind::File && !p.is_some_and(|p| same_stat(h, p)))
                && !skip.skips(rel)
        })
        .map(|(rel, h, _)| {
            announced = announced.saturating_add(h.map_or(0, |h| h.size));
            rel.as_str()
        })
        .collect();
    if announced > max_bytes {
        return Err(over_sync_cap(
            max_bytes,
            &format!("are {} MiB", announced.div_ceil(1 << 20)),
        ));
    }
    let budget = Budget {
        left: max_bytes.into(),
        max: max_bytes,
    };
    let mut reads = read_all(root, &to_read, &budget);
    // Sized once: growing a 100 MB archive by doubling copies it over and over.
    let data: usize = reads
        .values()
        .map(|r| match r {
            Ok(Some((d, _))) => d.len().next_multiple_of(512),
            _ => 0,
        })
        .sum();
    let mut b = tar::Builder::new(Vec::with_capacity(data + (to_read.len() + 64) * 512));
    let mut delete: Vec<String> = Vec::new();
    let mut deleted: HashSet<&str> = HashSet::new();
    for (rel, h, prev) in merged(scan, old) {
        if skip.skips(rel) {
            // Left as they are: the base keeps what it had.
            if let Some(p) = prev {
                out.push((rel.clone(), p.clone()));
            }
            continue;
        }
        if let Some(e) = prev {
            // Gone from the host, or a directory that became something else (the guest
            // replaces a file of another kind while unpacking). A directory's content goes
            // with it: one entry.
            let gone = h.is_none_or(|h| h.kind != e.kind && e.kind == Kind::Dir);
            if gone && !super::ancestors(rel).any(|a| deleted.contains(a)) {
                delete.push(rel.clone());
                deleted.insert(rel.as_str());
            }
        }
        let Some(h) = h else { continue };
        if let Some(p) = prev.filter(|p| same_stat(h, p)) {
            out.push((rel.clone(), p.clone()));
            unchanged += 1;
            continue;
        }
        match h.kind {
            Kind::Dir => {
                let hd = header(tar::EntryType::Directory, h.mode, 0, h.mtime_ns);
                b.append_data(&mut hd.clone(), rel, std::io::empty())
                    .map_err(tar_err(rel))?;
                entries += 1;
                out.push((
                    rel.clone(),
                    Entry {
                        kind: Kind::Dir,
                        mode: h.mode,
                        size: 0,
                        mtime_ns: h.mtime_ns,
                        sha256: String::new(),
                        link: None,
                        guest_size: 0,
                        guest_mtime: 0,
                        guest_nsec: 0,
                    },
                ));
            }
            Kind::Symlink => {
                let target = h.link.clone().unwrap_or_default();
                let mut hd = header(tar::EntryType::Symlink, h.mode, 0, h.mtime_ns);
                b.append_link(&mut hd, rel, &target).map_err(tar_err(rel))?;
                entries += 1;
                out.push((
                    rel.clone(),
                    Entry {
                        kind: Kind::Symlink,
                        mode: h.mode,
                        size: h.size,
                        mtime_ns: h.mtime_ns,
                        sha256: String::new(),
                        link: Some(target),
                        guest_size: 0,
                        guest_mtime: 0,
                        guest_nsec: 0,
                    },
                ));
                files_sent += 1;
            }
            Kind::File => {
                let Some(read) = reads.remove(rel.as_str()) else {
                    continue;
                };
                // Removed (or no regular file any more) since the scan: the next sync sees it.
                let Some((data, sha)) = read? else {
                    continue;
                };
                if let Some(name) = values.find(&data) {
                    secret_values_skipped.push((rel.clone(), name.to_owned()));
                    if let Some(p) = prev {
                        out.push((rel.clone(), p.clone()));
                    }
                    continue;
                }
                let mut e = Entry::file(h.mode, h.size, h.mtime_ns, sha.clone());
                e.guest_size = data.len() as u64;
                if let Some(p) =
                    prev.filter(|p| p.kind == Kind::File && p.sha256 == sha && p.mode == h.mode)
                {
                    // Touched but not changed: the VM keeps its copy.
                    e.guest_size = p.guest_size;
                    e.guest_mtime = p.guest_mtime;
                    e.guest_nsec = p.guest_nsec;
                    out.push((rel.clone(), e));
                    unchanged += 1;
                    continue;
                }
                if let Some(p) = prev.filter(|p| p.kind == Kind::File && vm_changed.contains(rel)) {
                    // Both changed: keep the VM's version and the old base.
                    out.push((rel.clone(), p.clone()));
                    kept_vm_changes.push(rel.clone());
                    continue;
                }
                let mut hd = header(
                    tar::EntryType::Regular,
                    h.mode,
                    data.len() as u64,
                    h.mtime_ns,
                );
                b.append_data(&mut hd, rel, data.as_slice())
                    .map_err(tar_err(rel))?;
                // The content ends where the archive ends, before the padding to 512.
                let end = b.get_ref().len() as u64;
                let len = data.len() as u64;
                pack_index.push((sha, end - len.div_ceil(512) * 512, len));
                files_sent += 1;
                entries += 1;
                bytes_sent += data.len() as u64;
                out.push((rel.clone(), e));
            }
        }
    }
    let archive = b.into_inner().map_err(tar_err("(archive)"))?;
    let out = Manifest {
        entries: out.into_iter().collect(),
    };
    Ok(Delta {
        pack_index,
        kept_vm_changes,
        changed: out != *old,
        archive,
        delete,
        manifest: out,
        entries,
        files_sent,
        bytes_sent,
        unchanged,
        secret_values_skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::super::manifest::Base;
    use super::super::rules::{Rules, scan};
    use super::*;
    use crate::config::SyncConfig;

    fn names(archive: &[u8]) -> Vec<String> {
        let mut a = tar::Archive::new(archive);
        a.entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    fn write(root: &Path, rel: &str, data: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, data).unwrap();
    }

    #[test]
    fn second_sync_sends_only_the_changed_file_and_the_deletion() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        for i in 0..20 {
            write(root, &format!("src/f{i}.txt"), &format!("file {i}"));
        }
        write(root, "old/x.txt", "x");
        write(root, ".env", "SECRET=1");
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!(first.files_sent, 21);
        base.put_pack(&first.archive, &first.pack_index).unwrap();
        for (rel, e) in &first.manifest.entries {
            if e.kind == Kind::File {
                let want = std::fs::read(root.join(rel)).unwrap();
                assert_eq!(base.blob(&e.sha256).unwrap(), want, "{rel} from the pack");
            }
        }
        assert!(!names(&first.archive).iter().any(|n| n.contains(".env")));
        base.save(&first.manifest).unwrap();

        // Nothing changed: nothing sent.
        let again = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!((again.files_sent, again.delete.len()), (0, 0));
        assert!(
            first.changed && !again.changed,
            "an idle sync writes no new base"
        );
        assert_eq!(again.unchanged, first.manifest.entries.len() as u64);

        write(root, "src/f3.txt", "changed!");
        std::fs::remove_dir_all(root.join("old")).unwrap();
        let d = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!(names(&d.archive), ["src/f3.txt"]);
        assert_eq!(d.delete, ["old"]);
        assert_eq!(d.files_sent, 1);
        assert_eq!(d.bytes_sent, 8);
        let sha = &d.manifest.entries["src/f3.txt"].sha256;
        base.put_pack(&d.archive, &d.pack_index).unwrap();
        assert_eq!(base.blob(sha).unwrap(), b"changed!");
    }

    #[test]
    fn deletions_name_each_gone_tree_once_and_kind_changes_replace() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        // "a-b" sorts between "a" and "a/x": it is not under "a".
        for p in ["a/x", "a/y/z", "a-b", "c/1", "c/2", "d/e", "f", "keep/k"] {
            write(root, p, p);
        }
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        base.save(&first.manifest).unwrap();
        std::fs::remove_dir_all(root.join("a")).unwrap();
        std::fs::remove_file(root.join("c/1")).unwrap();
        std::fs::remove_file(root.join("c/2")).unwrap();
        // A directory becomes a file, a file becomes a directory.
        std::fs::remove_dir_all(root.join("d")).unwrap();
        write(root, "d", "now a file");
        std::fs::remove_file(root.join("f")).unwrap();
        write(root, "f/g", "now a dir");
        let d = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!(d.delete, ["a", "c/1", "c/2", "d"]);
        assert_eq!(names(&d.archive), ["d", "f", "f/g"]);
        let paths: Vec<&str> = d.manifest.entries.keys().map(|k| k.as_str()).collect();
        assert_eq!(paths, ["a-b", "c", "d", "f", "f/g", "keep", "keep/k"]);
        assert_eq!(d.manifest.entries["d"].kind, Kind::File);
        assert_eq!(d.manifest.entries["f"].kind, Kind::Dir);
    }

    #[test]
    fn a_file_changed_on_both_sides_is_left_as_the_vm_has_it() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        write(root, "a.txt", "base");
        write(root, "b.txt", "base");
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        base.save(&first.manifest).unwrap();
        write(root, "a.txt", "host edit");
        write(root, "b.txt", "host edit");
        let s = scan(root, &rules).unwrap();
        assert_eq!(
            overwrite_candidates(&s, &first.manifest),
            ["a.txt", "b.txt"]
        );
        let vm = HashSet::from(["a.txt".to_string()]);
        let d = compute_keeping(
            root,
            &s,
            &first.manifest,
            &vm,
            &Skip::default(),
            u64::MAX,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(names(&d.archive), ["b.txt"]);
        assert_eq!(d.kept_vm_changes, ["a.txt"]);
        assert_eq!(d.manifest.entries["a.txt"], first.manifest.entries["a.txt"]);
    }

    #[test]
    fn a_file_holding_a_stored_value_is_left_out_and_listed() {
        use crate::secrets::{Value, scan::Scanner};
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        write(root, "config.js", "key = 'none'");
        write(root, "ok.txt", "fine");
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        base.save(&first.manifest).unwrap();
        let values =
            Scanner::new(&[("API_KEY".into(), Value::new(b"sk-live-0123456789".to_vec()))]);
        // Changed to hold the value (base64 of it), and a new file holding it raw.
        let b64 = crate::api::b64::encode(b"sk-live-0123456789");
        write(root, "config.js", &format!("key = atob('{b64}')"));
        write(root, "notes/new.txt", "token sk-live-0123456789\n");
        write(root, "ok.txt", "still fine");
        let s = scan(root, &rules).unwrap();
        let d = compute_keeping(
            root,
            &s,
            &first.manifest,
            &HashSet::new(),
            &Skip::default(),
            u64::MAX,
            &values,
        )
        .unwrap();
        assert_eq!(names(&d.archive), ["notes", "ok.txt"]);
        let mut skipped = d.secret_values_skipped.clone();
        skipped.sort();
        assert_eq!(
            skipped,
            [
                ("config.js".to_owned(), "API_KEY".to_owned()),
                ("notes/new.txt".to_owned(), "API_KEY".to_owned())
            ]
        );
        // The base keeps what the VM has: the old config.js, no notes/new.txt.
        assert_eq!(
            d.manifest.entries["config.js"],
            first.manifest.entries["config.js"]
        );
        assert!(!d.manifest.entries.contains_key("notes/new.txt"));
    }

    #[test]
    fn a_request_exclude_neither_sends_nor_deletes_its_paths() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        write(root, "big/a.bin", "a");
        write(root, "src/x.txt", "x");
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        base.save(&first.manifest).unwrap();
        write(root, "big/a.bin", "changed");
        write(root, "big/new.bin", "new");
        write(root, "src/x.txt", "changed");
        let skip = Skip::new(&["big".into()]).unwrap();
        let scan_rules = rules.with_exclude(&["big".into()]).unwrap();
        let s = scan(root, &scan_rules).unwrap();
        let d = compute_keeping(
            root,
            &s,
            &first.manifest,
            &HashSet::new(),
            &skip,
            u64::MAX,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(names(&d.archive), ["src/x.txt"]);
        assert!(d.delete.is_empty(), "{:?}", d.delete);
        for p in ["big", "big/a.bin"] {
            assert_eq!(d.manifest.entries[p], first.manifest.entries[p], "{p}");
        }
        assert!(!d.manifest.entries.contains_key("big/new.bin"));
        // The next sync without the exclude sends what was skipped.
        base.save(&d.manifest).unwrap();
        let n = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!(names(&n.archive), ["big/a.bin", "big/new.bin"]);
    }

    #[test]
    fn touched_but_identical_file_is_not_resent() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        write(root, "a.txt", "same");
        let first = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        base.save(&first.manifest).unwrap();
        let f = std::fs::File::options()
            .write(true)
            .open(root.join("a.txt"))
            .unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000))
            .unwrap();
        let d = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        assert_eq!(d.files_sent, 0);
    }

    #[test]
    fn git_config_goes_in_sanitized() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        write(
            root,
            ".git/config",
            "[remote \"o\"]\n\turl = https://u:tok@h/r.git\n[credential]\n\thelper = store\n",
        );
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        let base = Base::new(data.path().join("ws"));
        let d = compute(root, &scan(root, &rules).unwrap(), &base).unwrap();
        let mut a = tar::Archive::new(d.archive.as_slice());
        let mut found = false;
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            if e.path().unwrap().to_str() == Some(".git/config") {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut e, &mut s).unwrap();
                assert!(!s.contains("tok") && !s.contains("helper"), "{s}");
                assert!(s.contains("https://h/r.git"), "{s}");
                found = true;
            }
        }
        assert!(found);
    }

    #[test]
    fn a_sync_over_its_byte_cap_is_refused_before_any_file_is_read() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let root = repo.path();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        write(root, "small.txt", "x");
        // 1 GiB announced, nothing allocated on disk: a read of it would fill memory.
        let big = std::fs::File::create(root.join("huge.bin")).unwrap();
        big.set_len(1 << 30).unwrap();
        let s = scan(root, &rules).unwrap();
        let old = Base::new(data.path().join("ws")).load().unwrap();
        let t = std::time::Instant::now();
        let e = compute_keeping(
            root,
            &s,
            &old,
            &HashSet::new(),
            &Skip::default(),
            1 << 20,
            &Default::default(),
        )
        .err()
        .expect("refused");
        assert!(matches!(e, WorkspaceError::TooBig(_)), "{e}");
        let m = e.to_string();
        assert!(
            m.contains("sync.max_sync_mib (1 MiB)") && m.contains("1025 MiB"),
            "{m}"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        // Under the cap it goes through.
        std::fs::remove_file(root.join("huge.bin")).unwrap();
        let s = scan(root, &rules).unwrap();
        compute_keeping(
            root,
            &s,
            &old,
            &HashSet::new(),
            &Skip::default(),
            1 << 20,
            &Default::default(),
        )
        .unwrap();
    }

    #[test]
    fn a_file_swapped_after_the_scan_for_a_symlink_or_fifo_is_not_followed() {
        let repo = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = repo.path().to_owned();
        let rules = Rules::new(&SyncConfig::default()).unwrap();
        write(outside.path(), "secret", "not in the repo");
        write(&root, "link", "a file when scanned");
        write(&root, "fifo", "a file when scanned");
        write(&root, "kept", "kept");
        let s = scan(&root, &rules).unwrap();
        std::fs::remove_file(root.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), root.join("link")).unwrap();
        std::fs::remove_file(root.join("fifo")).unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let old = Base::new(data.path().join("ws")).load().unwrap();
        // On a thread: a read that opens the FIFO waits for a writer forever.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let d = compute_keeping(
                &root,
                &s,
                &old,
                &HashSet::new(),
                &Skip::default(),
                1 << 20,
                &Default::default(),
            );
            let _ = tx.send(d.map(|d| (names(&d.archive), d.manifest)));
        });
        let (names, manifest) = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the sync opened the FIFO and waits")
            .unwrap();
        assert_eq!(names, ["kept"]);
        assert!(!manifest.entries.contains_key("link"));
        assert!(!manifest.entries.contains_key("fifo"));
    }
}
