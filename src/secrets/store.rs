//! The secret store: the values the user gave (`tryboxi secret set`), kept on the host only in
//! `<data root>/secrets.json` (mode 0600, written atomically: temp file, fsync, rename, fsync
//! of the directory).
//!
//! Owns: the file, its format, the validation of names, hosts and header names, and the bounds
//! (at most [`MAX_SECRETS`] secrets, values of 1..=[`MAX_VALUE`] bytes). Values are held as
//! [`Value`] (zeroized on drop) and never appear in an error text or `Debug` output; an error
//! names the secret at most.
//!
//! A file that cannot be read or parsed leaves the store *broken*: every call is refused and
//! the file is never overwritten (the daemon refuses to start and says so).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize as _, Zeroizing};

use super::Value;
use super::scan::Scanner;

/// At most this many secrets in the store.
pub const MAX_SECRETS: usize = 256;
/// A value's largest size in bytes.
pub const MAX_VALUE: usize = 16 * 1024;
/// At most this many hosts per secret.
pub const MAX_HOSTS: usize = 16;
/// At most this many extra header names per secret.
pub const MAX_HEADERS: usize = 16;
/// The store file's largest size: every secret at its largest, base64, with metadata.
const MAX_FILE: u64 = (MAX_SECRETS as u64) * (MAX_VALUE as u64 * 2 + 4096);
/// `last_used_at` is written to disk at most this often per secret.
const USED_WRITE_EVERY_S: u64 = 60;

/// Header names a secret may not name: they frame or route the request.
const FORBIDDEN_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
];

#[derive(Debug, thiserror::Error)]
pub enum SecretStoreError {
    #[error("invalid secret name `{0}`: use 1 to 64 of A-Z, 0-9 and _, not starting with a digit")]
    BadName(String),
    #[error("secret `{name}`: {why}")]
    Invalid { name: String, why: String },
    #[error("no secret `{0}`")]
    NotFound(String),
    #[error("the secret store holds {MAX_SECRETS} secrets already: remove one first")]
    Full,
    #[error("cannot read the secret store {path}: {message} (the file was left untouched)")]
    Read { path: PathBuf, message: String },
    #[error("cannot write the secret store {path}: {message}")]
    Write { path: PathBuf, message: String },
    #[error("the secret store is unusable: {0}")]
    Broken(String),
}

/// What the store keeps about a secret besides its value (what `secret ls` shows).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretMeta {
    pub name: String,
    pub hosts: Vec<String>,
    pub headers: Vec<String>,
    pub in_body: bool,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// RFC 3339 UTC; `None` until the interceptor first swaps it in.
    pub last_used_at: Option<String>,
}

/// What a `set` gives besides the value.
#[derive(Debug, Clone, Default)]
pub struct SecretSpec {
    pub hosts: Vec<String>,
    pub headers: Vec<String>,
    pub in_body: bool,
}

#[derive(Clone)]
struct Entry {
    meta: SecretMeta,
    value: Value,
    /// Unix seconds of the last `last_used_at` written to disk.
    used_written: u64,
}

/// One secret as the file holds it.
#[derive(Serialize, Deserialize)]
struct FileSecret {
    #[serde(flatten)]
    meta: SecretMeta,
    /// The value, standard base64.
    value_b64: String,
}

#[derive(Serialize, Deserialize)]
struct FileBody {
    version: u32,
    secrets: Vec<FileSecret>,
}

struct Inner {
    secrets: BTreeMap<String, Entry>,
    broken: Option<String>,
    /// The inbound scanner over every value, built on first use after a change.
    scanner: Option<Arc<Scanner>>,
}

/// The host's secrets. Cheap calls under one lock; every change is written before it returns.
pub struct SecretStore {
    path: PathBuf,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.lock().secrets.len();
        write!(f, "SecretStore({}, {n} secrets)", self.path.display())
    }
}

impl SecretStore {
    /// Read `path` (absent: an empty store). A file that cannot be read or parsed gives a
    /// broken store: [`SecretStore::broken`] says why, and every call is refused.
    pub fn open(path: &Path) -> SecretStore {
        let (secrets, broken) = match read_file(path) {
            Ok(s) => (s, None),
            Err(e) => (BTreeMap::new(), Some(e.to_string())),
        };
        SecretStore {
            path: path.to_path_buf(),
            inner: Mutex::new(Inner {
                secrets,
                broken,
                scanner: None,
            }),
        }
    }

    /// Why the store cannot be used (its file was unreadable at start), if it cannot.
    pub fn broken(&self) -> Option<String> {
        self.lock().broken.clone()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn usable(&self) -> Result<std::sync::MutexGuard<'_, Inner>, SecretStoreError> {
        let g = self.lock();
        match &g.broken {
            Some(why) => Err(SecretStoreError::Broken(why.clone())),
            None => Ok(g),
        }
    }

    /// Add or replace a secret (a replaced one keeps its `created_at`). Returns its metadata.
    pub fn set(
        &self,
        name: &str,
        value: Value,
        spec: SecretSpec,
    ) -> Result<SecretMeta, SecretStoreError> {
        check_name(name)?;
        let invalid = |why: String| SecretStoreError::Invalid {
            name: name.to_owned(),
            why,
        };
        let n = value.bytes().len();
        if n == 0 || n > MAX_VALUE {
            return Err(invalid(format!(
                "the value must be 1 to {MAX_VALUE} bytes, got {n}"
            )));
        }
        let hosts = check_hosts(&spec.hosts).map_err(invalid)?;
        let headers = check_headers(&spec.headers).map_err(invalid)?;
        let mut g = self.usable()?;
        if !g.secrets.contains_key(name) && g.secrets.len() >= MAX_SECRETS {
            return Err(SecretStoreError::Full);
        }
        let old = g.secrets.get(name);
        let meta = SecretMeta {
            name: name.to_owned(),
            hosts,
            headers,
            in_body: spec.in_body,
            created_at: old
                .map(|e| e.meta.created_at.clone())
                .unwrap_or_else(now_rfc3339),
            last_used_at: old.and_then(|e| e.meta.last_used_at.clone()),
        };
        let mut next = g.secrets.clone();
        next.insert(
            name.to_owned(),
            Entry {
                meta: meta.clone(),
                value,
                used_written: 0,
            },
        );
        write_file(&self.path, &next)?;
        g.secrets = next;
        g.scanner = None;
        Ok(meta)
    }

    /// Remove a secret.
    pub fn remove(&self, name: &str) -> Result<SecretMeta, SecretStoreError> {
        let mut g = self.usable()?;
        let Some(e) = g.secrets.get(name) else {
            return Err(SecretStoreError::NotFound(name.to_owned()));
        };
        let meta = e.meta.clone();
        let mut next = g.secrets.clone();
        next.remove(name);
        write_file(&self.path, &next)?;
        g.secrets = next;
        g.scanner = None;
        Ok(meta)
    }

    /// Every secret's metadata, by name (never a value).
    pub fn list(&self) -> Result<Vec<SecretMeta>, SecretStoreError> {
        Ok(self
            .usable()?
            .secrets
            .values()
            .map(|e| e.meta.clone())
            .collect())
    }

    /// One secret's metadata and value.
    pub fn get(&self, name: &str) -> Result<(SecretMeta, Value), SecretStoreError> {
        let g = self.usable()?;
        g.secrets
            .get(name)
            .map(|e| (e.meta.clone(), e.value.clone()))
            .ok_or_else(|| SecretStoreError::NotFound(name.to_owned()))
    }

    /// Every secret's name and value (for the inbound scanners).
    #[cfg(test)]
    pub fn values(&self) -> Vec<(String, Value)> {
        let g = self.lock();
        if g.broken.is_some() {
            return Vec::new();
        }
        g.secrets
            .iter()
            .map(|(n, e)| (n.clone(), e.value.clone()))
            .collect()
    }

    /// The scanner over every stored value (empty when the store is broken), shared until
    /// the next change.
    pub fn scanner(&self) -> Arc<Scanner> {
        let mut g = self.lock();
        if g.broken.is_some() {
            return Arc::new(Scanner::default());
        }
        if let Some(s) = &g.scanner {
            return s.clone();
        }
        let values: Vec<(String, Value)> = g
            .secrets
            .iter()
            .map(|(n, e)| (n.clone(), e.value.clone()))
            .collect();
        let s = Arc::new(Scanner::new(&values));
        g.scanner = Some(s.clone());
        s
    }

    /// The interceptor swapped `name` in: note the time (written to disk at most once a
    /// minute per secret).
    pub fn mark_used(&self, name: &str) {
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut g = self.lock();
        if g.broken.is_some() {
            return;
        }
        let Some(e) = g.secrets.get_mut(name) else {
            return;
        };
        e.meta.last_used_at = Some(now_rfc3339());
        if now_s.saturating_sub(e.used_written) < USED_WRITE_EVERY_S {
            return;
        }
        e.used_written = now_s;
        if let Err(err) = write_file(&self.path, &g.secrets) {
            tracing::warn!(secret = %name, error = %err, "cannot record when a secret was used");
        }
    }
}

/// `[A-Z_][A-Z0-9_]{0,63}`.
pub fn check_name(name: &str) -> Result<(), SecretStoreError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_uppercase() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_');
    if ok {
        Ok(())
    } else {
        // The name is shown only when it is short and printable (it could be a pasted value).
        let shown = if name.len() <= 64 && name.bytes().all(|c| c.is_ascii_graphic()) {
            name.to_owned()
        } else {
            format!("<{} bytes>", name.len())
        };
        Err(SecretStoreError::BadName(shown))
    }
}

/// Lowercase DNS names, 1..=[`MAX_HOSTS`], deduplicated (input in any case).
fn check_hosts(hosts: &[String]) -> Result<Vec<String>, String> {
    if hosts.is_empty() || hosts.len() > MAX_HOSTS {
        return Err(format!(
            "give 1 to {MAX_HOSTS} hosts (--host), got {}",
            hosts.len()
        ));
    }
    let mut out = Vec::new();
    for h in hosts {
        let l = h.to_ascii_lowercase();
        if !is_dns_name(&l) {
            let shown: String = h.chars().take(80).collect();
            return Err(format!(
                "`{shown}` is not a DNS host name (no scheme, port, path or IP address)"
            ));
        }
        if !out.contains(&l) {
            out.push(l);
        }
    }
    Ok(out)
}

/// A lowercase DNS name: labels of `[a-z0-9-]` (1..=63, no leading/trailing `-`), at most 253
/// bytes, and a last label that is not all digits (no IPv4 address).
pub fn is_dns_name(h: &str) -> bool {
    if h.is_empty() || h.len() > 253 {
        return false;
    }
    let labels: Vec<&str> = h.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
    };
    labels.iter().all(label_ok)
        && labels
            .last()
            .is_some_and(|l| !l.bytes().all(|c| c.is_ascii_digit()))
}

/// Header names as lowercase HTTP tokens, at most [`MAX_HEADERS`], none that frames a request.
fn check_headers(headers: &[String]) -> Result<Vec<String>, String> {
    if headers.len() > MAX_HEADERS {
        return Err(format!(
            "give at most {MAX_HEADERS} headers, got {}",
            headers.len()
        ));
    }
    let mut out = Vec::new();
    for h in headers {
        let l = h.to_ascii_lowercase();
        let token = !l.is_empty()
            && l.len() <= 64
            && l.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c));
        if !token {
            let shown: String = h.chars().take(64).collect();
            return Err(format!("`{shown}` is not an HTTP header name"));
        }
        if FORBIDDEN_HEADERS.contains(&l.as_str()) {
            return Err(format!("the header `{l}` cannot carry a secret"));
        }
        if !out.contains(&l) {
            out.push(l);
        }
    }
    Ok(out)
}

fn read_file(path: &Path) -> Result<BTreeMap<String, Entry>, SecretStoreError> {
    use std::io::Read as _;
    let err = |message: String| SecretStoreError::Read {
        path: path.to_path_buf(),
        message,
    };
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(err(e.to_string())),
    };
    let mut buf = Zeroizing::new(Vec::new());
    f.take(MAX_FILE + 1)
        .read_to_end(&mut buf)
        .map_err(|e| err(e.to_string()))?;
    if buf.len() as u64 > MAX_FILE {
        return Err(err(format!("larger than {MAX_FILE} bytes")));
    }
    // serde_json's error text quotes no input, only a line and column.
    let body: FileBody = serde_json::from_slice(&buf).map_err(|e| err(e.to_string()))?;
    if body.version != 1 {
        return Err(err(format!(
            "format version {} is not known to this build",
            body.version
        )));
    }
    if body.secrets.len() > MAX_SECRETS {
        return Err(err(format!("more than {MAX_SECRETS} secrets")));
    }
    let mut out = BTreeMap::new();
    for mut s in body.secrets {
        let decoded = B64.decode(&s.value_b64);
        s.value_b64.zeroize();
        let value = Value::new(
            decoded.map_err(|_| err(format!("the value of `{}` is not base64", s.meta.name)))?,
        );
        check_name(&s.meta.name).map_err(|e| err(e.to_string()))?;
        if value.bytes().is_empty() || value.bytes().len() > MAX_VALUE {
            return Err(err(format!(
                "the value of `{}` has a bad size",
                s.meta.name
            )));
        }
        out.insert(
            s.meta.name.clone(),
            Entry {
                meta: s.meta,
                value,
                used_written: 0,
            },
        );
    }
    Ok(out)
}

fn write_file(path: &Path, secrets: &BTreeMap<String, Entry>) -> Result<(), SecretStoreError> {
    let err = |message: String| SecretStoreError::Write {
        path: path.to_path_buf(),
        message,
    };
    let mut body = FileBody {
        version: 1,
        secrets: secrets
            .values()
            .map(|e| FileSecret {
                meta: e.meta.clone(),
                value_b64: B64.encode(e.value.bytes()),
            })
            .collect(),
    };
    let data = serde_json::to_vec_pretty(&body).map(Zeroizing::new);
    for s in &mut body.secrets {
        s.value_b64.zeroize();
    }
    let data = data.map_err(|e| err(e.to_string()))?;
    write_private(path, &data).map_err(|e| err(e.to_string()))
}

/// Temp file (0600, created exclusively) in the same directory, fsync, rename over `path`,
/// fsync the directory. A crash leaves the old file or the new one.
fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut rnd = [0u8; 6];
    getrandom::fill(&mut rnd).map_err(|e| std::io::Error::other(e.to_string()))?;
    let tmp = dir.join(format!(".secrets.json.{}", hex::encode(rnd)));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        // The umask may only take bits away, but say it exactly.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Standard padded base64 of the values in the file (the store depends on no layer above it).
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Now, as `2026-12-04T21:00:00Z` (UTC, seconds), for `created_at` and `last_used_at`.
fn now_rfc3339() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    const V: &[u8] = b"sk-live-0123456789abcdef";

    fn spec(hosts: &[&str]) -> SecretSpec {
        SecretSpec {
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            headers: vec!["X-Foo".into()],
            in_body: true,
        }
    }

    #[test]
    fn a_set_secret_survives_a_reopen_in_a_0600_file_and_never_prints_its_value() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secrets.json");
        let s = SecretStore::open(&p);
        let m = s
            .set(
                "API_KEY",
                Value::new(V.to_vec()),
                spec(&["API.Example.com"]),
            )
            .unwrap();
        assert_eq!(m.hosts, ["api.example.com"]);
        assert_eq!(m.headers, ["x-foo"]);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // No temp file is left behind.
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        let again = SecretStore::open(&p);
        assert!(again.broken().is_none());
        let (meta, v) = again.get("API_KEY").unwrap();
        assert!(v.ct_eq(V));
        assert_eq!(meta, m);
        let shown = format!(
            "{again:?} {:?} {:?}",
            again.list().unwrap(),
            again.get("API_KEY")
        );
        assert!(!shown.contains("sk-live"), "{shown}");
        // Replacing keeps created_at; removing forgets it.
        let m2 = again
            .set(
                "API_KEY",
                Value::new(b"another-value-123".to_vec()),
                spec(&["x.io"]),
            )
            .unwrap();
        assert_eq!(m2.created_at, m.created_at);
        again.remove("API_KEY").unwrap();
        assert!(matches!(
            SecretStore::open(&p).get("API_KEY"),
            Err(SecretStoreError::NotFound(_))
        ));
    }

    #[test]
    fn bad_names_hosts_headers_and_sizes_are_refused_without_the_value() {
        let d = tempfile::tempdir().unwrap();
        let s = SecretStore::open(&d.path().join("secrets.json"));
        let set = |name: &str, v: &[u8], sp: SecretSpec| s.set(name, Value::new(v.to_vec()), sp);
        for bad in ["", "lower", "9A", "A-B", &"A".repeat(65)] {
            assert!(
                matches!(
                    set(bad, V, spec(&["a.io"])),
                    Err(SecretStoreError::BadName(_))
                ),
                "{bad}"
            );
        }
        assert!(set(&"A".repeat(64), V, spec(&["a.io"])).is_ok());
        for bad in [
            "",
            "https://a.io",
            "a.io:443",
            "1.2.3.4",
            "-a.io",
            "a..io",
            "a_b.io",
        ] {
            let e = set("K", V, spec(&[bad])).unwrap_err();
            assert!(matches!(e, SecretStoreError::Invalid { .. }), "{bad}: {e}");
        }
        assert!(set("K", V, spec(&[])).is_err());
        let many: Vec<String> = (0..17).map(|i| format!("h{i}.io")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(set("K", V, spec(&many)).is_err());
        let mut sp = spec(&["a.io"]);
        sp.headers = vec!["Host".into()];
        assert!(set("K", V, sp.clone()).is_err());
        sp.headers = vec!["bad header".into()];
        assert!(set("K", V, sp).is_err());
        assert!(set("K", b"", spec(&["a.io"])).is_err());
        let big = vec![b'x'; MAX_VALUE + 1];
        let e = set("K", &big, spec(&["a.io"])).unwrap_err().to_string();
        assert!(!e.contains("xxxxxxxx"), "{e}");
        assert!(set("K", &big[..MAX_VALUE], spec(&["a.io"])).is_ok());
    }

    #[test]
    fn the_store_holds_at_most_max_secrets() {
        let d = tempfile::tempdir().unwrap();
        let s = SecretStore::open(&d.path().join("secrets.json"));
        for i in 0..MAX_SECRETS {
            s.set(&format!("K{i}"), Value::new(V.to_vec()), spec(&["a.io"]))
                .unwrap();
        }
        let e = s.set("ONE_MORE", Value::new(V.to_vec()), spec(&["a.io"]));
        assert!(matches!(e, Err(SecretStoreError::Full)));
        // Replacing one still works.
        s.set("K0", Value::new(V.to_vec()), spec(&["b.io"]))
            .unwrap();
    }

    #[test]
    fn an_unreadable_file_breaks_the_store_and_is_never_overwritten() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("secrets.json");
        std::fs::write(&p, b"{\"version\":1,\"secrets\":[{\"name\":\"K\",").unwrap();
        let s = SecretStore::open(&p);
        assert!(s.broken().is_some());
        assert!(matches!(
            s.set("K", Value::new(V.to_vec()), spec(&["a.io"])),
            Err(SecretStoreError::Broken(_))
        ));
        assert!(s.values().is_empty());
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"{\"version\":1,\"secrets\":[{\"name\":\"K\","
        );
    }
}
