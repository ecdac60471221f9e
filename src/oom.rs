//! Who the kernel's out-of-memory killer picks: never the daemon if it can help it, a sandbox's
//! QEMU first.
//!
//! Owns: the daemon's `oom_score_adj` (set once at `serve` start: [`DAEMON_OOM_SCORE_ADJ`]
//! (-900) with `CAP_SYS_RESOURCE`, else the lowest the kernel lets this user set), the value
//! every QEMU sets for itself before `exec` ([`QEMU_OOM_SCORE_ADJ`]) and the value every other
//! child the daemon spawns (git, mke2fs, debugfs, qemu-img, probes) starts with
//! ([`CHILD_OOM_SCORE_ADJ`], through [`ResetOomScore`]): a child inherits its parent's score,
//! and raising one's own value needs no privilege.
//! Also tells who sent a SIGKILL tryboxi did not send ([`sigkill_cause`]): the kernel's OOM
//! killer when `/proc/vmstat`'s `oom_kill` counter moved while the QEMU ran, another process
//! otherwise.
//! Also gives the daemon's free heap pages back to the system once a minute
//! ([`spawn_heap_trim`]): glibc keeps freed memory in its per-thread arenas, and under
//! sustained load that slack was a third of the daemon's RSS growth (BENCHMARKS.md, row (n)).
//! Never: changes the score of any other process.
//!
//! Why -900 and not -1000: -1000 exempts the daemon from the OOM killer entirely, so a daemon
//! that itself runs away with memory (a bug, or an input that gets past a bound) would have
//! the kernel kill every other process of the host, and panic when none is left. At -900 the
//! daemon is still picked after everything else unless it alone holds over 90% of memory.

use std::io::Write;

/// What a sandbox's QEMU sets for itself: a guest that fills its RAM is killed before the host's
/// other processes (and long before the daemon).
pub const QEMU_OOM_SCORE_ADJ: i32 = 500;
/// What every other child of the daemon starts with: the kernel's default, as if started from
/// a shell (never the daemon's protection).
pub const CHILD_OOM_SCORE_ADJ: i32 = 0;
/// What the daemon asks for itself (see the module docs for why not -1000).
pub const DAEMON_OOM_SCORE_ADJ: i32 = -900;

const SELF_PATH: &str = "/proc/self/oom_score_adj";

/// `/proc/self/oom_score_adj` now.
pub fn current() -> std::io::Result<i32> {
    let s = std::fs::read_to_string(SELF_PATH)?;
    s.trim()
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

fn set(v: i32) -> std::io::Result<()> {
    // One write(2) of the whole number: the kernel parses what one write gives it.
    let mut f = std::fs::OpenOptions::new().write(true).open(SELF_PATH)?;
    f.write_all(v.to_string().as_bytes())
}

/// Protect the daemon from the OOM killer: -900 when allowed (root, `CAP_SYS_RESOURCE`),
/// otherwise the lowest value the kernel accepts from this user (it refuses going below the
/// lowest value a privileged process set for us). Returns the value now in force; failures
/// are logged, never fatal.
pub fn protect_daemon() -> Option<i32> {
    let before = match current() {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read {SELF_PATH}; the daemon is not protected from the OOM killer");
            return None;
        }
    };
    if set(DAEMON_OOM_SCORE_ADJ).is_err() {
        // Lowering is refused below a floor we cannot read: find it by bisection (<= 11 writes).
        let (mut lo, mut hi) = (DAEMON_OOM_SCORE_ADJ, before);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if set(mid).is_ok() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let _ = set(hi);
    }
    let now = current().ok();
    match now {
        Some(v) if v <= DAEMON_OOM_SCORE_ADJ => {
            tracing::info!(oom_score_adj = v, "daemon protected from the OOM killer")
        }
        Some(v) => tracing::info!(
            oom_score_adj = v,
            was = before,
            "daemon's OOM score lowered as far as this user may (-900 needs root)"
        ),
        None => {}
    }
    now
}

/// The bytes QEMU writes into its own `oom_score_adj` (a NUL-terminated path and the value).
pub(crate) struct ChildScore {
    path: std::ffi::CString,
    value: Vec<u8>,
}

impl ChildScore {
    pub fn new(value: i32) -> ChildScore {
        ChildScore {
            path: std::ffi::CString::new(SELF_PATH).expect("no NUL in the path"),
            value: value.to_string().into_bytes(),
        }
    }

    /// Set it, in a forked child before `exec`: only open(2), write(2) and close(2), which are
    /// async-signal-safe, on memory prepared before the fork. A failure is ignored (no /proc:
    /// QEMU keeps the daemon's value, as before).
    pub fn apply_in_child(&self) {
        // SAFETY: `path` is a valid NUL-terminated string and `value` a live buffer, both
        // owned by `self` for the duration of the calls; the fd is closed before returning.
        unsafe {
            let fd = libc::open(self.path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                let _ = libc::write(fd, self.value.as_ptr().cast(), self.value.len());
                libc::close(fd);
            }
        }
    }
}

const VMSTAT: &str = "/proc/vmstat";

/// The `oom_kill` counter of a `/proc/vmstat` text (kills by the kernel's OOM killer since
/// boot, host-wide); `None` when absent (kernels before 4.13) or unreadable.
fn parse_oom_kill(vmstat: &str) -> Option<u64> {
    vmstat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == "oom_kill").then(|| v.trim().parse().ok())?
    })
}

/// The host's OOM kill count now (`/proc/vmstat` `oom_kill`); `None` when unknown.
pub fn kill_count() -> Option<u64> {
    parse_oom_kill(&std::fs::read_to_string(VMSTAT).ok()?)
}

/// Who sent a SIGKILL tryboxi did not send to a QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SigkillCause {
    /// The kernel's OOM killer: its kill counter moved while the QEMU ran (host-wide, so
    /// another process killed for memory meanwhile reads the same; the QEMU's raised score
    /// makes it the likely victim).
    OutOfMemory,
    /// Another process (a user's `kill -9`, a supervisor): the OOM counter did not move.
    AnotherProcess,
    /// The counter cannot be read: either.
    Unknown,
}

/// The cause of an outside SIGKILL from the OOM kill count when the QEMU started (`before`)
/// and after it died (`after`).
pub fn sigkill_cause(before: Option<u64>, after: Option<u64>) -> SigkillCause {
    match (before, after) {
        (Some(b), Some(a)) if a > b => SigkillCause::OutOfMemory,
        (Some(_), Some(_)) => SigkillCause::AnotherProcess,
        _ => SigkillCause::Unknown,
    }
}

impl std::fmt::Display for SigkillCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SigkillCause::OutOfMemory => "killed by the kernel's OOM killer (out of memory)",
            SigkillCause::AnotherProcess => "killed by another process (SIGKILL)",
            SigkillCause::Unknown => "killed by the kernel (out of memory?) or another process",
        })
    }
}

/// Spawning a child of the daemon: it starts at [`CHILD_OOM_SCORE_ADJ`] instead of inheriting
/// the daemon's protection. Every `Command` the daemon runs goes through this (QEMU sets its
/// own [`QEMU_OOM_SCORE_ADJ`]).
pub trait ResetOomScore {
    /// Set the child's `oom_score_adj` to [`CHILD_OOM_SCORE_ADJ`] before `exec`.
    fn reset_oom_score(&mut self) -> &mut Self;
}

impl ResetOomScore for std::process::Command {
    fn reset_oom_score(&mut self) -> &mut Self {
        let score = ChildScore::new(CHILD_OOM_SCORE_ADJ);
        // SAFETY: the closure only calls `apply_in_child` (async-signal-safe, see there).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(self, move || {
                score.apply_in_child();
                Ok(())
            })
        }
    }
}

impl ResetOomScore for tokio::process::Command {
    fn reset_oom_score(&mut self) -> &mut Self {
        let score = ChildScore::new(CHILD_OOM_SCORE_ADJ);
        // SAFETY: the closure only calls `apply_in_child` (async-signal-safe, see there).
        unsafe {
            self.pre_exec(move || {
                score.apply_in_child();
                Ok(())
            })
        }
    }
}

/// At most this many glibc malloc arenas in the daemon (`M_ARENA_MAX`; glibc's default is 8 per
/// core). Each thread that meets a locked arena gets one of its own, and each arena keeps the
/// memory freed in it: with the runtime's workers and its blocking threads (file copies, walks,
/// QMP) that slack was the largest part of the daemon's memory growth under sustained load
/// (bench row (n)). Allocation stays fast: glibc's per-thread cache serves small blocks without
/// taking an arena's lock.
pub const HEAP_ARENAS: i32 = 2;

/// Blocks of at least this size are mapped on their own and unmapped when freed
/// (`M_MMAP_THRESHOLD`). Setting it also turns off glibc's sliding threshold, which after the
/// first large block freed serves blocks of up to 32 MiB from the arenas, where an exec's
/// output buffers and a stream's window then stay as slack between live blocks.
pub const HEAP_MMAP_THRESHOLD: i32 = 128 << 10;

/// The daemon's allocator settings: at most [`HEAP_ARENAS`] arenas, and large blocks mapped
/// on their own ([`HEAP_MMAP_THRESHOLD`]). Call before the runtime starts its threads. Whether
/// glibc took both.
pub fn limit_heap_arenas() -> bool {
    // SAFETY: `mallopt` only sets one of glibc's allocator parameters (under its own lock);
    // arenas and blocks already made stay valid, and only later allocations follow the new
    // values.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, HEAP_ARENAS) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) == 1
    }
}

/// How often [`spawn_heap_trim`] trims.
pub const HEAP_TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Every [`HEAP_TRIM_EVERY`], `malloc_trim(0)` on a blocking thread: the allocator returns the
/// whole free pages of every arena to the system (what it still uses stays). Runs until the
/// runtime stops.
pub fn spawn_heap_trim() {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(HEAP_TRIM_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let _ = tokio::task::spawn_blocking(trim_heap).await;
        }
    });
}

/// Return the allocator's free pages to the system; whether it released any.
pub fn trim_heap() -> bool {
    // SAFETY: `malloc_trim` takes a byte count to keep at the top of the main heap and only
    // works on the allocator's own free lists, under its own locks.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_takes_the_arena_cap() {
        assert!(limit_heap_arenas());
    }

    #[test]
    fn trimming_returns_free_pages_between_live_blocks() {
        // Freed blocks between live ones stay in the arena (free() only shrinks its top);
        // the trim gives their pages back and leaves the live blocks intact.
        let mut keep = Vec::new();
        let mut gone = Vec::new();
        for i in 0..512u32 {
            gone.push(vec![1u8; 64 << 10]);
            keep.push(vec![(i % 251) as u8; 64]);
        }
        drop(gone);
        assert!(trim_heap(), "nothing released");
        for (i, v) in keep.iter().enumerate() {
            assert!(v.iter().all(|&b| b == (i % 251) as u8));
        }
    }

    #[test]
    fn the_oom_counter_is_read_from_vmstat() {
        let text = "nr_free_pages 12\noom_kill_extra 9\noom_kill 7\npgfault 3\n";
        assert_eq!(parse_oom_kill(text), Some(7));
        assert_eq!(parse_oom_kill("nr_free_pages 12\n"), None);
        assert_eq!(parse_oom_kill("oom_kill x\n"), None);
        // This host's kernel has the counter (4.13+).
        assert!(kill_count().is_some(), "no oom_kill in {VMSTAT}");
    }

    #[test]
    fn an_outside_sigkill_is_the_oom_killer_only_when_its_counter_moved() {
        use SigkillCause::*;
        assert_eq!(sigkill_cause(Some(3), Some(4)), OutOfMemory);
        assert_eq!(sigkill_cause(Some(3), Some(9)), OutOfMemory);
        assert_eq!(sigkill_cause(Some(3), Some(3)), AnotherProcess);
        assert_eq!(sigkill_cause(None, Some(3)), Unknown);
        assert_eq!(sigkill_cause(Some(3), None), Unknown);
        assert!(OutOfMemory.to_string().contains("OOM killer"));
        assert!(AnotherProcess.to_string().contains("another process"));
        assert!(!AnotherProcess.to_string().contains("memory"));
    }

    #[test]
    fn a_child_sets_its_own_score_and_the_parent_keeps_its_own() {
        let before = current().unwrap();
        let score = ChildScore::new(QEMU_OOM_SCORE_ADJ);
        let mut cmd = std::process::Command::new("cat");
        cmd.arg("/proc/self/oom_score_adj");
        // SAFETY: the closure only calls `apply_in_child` (async-signal-safe, see there).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                score.apply_in_child();
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "500");
        assert_eq!(current().unwrap(), before);
    }

    const PROBE_OUT: &str = "TRYBOXI_TEST_OOM_PROBE_OUT";

    /// A helper the daemon spawns (here `git merge-file`, the real call, with a `git` on PATH
    /// that records its score) starts at 0, not at the score of the process that spawned it
    /// (raised to 700 here: unprivileged, the daemon's own -900 cannot be set, but inheritance
    /// shows the same way).
    #[test]
    fn a_spawned_helper_starts_at_zero_not_at_the_daemons_score() {
        if std::env::var_os(PROBE_OUT).is_some() {
            // The re-executed test process, at 700: spawn the helper as the daemon does.
            let _ = crate::workspace::apply::merge3(b"a\n", b"b\n", b"c\n");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("score");
        let git = d.path().join("git");
        std::fs::write(
            &git,
            "#!/bin/sh\ncat /proc/self/oom_score_adj > \"$TRYBOXI_TEST_OOM_PROBE_OUT\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&git, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let path = format!(
            "{}:{}",
            d.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let raised = ChildScore::new(700);
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "oom::tests::a_spawned_helper_starts_at_zero_not_at_the_daemons_score",
            "--exact",
            "--test-threads=1",
        ])
        .env(PROBE_OUT, &out)
        .env("PATH", path);
        // SAFETY: the closure only calls `apply_in_child` (async-signal-safe, see there).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                raised.apply_in_child();
                Ok(())
            });
        }
        let st = cmd.output().unwrap();
        assert!(st.status.success(), "{st:?}");
        let score = std::fs::read_to_string(&out).expect("the fake git ran");
        assert_eq!(
            score.trim(),
            CHILD_OOM_SCORE_ADJ.to_string(),
            "git merge-file inherited its parent's score"
        );
    }
}
