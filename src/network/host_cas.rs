//! The host's locally added CA certificates: what the host trusts beyond its distribution's
//! bundle, read so that every guest can trust it too (a TLS-inspecting proxy on the host's
//! path to the registries re-signs their certificates with such a CA).
//!
//! Owns: reading the configured anchor directories (`[network] host_ca_dirs`, by default
//! `/usr/local/share/ca-certificates` (Debian/Ubuntu) and `/etc/pki/ca-trust/source/anchors`
//! (Fedora/RHEL)): `.crt`/`.pem` files in each directory and one level of subdirectories,
//! each PEM certificate parsed and kept only if it is a CA certificate (basicConstraints
//! `CA:TRUE`, key usage allowing certificate signing when present, valid now). Symlinks to
//! regular files are followed, as `update-ca-certificates` does (only parsed CA certificates
//! leave this module, so a link to any other file yields nothing); symlinked directories are
//! not entered. Files, bytes and certificates are bounded; everything left out is listed with
//! its reason (for `tryboxi doctor` and the daemon log).
//! Never: reads private keys into the result (only `CERTIFICATE` blocks are parsed), or
//! blocks on a FIFO or device (opened non-blocking, read only when a regular file).

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

/// The usual local-anchor directories: Debian/Ubuntu, then Fedora/RHEL.
pub const DEFAULT_DIRS: [&str; 2] = [
    "/usr/local/share/ca-certificates",
    "/etc/pki/ca-trust/source/anchors",
];
/// Largest file read (a CA certificate in PEM is 1-3 KiB).
pub const MAX_FILE: u64 = 256 << 10;
/// Most candidate files looked at, over all directories.
pub const MAX_FILES: usize = 256;
/// Most CA certificates kept.
pub const MAX_CAS: usize = 64;

/// One CA certificate taken from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCa {
    /// The subject's common name (the whole subject when it has none).
    pub subject: String,
    /// The file it came from.
    pub file: PathBuf,
    /// The certificate, PEM.
    pub pem: String,
}

/// A file (or a certificate in it) left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub file: PathBuf,
    pub reason: String,
}

/// What the anchor directories hold.
#[derive(Debug, Default, Clone)]
pub struct HostCas {
    /// The configured directories that exist (and were read).
    pub dirs: Vec<PathBuf>,
    pub cas: Vec<HostCa>,
    pub skipped: Vec<Skipped>,
}

impl HostCas {
    /// The certificates as one PEM block, each after a comment line naming it and its file
    /// (`marker` starts the comment); "" when there are none.
    pub fn pem_block(&self, marker: &str) -> String {
        let mut out = String::new();
        for ca in &self.cas {
            out.push_str(&format!(
                "{marker} host CA {} ({})\n",
                one_line(&ca.subject),
                ca.file.display()
            ));
            out.push_str(&ca.pem);
        }
        out
    }

    /// `CN (file)` of each CA, for logs and `doctor`.
    pub fn describe(&self) -> Vec<String> {
        self.cas
            .iter()
            .map(|c| format!("CN={} ({})", one_line(&c.subject), c.file.display()))
            .collect()
    }
}

fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Read every CA certificate under `dirs` (those that do not exist are passed over).
pub fn read_dirs(dirs: &[PathBuf]) -> HostCas {
    let mut out = HostCas::default();
    let mut files = Vec::new();
    for dir in dirs {
        if !dir.is_dir() {
            continue;
        }
        out.dirs.push(dir.clone());
        collect(dir, 0, &mut files, &mut out.skipped);
    }
    let mut seen = std::collections::HashSet::new();
    for (n, file) in files.into_iter().enumerate() {
        if n >= MAX_FILES {
            out.skipped
                .push(skip(&file, format!("more than {MAX_FILES} files")));
            continue;
        }
        let bytes = match read_regular(&file) {
            Ok(b) => b,
            Err(reason) => {
                out.skipped.push(skip(&file, reason));
                continue;
            }
        };
        let mut found = 0;
        for der in CertificateDer::pem_slice_iter(&bytes) {
            let der = match der {
                Ok(d) => d,
                Err(e) => {
                    out.skipped.push(skip(&file, format!("bad PEM: {e}")));
                    break;
                }
            };
            found += 1;
            match check_ca(&der) {
                Ok(_) if !seen.insert(der.as_ref().to_vec()) => {}
                Ok(_) if out.cas.len() >= MAX_CAS => {
                    out.skipped
                        .push(skip(&file, format!("more than {MAX_CAS} CA certificates")));
                }
                Ok(subject) => out.cas.push(HostCa {
                    subject,
                    file: file.clone(),
                    pem: to_pem(&der),
                }),
                Err(reason) => out.skipped.push(skip(&file, reason)),
            }
        }
        if found == 0 && !out.skipped.iter().any(|s| s.file == file) {
            out.skipped
                .push(skip(&file, "no PEM certificate in it".to_owned()));
        }
    }
    out
}

fn skip(file: &Path, reason: String) -> Skipped {
    Skipped {
        file: file.to_path_buf(),
        reason,
    }
}

/// Candidate files of `dir` (sorted; subdirectories one level deep, not through symlinks).
fn collect(dir: &Path, depth: usize, files: &mut Vec<PathBuf>, skipped: &mut Vec<Skipped>) {
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(Result::ok)
            .map(|e| e.path())
            .take(4 * MAX_FILES)
            .collect(),
        Err(e) => {
            skipped.push(skip(dir, format!("cannot list: {e}")));
            return;
        }
    };
    entries.sort();
    for path in entries {
        let Ok(lmeta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if lmeta.is_dir() {
            if depth == 0 {
                collect(&path, 1, files, skipped);
            }
            continue;
        }
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        if matches!(ext.as_deref(), Some("crt" | "pem")) {
            files.push(path);
        }
        if files.len() > MAX_FILES {
            return;
        }
    }
}

/// The file's bytes if it is (or links to) a regular file of at most [`MAX_FILE`] bytes.
fn read_regular(path: &Path) -> Result<Vec<u8>, String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot open: {e}"))?;
    let meta = f.metadata().map_err(|e| format!("cannot stat: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_FILE {
        return Err(format!("larger than {MAX_FILE} bytes"));
    }
    let mut bytes = Vec::new();
    f.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(format!("larger than {MAX_FILE} bytes"));
    }
    Ok(bytes)
}

/// The subject's CN if `der` is a CA certificate valid now; otherwise why not.
fn check_ca(der: &[u8]) -> Result<String, String> {
    let (rest, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err("trailing bytes after the certificate".into());
    }
    let subject = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| cert.subject().to_string());
    match cert.basic_constraints() {
        Ok(Some(bc)) if bc.value.ca => {}
        Ok(_) => return Err(format!("{subject}: not a CA certificate (no CA:TRUE)")),
        Err(e) => return Err(format!("{subject}: bad basicConstraints: {e}")),
    }
    match cert.key_usage() {
        Ok(Some(ku)) if !ku.value.key_cert_sign() => {
            return Err(format!("{subject}: key usage does not allow keyCertSign"));
        }
        Ok(_) => {}
        Err(e) => return Err(format!("{subject}: bad keyUsage: {e}")),
    }
    if !cert.validity().is_valid() {
        return Err(format!(
            "{subject}: not valid now (expired or not yet valid)"
        ));
    }
    Ok(subject)
}

fn to_pem(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 64);
    out.push_str("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

#[cfg(test)]
#[path = "host_cas_tests.rs"]
mod tests;
