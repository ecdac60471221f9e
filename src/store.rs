//! The store: one redb file in the data root (`tryboxi.redb`).
//!
//! Owns: the tables, their value encoding (JSON, so records stay readable and can gain fields
//! with `#[serde(default)]`), the schema version and migrations. Opening a file that is not a
//! redb database, is corrupt, or carries a newer schema is a clear error and never overwrites it.
//!
//! An I/O error (a full data root: ENOSPC in a commit) leaves redb refusing every later
//! transaction ("Previous I/O error occurred"); the store then closes and reopens the database
//! file (redb's repair brings it back to its last committed state), so the operation after the
//! space is freed works without a daemon restart. The failed call itself reports its error.
//!
//! Tables (key -> value):
//! - `meta`: `&str -> u64` (`schema_version`)
//! - `sandboxes`: sandbox id -> sandbox record
//! - `execs`: exec id -> exec record
//! - `artifacts`: artifact id -> backup record (apply/pull)
//! - `events`: sequence number -> event
//! - `snapshots`: snapshot id -> snapshot record
//! - `network`: sandbox id -> egress policy and access requests (a new table needs no
//!   migration: `init` creates missing tables)
//! - `secret_bindings`: sandbox id -> the stored secrets it was given and its placeholder for
//!   each (names and placeholders only; values live in `secrets.json`)
//! - `git_grants`: sandbox id -> the repos its git proxy may reach and push to
//! - `e2b_sandboxes`: sandbox id -> what the E2B face keeps for a sandbox it created (its access
//!   tokens, metadata, env vars, deadline)

use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The schema this build writes. Bump it and add a step to [`MIGRATIONS`] when a table changes.
pub const SCHEMA_VERSION: u64 = 1;

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
pub const SANDBOXES: TableDefinition<&str, &[u8]> = TableDefinition::new("sandboxes");
pub const EXECS: TableDefinition<&str, &[u8]> = TableDefinition::new("execs");
pub const ARTIFACTS: TableDefinition<&str, &[u8]> = TableDefinition::new("artifacts");
pub const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
pub const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
pub const NETWORK: TableDefinition<&str, &[u8]> = TableDefinition::new("network");
pub const SECRET_BINDINGS: TableDefinition<&str, &[u8]> = TableDefinition::new("secret_bindings");
pub const GIT_GRANTS: TableDefinition<&str, &[u8]> = TableDefinition::new("git_grants");
pub const E2B_SANDBOXES: TableDefinition<&str, &[u8]> = TableDefinition::new("e2b_sandboxes");

/// Migration from version `n` to `n + 1` is `MIGRATIONS[n - 1]`.
type Migration = fn(&redb::WriteTransaction) -> Result<(), redb::Error>;
const MIGRATIONS: &[Migration] = &[];

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "cannot open the store {path}: {source}. The file was left untouched; if it is corrupt, \
         stop the daemon and move it aside"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: redb::DatabaseError,
    },
    #[error(
        "the store {path} has schema version {found}, newer than this build's {supported}: \
         upgrade tryboxi (the file was left untouched)"
    )]
    NewerSchema {
        path: PathBuf,
        found: u64,
        supported: u64,
    },
    #[error("store: {0}")]
    Db(#[from] redb::Error),
    #[error(
        "store: the database is closed after an I/O error and cannot be reopened yet (is the \
         data root full?)"
    )]
    Closed,
    #[error("store: a record in `{table}` under `{key}` cannot be decoded: {message}")]
    Decode {
        table: String,
        key: String,
        message: String,
    },
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self { StoreError::Db(e.into()) }
        }
    )*};
}
from_redb!(
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// Opens the database again after an I/O error.
/// The store's page cache. redb's default (1 GiB) lets the daemon's memory grow with the
/// store's size (every exec adds events) up to that; the store is small records read by key
/// (the system's page cache holds the file too), so a small cache costs little. Measured
/// (bench row (n), `tryboxi_store_cache_bytes`): at 16 MiB the cache was half of the daemon's
/// heap growth over 300 s of sustained load, still filling; at 4 MiB it filled in 300 s too and
/// was then half of the growth again. 1 MiB holds the tables' upper pages, which every lookup
/// walks; the leaves of old events and traces come from the system's page cache.
const CACHE_BYTES: usize = 1 << 20;

/// Open or create the store file with the daemon's cache size.
fn open_file(path: &Path) -> Result<Database, redb::DatabaseError> {
    Database::builder().set_cache_size(CACHE_BYTES).create(path)
}

type Reopen = Box<dyn Fn() -> Result<Database, redb::DatabaseError> + Send + Sync>;

pub struct Store {
    /// `None` only between a failed reopen and the next successful one.
    db: RwLock<Option<Database>>,
    reopen: Reopen,
}

impl StoreError {
    /// redb refuses every transaction after an I/O error until the database is reopened.
    fn needs_reopen(&self) -> bool {
        matches!(
            self,
            StoreError::Db(redb::Error::Io(_) | redb::Error::PreviousIo)
        )
    }
}

impl Store {
    /// Open (or create) the store file, then check and migrate its schema.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        // Look before writing: a newer schema must be refused without redb touching the file.
        if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
            let found = peek_schema_version(path)?;
            if let Some(found) = found.filter(|v| *v > SCHEMA_VERSION) {
                return Err(StoreError::NewerSchema {
                    path: path.to_path_buf(),
                    found,
                    supported: SCHEMA_VERSION,
                });
            }
        }
        let db = open_file(path).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let again = path.to_path_buf();
        Store::init(db, path, Box::new(move || open_file(&again)))
    }

    /// A store in memory, for tests.
    #[cfg(test)]
    pub fn in_memory() -> Store {
        let fresh =
            || Database::builder().create_with_backend(redb::backends::InMemoryBackend::new());
        let db = fresh().expect("in-memory redb");
        Store::init(db, Path::new(":memory:"), Box::new(fresh)).expect("fresh in-memory store")
    }

    fn init(db: Database, path: &Path, reopen: Reopen) -> Result<Store, StoreError> {
        let txn = db.begin_write()?;
        {
            let mut meta = txn.open_table(META)?;
            let found = meta.get("schema_version")?.map(|v| v.value());
            match found {
                None => {
                    meta.insert("schema_version", SCHEMA_VERSION)?;
                }
                Some(v) if v > SCHEMA_VERSION => {
                    return Err(StoreError::NewerSchema {
                        path: path.to_path_buf(),
                        found: v,
                        supported: SCHEMA_VERSION,
                    });
                }
                Some(v) => {
                    for (step, migrate) in MIGRATIONS.iter().enumerate().skip((v - 1) as usize) {
                        tracing::info!(from = step + 1, to = step + 2, "migrating the store");
                        migrate(&txn)?;
                    }
                    meta.insert("schema_version", SCHEMA_VERSION)?;
                }
            }
            // Create every table so readers never see "table does not exist".
            txn.open_table(SANDBOXES)?;
            txn.open_table(EXECS)?;
            txn.open_table(ARTIFACTS)?;
            txn.open_table(EVENTS)?;
            txn.open_table(SNAPSHOTS)?;
            txn.open_table(NETWORK)?;
            txn.open_table(SECRET_BINDINGS)?;
            txn.open_table(GIT_GRANTS)?;
            txn.open_table(E2B_SANDBOXES)?;
        }
        txn.commit()?;
        Ok(Store {
            db: RwLock::new(Some(db)),
            reopen,
        })
    }

    /// Bytes the store's page cache holds now (at most its configured size; `None` while the
    /// database is closed after an I/O error).
    pub fn cache_bytes(&self) -> Option<u64> {
        self.guard()
            .as_ref()
            .map(|db| db.cache_stats().used_bytes() as u64)
    }

    fn guard(&self) -> RwLockReadGuard<'_, Option<Database>> {
        self.db.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `f` on the database; after an I/O error, reopen it for the next call.
    fn with_db<R>(
        &self,
        f: impl FnOnce(&Database) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let closed = self.guard().is_none();
        if closed {
            self.reopen();
        }
        let r = match self.guard().as_ref() {
            Some(db) => f(db),
            None => Err(StoreError::Closed),
        };
        if let Err(e) = &r
            && e.needs_reopen()
        {
            tracing::warn!(error = %e, "store I/O error; reopening the database");
            self.reopen();
        }
        r
    }

    /// Close the database and open it again (waits for calls in flight).
    fn reopen(&self) {
        let mut g = self.db.write().unwrap_or_else(|e| e.into_inner());
        // Dropped first: redb refuses a second open of a file this process holds.
        drop(g.take());
        match (self.reopen)() {
            Ok(db) => {
                tracing::info!("store reopened");
                *g = Some(db);
            }
            Err(e) => tracing::error!(error = %e, "cannot reopen the store; will try again"),
        }
    }

    #[cfg(test)]
    pub fn schema_version(&self) -> Result<u64, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let meta = txn.open_table(META)?;
            Ok(meta.get("schema_version")?.map(|v| v.value()).unwrap_or(0))
        })
    }

    /// Insert or replace a record.
    pub fn put<T: Serialize>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
        value: &T,
    ) -> Result<(), StoreError> {
        self.with_db(|db| {
            let bytes = serde_json::to_vec(value).expect("store records serialize to JSON");
            let txn = db.begin_write()?;
            txn.open_table(table)?.insert(key, bytes.as_slice())?;
            txn.commit()?;
            Ok(())
        })
    }

    pub fn get<T: DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
    ) -> Result<Option<T>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(table)?;
            let Some(v) = t.get(key)? else {
                return Ok(None);
            };
            decode(table.name(), key, v.value()).map(Some)
        })
    }

    /// Every record of a table, in key order.
    pub fn list<T: DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
    ) -> Result<Vec<T>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in t.iter()? {
                let (k, v) = row?;
                out.push(decode(table.name(), k.value(), v.value())?);
            }
            Ok(out)
        })
    }

    /// Every record of a table with its key, in key order.
    pub fn list_keyed<T: DeserializeOwned>(
        &self,
        table: TableDefinition<&str, &[u8]>,
    ) -> Result<Vec<(String, T)>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(table)?;
            let mut out = Vec::new();
            for row in t.iter()? {
                let (k, v) = row?;
                out.push((
                    k.value().to_owned(),
                    decode(table.name(), k.value(), v.value())?,
                ));
            }
            Ok(out)
        })
    }

    /// Remove a record; true if it existed.
    pub fn delete(
        &self,
        table: TableDefinition<&str, &[u8]>,
        key: &str,
    ) -> Result<bool, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write()?;
            let existed = txn.open_table(table)?.remove(key)?.is_some();
            txn.commit()?;
            Ok(existed)
        })
    }

    /// Append an event; returns its sequence number (1, 2, ...). With `keep`, the same
    /// transaction then deletes the oldest events past that many, at most [`PRUNE_ON_APPEND`]
    /// of them (one at a time in the steady state; a lowered cap is caught up by
    /// [`Store::prune_events`]).
    pub fn append_event<T: Serialize>(
        &self,
        event: &T,
        keep: Option<u64>,
    ) -> Result<u64, StoreError> {
        self.with_db(|db| {
            let bytes = serde_json::to_vec(event).expect("events serialize to JSON");
            let txn = db.begin_write()?;
            let seq = {
                let mut t = txn.open_table(EVENTS)?;
                let next = t.last()?.map(|(k, _)| k.value() + 1).unwrap_or(1);
                t.insert(next, bytes.as_slice())?;
                if let Some(keep) = keep {
                    prune_oldest(&mut t, keep, PRUNE_ON_APPEND, |_| false)?;
                }
                next
            };
            txn.commit()?;
            Ok(seq)
        })
    }

    /// Delete the oldest events past `keep` and, from the oldest on, those `expired` says are
    /// (it gets the stored bytes; the first one it keeps ends the walk): at most `batch` in one
    /// transaction, so a long backlog is pruned in many small transactions, never one huge one
    /// (call again while it returns `batch`). Returns how many were deleted.
    pub fn prune_events(
        &self,
        keep: u64,
        batch: usize,
        expired: impl Fn(&[u8]) -> bool,
    ) -> Result<usize, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write()?;
            let n = prune_oldest(&mut txn.open_table(EVENTS)?, keep, batch.max(1), expired)?;
            txn.commit()?;
            Ok(n)
        })
    }

    /// How many events are stored.
    #[cfg(test)]
    pub fn event_count(&self) -> Result<u64, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            Ok(redb::ReadableTableMetadata::len(&txn.open_table(EVENTS)?)?)
        })
    }

    /// The newest event's sequence number (0 when there is none).
    pub fn last_event_id(&self) -> Result<u64, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(EVENTS)?;
            Ok(t.last()?.map(|(k, _)| k.value()).unwrap_or(0))
        })
    }

    /// Events with a sequence number greater than `after`, oldest first, at most `limit`.
    pub fn events_after<T: DeserializeOwned>(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, T)>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(EVENTS)?;
            let mut out = Vec::new();
            for row in t.range(after.saturating_add(1)..)?.take(limit) {
                let (k, v) = row?;
                out.push((
                    k.value(),
                    decode("events", &k.value().to_string(), v.value())?,
                ));
            }
            Ok(out)
        })
    }
}

/// Most events one append deletes to get back under the count cap.
pub const PRUNE_ON_APPEND: usize = 64;

/// Delete up to `max` of the oldest events: those past `keep` (counted from the newest), then
/// those `expired` says are, oldest first, never the newest one (the next number is one more
/// than the newest, so numbers are never reused and followers' cursors stay valid). Event keys are consecutive (only the oldest are
/// ever deleted), so the count is `last - first + 1` without walking the table.
fn prune_oldest(
    t: &mut redb::Table<u64, &[u8]>,
    keep: u64,
    max: usize,
    expired: impl Fn(&[u8]) -> bool,
) -> Result<usize, StoreError> {
    let mut n = 0;
    while n < max {
        let first = t.first()?.map(|(k, _)| k.value());
        let last = t.last()?.map(|(k, _)| k.value());
        let (Some(first), Some(last)) = (first, last) else {
            break;
        };
        let count = last - first + 1;
        // The newest event always stays, whatever its age: it carries the sequence on.
        let drop = count > keep
            || count > 1 && {
                let v = t.get(first)?;
                v.is_some_and(|v| expired(v.value()))
            };
        if !drop {
            break;
        }
        t.remove(first)?;
        n += 1;
    }
    Ok(n)
}

/// The schema version of an existing store file, read without writing to it. `None` when the
/// file cannot be read that way because it was not closed cleanly (the daemon was killed): it
/// then needs redb's repair, which only a writable open does, and `init` checks the version.
fn peek_schema_version(path: &Path) -> Result<Option<u64>, StoreError> {
    let ro = match Database::builder().open_read_only(path) {
        Ok(db) => db,
        Err(redb::DatabaseError::RepairAborted) => return Ok(None),
        Err(source) => {
            return Err(StoreError::Open {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let txn = ro.begin_read()?;
    let Ok(meta) = txn.open_table(META) else {
        return Ok(None);
    };
    Ok(meta.get("schema_version")?.map(|v| v.value()))
}

fn decode<T: DeserializeOwned>(table: &str, key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Decode {
        table: table.to_owned(),
        key: key.to_owned(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct Rec {
        id: String,
        n: u32,
    }

    #[test]
    fn records_round_trip_and_delete() {
        let s = Store::in_memory();
        let r = Rec {
            id: "sbx_1".into(),
            n: 7,
        };
        s.put(SANDBOXES, &r.id, &r).unwrap();
        assert_eq!(s.get::<Rec>(SANDBOXES, "sbx_1").unwrap(), Some(r));
        assert_eq!(s.list::<Rec>(SANDBOXES).unwrap().len(), 1);
        assert!(s.delete(SANDBOXES, "sbx_1").unwrap());
        assert!(!s.delete(SANDBOXES, "sbx_1").unwrap());
        assert_eq!(s.get::<Rec>(SANDBOXES, "sbx_1").unwrap(), None);
    }

    #[test]
    fn events_are_sequenced_and_resumable() {
        let s = Store::in_memory();
        for i in 0..5u32 {
            assert_eq!(s.append_event(&i, None).unwrap(), u64::from(i) + 1);
        }
        let after: Vec<(u64, u32)> = s.events_after(3, 10).unwrap();
        assert_eq!(after, vec![(4, 3), (5, 4)]);
    }

    #[test]
    fn appends_keep_the_newest_events_and_pruning_goes_by_count_then_age() {
        let s = Store::in_memory();
        for i in 0..50u32 {
            s.append_event(&i, Some(10)).unwrap();
        }
        assert_eq!(s.event_count().unwrap(), 10);
        let kept: Vec<(u64, u32)> = s.events_after(0, 100).unwrap();
        assert_eq!(kept.first(), Some(&(41, 40)));
        assert_eq!(kept.last(), Some(&(50, 49)));
        // Numbering goes on after pruning.
        assert_eq!(s.append_event(&50u32, Some(10)).unwrap(), 51);
        // A lowered cap is caught up in batches; then the "expired" ones (here: < 47) go.
        assert_eq!(s.prune_events(6, 3, |_| false).unwrap(), 3);
        assert_eq!(s.prune_events(6, 3, |_| false).unwrap(), 1);
        assert_eq!(s.event_count().unwrap(), 6);
        let old = |b: &[u8]| serde_json::from_slice::<u32>(b).unwrap() < 47;
        assert_eq!(s.prune_events(100, 10, old).unwrap(), 2);
        assert_eq!(s.prune_events(100, 10, old).unwrap(), 0);
        let kept: Vec<(u64, u32)> = s.events_after(0, 100).unwrap();
        assert_eq!(
            kept.iter().map(|k| k.1).collect::<Vec<_>>(),
            [47, 48, 49, 50]
        );
    }

    #[test]
    fn fresh_file_gets_current_schema_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.redb");
        assert_eq!(
            Store::open(&p).unwrap().schema_version().unwrap(),
            SCHEMA_VERSION
        );
        assert_eq!(
            Store::open(&p).unwrap().schema_version().unwrap(),
            SCHEMA_VERSION
        );
    }

    #[test]
    fn corrupt_file_is_an_error_and_left_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.redb");
        let garbage = b"this is not a redb database, it is a user's precious file".repeat(100);
        std::fs::write(&p, &garbage).unwrap();
        let e = Store::open(&p).err().expect("must refuse");
        assert!(matches!(e, StoreError::Open { .. }), "{e}");
        assert!(
            std::fs::read(&p).unwrap() == garbage,
            "the file was modified"
        );
    }

    #[test]
    fn newer_schema_is_refused_and_left_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.redb");
        {
            let db = Database::create(&p).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert("schema_version", SCHEMA_VERSION + 1)
                .unwrap();
            txn.commit().unwrap();
        }
        let before = std::fs::read(&p).unwrap();
        let e = Store::open(&p).err().expect("must refuse");
        assert!(matches!(e, StoreError::NewerSchema { .. }), "{e}");
        assert!(
            std::fs::read(&p).unwrap() == before,
            "the file was modified"
        );
    }

    /// A file backend whose writes fail with ENOSPC while `full` is set.
    #[derive(Debug)]
    struct FillableDisk {
        inner: redb::backends::FileBackend,
        full: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl FillableDisk {
        fn check(&self) -> std::io::Result<()> {
            if self.full.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
            }
            Ok(())
        }
    }

    impl redb::StorageBackend for FillableDisk {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.inner.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.check()?;
            self.inner.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.check()?;
            self.inner.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.check()?;
            self.inner.write(offset, data)
        }
        fn close(&self) -> std::io::Result<()> {
            self.inner.close()
        }
    }

    #[test]
    fn a_full_disk_fails_the_write_and_the_store_works_again_once_there_is_room() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.redb");
        let full = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = {
            let (p, full) = (p.clone(), full.clone());
            move || {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&p)
                    .map_err(redb::DatabaseError::from)?;
                let inner = redb::backends::FileBackend::new(file)?;
                Database::builder().create_with_backend(FillableDisk {
                    inner,
                    full: full.clone(),
                })
            }
        };
        let db = open().unwrap();
        let s = Store::init(db, &p, Box::new(open)).unwrap();
        let rec = |n| Rec {
            id: format!("sbx_{n}"),
            n,
        };
        s.put(SANDBOXES, "sbx_1", &rec(1)).unwrap();

        full.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut big = rec(2);
        big.id = "x".repeat(1 << 20);
        assert!(s.put(SANDBOXES, "sbx_2", &big).is_err());
        // Still full: refused again (reopening cannot repair the file yet), never a panic.
        assert!(s.put(SANDBOXES, "sbx_3", &rec(3)).is_err());

        // Room again: the next write works without a restart, and what was committed is there.
        full.store(false, std::sync::atomic::Ordering::SeqCst);
        s.put(SANDBOXES, "sbx_4", &rec(4)).unwrap();
        assert_eq!(s.get::<Rec>(SANDBOXES, "sbx_1").unwrap(), Some(rec(1)));
        assert_eq!(s.get::<Rec>(SANDBOXES, "sbx_4").unwrap(), Some(rec(4)));
        assert_eq!(s.get::<Rec>(SANDBOXES, "sbx_2").unwrap(), None);
        s.append_event(&1u32, None).unwrap();
    }
}
