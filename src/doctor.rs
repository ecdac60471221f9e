//! `tryboxi doctor`: host checks, one pass/fail line each; exits non-zero when a required
//! check fails.

use std::path::Path;

use crate::client::Client;
use crate::config::AccelSetting;
use crate::config::{Config, Paths};
use crate::error::TopError;
use crate::vmm::{Images, QemuDriver, probe_accel};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
}

impl Check {
    fn new(name: &'static str, status: Status, detail: impl Into<String>) -> Check {
        Check {
            name,
            status,
            detail: detail.into(),
        }
    }
}

pub async fn run(artifacts: Option<std::path::PathBuf>) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    let config = Config::load(&paths).map_err(|e| TopError::Usage(e.to_string()))?;
    let _ = crate::vmm::jail::user::set_uid_base(config.vm_uid_base);
    let artifacts = artifacts
        .or_else(|| config.artifacts.clone())
        .unwrap_or_else(|| paths.artifacts_dir());
    let (images_check, images) = images(&artifacts);
    let mut checks = vec![
        qemu(&config),
        accel(&config, &paths, images.as_ref()).await,
        images_check,
        templates(images.as_ref()),
        data_root(&paths),
        daemon(&paths).await,
        memory(),
        cpu_pressure(&config.limits),
        disk(&paths.root, &config.limits),
        e2fsprogs(),
        fence(&config.qemu_binary),
        ram_reserve(&paths.root, config.limits.reserve_ram_on_disk),
        guest_cas(&config.network),
        upstream_proxy(&config.network, |v| std::env::var(v).ok()),
    ];
    checks.sort_by_key(|c| c.status == Status::Ok);
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    for c in &checks {
        let tag = match c.status {
            Status::Ok => "[ ok ]",
            Status::Warn => "[warn]",
            Status::Fail => "[FAIL]",
        };
        println!("{tag} {:<10} {}", c.name, c.detail);
    }
    if failed > 0 {
        return Err(TopError::Other(anyhow::anyhow!(
            "{failed} required check(s) failed"
        )));
    }
    Ok(())
}

/// Which fences QEMU starts in on this host, for this user (see `vmm/jail.rs`). A root
/// daemon refuses to start QEMU without them (fail); any other user runs without a fence the
/// host does not allow (warn, with the reason).
fn fence(binary: &str) -> Check {
    let jail = crate::vmm::jail::Jail::detect(std::path::Path::new(binary));
    let r = jail.report();
    let root = nix::unistd::geteuid().is_root();
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    match r.user {
        Ok(u) => parts.push(u),
        Err(e) => missing.push(format!("no VM user: {e}")),
    }
    match r.namespace {
        Ok(n) => parts.push(n),
        Err(e) => missing.push(format!("no mount namespace: {e}")),
    }
    match r.cgroup {
        Ok(c) => parts.push(c),
        Err(e) => missing.push(format!("no cgroup: {e}")),
    }
    let status = match (missing.is_empty(), root) {
        (true, _) => Status::Ok,
        (false, true) => Status::Fail,
        (false, false) => Status::Warn,
    };
    parts.extend(missing);
    Check::new("fence", status, parts.join("; "))
}

/// Whether memory a guest frees keeps its RAM reserve on the data root (`vmm::qemu::discard`);
/// without it the daemon reserves it again every 2 s, which a filling root can beat (warn).
fn ram_reserve(root: &Path, reserve: bool) -> Check {
    if !reserve {
        return Check::new(
            "reserve",
            Status::Warn,
            "limits.reserve_ram_on_disk is off: a VM's first touch of memory on a full data root stops it",
        );
    }
    match crate::vmm::qemu::discard::probe(root) {
        Ok(()) => Check::new(
            "reserve",
            Status::Ok,
            "RAM files reserved on the data root; memory guests free is zeroed, not punched \
             (seccomp user notification)",
        ),
        Err(why) => Check::new("reserve", Status::Warn, why),
    }
}

fn qemu(config: &Config) -> Check {
    match std::process::Command::new(&config.qemu_binary)
        .arg("--version")
        .output()
    {
        Ok(o) if o.status.success() => {
            let first = String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_owned();
            Check::new(
                "qemu",
                Status::Ok,
                format!("{}: {first}", config.qemu_binary),
            )
        }
        Ok(o) => Check::new(
            "qemu",
            Status::Fail,
            format!("`{} --version` failed: {}", config.qemu_binary, o.status),
        ),
        Err(e) => Check::new(
            "qemu",
            Status::Fail,
            format!(
                "`{}` not usable ({e}); install it with `cargo xtask deps` (Debian: qemu-system-x86)",
                config.qemu_binary
            ),
        ),
    }
}

fn images(artifacts: &Path) -> (Check, Option<Images>) {
    let imgs = match Images::load(artifacts) {
        Ok(i) => i,
        Err(e) => {
            return (
                Check::new(
                    "images",
                    Status::Fail,
                    format!("{e}; build with `cargo xtask images`, then `tryboxi install`"),
                ),
                None,
            );
        }
    };
    match imgs.verify(true) {
        Ok(()) => {
            let list: Vec<String> = imgs
                .manifest
                .artifacts
                .iter()
                .map(|a| {
                    format!(
                        "{} {} sha256:{}",
                        a.name,
                        a.file,
                        &a.sha256[..a.sha256.len().min(12)]
                    )
                })
                .collect();
            (
                Check::new(
                    "images",
                    Status::Ok,
                    format!("{}: {}", imgs.dir.display(), list.join(", ")),
                ),
                Some(imgs),
            )
        }
        Err(e) => (Check::new("images", Status::Fail, e.to_string()), None),
    }
}

/// The templates the images provide (`base` always; the others are layers over it).
fn templates(images: Option<&Images>) -> Check {
    let Some(imgs) = images else {
        return Check::new("templates", Status::Warn, "no usable images");
    };
    let names: Vec<String> = crate::service::templates::available(imgs)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let status = if names.len() > 1 {
        Status::Ok
    } else {
        Status::Warn
    };
    let mut detail = names.join(", ");
    if names.len() == 1 {
        detail.push_str(
            " only (the images have no template layers; `cargo xtask images` builds them)",
        );
    }
    Check::new("templates", status, detail)
}

async fn accel(config: &Config, paths: &Paths, images: Option<&Images>) -> Check {
    let driver = match QemuDriver::new(&config.qemu_binary) {
        Ok(d) => d,
        Err(e) => return Check::new("accel", Status::Fail, format!("cannot probe: {e}")),
    };
    match config.accel {
        AccelSetting::Kvm => {
            return Check::new(
                "accel",
                Status::Ok,
                "kvm (forced by accel = kvm in config.toml)",
            );
        }
        AccelSetting::Tcg => {
            return Check::new(
                "accel",
                Status::Ok,
                "tcg (forced by accel = tcg in config.toml)",
            );
        }
        AccelSetting::Auto => {}
    }
    let Some(images) = images else {
        return Check::new(
            "accel",
            Status::Warn,
            "not probed: the guest images are missing",
        );
    };
    match probe_accel(
        &driver,
        &images.kernel,
        &images.initramfs,
        &paths.cache_dir(),
    )
    .await
    {
        Ok(r) if r.kvm_ok => Check::new(
            "accel",
            Status::Ok,
            format!("kvm: a probe guest booted ({})", r.detail),
        ),
        Ok(r) => Check::new(
            "accel",
            Status::Warn,
            format!(
                "tcg will be used (slower): KVM cannot run the guest here: {}",
                r.detail
            ),
        ),
        Err(e) => Check::new(
            "accel",
            Status::Warn,
            format!("tcg will be used: the probe failed: {e}"),
        ),
    }
}

fn data_root(paths: &Paths) -> Check {
    let probe = paths.root.join(".doctor-write-test");
    let res = std::fs::create_dir_all(&paths.root).and_then(|_| std::fs::write(&probe, b"ok"));
    let _ = std::fs::remove_file(&probe);
    match res {
        Ok(()) => Check::new(
            "data-root",
            Status::Ok,
            format!("{} is writable", paths.root.display()),
        ),
        Err(e) => Check::new(
            "data-root",
            Status::Fail,
            format!("{} is not writable: {e}", paths.root.display()),
        ),
    }
}

async fn daemon(paths: &Paths) -> Check {
    let client = Client::new(&paths.socket());
    match client.get::<crate::api::Health>("/v1/health").await {
        Ok(h) => {
            let cap = h.capacity.map(|c| capacity_line(&c));
            Check::new(
                "daemon",
                Status::Ok,
                format!(
                    "reachable at {} (pid {}, version {}){}",
                    paths.socket().display(),
                    h.pid,
                    h.version,
                    cap.unwrap_or_default()
                ),
            )
        }
        Err(e) => Check::new("daemon", Status::Warn, e.to_string()),
    }
}

/// The daemon's ledger in one line: vCPUs held against the overcommitted cap, memory by use
/// (PSS of the VMs, what they count for, the room left above the reserve), CPU pressure.
fn capacity_line(c: &crate::api::Capacity) -> String {
    let pool = c.reservations.iter().filter(|r| r.holder == "pool").count();
    let m = &c.memory;
    let strict = c
        .max_memory_mib
        .map(|cap| {
            format!(
                ", {}/{cap} MiB configured (strict cap)",
                c.reserved_memory_mib
            )
        })
        .unwrap_or_default();
    let room = m
        .room_mib
        .map_or("unknown".to_owned(), |r| format!("{r} MiB"));
    let cpu = match c.cpu.some_avg60 {
        Some(p) => format!(
            "CPU pressure {p:.0}% (PSI some avg60; admission waits at {:.0}%)",
            c.cpu.limit
        ),
        None => "no CPU pressure reading (vCPU ratio only)".to_owned(),
    };
    format!(
        "; {} VMs ({pool} warm-pool): {}/{} vCPUs held ({:.0}x {} CPUs){strict}; memory used \
         {} MiB (PSS), counted {} MiB, room {room} (reserve {} MiB); {cpu}; {} queued, {} waited ({} for CPU)",
        c.reservations.len(),
        c.reserved_vcpus,
        c.max_vcpus,
        c.vcpu_overcommit,
        c.host_cpus,
        m.used_mib,
        m.counted_mib,
        m.reserve_mib,
        c.queued,
        c.waited,
        c.waited_cpu
    )
}

/// Which CPU pressure signal admission uses: PSI when `/proc/pressure/cpu` exists, else none
/// (only the vCPU overcommit ratio bounds admission).
fn cpu_pressure(limits: &crate::config::LimitsConfig) -> Check {
    cpu_pressure_verdict(crate::service::usage::cpu_psi_now(), limits)
}

fn cpu_pressure_verdict(psi: Option<f64>, limits: &crate::config::LimitsConfig) -> Check {
    let ratio = format!(
        "vCPUs overcommitted up to {} for {} CPUs",
        limits.vcpu_cap(crate::config::host_cpus()),
        crate::config::host_cpus()
    );
    match psi {
        None => Check::new(
            "cpu-pressure",
            Status::Warn,
            format!(
                "no /proc/pressure/cpu (kernel without PSI, or psi=0): admission is bounded by \
                 the vCPU ratio only ({ratio}), never by how busy the host is"
            ),
        ),
        Some(_) if limits.cpu_pressure_psi_avg60 <= 0.0 => Check::new(
            "cpu-pressure",
            Status::Ok,
            format!("PSI available but ignored ([limits] cpu_pressure_psi_avg60 = 0); {ratio}"),
        ),
        Some(p) => {
            let saturated = p >= limits.cpu_pressure_psi_avg60;
            Check::new(
                "cpu-pressure",
                if saturated { Status::Warn } else { Status::Ok },
                format!(
                    "PSI some avg60 {p:.1}%: admission {} at {:.0}% ([limits] \
                     cpu_pressure_psi_avg60); {ratio}",
                    if saturated {
                        "waits now, saturated"
                    } else {
                        "would wait"
                    },
                    limits.cpu_pressure_psi_avg60
                ),
            )
        }
    }
}

/// MemAvailable from /proc/meminfo, in MiB.
pub fn mem_available_mib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

fn memory() -> Check {
    match mem_available_mib() {
        Some(m) if m >= 1024 => Check::new("memory", Status::Ok, format!("{m} MiB available")),
        Some(m) => Check::new(
            "memory",
            Status::Warn,
            format!("only {m} MiB available; a sandbox needs 1024 MiB by default"),
        ),
        None => Check::new("memory", Status::Warn, "cannot read /proc/meminfo"),
    }
}

/// `mke2fs` + `debugfs` build the workspace base disk of a first big sync (without them that
/// sync unpacks an archive in the guest: correct, much slower under TCG).
fn e2fsprogs() -> Check {
    match crate::workspace::basedisk::tools() {
        Ok(()) => Check::new(
            "e2fsprogs",
            Status::Ok,
            if crate::workspace::basedisk::reads_tar() {
                "mke2fs and debugfs found: first big syncs go through the workspace base disk, \
                 built from the sync archive"
            } else {
                "mke2fs and debugfs found: first big syncs go through the workspace base disk \
                 (mke2fs < 1.47.1 cannot read the archive: the tree is staged first, slower)"
            },
        ),
        Err(e) => Check::new(
            "e2fsprogs",
            Status::Warn,
            format!("{e}: first big syncs will unpack an archive in the guest (slower)"),
        ),
    }
}

/// Free space on the data root's filesystem: fail below `[limits] min_free_disk_mib` (creates
/// are refused there), warn below `warn_free_disk_mib`.
fn disk(root: &Path, limits: &crate::config::LimitsConfig) -> Check {
    let at = if root.exists() { root } else { Path::new("/") };
    match crate::diskspace::free_bytes(at) {
        Ok(free) => disk_verdict(at, free >> 20, limits),
        Err(e) => Check::new(
            "disk",
            Status::Warn,
            format!("statvfs {}: {e}", at.display()),
        ),
    }
}

fn disk_verdict(at: &Path, free_mib: u64, limits: &crate::config::LimitsConfig) -> Check {
    if free_mib < limits.min_free_disk_mib {
        Check::new(
            "disk",
            Status::Fail,
            format!(
                "only {free_mib} MiB free at {}; creates are refused below {} MiB \
                 ([limits] min_free_disk_mib): free space or run `tryboxi gc`",
                at.display(),
                limits.min_free_disk_mib
            ),
        )
    } else if free_mib < limits.warn_free_disk_mib {
        Check::new(
            "disk",
            Status::Warn,
            format!(
                "only {free_mib} MiB free at {} (below {} MiB, [limits] warn_free_disk_mib): \
                 snapshots and pauses may fail with no_space; creates stop below {} MiB",
                at.display(),
                limits.warn_free_disk_mib,
                limits.min_free_disk_mib
            ),
        )
    } else {
        Check::new(
            "disk",
            Status::Ok,
            format!("{free_mib} MiB free at {}", at.display()),
        )
    }
}

/// Which of the host's locally added CAs every guest will trust (`[network] trust_host_cas`),
/// by subject CN and file; files left out are a warning with their reason.
fn guest_cas(cfg: &crate::config::NetworkConfig) -> Check {
    if !cfg.trust_host_cas {
        return Check::new(
            "guest-ca",
            Status::Ok,
            "off ([network] trust_host_cas = false): guests trust only their own CA bundle",
        );
    }
    let h = crate::network::host_cas::read_dirs(&cfg.host_ca_dirs);
    let mut parts = Vec::new();
    if h.cas.is_empty() {
        let dirs: Vec<String> = cfg
            .host_ca_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        parts.push(format!(
            "no local CA in {} to add to the guests",
            dirs.join(", ")
        ));
    } else {
        parts.push(format!(
            "every guest trusts {} host CA(s) besides its own bundle: {}",
            h.cas.len(),
            h.describe().join(", ")
        ));
    }
    for s in &h.skipped {
        parts.push(format!("not used: {}: {}", s.file.display(), s.reason));
    }
    let status = if h.skipped.is_empty() {
        Status::Ok
    } else {
        Status::Warn
    };
    Check::new("guest-ca", status, parts.join("; "))
}

/// The explicit upstream proxy (`[network] upstream_proxy`, else the daemon's
/// `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY`), credentials masked, where it came from, and
/// whether the proxy answers a TCP connect (it is not asked for a tunnel: no name is sent).
fn upstream_proxy(
    cfg: &crate::config::NetworkConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Check {
    use crate::network::upstream_proxy::resolve;
    match resolve(
        cfg.upstream_proxy.as_deref(),
        cfg.upstream_no_proxy.as_deref(),
        env,
    ) {
        Err(e) => Check::new("proxy", Status::Fail, e.to_string()),
        Ok(None) => Check::new("proxy", Status::Ok, "none: egress connects directly"),
        Ok(Some(p)) => {
            let no = match &p.no_proxy_source {
                Some(s) => format!("; {} no-proxy entr(y/ies) from {s}", p.no_proxy_len()),
                None => String::new(),
            };
            let (status, reach) = match p.probe(std::time::Duration::from_secs(3)) {
                Ok(()) => (Status::Ok, "answers".to_owned()),
                Err(why) => (
                    Status::Warn,
                    format!("does NOT answer ({why}): the flows it should carry are reset"),
                ),
            };
            Check::new(
                "proxy",
                status,
                format!(
                    "{} (from {}){no}; {reach}; guest egress goes through it (CONNECT by name; \
                     no-proxy and loopback destinations directly)",
                    p.display(),
                    p.source
                ),
            )
        }
    }
}

#[cfg(test)]
mod proxy_tests {
    use super::*;

    #[test]
    fn doctor_shows_the_proxy_masked_with_its_source_and_whether_it_answers() {
        let mut cfg = crate::config::NetworkConfig::default();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://u:topsecret@{}", l.local_addr().unwrap());
        let env = |v: &str| (v == "HTTPS_PROXY").then(|| url.clone());
        let c = upstream_proxy(&cfg, env);
        let shown = format!("http://***@{}", l.local_addr().unwrap());
        assert!(c.detail.contains(&shown), "{}", c.detail);
        assert!(c.detail.contains("$HTTPS_PROXY") && !c.detail.contains("topsecret"));
        assert_eq!(c.status, Status::Ok, "{}", c.detail);
        assert!(c.detail.contains("answers"), "{}", c.detail);
        // Nothing listens there any more: a warning that says so, still masked.
        drop(l);
        let c = upstream_proxy(&cfg, env);
        assert_eq!(c.status, Status::Warn, "{}", c.detail);
        assert!(c.detail.contains("does NOT answer") && !c.detail.contains("topsecret"));
        cfg.upstream_proxy = Some(String::new());
        assert_eq!(upstream_proxy(&cfg, env).status, Status::Ok);
        cfg.upstream_proxy = Some("socks5://p:1080".into());
        let c = upstream_proxy(&cfg, env);
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.detail.contains("[network] upstream_proxy"),
            "{}",
            c.detail
        );
    }
}

#[cfg(test)]
mod guest_ca_tests {
    use super::*;

    #[test]
    fn doctor_lists_the_host_cas_the_guests_get_or_says_off() {
        let d = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "Doctor Proxy CA");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        std::fs::write(
            d.path().join("proxy.crt"),
            p.self_signed(&key).unwrap().pem(),
        )
        .unwrap();
        let mut cfg = crate::config::NetworkConfig {
            host_ca_dirs: vec![d.path().to_path_buf()],
            ..Default::default()
        };
        let c = guest_cas(&cfg);
        assert_eq!(c.status, Status::Ok, "{}", c.detail);
        let file = d.path().join("proxy.crt");
        assert!(
            c.detail
                .contains(&format!("CN=Doctor Proxy CA ({})", file.display())),
            "{}",
            c.detail
        );
        std::fs::write(d.path().join("junk.pem"), "junk").unwrap();
        let c = guest_cas(&cfg);
        assert_eq!(c.status, Status::Warn, "{}", c.detail);
        assert!(c.detail.contains("junk.pem"), "{}", c.detail);
        cfg.trust_host_cas = false;
        let c = guest_cas(&cfg);
        assert!(c.detail.starts_with("off"), "{}", c.detail);
        cfg.trust_host_cas = true;
        cfg.host_ca_dirs = vec![d.path().join("none")];
        assert!(guest_cas(&cfg).detail.starts_with("no local CA in"));
    }
}

#[cfg(test)]
mod disk_tests {
    use super::*;

    #[test]
    fn doctor_warns_then_fails_as_free_space_drops() {
        let limits = crate::config::LimitsConfig {
            min_free_disk_mib: 1024,
            warn_free_disk_mib: 4096,
            ..Default::default()
        };
        let at = Path::new("/data");
        assert_eq!(disk_verdict(at, 8000, &limits).status, Status::Ok);
        let warn = disk_verdict(at, 2000, &limits);
        assert_eq!(warn.status, Status::Warn, "{}", warn.detail);
        assert!(
            warn.detail.contains("warn_free_disk_mib"),
            "{}",
            warn.detail
        );
        let fail = disk_verdict(at, 500, &limits);
        assert_eq!(fail.status, Status::Fail, "{}", fail.detail);
        assert!(fail.detail.contains("min_free_disk_mib"), "{}", fail.detail);
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    #[test]
    fn doctor_says_which_cpu_pressure_signal_admission_uses() {
        let limits = crate::config::LimitsConfig {
            cpu_pressure_psi_avg60: 90.0,
            ..Default::default()
        };
        let none = cpu_pressure_verdict(None, &limits);
        assert_eq!(none.status, Status::Warn);
        assert!(none.detail.contains("vCPU ratio only"), "{}", none.detail);
        let calm = cpu_pressure_verdict(Some(3.0), &limits);
        assert_eq!(calm.status, Status::Ok);
        assert!(
            calm.detail.contains("PSI some avg60 3.0%"),
            "{}",
            calm.detail
        );
        let busy = cpu_pressure_verdict(Some(95.0), &limits);
        assert_eq!(busy.status, Status::Warn);
        assert!(busy.detail.contains("saturated"), "{}", busy.detail);
        let off = crate::config::LimitsConfig {
            cpu_pressure_psi_avg60: 0.0,
            ..Default::default()
        };
        assert!(
            cpu_pressure_verdict(Some(99.0), &off)
                .detail
                .contains("ignored")
        );
    }
}
