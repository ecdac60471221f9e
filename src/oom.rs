//! Who the kernel's out-of-memory killer picks: never the daemon if it can help it, a sandbox's
//! QEMU first.
//!
//! Owns: the daemon's `oom_score_adj` (set once at `serve` start: -1000 as root, else the lowest
//! the kernel lets this user set) and the value every QEMU sets for itself before `exec`
//! ([`QEMU_OOM_SCORE_ADJ`]; raising one's own value needs no privilege, and without it QEMU
//! would inherit the daemon's protection).
//! Never: changes the score of any other process.

use std::io::Write;

/// What a sandbox's QEMU sets for itself: a guest that fills its RAM is killed before the host's
/// other processes (and long before the daemon).
pub const QEMU_OOM_SCORE_ADJ: i32 = 500;
/// Most protected value (`OOM_SCORE_ADJ_MIN`).
pub const MIN: i32 = -1000;

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

/// Protect the daemon from the OOM killer: -1000 when allowed (root, `CAP_SYS_RESOURCE`),
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
    if set(MIN).is_err() {
        // Lowering is refused below a floor we cannot read: find it by bisection (<= 11 writes).
        let (mut lo, mut hi) = (MIN, before);
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
        Some(v) if v == MIN => {
            tracing::info!(oom_score_adj = v, "daemon protected from the OOM killer")
        }
        Some(v) => tracing::info!(
            oom_score_adj = v,
            was = before,
            "daemon's OOM score lowered as far as this user may (-1000 needs root)"
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
