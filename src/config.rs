//! The data root and `config.toml`.
//!
//! Owns: where tryboxi keeps its state (`TRYBOXI_HOME`, else `/var/lib/tryboxi` for root, else
//! `$XDG_DATA_HOME/tryboxi`), the layout of files inside it, and the daemon's configuration.
//! Every key of `config.toml` is documented on [`Config`] with its default; an unknown key is an
//! error (a typo must not be silently ignored).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use crate::vmm::AccelSetting;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("cannot find a data root: set TRYBOXI_HOME, or HOME/XDG_DATA_HOME")]
    NoHome,
}

/// `config.toml` in the data root. All keys are optional.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Also listen on TCP (e.g. `"127.0.0.1:7070"`). Requests over TCP need
    /// `Authorization: Bearer <token>` (`tryboxi token`) and, over plain HTTP, a loopback
    /// Host/Origin. An address that is not loopback needs `tcp_tls = true` (the daemon refuses
    /// to start otherwise: the token must never travel in plain text off the machine).
    /// Default: unset (unix socket only).
    pub tcp_listen: Option<SocketAddr>,
    /// Serve `tcp_listen` over TLS with a self-signed certificate made once in the data root
    /// (`tls-cert.pem`, `tls-key.pem`, mode 0600); clients pin its SHA-256 fingerprint, which
    /// `tryboxi token` prints (`TRYBOXI_URL=https://host:port`, `TRYBOXI_TOKEN`,
    /// `TRYBOXI_FINGERPRINT`). Default: false.
    pub tcp_tls: bool,
    /// Serve the E2B-compatible API here (`serve --e2b ADDR` overrides it): E2B SDK code runs
    /// against the daemon with `E2B_API_URL` and `E2B_SANDBOX_URL` set to `http://ADDR` and
    /// `E2B_API_KEY=$(tryboxi token)`. A loopback address, or any with `tcp_tls` on. Default:
    /// unset (off).
    pub e2b_listen: Option<SocketAddr>,
    /// `auto` (default), `kvm` or `tcg`.
    pub accel: AccelSetting,
    /// The QEMU system emulator. Default: `qemu-system-x86_64` (looked up on PATH).
    pub qemu_binary: String,
    /// vCPUs per sandbox when the request does not say. Default: 2.
    pub default_vcpus: u32,
    /// Memory per sandbox in MiB when the request does not say. Default: 1024.
    pub default_memory_mib: u32,
    /// Largest vCPU count a request may ask for. Default: the host's CPU count.
    pub max_vcpus: u32,
    /// Largest memory a request may ask for, in MiB. Default: 16384.
    pub max_memory_mib: u32,
    /// Seconds to wait for a new VM's agent to answer. Default: 120 (TCG boots are slow).
    pub boot_timeout_s: u64,
    /// Seconds the daemon waits for a guest agent's answer to any request (a reply, the next
    /// chunk of a read, credit for the next chunk of a write; an unpack from a disk gets 1 s
    /// more per MiB): past it the agent counts as hung or hostile, its connection is closed
    /// and the sandbox becomes `failed`. Exec output and stdin have no deadline. Default: 120
    /// (a first walk of a big tree under TCG takes tens of seconds); at least 1.
    pub agent_timeout_s: u64,
    /// Default exec timeout in seconds when the request has none; 0 = no limit. Default: 0.
    pub exec_timeout_s: u64,
    /// Where guest images live when `serve --artifacts` is not given. Default: `<data root>/artifacts`.
    pub artifacts: Option<PathBuf>,
    /// Cap in bytes of each exec output log file (stdout, stderr, both interleaved) kept under
    /// `sandboxes/<id>/execs/<exe_id>/`; output past it is counted, not kept. Default: 16 MiB.
    pub exec_log_max_bytes: u64,
    /// Export traces over OTLP/HTTP to this endpoint (e.g. `http://127.0.0.1:4318`);
    /// `serve --otlp-endpoint` overrides it. Default: unset (traces stay in the daemon).
    pub otlp_endpoint: Option<String>,
    /// Workspace sync, diff, apply and pull (`[sync]` table).
    pub sync: SyncConfig,
    /// Host capacity (vCPU overcommit, memory by use), the wait queue, memory and CPU
    /// pressure, free disk (`[limits]` table).
    pub limits: LimitsConfig,
    /// What `tryboxi gc` deletes (`[gc]` table).
    pub gc: GcConfig,
    /// What daemon shutdown (SIGINT/SIGTERM) does with running sandboxes: `pause` (default:
    /// each is paused to disk and resumed when the next daemon starts) or `leave` (QEMU keeps
    /// running and the next daemon reattaches to it).
    pub shutdown: ShutdownMode,
    /// Pause a ready sandbox to disk once nothing used it for this many seconds (an exec,
    /// sync, diff... resumes it transparently); 0 = never. Default: 0.
    pub idle_pause_secs: u64,
    /// Golden snapshots and the warm pool (`[pool]` table).
    pub pool: PoolConfig,
    /// The sandboxes' egress network (`[network]` table).
    pub network: NetworkConfig,
    /// Limits of the daemon's HTTP listeners (`[http]` table).
    pub http: HttpConfig,
    /// Who may use the unix socket besides the daemon's own user and root (`[api]` table).
    pub api: ApiConfig,
    /// Retention of events, traces and VM logs (`[telemetry]` table).
    pub telemetry: TelemetryConfig,
    /// First of the numeric uids (and gids) a root daemon gives each sandbox's QEMU, one per
    /// sandbox (no /etc/passwd entry); 2^30 ids from there. Change it when a directory
    /// service hands out ids in that range. A sandbox keeps the id it has. At least 1048576,
    /// at most 3221225471. Default: 2000000000.
    pub vm_uid_base: u32,
}

/// `[api]`: who may talk to the daemon over its unix socket. The peer's uid comes from the
/// kernel (`SO_PEERCRED`); the daemon's own uid and root are always allowed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// More uids allowed to use the daemon, e.g. `[1000]` for the user who started a root
    /// daemon with `sudo` and runs the CLI or an MCP client as themselves. Each gets the whole
    /// API (sandboxes of every user, workspaces the daemon's user can read and write): list
    /// only users you would give the daemon's powers. When the list is not empty the socket is
    /// mode 0666 and the data root 0711 (search only; every entry in it but the socket is closed
    /// to other users), and the uid check refuses everyone else, naming this key. Default:
    /// none (socket 0600, data root 0700).
    pub allowed_uids: Vec<u32>,
}

/// `[http]`: what one client may hold of the daemon's HTTP listeners. Each listener (the unix
/// socket, `tcp_listen`) has its own budget, so a flood on TCP never stops the unix socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// A client must send a request's complete header within this many seconds of the
    /// connection opening, or of the request's first byte on a kept-alive connection; else the
    /// connection is closed (slowloris). Streams already answering (`GET /v1/events`, exec
    /// NDJSON) are not cut. Default: 10; at least 1.
    pub header_timeout_s: u64,
    /// A kept-alive connection on which no request has begun within this many seconds of the
    /// previous response ending is closed. Longer than the pools of common HTTP clients
    /// (reqwest and Go keep idle connections 90 s), so they drop a connection before the
    /// daemon does: a request written as the daemon closes it would be reset. Default: 120;
    /// at least 1.
    pub idle_timeout_s: u64,
    /// A request's whole body (at most 16 MiB) must arrive within this many seconds of its
    /// header, else the answer is 408 and the connection is closed (slow uploads that hold a
    /// connection). Default: 60; at least 1.
    pub body_timeout_s: u64,
    /// Open connections per listener; past it new connections get a 503 and are closed.
    /// Default: 1024.
    pub max_connections: usize,
    /// Open connections per peer and listener: per uid on the unix socket and for loopback TCP
    /// peers (the socket's owner, looked up with sock_diag), per IP address otherwise.
    /// Default: 256.
    pub max_connections_per_peer: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_timeout_s: 10,
            idle_timeout_s: 120,
            body_timeout_s: 60,
            max_connections: 1024,
            max_connections_per_peer: 256,
        }
    }
}

/// `[limits]`: what all VMs together may hold on this host (the scheduler's ledger,
/// `service/scheduler.rs`; its accounting is `service/usage.rs`).
///
/// vCPUs are overcommitted (an idle guest uses no CPU): all VMs together may hold
/// `vcpu_overcommit` x the host's CPUs, and a request waits while the host is really CPU
/// saturated (PSI). Memory is admitted by what VMs really use (each QEMU's PSS plus headroom,
/// at most its configured size), keeping `memory_reserve_mib` free for the daemon and the host.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// vCPUs all VMs may hold together per host CPU (a ratio; idle guests use no CPU).
    /// Default: 128 (on 2 CPUs, 128 sandboxes of 2 vCPUs). `max_vcpus` overrides it.
    pub vcpu_overcommit: f64,
    /// vCPUs all VMs may hold together, exactly (a strict limit); unset: `vcpu_overcommit` x
    /// the host's CPU count. Default: unset.
    pub max_vcpus: Option<u32>,
    /// A strict cap on the configured memory of all VMs together, in MiB (no memory
    /// overcommit past it); unset: memory is admitted by use alone. Default: unset.
    pub max_memory_mib: Option<u64>,
    /// Memory (MiB) kept free for the daemon and the host: a VM is admitted only if its
    /// expected use fits in `MemAvailable` minus this and minus what running VMs may still grow
    /// into (their headroom). Default: 10% of MemTotal, at least 512 (above the memory
    /// pressure floor, so an admission does not itself cause pressure pauses).
    pub memory_reserve_mib: u64,
    /// Growth (MiB) each running VM counts for on top of its measured use (PSS), never past
    /// its configured memory. Default: 64.
    pub memory_headroom_mib: u64,
    /// What a VM counts for (MiB, at most its configured memory) from admission until its
    /// first measurement (a boot, a restore or a fork child starting). Default: 256.
    pub memory_new_vm_mib: u64,
    /// PSI `some avg60` (percent) of `/proc/pressure/cpu` at or above which the host counts as
    /// CPU saturated: requests wait in the queue (admitted when the wait ends, if CPU was the
    /// only shortage) and no warm-pool VM or golden build starts;
    /// 0 = ignore CPU pressure. Without `/proc/pressure/cpu` only the vCPU ratio applies.
    /// Default: 90.
    pub cpu_pressure_psi_avg60: f64,
    /// How long a create/restore/fork waits in the queue when the host is full. Default: 30.
    pub queue_timeout_s: u64,
    /// Requests allowed to wait at once; more are refused. Default: 16.
    pub max_queue: usize,
    /// Seconds between memory pressure checks; 0 = off. Default: 5.
    pub pressure_check_s: u64,
    /// PSI `some avg10` (percent) of `/proc/pressure/memory` that counts as pressure; 0 = ignore
    /// PSI. Default: 10.
    pub pressure_psi_avg10: f64,
    /// `MemAvailable` below this (MiB) counts as pressure. Default: 5% of MemTotal.
    pub pressure_min_available_mib: u64,
    /// A sandbox idle for less than this is never paused for memory. Default: 120.
    pub pressure_min_idle_s: u64,
    /// Free space (MiB) on the data root's filesystem below which a create is refused up front
    /// with `no_space` (nothing half-made) and `tryboxi doctor` fails its disk check.
    /// Default: 1024.
    pub min_free_disk_mib: u64,
    /// Free space (MiB) below which `tryboxi doctor` warns. Default: 4096.
    pub warn_free_disk_mib: u64,
    /// Space (MiB) every big write (snapshot, pause, fork, first sync's base disk, apply
    /// backup) must leave free after its known size, so the store and logs can still be
    /// written; a write that would eat into it is refused with `no_space`. Default: 64.
    pub disk_reserve_mib: u64,
    /// Reserve the blocks of each running VM's own RAM file on the data root when its QEMU
    /// starts (`fallocate`; nothing is written, and a pause gives back what the guest never
    /// wrote). The guest's page faults then never meet a full filesystem: without it, a guest
    /// that fills the data root with its own disk writes kills its QEMU (SIGBUS on the next
    /// page it touches). Costs disk, not memory: each running sandbox holds its memory size
    /// (forks and golden clones excepted: they map their parent's file). Default: true.
    pub reserve_ram_on_disk: bool,
    /// Disk budget (MiB) of each sandbox's root disk: what the guest writes, in its qcow2
    /// overlay and, after each snapshot, pause or restore, in the layers frozen below the new
    /// one. A new layer gets what the frozen layers in the sandbox's directory leave (at least
    /// 1 MiB), its file never grows past that, and a guest write that would need more fails in
    /// the guest with an I/O error (its VM lives on, as on a full data root). The guest's other
    /// disks are read-only to it. A layer already bigger (made before a lower setting) keeps
    /// its size as its cap. 0 = no budget (a layer then grows up to the size of the root
    /// image); at least 64. Default: 4096.
    pub disk_budget_mib: u64,
}

/// The host's CPU count (at least 1).
pub fn host_cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(2)
}

impl LimitsConfig {
    /// [`LimitsConfig::disk_budget_mib`] in bytes, `None` when off.
    pub fn disk_budget(&self) -> Option<u64> {
        (self.disk_budget_mib > 0).then(|| self.disk_budget_mib.max(64).saturating_mul(1 << 20))
    }

    /// [`LimitsConfig::disk_reserve_mib`] in bytes.
    pub fn disk_reserve(&self) -> u64 {
        self.disk_reserve_mib.saturating_mul(1 << 20)
    }

    /// vCPUs all VMs may hold together on a host of `cpus` CPUs: `max_vcpus`, else
    /// `vcpu_overcommit` x `cpus` (rounded down, at least 1).
    pub fn vcpu_cap(&self, cpus: u32) -> u32 {
        self.max_vcpus.unwrap_or_else(|| {
            let v = (self.vcpu_overcommit.max(0.0) * f64::from(cpus)).floor();
            (v.min(f64::from(u32::MAX)) as u32).max(1)
        })
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| crate::service::pressure::parse_meminfo_mib(&t, "MemTotal"))
            .unwrap_or(4096);
        LimitsConfig {
            vcpu_overcommit: 128.0,
            max_vcpus: None,
            max_memory_mib: None,
            memory_reserve_mib: (total / 10).max(512),
            memory_headroom_mib: 64,
            memory_new_vm_mib: 256,
            cpu_pressure_psi_avg60: 90.0,
            queue_timeout_s: 30,
            max_queue: 16,
            pressure_check_s: 5,
            pressure_psi_avg10: 10.0,
            pressure_min_available_mib: total / 20,
            pressure_min_idle_s: 120,
            min_free_disk_mib: 1024,
            warn_free_disk_mib: 4096,
            disk_reserve_mib: 64,
            reserve_ram_on_disk: true,
            disk_budget_mib: 4096,
        }
    }
}

/// `[gc]`: retention of snapshots and backups (`tryboxi gc`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GcConfig {
    /// Snapshots older than this many days are deleted; 0 = never by age. Default: 14.
    pub snapshot_max_age_days: u64,
    /// Newest snapshots kept per sandbox (older ones are deleted); 0 = no limit. Default: 10.
    pub keep_snapshots_per_sandbox: usize,
    /// apply/pull backups (`artifacts/art_*`) older than this many days are deleted, except the
    /// newest one of each existing sandbox (its undo). Default: 30.
    pub backup_retention_days: u64,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            snapshot_max_age_days: 14,
            keep_snapshots_per_sandbox: 10,
            backup_retention_days: 30,
        }
    }
}

/// See [`Config::shutdown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownMode {
    #[default]
    Pause,
    Leave,
}

/// `[pool]`: creating sandboxes from a golden snapshot instead of booting, and keeping some
/// ready ahead of time. See docs/ARCHITECTURE.md, "Golden snapshots and the warm pool".
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Keep a booted, agent-ready golden snapshot per (images, template, vCPUs, memory, device
    /// layout) and create sandboxes by restoring it. It is built in the background after the
    /// first create of its kind. Default: true.
    pub golden: bool,
    /// Sandboxes kept pre-restored from each golden snapshot that was used (0 = none);
    /// refilled in the background. Default: 1.
    pub size: u32,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            golden: true,
            size: 1,
        }
    }
}

/// `[network]`: egress policy defaults and the sandbox resolver (docs/NETWORK-POLICY.md).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Policy of sandboxes created without `--network`: preset names (`registries`, `github`,
    /// `none`) and `HOST|CIDR[:PORTS]` allow rules. Default: `["registries", "github"]`.
    pub default_policy: Vec<String>,
    /// The resolver allowed names are looked up with, `IP:PORT`. Default: the first
    /// `nameserver` of the host's /etc/resolv.conf, port 53.
    pub upstream_dns: Option<SocketAddr>,
    /// TEST/OVERRIDE: names the sandbox resolver answers from this table instead of asking
    /// the upstream resolver, e.g. `"allowed.test" = ["203.0.113.10"]`. The answers still go
    /// through the policy and the blocked-range check. Default: none.
    pub test_hosts: BTreeMap<String, Vec<IpAddr>>,
    /// TEST/OVERRIDE: an allowed guest connection to the key really connects to the value,
    /// e.g. `"203.0.113.10:443" = "127.0.0.1:8443"`. Applied after the policy allowed the flow,
    /// so tests use local servers while the guest-visible address stays public (the guest can
    /// still never reach loopback itself). Default: none.
    pub test_upstream_map: BTreeMap<SocketAddr, SocketAddr>,
    /// A PEM file of extra CAs that intercepted flows (secrets) trust upstream, besides the
    /// host's CA bundle, e.g. the test CA of a local upstream. Default: none.
    pub intercept_extra_ca: Option<std::path::PathBuf>,
    /// Every sandbox's guest trusts the CA certificates the host added locally (those in
    /// `host_ca_dirs`), besides its own distribution's bundle: they go into the guest's trust
    /// store and the CA env vars of every exec, so that a TLS-inspecting proxy the host trusts
    /// works from the guest too. Read when the daemon starts. Default: true.
    pub trust_host_cas: bool,
    /// The host's local CA directories read for `trust_host_cas` (those that exist; `.crt`
    /// and `.pem` files, PEM, only CA certificates). Default:
    /// `["/usr/local/share/ca-certificates", "/etc/pki/ca-trust/source/anchors"]`.
    pub host_ca_dirs: Vec<std::path::PathBuf>,
    /// The explicit proxy guest egress goes through, `http://[user:pass@]host:port`
    /// (`CONNECT name:port`; only http:// proxies, others are a config error). Unset: the
    /// first non-empty of `https_proxy`, `HTTPS_PROXY`, `http_proxy`, `HTTP_PROXY`,
    /// `all_proxy`, `ALL_PROXY` in the daemon's environment; `""` turns it off. Credentials
    /// are never shown (`tryboxi doctor` masks them). Names the host cannot resolve get
    /// synthetic DNS answers for the proxy (README, "Explicit proxy"). Default: unset.
    pub upstream_proxy: Option<String>,
    /// Destinations that skip `upstream_proxy`: `*`, domains (`example.com`, `.example.com`:
    /// the name and its subdomains), IPs and CIDRs, each optionally with `:port`. Unset:
    /// `no_proxy`/`NO_PROXY` from the daemon's environment. Default: unset.
    pub upstream_no_proxy: Option<Vec<String>>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            default_policy: vec!["registries".into(), "github".into()],
            upstream_dns: None,
            test_hosts: BTreeMap::new(),
            test_upstream_map: BTreeMap::new(),
            intercept_extra_ca: None,
            trust_host_cas: true,
            host_ca_dirs: crate::network::host_cas::DEFAULT_DIRS
                .iter()
                .map(std::path::PathBuf::from)
                .collect(),
            upstream_proxy: None,
            upstream_no_proxy: None,
        }
    }
}

/// `[telemetry]`: how much of the event log, the traces and each VM's logs is kept, so that a
/// guest (or a client) producing events or output without end cannot fill the disk or memory.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Newest events kept in the store (each new one past it deletes the oldest). Default:
    /// 100000.
    pub event_max_count: u64,
    /// Events older than this many days are deleted (at start and as events come); 0 = never
    /// by age. Default: 30.
    pub event_max_age_days: u64,
    /// Traces kept in memory (`GET /v1/traces/{id}`). Default: 1024.
    pub trace_max_count: usize,
    /// Traces older than this many seconds are dropped as new ones come; 0 = never by age.
    /// Default: 86400.
    pub trace_max_age_s: u64,
    /// Cap in bytes of each VM's `console.log` and `qemu.log`: past it the file is rotated to
    /// `<name>.1` (one previous file is kept). Default: 1 MiB.
    pub vm_log_max_bytes: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            event_max_count: 100_000,
            event_max_age_days: 30,
            trace_max_count: crate::telemetry::traces::MAX_TRACES,
            trace_max_age_s: crate::telemetry::traces::MAX_AGE.as_secs(),
            vm_log_max_bytes: 1 << 20,
        }
    }
}

/// `[sync]`: what of the host repo goes into the VM, and limits on what comes back.
///
/// Patterns are globs on the path relative to the repo root, `/`-separated. A pattern without
/// a `/` matches a name at any depth (`*.pem` matches `a/b/c.pem`); an `exclude` pattern
/// matching a directory covers everything under it (`vendor` covers `vendor/x.c`). A secret
/// pattern (and an `allow_secrets` one) matches files only unless written with a trailing `/`:
/// `.aws/` covers the directory and everything under it, `id_*` matches the file `id_rsa` but
/// not a directory `id_service/` nor what is in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncConfig {
    /// Extra paths never synced (on top of `.gitignore`, `.git/info/exclude`). Default: none.
    pub exclude: Vec<String>,
    /// Secret files: never synced, never applied back unless allowed below. Default:
    /// `.env*` (`.env`, `.env.local`, `.env-dev`, `.env_local`, `.envrc`, ...), `*.pem`,
    /// `*.key`, `*.p12`, `*.pfx`, `id_*` (any name starting `id_`: `id_rsa`, `id_ed25519.pub`,
    /// `id_deploy`, ...), `.npmrc`, `.pypirc`, `.netrc`, `_netrc`, `.git-credentials`, the
    /// directories `.aws/`, `.ssh/`, `.gnupg/`, `.azure/`, `**/.config/gcloud/`, and
    /// `**/.kube/config`, `**/.docker/config.json`, `**/.config/gh/hosts.yml`,
    /// `credentials.json`, `secrets.*`, `*.keystore`, `.htpasswd` (all at any depth). Matched in
    /// any case (`.ENV`, `ID_RSA`, `Credentials.json` are secrets too). Setting this replaces
    /// the whole list.
    pub secrets: Vec<String>,
    /// Secret paths the user explicitly allows into the VM (same pattern syntax, but matched
    /// case-sensitively: only the spelling the user wrote is let through). Default:
    /// `.env.example`, `.env.sample`, `.env.template`, `.env.dist` (committed templates of a
    /// `.env`, without values). Setting this replaces the whole list.
    pub allow_secrets: Vec<String>,
    /// Largest single file apply/pull bring back from a VM, in MiB. Default: 64. Larger ones are
    /// not read: diff and apply list them as too big and leave the host's copy untouched.
    pub max_file_mib: u64,
    /// Most file content one diff, apply or pull reads from a VM, in MiB: the sum of the changed
    /// files' sizes. Over it the request is refused with an error (narrow it to some paths);
    /// the files are read into a spill directory in the sandbox's directory, not into memory
    /// (apply and pull then hold what they bring back in memory). Default: 1024.
    pub max_diff_mib: u64,
    /// Most file content one host -> VM sync sends, in MiB (a first sync sends the whole
    /// workspace): over it the sync, or the create, is refused before any file is read. The
    /// daemon holds what one sync sends in memory while it sends it. Default: 1024.
    pub max_sync_mib: u64,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            exclude: Vec::new(),
            secrets: DEFAULT_SECRETS.iter().map(|s| s.to_string()).collect(),
            allow_secrets: DEFAULT_ALLOWED_SECRETS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            max_file_mib: 64,
            max_diff_mib: 1024,
            max_sync_mib: 1024,
        }
    }
}

/// The committed templates of `.env` files, not secrets by default (see
/// [`SyncConfig::allow_secrets`]).
pub const DEFAULT_ALLOWED_SECRETS: &[&str] =
    &[".env.example", ".env.sample", ".env.template", ".env.dist"];

/// The default secret patterns (see [`SyncConfig::secrets`]).
pub const DEFAULT_SECRETS: &[&str] = &[
    ".env*",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "id_*",
    ".npmrc",
    ".pypirc",
    ".netrc",
    "_netrc",
    ".git-credentials",
    ".aws/",
    ".ssh/",
    ".gnupg/",
    ".azure/",
    "**/.kube/config",
    "**/.docker/config.json",
    "**/.config/gcloud/",
    "**/.config/gh/hosts.yml",
    "credentials.json",
    "secrets.*",
    "*.keystore",
    ".htpasswd",
];

impl Default for Config {
    fn default() -> Self {
        Config {
            tcp_listen: None,
            tcp_tls: false,
            e2b_listen: None,
            accel: AccelSetting::Auto,
            qemu_binary: "qemu-system-x86_64".into(),
            default_vcpus: 2,
            default_memory_mib: 1024,
            max_vcpus: host_cpus(),
            max_memory_mib: 16384,
            boot_timeout_s: 120,
            agent_timeout_s: 120,
            exec_timeout_s: 0,
            artifacts: None,
            exec_log_max_bytes: 16 << 20,
            otlp_endpoint: None,
            sync: SyncConfig::default(),
            limits: LimitsConfig::default(),
            gc: GcConfig::default(),
            shutdown: ShutdownMode::Pause,
            idle_pause_secs: 0,
            pool: PoolConfig::default(),
            network: NetworkConfig::default(),
            http: HttpConfig::default(),
            api: ApiConfig::default(),
            telemetry: TelemetryConfig::default(),
            vm_uid_base: crate::vmm::jail::user::DEFAULT_UID_BASE,
        }
    }
}

impl Config {
    /// Load `config.toml` from the data root; a missing file means all defaults.
    pub fn load(paths: &Paths) -> Result<Config, ConfigError> {
        let path = paths.config_file();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                Config::parse(&text).map_err(|message| ConfigError::Parse { path, message })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Config::default()),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        let c: Config = toml::from_str(text).map_err(|e| e.to_string())?;
        crate::vmm::jail::user::check_uid_base(c.vm_uid_base)?;
        Ok(c)
    }
}

/// Files and directories inside the data root.
#[derive(Debug, Clone)]
pub struct Paths {
    pub root: PathBuf,
}

impl Paths {
    /// The data root: `TRYBOXI_HOME`, else `/var/lib/tryboxi` as root, else
    /// `$XDG_DATA_HOME/tryboxi` (default `~/.local/share/tryboxi`).
    pub fn discover() -> Result<Paths, ConfigError> {
        if let Some(h) = std::env::var_os("TRYBOXI_HOME").filter(|h| !h.is_empty()) {
            return Ok(Paths {
                root: absolute(Path::new(&h)),
            });
        }
        if nix::unistd::geteuid().is_root() {
            return Ok(Paths {
                root: PathBuf::from("/var/lib/tryboxi"),
            });
        }
        if let Some(x) = std::env::var_os("XDG_DATA_HOME").filter(|h| !h.is_empty()) {
            return Ok(Paths {
                root: Path::new(&x).join("tryboxi"),
            });
        }
        let home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .ok_or(ConfigError::NoHome)?;
        Ok(Paths {
            root: Path::new(&home).join(".local/share/tryboxi"),
        })
    }

    pub fn config_file(&self) -> PathBuf {
        self.root.join("config.toml")
    }
    pub fn socket(&self) -> PathBuf {
        self.root.join("tryboxi.sock")
    }
    pub fn lock_file(&self) -> PathBuf {
        self.root.join("tryboxi.lock")
    }
    pub fn token_file(&self) -> PathBuf {
        self.root.join("token")
    }
    /// The TCP listener's self-signed certificate (PEM, 0600) when `tcp_tls` is on.
    pub fn tls_cert_file(&self) -> PathBuf {
        self.root.join("tls-cert.pem")
    }
    /// Its private key (PEM, 0600).
    pub fn tls_key_file(&self) -> PathBuf {
        self.root.join("tls-key.pem")
    }
    pub fn store_file(&self) -> PathBuf {
        self.root.join("tryboxi.redb")
    }
    /// The secret store (`secret set`): values on the host only, mode 0600.
    pub fn secrets_file(&self) -> PathBuf {
        self.root.join("secrets.json")
    }
    /// One directory per sandbox: `sandboxes/<sbx_id>/`.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir().join(id)
    }
    /// Installed guest images (`tryboxi install`): `artifacts/images/...`.
    pub fn artifacts_dir(&self) -> PathBuf {
        self.root.join("artifacts")
    }
    /// Golden snapshots, one directory per image key: `golden/<key>/`.
    pub fn golden_dir(&self) -> PathBuf {
        self.root.join("golden")
    }
    /// Cached host facts (the KVM probe).
    pub fn cache_dir(&self) -> PathBuf {
        self.root.join("cache")
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vm_uid_base_is_checked_when_the_config_is_read() {
        assert_eq!(
            Config::parse("").unwrap().vm_uid_base,
            crate::vmm::jail::user::DEFAULT_UID_BASE
        );
        assert_eq!(
            Config::parse("vm_uid_base = 300000000")
                .unwrap()
                .vm_uid_base,
            300_000_000
        );
        let e = Config::parse("vm_uid_base = 1000").unwrap_err();
        assert!(e.contains("vm_uid_base = 1000"), "{e}");
        assert!(Config::parse("vm_uid_base = 4000000000").is_err());
    }

    #[test]
    fn empty_config_gives_documented_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.accel, AccelSetting::Auto);
        assert_eq!(c.default_vcpus, 2);
        assert_eq!(c.default_memory_mib, 1024);
        assert!(c.tcp_listen.is_none());
        assert_eq!(c.exec_log_max_bytes, 16 << 20);
        assert!(c.otlp_endpoint.is_none());
        assert!(!c.tcp_tls);
        assert_eq!(c.http.header_timeout_s, 10);
        assert_eq!(c.http.idle_timeout_s, 120);
        assert_eq!(c.http.body_timeout_s, 60);
        assert_eq!(c.http.max_connections, 1024);
        assert_eq!(c.http.max_connections_per_peer, 256);
        assert!(c.api.allowed_uids.is_empty());
    }

    #[test]
    fn api_table_lists_allowed_uids_and_rejects_typos() {
        let c = Config::parse("[api]\nallowed_uids = [1000, 1002]").unwrap();
        assert_eq!(c.api.allowed_uids, [1000, 1002]);
        assert!(Config::parse("[api]\nallowed_uid = [1000]").is_err());
        assert!(Config::parse("[api]\nallowed_uids = [-1]").is_err());
    }

    #[test]
    fn unknown_key_is_an_error() {
        let e = Config::parse("tcp_lisen = \"127.0.0.1:1\"").unwrap_err();
        assert!(e.contains("tcp_lisen"), "{e}");
    }

    #[test]
    fn sync_table_parses_and_rejects_typos() {
        let c = Config::parse("[sync]\nexclude = [\"big/\"]\nallow_secrets = [\".env.example\"]")
            .unwrap();
        assert_eq!(c.sync.exclude, ["big/"]);
        assert_eq!(c.sync.allow_secrets, [".env.example"]);
        assert!(c.sync.secrets.iter().any(|s| s == "*.pem"));
        assert_eq!(c.sync.max_file_mib, 64);
        assert_eq!((c.sync.max_diff_mib, c.sync.max_sync_mib), (1024, 1024));
        assert!(Config::parse("[sync]\nexclud = []").is_err());
    }

    #[test]
    fn limits_and_gc_tables_parse() {
        let c = Config::parse(
            "[limits]\nmax_memory_mib = 2048\nqueue_timeout_s = 1\n[gc]\nbackup_retention_days = 7",
        )
        .unwrap();
        assert_eq!(c.limits.max_memory_mib, Some(2048));
        assert_eq!(c.limits.queue_timeout_s, 1);
        // vCPUs are overcommitted by default; `max_vcpus` is a strict limit.
        assert_eq!(c.limits.max_vcpus, None);
        assert_eq!(c.limits.vcpu_cap(2), 256);
        let strict = Config::parse("[limits]\nmax_vcpus = 3\nvcpu_overcommit = 64").unwrap();
        assert_eq!(strict.limits.vcpu_cap(2), 3);
        let ratio = Config::parse("[limits]\nvcpu_overcommit = 1.5").unwrap();
        assert_eq!(ratio.limits.vcpu_cap(2), 3);
        assert_eq!(ratio.limits.vcpu_cap(1), 1);
        assert_eq!(c.gc.backup_retention_days, 7);
        assert_eq!(c.gc.keep_snapshots_per_sandbox, 10);
        assert!(Config::parse("[limits]\nmax_mem = 1").is_err());
    }

    #[test]
    fn network_table_parses_test_overrides_and_rejects_typos() {
        let c = Config::parse(
            "[network]\nupstream_dns = \"127.0.0.1:5353\"\n\
             [network.test_hosts]\n\"allowed.test\" = [\"203.0.113.10\"]\n\
             [network.test_upstream_map]\n\"203.0.113.10:443\" = \"127.0.0.1:8443\"\n",
        )
        .unwrap();
        assert_eq!(c.network.upstream_dns.unwrap().port(), 5353);
        assert_eq!(c.network.test_hosts["allowed.test"].len(), 1);
        assert_eq!(
            c.network.test_upstream_map[&"203.0.113.10:443".parse().unwrap()],
            "127.0.0.1:8443".parse().unwrap()
        );
        assert_eq!(
            Config::parse("").unwrap().network.default_policy,
            ["registries", "github"]
        );
        assert!(Config::parse("[network]\nupstream = \"x\"").is_err());
    }

    #[test]
    fn host_cas_are_trusted_by_default_from_the_usual_anchor_dirs() {
        let n = Config::parse("").unwrap().network;
        assert!(n.trust_host_cas);
        assert_eq!(
            n.host_ca_dirs,
            [
                std::path::PathBuf::from("/usr/local/share/ca-certificates"),
                "/etc/pki/ca-trust/source/anchors".into()
            ]
        );
        let n = Config::parse("[network]\ntrust_host_cas = false\nhost_ca_dirs = [\"/x\"]")
            .unwrap()
            .network;
        assert!(!n.trust_host_cas);
        assert_eq!(n.host_ca_dirs, [std::path::PathBuf::from("/x")]);
    }

    /// The config the Kubernetes DaemonSet's daemons load (deploy/kubernetes/configmap.yaml;
    /// tests/k8s_manifests.rs also starts a daemon on it).
    #[test]
    fn the_kubernetes_configmap_config_parses_and_passes_the_listener_check() {
        let yaml = include_str!("../deploy/kubernetes/configmap.yaml");
        let docs = yaml_rust2::YamlLoader::load_from_str(yaml).unwrap();
        let text = docs[0]["data"]["config.toml"]
            .as_str()
            .expect("data.config.toml");
        let c = Config::parse(text).unwrap();
        let addr = c.tcp_listen.expect("tcp_listen");
        assert!(!addr.ip().is_loopback() && c.tcp_tls);
        crate::daemon::check_tcp_listen(&c).unwrap();
        assert_eq!(c.accel, AccelSetting::Kvm);
        assert_eq!(c.shutdown, ShutdownMode::Pause);
        assert_eq!(c.artifacts.as_deref(), Some(Path::new("/opt/tryboxi")));
        // The same file with a typo is refused, as the daemon would refuse to start.
        assert!(Config::parse(&text.replace("tcp_tls", "tcp_tsl")).is_err());
    }

    #[test]
    fn keys_parse() {
        let c = Config::parse(
            "tcp_listen = \"127.0.0.1:7070\"\naccel = \"tcg\"\ndefault_memory_mib = 512",
        )
        .unwrap();
        assert_eq!(c.tcp_listen.unwrap().port(), 7070);
        assert_eq!(c.accel, AccelSetting::Tcg);
        assert_eq!(c.default_memory_mib, 512);
    }
}
