//! The metrics history behind `get_metrics(start, end)`: every [`EVERY`] (5 s, as E2B samples)
//! one sample of each running sandbox the E2B face created, the last [`KEEP`] (an hour) kept in
//! memory per sandbox, dropped with its E2B record.
//!
//! Measured from the host, so an idle guest is never woken to be measured (a guest-side probe
//! every 5 s would be an exec in every sandbox, against the density rule that idle guests cost
//! nothing):
//! - CPU: the QEMU process's CPU time (`/proc/PID/stat` utime + stime) over the wall time since
//!   the previous sample (the first: since QEMU started), per vCPU, 0-100 %;
//! - memory: the guest RAM that holds data (its RAM file's `SEEK_DATA` extents: pages the
//!   guest wrote, its page cache included, less what it freed and reported), or for a clone on
//!   a borrowed RAM file its QEMU's resident size; at most its memory size; no cache figure;
//! - disk: the allocated blocks of its root disk's chain (base image and layers) against the
//!   disk's virtual size from the top layer's header.
//!
//! Owns: the per-sandbox rings, the sampler task and reading one sample. Never: the HTTP shape
//! (`metrics.rs`). Bounded: [`KEEP`] samples per sandbox, sandboxes bounded by the store.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::Face;
use super::metrics::Sample;

/// How often each running sandbox is sampled.
pub const EVERY: Duration = Duration::from_secs(5);
/// Samples kept per sandbox (an hour at [`EVERY`]).
pub const KEEP: usize = 720;
/// Longest disk chain walked (a chain grows by one layer per checkpoint).
const MAX_CHAIN: usize = 256;

/// A running sandbox's VM, as the sampler reads it.
#[derive(Debug, Clone)]
pub struct VmRef {
    pub pid: u32,
    pub dir: PathBuf,
    pub vcpus: u32,
    pub memory_mib: u32,
}

#[derive(Default)]
struct Track {
    /// (pid, when, CPU ticks then) of the previous reading.
    last_cpu: Option<(u32, Instant, u64)>,
    samples: VecDeque<(u64, Sample)>,
}

/// Every E2B sandbox's samples.
#[derive(Default)]
pub struct History {
    tracks: Mutex<HashMap<String, Track>>,
}

impl History {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Track>> {
        self.tracks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add a sample of `id` taken at `unix` seconds; the oldest goes past [`KEEP`]. One per
    /// second: a sample in the second of the newest replaces it (the on-demand first reading
    /// and the sampler's tick can meet; E2B's samples are keyed by their timestamp).
    pub fn record(&self, id: &str, unix: u64, s: Sample) {
        let mut t = self.lock();
        let track = t.entry(id.to_owned()).or_default();
        if let Some(last) = track.samples.back_mut()
            && last.0 == unix
        {
            last.1 = s;
            return;
        }
        if track.samples.len() >= KEEP {
            track.samples.pop_front();
        }
        track.samples.push_back((unix, s));
    }

    /// The samples of `id` taken from `start` to `end` (unix seconds, both included), oldest
    /// first.
    pub fn range(&self, id: &str, start: Option<u64>, end: Option<u64>) -> Vec<(u64, Sample)> {
        let (lo, hi) = (start.unwrap_or(0), end.unwrap_or(u64::MAX));
        self.lock()
            .get(id)
            .map(|t| {
                t.samples
                    .iter()
                    .filter(|(at, _)| (lo..=hi).contains(at))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Forget every sandbox not in `keep` (its E2B record is gone).
    pub fn retain(&self, keep: &HashSet<String>) {
        self.lock().retain(|id, _| keep.contains(id));
    }

    /// Read `vm` now (blocking: `/proc` and the RAM file), CPU against `id`'s previous reading.
    pub fn read(&self, id: &str, vm: &VmRef) -> Option<Sample> {
        let now = Instant::now();
        let ticks = cpu_ticks(vm.pid)?;
        let prev = self.lock().get(id).and_then(|t| t.last_cpu);
        let hz = clock_ticks_per_second();
        let (used, wall) = match prev {
            Some((pid, at, before)) if pid == vm.pid => (
                ticks.saturating_sub(before) as f64 / hz,
                now.duration_since(at).as_secs_f64(),
            ),
            // The first reading of this QEMU: its average since it started.
            _ => (ticks as f64 / hz, seconds_since_start(vm.pid, hz)?),
        };
        self.lock().entry(id.to_owned()).or_default().last_cpu = Some((vm.pid, now, ticks));
        let s = sample_of(vm, used, wall);
        Some(s)
    }
}

/// The sample of `vm` given `cpu` seconds used over `wall` seconds.
fn sample_of(vm: &VmRef, cpu: f64, wall: f64) -> Sample {
    let cpu_count = u64::from(vm.vcpus.max(1));
    let cpu_used_pct = cpu_pct(cpu, wall, cpu_count);
    let mem_total = u64::from(vm.memory_mib) << 20;
    let ram = vm.dir.join(crate::vmm::qemu::RAM_FILE);
    let mem_used = if ram.exists() {
        crate::vmm::qemu::ramfile::data_bytes(&ram)
    } else {
        crate::service::usage::read_rss_kib(vm.pid).unwrap_or(0) * 1024
    }
    .min(mem_total);
    let (disk_used, disk_total) = disk_use(&vm.dir.join("disk.qcow2"));
    Sample {
        cpu_count,
        cpu_used_pct,
        mem_used,
        mem_total,
        mem_cache: 0,
        disk_used,
        disk_total,
    }
}

/// `cpu` seconds over `wall` seconds on `vcpus`, as a percentage of all of them (0-100).
pub fn cpu_pct(cpu: f64, wall: f64, vcpus: u64) -> f64 {
    if wall <= 0.0 || vcpus == 0 {
        return 0.0;
    }
    (cpu * 100.0 / (wall * vcpus as f64)).clamp(0.0, 100.0)
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f = stat_fields(&stat)?;
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// The fields of a `/proc/PID/stat` line after the command name (field 3, the state, first):
/// the name is in parentheses and may itself hold spaces and parentheses.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

/// Seconds since `pid` started (`starttime`, field 22, against `/proc/uptime`).
fn seconds_since_start(pid: u32, hz: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let start: u64 = stat_fields(&stat)?.get(19)?.parse().ok()?;
    let up: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((up - start as f64 / hz).max(0.0))
}

fn clock_ticks_per_second() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(n)) if n > 0 => n as f64,
        _ => 100.0,
    }
}

/// (allocated bytes of the chain under `top`, its virtual size): what the guest's root disk
/// holds on the host and how big the guest sees it.
pub fn disk_use(top: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    let total = crate::vmm::qcow2::virtual_size(top, "qcow2").unwrap_or(0);
    let mut used = 0u64;
    let mut cur = Some(top.to_owned());
    let mut seen = 0;
    while let Some(layer) = cur {
        if seen == MAX_CHAIN {
            break;
        }
        seen += 1;
        match std::fs::symlink_metadata(&layer) {
            Ok(m) if m.is_file() => used = used.saturating_add(m.blocks() * 512),
            _ => break,
        }
        cur = crate::vmm::qemu::budget::backing_of(&layer);
    }
    (used, total)
}

/// Start the sampler of `face`'s sandboxes; it ends when the face is dropped.
pub fn spawn(face: &Arc<Face>) {
    let weak: Weak<Face> = Arc::downgrade(face);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(face) = weak.upgrade() else { return };
            let Ok(all) = face.svc.e2b_list() else {
                continue;
            };
            let keep: HashSet<String> = all.iter().map(|(r, _)| r.sandbox_id.clone()).collect();
            face.history.retain(&keep);
            let running: Vec<(String, VmRef)> = all
                .iter()
                .filter_map(|(r, sbx)| Some((r.sandbox_id.clone(), face.svc.e2b_vm(sbx)?)))
                .collect();
            let f = face.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let unix = crate::service::e2b::unix_now();
                for (id, vm) in running {
                    if let Some(s) = f.history.read(&id, &vm) {
                        f.history.record(&id, unix, s);
                    }
                }
            })
            .await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(pct: f64) -> Sample {
        Sample {
            cpu_count: 1,
            cpu_used_pct: pct,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 0,
            disk_used: 1,
            disk_total: 2,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_hour_and_ranges_include_both_ends() {
        let h = History::default();
        for i in 0..(KEEP as u64 + 10) {
            h.record("a", 1000 + i * 5, s(i as f64));
        }
        let all = h.range("a", None, None);
        assert_eq!(all.len(), KEEP);
        assert_eq!(all[0].0, 1000 + 10 * 5, "the oldest went first");
        let some = h.range("a", Some(1100), Some(1110));
        assert_eq!(
            some.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            [1100, 1105, 1110]
        );
        assert!(h.range("a", Some(1), Some(2)).is_empty());
        assert!(h.range("other", None, None).is_empty());
        h.retain(&HashSet::from(["b".to_owned()]));
        assert!(h.range("a", None, None).is_empty());
    }

    #[test]
    fn one_sample_per_second_the_newest_wins() {
        let h = History::default();
        h.record("a", 1000, s(1.0));
        h.record("a", 1000, s(2.0));
        h.record("a", 1001, s(3.0));
        let all = h.range("a", Some(1000), Some(1000));
        assert_eq!(all.len(), 1, "a range of one second has one sample");
        assert_eq!(all[0].1.cpu_used_pct, 2.0);
        assert_eq!(h.range("a", None, None).len(), 2);
    }

    #[test]
    fn cpu_percent_is_per_vcpu_and_clamped() {
        assert_eq!(cpu_pct(1.0, 2.0, 1), 50.0);
        assert_eq!(cpu_pct(1.0, 2.0, 2), 25.0);
        assert_eq!(cpu_pct(9.0, 2.0, 2), 100.0);
        assert_eq!(cpu_pct(1.0, 0.0, 1), 0.0);
    }

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let line = "42 (qemu) x (y)) S 1 42 42 0 -1 4194560 100 0 0 0 700 300 0 0 20 0 3 0 \
                    5000 1000 100";
        let f = stat_fields(line).unwrap();
        assert_eq!(f[0], "S");
        assert_eq!((f[11], f[12]), ("700", "300"));
        assert_eq!(f[19], "5000");
    }

    #[test]
    fn this_process_reads_as_a_vm() {
        let h = History::default();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmRef {
            pid: std::process::id(),
            dir: dir.path().to_owned(),
            vcpus: 1,
            memory_mib: 1 << 20,
        };
        // Burn some CPU so the second reading has something to show.
        let first = h.read("x", &vm).unwrap();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(300) {
            x = x.wrapping_mul(31).wrapping_add(1);
        }
        std::hint::black_box(x);
        let second = h.read("x", &vm).unwrap();
        assert!((0.0..=100.0).contains(&first.cpu_used_pct), "{first:?}");
        assert!(second.cpu_used_pct > 20.0, "{second:?}");
        // No RAM file: its resident size.
        assert!(second.mem_used > 0 && second.mem_used < second.mem_total);
        // No disk: nothing.
        assert_eq!((second.disk_used, second.disk_total), (0, 0));
    }

    #[test]
    fn a_disk_chain_adds_its_layers_and_takes_the_top_size() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.img");
        std::fs::write(&base, vec![1u8; 64 << 10]).unwrap();
        let top = dir.path().join("disk.qcow2");
        crate::vmm::qcow2::create_overlay(&base, "raw", &top).unwrap();
        let (used, total) = disk_use(&top);
        assert_eq!(total, 64 << 10);
        let top_blocks = {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(&top).unwrap().blocks() * 512
        };
        assert!(used >= top_blocks + (64 << 10), "{used}");
    }
}
