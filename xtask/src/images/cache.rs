//! The image cache outside the checkout: `$TRYBOXI_IMAGE_CACHE` or `/var/cache/tryboxi`.
//!
//! Layout: `<root>/<kind>/<key>/{<file>, meta.json}`. An entry is built in
//! `<root>/<kind>/.tmp-<key>-<pid>/` and renamed into place only when complete, so a directory
//! named `<key>` is always a finished entry. Never deletes anything but its own temp dirs.

use crate::util::{fmt_dur, repo_root};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

pub const DEFAULT_ROOT: &str = "/var/cache/tryboxi";

/// The cache root chosen by the environment.
pub fn root_from_env() -> PathBuf {
    match std::env::var_os("TRYBOXI_IMAGE_CACHE") {
        Some(p) if !p.is_empty() => {
            let p = PathBuf::from(p);
            if p.is_absolute() {
                p
            } else {
                repo_root().join(p)
            }
        }
        _ => PathBuf::from(DEFAULT_ROOT),
    }
}

/// What a finished cache entry records about its artifact.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub kind: String,
    pub key: String,
    /// File name inside the entry directory (and in `_out/images/`).
    pub file: String,
    pub size: u64,
    pub sha256: String,
    /// RFC 3339, UTC.
    pub built_at: String,
    pub build_seconds: f64,
    /// Kind-specific facts (kernel version, rootfs used bytes, ...).
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

pub struct Entry {
    pub dir: PathBuf,
    pub meta: Meta,
}

impl Entry {
    pub fn file_path(&self) -> PathBuf {
        self.dir.join(&self.meta.file)
    }
}

#[derive(Debug, Clone)]
pub struct Cache {
    pub root: PathBuf,
}

impl Cache {
    pub fn from_env() -> Cache {
        Cache {
            root: root_from_env(),
        }
    }

    fn kind_dir(&self, kind: &str) -> PathBuf {
        self.root.join(kind)
    }

    /// A finished entry for `kind`/`key`, if one exists and its file is present with the recorded
    /// size. (The sha256 is trusted from meta.json: re-hashing a multi-GB rootfs every run is
    /// what this cache exists to avoid.)
    pub fn lookup(&self, kind: &str, key: &str) -> Option<Entry> {
        let dir = self.kind_dir(kind).join(key);
        let text = std::fs::read_to_string(dir.join("meta.json")).ok()?;
        let meta: Meta = serde_json::from_str(&text).ok()?;
        let len = std::fs::metadata(dir.join(&meta.file)).ok()?.len();
        (meta.key == key && len == meta.size).then_some(Entry { dir, meta })
    }

    /// Starts building `kind`/`key`: takes the kind's build lock (waiting while another process
    /// builds that kind), then re-checks the cache, since the other build may have produced it.
    pub fn begin(&self, kind: &str, key: &str) -> Result<Begin> {
        let kd = self.kind_dir(kind);
        std::fs::create_dir_all(&kd).with_context(|| {
            format!(
                "creating cache dir {} (run as root, or set TRYBOXI_IMAGE_CACHE to a writable \
                 path)",
                kd.display()
            )
        })?;
        let lock = lock_exclusive(&kd.join(".lock"), kind)?;
        if let Some(e) = self.lookup(kind, key) {
            return Ok(Begin::Done(e));
        }
        remove_stale_temps(&kd);
        let dir = kd.join(format!(".tmp-{key}-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // A fresh log per attempt (a build's commands append to it).
        let log = kd.join(format!("build-{key}.log"));
        std::fs::write(&log, b"").with_context(|| format!("creating {}", log.display()))?;
        Ok(Begin::Build(Pending {
            cache: self.clone(),
            kind: kind.into(),
            key: key.into(),
            log,
            dir,
            started: SystemTime::now(),
            committed: false,
            _lock: lock,
        }))
    }
}

/// What [`Cache::begin`] found once it held the lock.
pub enum Begin {
    /// Build it: nobody else has.
    Build(Pending),
    /// Another process finished this entry while we waited.
    Done(Entry),
}

/// An exclusive `flock` on `path`, held until the returned file is dropped.
fn lock_exclusive(path: &Path, kind: &str) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening lock {}", path.display()))?;
    // SAFETY: flock on a file descriptor we own and keep open; no memory is involved.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(f);
    }
    println!(
        "    waiting for another process building the {kind} ({})",
        path.display()
    );
    // SAFETY: as above; this call blocks until the other holder releases the lock.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("locking {}", path.display()));
    }
    Ok(f)
}

/// A build in progress: a private temp dir that becomes the entry on [`Pending::commit`].
pub struct Pending {
    cache: Cache,
    pub kind: String,
    pub key: String,
    pub dir: PathBuf,
    /// The build tools' output, `<kind>/build-<key>.log`: outside the temp dir so it survives a
    /// failed build (whose temp dir is removed); moved into the entry on commit.
    pub log: PathBuf,
    started: SystemTime,
    committed: bool,
    /// The kind's build lock; released when the entry is committed or the build fails.
    _lock: std::fs::File,
}

impl Pending {
    /// Records meta.json for `file` (already written into `self.dir`) and renames the temp dir
    /// into place. If another build finished the same key first, theirs wins and ours is dropped.
    pub fn commit(
        mut self,
        file: &str,
        sha256: String,
        build_time: Duration,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Entry> {
        let path = self.dir.join(file);
        let size = std::fs::metadata(&path)
            .with_context(|| format!("stat {}", path.display()))?
            .len();
        let meta = Meta {
            kind: self.kind.clone(),
            key: self.key.clone(),
            file: file.into(),
            size,
            sha256,
            built_at: humantime::format_rfc3339_seconds(self.started).to_string(),
            build_seconds: (build_time.as_secs_f64() * 10.0).round() / 10.0,
            extra,
        };
        // Read-only: `_out/images/` hard-links this file, so nobody should write through it.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444))
            .with_context(|| format!("chmod {}", path.display()))?;
        let meta_path = self.dir.join("meta.json");
        std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta)?)
            .with_context(|| format!("writing {}", meta_path.display()))?;
        if self.log.exists() {
            std::fs::rename(&self.log, self.dir.join("build.log"))
                .with_context(|| format!("moving {}", self.log.display()))?;
        }
        sync_dir_contents(&self.dir, &[file, "meta.json"]);
        self.committed = true;
        let final_dir = self.cache.kind_dir(&self.kind).join(&self.key);
        match std::fs::rename(&self.dir, &final_dir) {
            Ok(()) => {}
            Err(_) if self.cache.lookup(&self.kind, &self.key).is_some() => {
                std::fs::remove_dir_all(&self.dir).ok();
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("renaming {} to {}", self.dir.display(), final_dir.display())
                });
            }
        }
        println!(
            "    cached {} {} ({})",
            self.kind,
            final_dir.display(),
            fmt_dur(build_time)
        );
        self.cache
            .lookup(&self.kind, &self.key)
            .with_context(|| format!("cache entry {} vanished after commit", final_dir.display()))
    }
}

impl Drop for Pending {
    /// A build that did not commit (error or panic) leaves no temp dir behind, only its log.
    fn drop(&mut self) {
        if !self.committed && self.dir.exists() {
            let _ = std::fs::remove_dir_all(&self.dir);
            if self.log.exists() {
                eprintln!(
                    "    {} build failed; its log: {}",
                    self.kind,
                    self.log.display()
                );
            }
        }
    }
}

fn sync_dir_contents(dir: &Path, files: &[&str]) {
    for f in files {
        if let Ok(fh) = std::fs::File::open(dir.join(f)) {
            let _ = fh.sync_all();
        }
    }
}

/// Removes `.tmp-<key>-<pid>` dirs left by builds whose process is gone (interrupted builds).
fn remove_stale_temps(kind_dir: &Path) {
    let Ok(rd) = std::fs::read_dir(kind_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".tmp-") else {
            continue;
        };
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            println!("    removing stale temp dir {}", e.path().display());
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Begin {
        fn pending(self) -> Pending {
            match self {
                Begin::Build(p) => p,
                Begin::Done(_) => panic!("expected a build, got a cache hit"),
            }
        }
    }

    #[test]
    fn entry_finished_by_another_process_while_waiting_is_a_hit() {
        let c = temp_cache("race");
        let p = c.begin("k", "abc").unwrap().pending();
        std::fs::write(p.dir.join("f"), b"data").unwrap();
        let c2 = c.clone();
        let waiter = std::thread::spawn(move || match c2.begin("k", "abc").unwrap() {
            Begin::Done(e) => e.meta.size,
            Begin::Build(_) => 0,
        });
        // Whether the waiter blocks on the lock or arrives after the commit, it must find the
        // finished entry instead of building it again.
        p.commit("f", "00".into(), Duration::from_secs(1), Default::default())
            .unwrap();
        assert_eq!(waiter.join().unwrap(), 4);
        std::fs::remove_dir_all(&c.root).unwrap();
    }

    fn temp_cache(name: &str) -> Cache {
        let root = std::env::temp_dir().join(format!("xtask-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        Cache { root }
    }

    #[test]
    fn unfinished_build_is_not_a_cache_hit() {
        let c = temp_cache("unfinished");
        let p = c.begin("k", "abc").unwrap().pending();
        std::fs::write(p.dir.join("f"), b"data").unwrap();
        assert!(c.lookup("k", "abc").is_none());
        let e = p
            .commit("f", "00".into(), Duration::from_secs(1), Default::default())
            .unwrap();
        assert_eq!(e.meta.size, 4);
        assert!(c.lookup("k", "abc").is_some());
        std::fs::remove_dir_all(&c.root).unwrap();
    }

    #[test]
    fn entry_with_truncated_file_is_not_a_hit() {
        let c = temp_cache("truncated");
        let p = c.begin("k", "abc").unwrap().pending();
        std::fs::write(p.dir.join("f"), b"data").unwrap();
        let e = p
            .commit("f", "00".into(), Duration::from_secs(1), Default::default())
            .unwrap();
        std::fs::set_permissions(e.file_path(), std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(e.file_path(), b"da").unwrap();
        assert!(c.lookup("k", "abc").is_none());
        std::fs::remove_dir_all(&c.root).unwrap();
    }

    #[test]
    fn failed_build_leaves_no_temp_dir_but_keeps_its_log() {
        let c = temp_cache("failed");
        let p = c.begin("k", "abc").unwrap().pending();
        std::fs::write(p.dir.join("half"), b"partial").unwrap();
        std::fs::write(&p.log, b"error: something broke").unwrap();
        let (dir, log) = (p.dir.clone(), p.log.clone());
        drop(p);
        assert!(!dir.exists());
        assert!(log.exists());
        assert!(c.lookup("k", "abc").is_none());
        std::fs::remove_dir_all(&c.root).unwrap();
    }

    #[test]
    fn temp_dirs_of_dead_processes_are_removed() {
        let c = temp_cache("stale");
        let kd = c.root.join("k");
        // PIDs are below 2^22 on Linux, so this one cannot be alive.
        let stale = kd.join(".tmp-abc-99999999");
        std::fs::create_dir_all(&stale).unwrap();
        let p = c.begin("k", "def").unwrap().pending();
        assert!(!stale.exists());
        assert!(p.dir.exists());
        std::fs::remove_dir_all(&c.root).unwrap();
    }
}
