//! Prometheus metrics: the `metrics` facade with `metrics-exporter-prometheus` as the
//! process-wide recorder, rendered on `GET /metrics` (text format 0.0.4).
//!
//! Owns: the metric names (constants below, so call sites and the dashboard agree), the
//! histogram buckets, and the gauges computed at scrape time (sandboxes by state, VM memory,
//! the daemon's own RSS). Never: serves HTTP (that is `daemon`) or reads the store by itself
//! (the service hands it a snapshot).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Sandboxes by state (`state` = creating, ready, failed, removing). Gauge.
pub const SANDBOXES: &str = "tryboxi_sandboxes";
/// Sandbox creates by `outcome` (ok, error). Counter.
pub const CREATES: &str = "tryboxi_sandbox_creates_total";
/// From create request to agent answering, by `accel`. Histogram, seconds.
pub const BOOT_SECONDS: &str = "tryboxi_boot_duration_seconds";
/// Execs by `outcome` (ok, nonzero, signal, timeout, error). Counter.
pub const EXECS: &str = "tryboxi_execs_total";
/// Exec wall time, start to exit. Histogram, seconds.
pub const EXEC_SECONDS: &str = "tryboxi_exec_duration_seconds";
/// Output bytes by `stream` (stdout, stderr). Counter.
pub const EXEC_OUTPUT_BYTES: &str = "tryboxi_exec_output_bytes_total";
/// Memory of running VMs by `kind`: `configured` (guest RAM) and `resident` (QEMU RSS). Gauge.
pub const VM_MEMORY: &str = "tryboxi_vm_memory_bytes";
/// The daemon's own resident set size. Gauge.
pub const DAEMON_RSS: &str = "tryboxi_daemon_resident_memory_bytes";
/// The daemon's heap by `kind`: `in_use` (allocated) and `free` (held by the allocator, not
/// yet given back to the system): what of [`DAEMON_RSS`] is live data and what is slack. Gauge.
pub const DAEMON_HEAP: &str = "tryboxi_daemon_heap_bytes";
/// Bytes in the store's page cache (bounded by its configured size). Gauge.
pub const STORE_CACHE: &str = "tryboxi_store_cache_bytes";
/// Bytes of VM files that diffs, applies and pulls hold in memory (small files; bounded by
/// `workspace::spill::MEM_TOTAL`, the rest goes to spill files). Gauge.
pub const DIFF_MEMORY: &str = "tryboxi_diff_memory_bytes";
/// Errors by `kind` (every [`ErrorKind`], exported at 0 from the start). Counter.
pub const ERRORS: &str = "tryboxi_errors_total";
/// Events recorded by `type`. Counter.
pub const EVENTS: &str = "tryboxi_events_total";
/// Workspace sync: bytes and files sent into VMs, at create and before each exec (and on
/// `POST /v1/sandboxes/{id}/sync`). Counters.
pub const SYNC_BYTES: &str = "tryboxi_sync_bytes_total";
pub const SYNC_FILES: &str = "tryboxi_sync_files_total";
/// Workspace syncs done (a sync that sent nothing counts too). Counter.
pub const SYNCS: &str = "tryboxi_syncs_total";
/// Host ledger (scheduler): `resource` = vcpus|memory_mib, `kind` = reserved|capacity. vCPU
/// capacity is the overcommitted cap; memory capacity is `[limits] max_memory_mib`, else
/// MemTotal minus `memory_reserve_mib` (memory is admitted by use: `GET /v1/health`).
pub const HOST_LEDGER: &str = "tryboxi_host_ledger";
/// Requests waiting in the scheduler's queue.
pub const SCHED_QUEUED: &str = "tryboxi_scheduler_queued";
/// Guest network flows by `verdict` (allowed, denied, upstream_failed) and `proto`. Counter.
pub const NET_FLOWS: &str = "tryboxi_network_flows_total";
/// Bytes relayed for guests by `direction` (up, down). Counter.
pub const NET_BYTES: &str = "tryboxi_network_bytes_total";
/// Sandbox resolver queries by `outcome` (answered, denied, rebinding, nodata, servfail). Counter.
pub const NET_DNS: &str = "tryboxi_network_dns_queries_total";
/// Warm-pool VMs (started from a golden snapshot) waiting to be taken by a create. Gauge.
pub const POOL_READY: &str = "tryboxi_pool_ready";
/// Network events dropped by the per-sandbox rate limit (counted, not recorded). Counter.
pub const NET_EVENTS_SUPPRESSED: &str = "tryboxi_network_events_suppressed_total";

/// What `tryboxi_errors_total` counts, as its `kind` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A create failed (boot, agent or first sync).
    BootFailed,
    /// A ready sandbox failed (VM died, agent link broke, lost over a restart).
    SandboxFailed,
    /// An exec ended without an exit status (VM or agent lost).
    ExecLost,
    /// A workspace sync failed.
    SyncFailed,
    /// A batch of traces could not be exported over OTLP.
    OtlpExport,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::BootFailed,
        ErrorKind::SandboxFailed,
        ErrorKind::ExecLost,
        ErrorKind::SyncFailed,
        ErrorKind::OtlpExport,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BootFailed => "boot_failed",
            ErrorKind::SandboxFailed => "sandbox_failed",
            ErrorKind::ExecLost => "exec_lost",
            ErrorKind::SyncFailed => "sync_failed",
            ErrorKind::OtlpExport => "otlp_export",
        }
    }
}

/// The Prometheus text exposition content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const BOOT_BUCKETS: &[f64] = &[0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0];
const EXEC_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Install the process-wide recorder once (later calls reuse it). `None` when another
/// recorder was installed first (then `/metrics` says so instead of lying).
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(BOOT_SECONDS.into()), BOOT_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(EXEC_SECONDS.into()), EXEC_BUCKETS)
                })
                .map(|b| b.build_recorder());
            let recorder = match recorder {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(error = %e, "cannot build the metrics recorder");
                    return None;
                }
            };
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    describe();
                    // Known error kinds exist at 0 (an error panel shows "none", not "no data").
                    for k in ErrorKind::ALL {
                        metrics::counter!(ERRORS, "kind" => k.as_str()).increment(0);
                    }
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a metrics recorder is already installed");
                    None
                }
            }
        })
        .as_ref()
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(SANDBOXES, "Sandboxes by lifecycle state");
    describe_counter!(CREATES, "Sandbox creates by outcome");
    describe_histogram!(BOOT_SECONDS, Unit::Seconds, "Sandbox create to agent ready");
    describe_gauge!(
        DAEMON_HEAP,
        Unit::Bytes,
        "The daemon's heap by kind: in use, or free but still held"
    );
    describe_gauge!(STORE_CACHE, Unit::Bytes, "Bytes in the store's page cache");
    describe_gauge!(
        DIFF_MEMORY,
        Unit::Bytes,
        "Bytes of VM files diffs, applies and pulls hold in memory"
    );
    describe_counter!(EXECS, "Execs by outcome");
    describe_histogram!(EXEC_SECONDS, Unit::Seconds, "Exec wall time, start to exit");
    describe_counter!(
        EXEC_OUTPUT_BYTES,
        Unit::Bytes,
        "Exec output bytes by stream"
    );
    describe_gauge!(
        VM_MEMORY,
        Unit::Bytes,
        "Memory of running VMs (configured guest RAM, QEMU resident)"
    );
    describe_gauge!(DAEMON_RSS, Unit::Bytes, "Resident memory of the daemon");
    describe_counter!(ERRORS, "Errors by kind");
    describe_counter!(EVENTS, "Events recorded by type");
    describe_counter!(SYNC_BYTES, Unit::Bytes, "Bytes synced into sandboxes");
    describe_counter!(SYNC_FILES, "Files synced into sandboxes");
    describe_counter!(SYNCS, "Workspace syncs into sandboxes");
    describe_gauge!(
        HOST_LEDGER,
        "Host vCPUs and configured memory held by VMs, and the capacity"
    );
    describe_gauge!(
        SCHED_QUEUED,
        "Create/restore/fork requests waiting for host capacity"
    );
    describe_gauge!(POOL_READY, "Warm-pool VMs waiting to be taken by a create");
    describe_counter!(NET_FLOWS, "Guest network flows by verdict and protocol");
    describe_counter!(
        NET_BYTES,
        Unit::Bytes,
        "Bytes relayed for guests by direction"
    );
    describe_counter!(NET_DNS, "Sandbox resolver queries by outcome");
    describe_counter!(
        NET_EVENTS_SUPPRESSED,
        "Network events dropped by the per-sandbox rate limit"
    );
}

/// What the service knows at scrape time.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// (state, count) for every state, zeros included.
    pub sandboxes_by_state: Vec<(&'static str, usize)>,
    /// Guest RAM of running VMs, bytes.
    pub vm_configured_bytes: u64,
    /// QEMU processes' pids, for their resident memory.
    pub vm_pids: Vec<u32>,
    /// Scheduler ledger: (held vCPUs, vCPU cap, configured MiB held, memory capacity MiB, queued).
    pub ledger: Option<(u32, u32, u64, u64, usize)>,
    /// Warm-pool VMs waiting, all templates and shapes together.
    pub pool_ready: usize,
    /// Bytes in the store's page cache.
    pub store_cache_bytes: Option<u64>,
}

/// Set the scrape-time gauges, then render the text exposition.
pub fn render(snap: &Snapshot) -> Option<String> {
    let handle = install()?;
    for (state, n) in &snap.sandboxes_by_state {
        metrics::gauge!(SANDBOXES, "state" => *state).set(*n as f64);
    }
    metrics::gauge!(VM_MEMORY, "kind" => "configured").set(snap.vm_configured_bytes as f64);
    let resident: u64 = snap
        .vm_pids
        .iter()
        .filter_map(|p| rss_bytes(&p.to_string()))
        .sum();
    metrics::gauge!(VM_MEMORY, "kind" => "resident").set(resident as f64);
    if let Some((rv, cv, rm, cm, q)) = snap.ledger {
        for (resource, kind, v) in [
            ("vcpus", "reserved", rv as f64),
            ("vcpus", "capacity", cv as f64),
            ("memory_mib", "reserved", rm as f64),
            ("memory_mib", "capacity", cm as f64),
        ] {
            metrics::gauge!(HOST_LEDGER, "resource" => resource, "kind" => kind).set(v);
        }
        metrics::gauge!(SCHED_QUEUED).set(q as f64);
    }
    metrics::gauge!(POOL_READY).set(snap.pool_ready as f64);
    if let Some(own) = rss_bytes("self") {
        metrics::gauge!(DAEMON_RSS).set(own as f64);
    }
    let (in_use, free) = heap_bytes();
    metrics::gauge!(DAEMON_HEAP, "kind" => "in_use").set(in_use as f64);
    metrics::gauge!(DAEMON_HEAP, "kind" => "free").set(free as f64);
    if let Some(b) = snap.store_cache_bytes {
        metrics::gauge!(STORE_CACHE).set(b as f64);
    }
    metrics::gauge!(DIFF_MEMORY).set(crate::workspace::spill::memory_used() as f64);
    handle.run_upkeep();
    Some(handle.render())
}

/// Count one error of `kind`.
pub fn error(kind: ErrorKind) {
    metrics::counter!(ERRORS, "kind" => kind.as_str()).increment(1);
}

/// Count a workspace sync that sent `bytes` in `files` files (both may be 0).
pub fn record_sync(bytes: u64, files: u64) {
    metrics::counter!(SYNCS).increment(1);
    metrics::counter!(SYNC_BYTES).increment(bytes);
    metrics::counter!(SYNC_FILES).increment(files);
}

/// Resident set size of `/proc/<pid>` in bytes (from `VmRSS`), if readable.
/// The allocator's (in use, free but held) bytes: the main heap and every arena, plus the
/// large blocks it maps on their own.
fn heap_bytes() -> (u64, u64) {
    // SAFETY: `mallinfo2` takes no arguments, only reads glibc's allocator counters (under its
    // own locks) and returns them by value.
    let m = unsafe { libc::mallinfo2() };
    ((m.uordblks + m.hblkhd) as u64, m.fordblks as u64)
}

fn rss_bytes(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss(&status)
}

fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_from_proc_status_in_kib() {
        assert_eq!(
            parse_vm_rss("Name:\tqemu\nVmRSS:\t  2048 kB\nVmSwap: 0 kB\n"),
            Some(2048 * 1024)
        );
        assert_eq!(parse_vm_rss("Name:\tkthread\n"), None);
        assert!(rss_bytes("self").is_some_and(|b| b > 0));
    }

    #[test]
    fn render_shows_scrape_time_gauges_and_counters() {
        let snap = Snapshot {
            sandboxes_by_state: vec![("ready", 2), ("failed", 0)],
            vm_configured_bytes: 512 << 20,
            vm_pids: vec![std::process::id()],
            ledger: Some((2, 8, 1024, 4096, 1)),
            pool_ready: 3,
            store_cache_bytes: Some(12_345),
        };
        install().expect("recorder installed");
        error(ErrorKind::OtlpExport);
        let text = render(&snap).expect("recorder installed");
        assert!(
            text.contains("tryboxi_host_ledger{resource=\"memory_mib\",kind=\"capacity\"} 4096"),
            "{text}"
        );
        assert!(text.contains("tryboxi_scheduler_queued 1"), "{text}");
        assert!(text.contains("tryboxi_pool_ready 3"), "{text}");
        assert!(
            text.contains("tryboxi_sandboxes{state=\"ready\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("tryboxi_errors_total{kind=\"otlp_export\"}"),
            "{text}"
        );
        assert!(
            text.contains("tryboxi_vm_memory_bytes{kind=\"configured\"} 536870912"),
            "{text}"
        );
        assert!(text.contains("tryboxi_store_cache_bytes 12345"), "{text}");
        assert!(text.contains("tryboxi_diff_memory_bytes "), "{text}");
        // This test process has allocated: the allocator's counters are read.
        let in_use = text
            .lines()
            .find_map(|l| l.strip_prefix("tryboxi_daemon_heap_bytes{kind=\"in_use\"} "))
            .and_then(|v| v.parse::<f64>().ok())
            .expect("heap in use exported");
        assert!(in_use > 0.0, "{text}");
        assert!(
            text.contains("tryboxi_daemon_heap_bytes{kind=\"free\"}"),
            "{text}"
        );
    }

    /// The two copies of the dashboard (for importing, and provisioned by the compose recipe).
    const DASHBOARDS: [&str; 2] = [
        include_str!("../../deploy/grafana/tryboxi.json"),
        include_str!("../../deploy/observability/grafana-dashboard.json"),
    ];

    /// The metric names a dashboard's panel queries use (histogram series by their base name).
    fn dashboard_metrics(dash: &str) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(dash).expect("dashboard JSON");
        let re = regex::Regex::new(r"tryboxi_[a-z_]+").unwrap();
        let mut names: Vec<String> = Vec::new();
        for p in v["panels"].as_array().expect("panels") {
            for t in p["targets"].as_array().into_iter().flatten() {
                for m in re.find_iter(t["expr"].as_str().unwrap_or_default()) {
                    let n = m.as_str();
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| n.strip_suffix(s))
                        .filter(|b| *b == BOOT_SECONDS || *b == EXEC_SECONDS)
                        .unwrap_or(n);
                    if !names.iter().any(|x| x == base) {
                        names.push(base.to_owned());
                    }
                }
            }
        }
        names
    }

    #[test]
    fn the_grafana_dashboard_only_queries_metrics_that_exist() {
        let known = [
            SANDBOXES,
            CREATES,
            BOOT_SECONDS,
            EXECS,
            EXEC_SECONDS,
            EXEC_OUTPUT_BYTES,
            VM_MEMORY,
            DAEMON_RSS,
            ERRORS,
            EVENTS,
            SYNC_BYTES,
            SYNC_FILES,
            SYNCS,
            NET_FLOWS,
            NET_BYTES,
            NET_DNS,
        ];
        for dash in DASHBOARDS {
            let used = dashboard_metrics(dash);
            for name in &used {
                assert!(
                    known.contains(&name.as_str()),
                    "the dashboard queries unknown metric `{name}`"
                );
            }
            for k in known {
                assert!(used.iter().any(|u| u == k), "no panel shows `{k}`");
            }
        }
    }

    #[test]
    fn both_dashboard_copies_show_the_same_panels() {
        let panels = |d: &str| {
            let mut v: serde_json::Value = serde_json::from_str(d).unwrap();
            let mut p = v["panels"].take();
            for x in p.as_array_mut().unwrap() {
                x.as_object_mut().unwrap().remove("datasource");
            }
            p
        };
        assert_eq!(panels(DASHBOARDS[0]), panels(DASHBOARDS[1]));
    }

    #[test]
    fn every_error_kind_is_exported_from_the_start() {
        install().expect("recorder installed");
        let text = render(&Snapshot::default()).expect("recorder installed");
        for k in ErrorKind::ALL {
            assert!(
                text.contains(&format!("tryboxi_errors_total{{kind=\"{}\"}}", k.as_str())),
                "{k:?} missing from {text}"
            );
        }
    }
}
