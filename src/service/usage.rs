//! What VMs really use and what the host has left: the scheduler's memory and CPU accounting.
//!
//! Owns: reading `/proc/PID/smaps_rollup` (a QEMU's PSS), `/proc/meminfo` and
//! `/proc/pressure/cpu`; the pure rules of how much memory a VM counts for, how much room the
//! host has for a new one, and whether the host is CPU saturated; the sampler task that feeds
//! every VM's measured use to the ledger (reading PSS only when a VM's resident size moved or
//! a minute passed: PSS walks the page tables, so idle VMs must not pay it every tick).
//! Never: grants or refuses anything itself (the ledger does, `scheduler.rs`).
//!
//! Memory rules (see docs/ARCHITECTURE.md, "Scheduler"):
//! - a measured VM counts for `min(size, PSS + headroom)`: PSS splits pages shared by several
//!   QEMUs (fork children mapping one frozen RAM file, copy-on-write) between them, so the sum
//!   over VMs is what they really hold; a VM never counts for more than its configured size;
//! - a VM not measured yet counts for `min(size, new_vm)`; one whose use cannot be read counts
//!   for its whole size;
//! - guest RAM is a file mapping whose pages `MemAvailable` calls available (the kernel could
//!   write them back), so the part of what a VM counts for that is not anonymous or shmem
//!   (`outstanding`) is taken off `MemAvailable` too;
//! - room for a new VM = `MemAvailable - reserve - sum(outstanding)`; it is admitted when its
//!   expected use (`min(size, new_vm)`) fits.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Service;

/// What one QEMU holds, from its `smaps_rollup`, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmUse {
    /// Proportional set size: its private pages plus its share of the shared ones.
    pub pss_mib: u64,
    /// The part of PSS the kernel cannot drop (anonymous and shmem pages); the rest is file
    /// pages (the guest's RAM file) that `MemAvailable` counts as available.
    pub pinned_mib: u64,
}

/// A VM's memory use as the ledger knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Usage {
    /// Admitted, not measured yet (starting, or between two samples).
    #[default]
    Pending,
    Measured(VmUse),
    /// Its process could not be read: it counts for its whole size.
    Unreadable,
}

impl Usage {
    pub fn pss_mib(self) -> Option<u64> {
        match self {
            Usage::Measured(u) => Some(u.pss_mib),
            _ => None,
        }
    }
    fn pinned_mib(self) -> u64 {
        match self {
            Usage::Measured(u) => u.pinned_mib,
            _ => 0,
        }
    }
}

/// `smaps_rollup` text -> PSS and its pinned part. Kernels without `Pss_Anon` (before 5.x)
/// count all of PSS as pinned (the cautious side).
pub fn parse_smaps_rollup(text: &str) -> Option<VmUse> {
    let kib = |field: &str| {
        text.lines()
            .find(|l| l.split(':').next() == Some(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let pss = kib("Pss")?;
    let pinned = match (kib("Pss_Anon"), kib("Pss_Shmem")) {
        (Some(a), s) => a + s.unwrap_or(0),
        (None, _) => pss,
    };
    Some(VmUse {
        pss_mib: pss.div_ceil(1024),
        pinned_mib: pinned.div_ceil(1024).min(pss.div_ceil(1024)),
    })
}

/// One field (`avg10`, `avg60`, ...) of one line (`some`, `full`) of a PSI file.
pub fn parse_psi(text: &str, line: &str, field: &str) -> Option<f64> {
    let l = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(line))?;
    l.split_whitespace()
        .find_map(|f| f.strip_prefix(field)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// The use of QEMU `pid` now.
pub fn read_vm_use(pid: u32) -> Usage {
    match std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
        Ok(t) => parse_smaps_rollup(&t).map_or(Usage::Unreadable, Usage::Measured),
        Err(_) => Usage::Unreadable,
    }
}

/// One reading of the host, for admission. `None`: not known (no such file).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HostReading {
    pub total_mib: Option<u64>,
    pub available_mib: Option<u64>,
    /// PSI `some avg60` of `/proc/pressure/cpu`; `None` without PSI.
    pub cpu_some_avg60: Option<f64>,
}

/// Where the ledger reads the host (a fake in tests).
pub trait HostProbe: Send + Sync {
    fn read(&self) -> HostReading;
}

/// The real host: `/proc/meminfo` and `/proc/pressure/cpu`.
pub struct ProcHost;

impl HostProbe for ProcHost {
    fn read(&self) -> HostReading {
        let mi = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        HostReading {
            total_mib: super::pressure::parse_meminfo_mib(&mi, "MemTotal"),
            available_mib: super::pressure::parse_meminfo_mib(&mi, "MemAvailable"),
            cpu_some_avg60: cpu_psi_now(),
        }
    }
}

/// PSI `some avg60` of `/proc/pressure/cpu`, if the host has it.
pub fn cpu_psi_now() -> Option<f64> {
    std::fs::read_to_string("/proc/pressure/cpu")
        .ok()
        .and_then(|t| parse_psi(&t, "some", "avg60"))
}

/// The memory and CPU rules, from `[limits]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemPolicy {
    /// MiB kept free for the daemon and the host.
    pub reserve_mib: u64,
    /// Growth a measured VM counts for on top of its PSS.
    pub headroom_mib: u64,
    /// What a VM counts for until measured.
    pub new_vm_mib: u64,
    /// PSI `some avg60` at or above which the host is CPU saturated; 0 = ignore.
    pub cpu_psi_limit: f64,
}

impl MemPolicy {
    pub fn from_limits(l: &crate::config::LimitsConfig) -> MemPolicy {
        MemPolicy {
            reserve_mib: l.memory_reserve_mib,
            headroom_mib: l.memory_headroom_mib,
            new_vm_mib: l.memory_new_vm_mib,
            cpu_psi_limit: l.cpu_pressure_psi_avg60,
        }
    }

    /// What a VM of `size_mib` counts for now.
    pub fn counted(&self, size_mib: u64, u: Usage) -> u64 {
        match u {
            Usage::Pending => self.expected(size_mib),
            Usage::Measured(m) => m.pss_mib.saturating_add(self.headroom_mib).min(size_mib),
            Usage::Unreadable => size_mib,
        }
    }

    /// The part of [`MemPolicy::counted`] that `MemAvailable` does not already miss.
    pub fn outstanding(&self, size_mib: u64, u: Usage) -> u64 {
        self.counted(size_mib, u).saturating_sub(u.pinned_mib())
    }

    /// What a new VM of `size_mib` is expected to use at first.
    pub fn expected(&self, size_mib: u64) -> u64 {
        size_mib.min(self.new_vm_mib)
    }

    /// Room for new VMs: `available + credit - reserve - outstanding`, where `credit` is
    /// memory about to be freed (VMs being stopped).
    pub fn room(&self, available_mib: u64, outstanding_mib: u64, credit_mib: u64) -> u64 {
        available_mib
            .saturating_add(credit_mib)
            .saturating_sub(self.reserve_mib.saturating_add(outstanding_mib))
    }

    /// The most memory all VMs together could ever count for: MemTotal minus the reserve.
    pub fn usable(&self, total_mib: u64) -> u64 {
        total_mib.saturating_sub(self.reserve_mib)
    }

    /// Whether `psi` (PSI `some avg60`, `None` without PSI) means the host is CPU saturated.
    pub fn cpu_saturated(&self, psi: Option<f64>) -> bool {
        self.cpu_psi_limit > 0.0 && psi.is_some_and(|p| p >= self.cpu_psi_limit)
    }
}

/// How often the sampler looks at the VMs (and queued requests at the host again).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// A VM's PSS is read again when its resident size moved by this much since the last read...
const RESAMPLE_RSS_KIB: u64 = 16 << 10;
/// ...or this long after it (pages shared with other VMs come and go with them).
const RESAMPLE_AFTER: Duration = Duration::from_secs(60);

/// Resident size of `pid` in KiB from `/proc/PID/statm` (a counter: cheap, unlike PSS, which
/// walks the page tables: about 30 µs per MiB resident).
pub fn read_rss_kib(pid: u32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = t.split_whitespace().nth(1)?.parse().ok()?;
    // 4 KiB pages: the x86_64 hosts tryboxi runs on.
    Some(pages * 4)
}

struct Cached {
    pid: u32,
    rss_kib: Option<u64>,
    at: Instant,
    usage: Usage,
}

/// Which VMs to measure again: a VM's PSS is read when it is new (or a new process), when its
/// resident size moved by [`RESAMPLE_RSS_KIB`], or [`RESAMPLE_AFTER`] after the last read; an
/// idle VM costs a `statm` read per tick.
#[derive(Default)]
pub struct Sampler {
    cache: HashMap<String, Cached>,
}

impl Sampler {
    /// Every VM's use now, reading with `rss` (cheap) and `pss` (dear) only as needed.
    pub fn sample(
        &mut self,
        vms: &[(String, u32)],
        now: Instant,
        rss: impl Fn(u32) -> Option<u64>,
        pss: impl Fn(u32) -> Usage,
    ) -> Vec<(String, Usage)> {
        self.cache.retain(|id, _| vms.iter().any(|(v, _)| v == id));
        vms.iter()
            .map(|(id, pid)| {
                let r = rss(*pid);
                let stale = match self.cache.get(id) {
                    None => true,
                    Some(c) => {
                        c.pid != *pid
                            || now.duration_since(c.at) >= RESAMPLE_AFTER
                            || match (c.rss_kib, r) {
                                (Some(a), Some(b)) => a.abs_diff(b) >= RESAMPLE_RSS_KIB,
                                _ => true,
                            }
                    }
                };
                if stale {
                    let usage = pss(*pid);
                    self.cache.insert(
                        id.clone(),
                        Cached {
                            pid: *pid,
                            rss_kib: r,
                            at: now,
                            usage,
                        },
                    );
                }
                (id.clone(), self.cache[id].usage)
            })
            .collect()
    }
}

/// Start the sampler: every [`SAMPLE_EVERY`] it measures each running QEMU (sandboxes and
/// warm-pool VMs; see [`Sampler`]) and hands the uses to the ledger, which then serves the
/// queue if the host has room. Ends when the service is dropped.
pub fn spawn_sampler(svc: &Arc<Service>) {
    let weak: Weak<Service> = Arc::downgrade(svc);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let sampler = Arc::new(std::sync::Mutex::new(Sampler::default()));
        loop {
            tick.tick().await;
            let Some(svc) = weak.upgrade() else { return };
            let vms = svc.vm_pids();
            drop(svc);
            let s = sampler.clone();
            let Ok(samples) = tokio::task::spawn_blocking(move || {
                let mut s = s.lock().unwrap_or_else(|p| p.into_inner());
                s.sample(&vms, Instant::now(), read_rss_kib, read_vm_use)
            })
            .await
            else {
                continue;
            };
            let Some(svc) = weak.upgrade() else { return };
            svc.ledger.record_usage(&samples);
            let rams = svc.own_ram_files();
            drop(svc);
            if !rams.is_empty() {
                let _ = tokio::task::spawn_blocking(move || rereserve_ram(&rams)).await;
            }
        }
    });
}

/// Whether a minute passed since the last RAM reserve warning (and note this one).
fn warn_due() -> bool {
    static LAST: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
    if due {
        *last = Some(Instant::now());
    }
    due
}

/// Reserve again what free page reporting gave back of each running VM's own RAM file
/// (`reserve_ram_on_disk`; see `ramfile::rereserve` and docs/VMM.md, "Free page reporting"):
/// the fallback where QEMU's discards could not be turned into zero ranges
/// (`vmm::qemu::discard`: a tmpfs data root, a kernel without the filter).
/// Skips a QEMU that has exited since the list was made: a VM paused to disk gives its reserve
/// back on purpose. Costs an `fstat` per VM when nothing was discarded.
pub fn rereserve_ram(rams: &[(u32, std::path::PathBuf)]) {
    for (pid, ram) in rams {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match crate::vmm::qemu::ramfile::rereserve(ram) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(pid, ram = %ram.display(), bytes = n, "RAM reserve restored"),
            // At most one warning a minute: a full disk fails this every tick for every VM.
            Err(e) if warn_due() => tracing::warn!(
                pid,
                ram = %ram.display(),
                error = %e,
                "cannot reserve the RAM the guest gave back: a first touch of it on a full disk \
                 would stop the VM"
            ),
            Err(e) => {
                tracing::debug!(pid, ram = %ram.display(), error = %e, "RAM reserve not restored")
            }
        }
    }
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
