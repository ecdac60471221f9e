//! Process handles that cannot be fooled by pid reuse (Linux pidfds, kernel >= 5.3).
//!
//! Owns: opening a pidfd for a pid, signalling through it, and waiting (asynchronously) for
//! the process to exit.
//! Never: decides whether a process is ours: callers open the pidfd first, then check
//! `/proc/<pid>/cmdline`, then signal through the pidfd, so the check and the signal are
//! guaranteed to concern the same process.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

pub(crate) struct Pidfd {
    fd: OwnedFd,
    pid: u32,
}

impl AsRawFd for Pidfd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

impl Pidfd {
    /// `Ok(None)` when no process has this pid.
    pub(crate) fn open(pid: u32) -> io::Result<Option<Pidfd>> {
        let Ok(raw_pid) = libc::pid_t::try_from(pid) else {
            return Ok(None);
        };
        if raw_pid <= 0 {
            return Ok(None);
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is
        // passed. PIDFD_NONBLOCK is not needed: we only poll the fd.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(None),
                _ => Err(e),
            };
        }
        let raw = i32::try_from(r).map_err(|_| io::Error::other("pidfd out of range"))?;
        // SAFETY: `raw` is a fresh fd returned by the kernel and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Some(Pidfd { fd, pid }))
    }

    /// A pidfd handed over by another process (e.g. on a known descriptor number), for `pid`.
    pub(crate) fn from_owned(fd: OwnedFd, pid: u32) -> Pidfd {
        Pidfd { fd, pid }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Send `sig`; a process that already exited (but is not yet reaped) is not an error.
    pub(crate) fn signal(&self, sig: libc::c_int) -> io::Result<()> {
        // SAFETY: pidfd_send_signal with a valid pidfd we own, a plain signal number, a null
        // siginfo (allowed: the kernel fills a default one) and no flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Ok(());
            }
            return Err(e);
        }
        Ok(())
    }

    /// Wait until the process exits (a pidfd becomes readable then). `false` on timeout.
    pub(crate) async fn wait_exit(&self, timeout: Duration) -> io::Result<bool> {
        // SAFETY: the borrowed fd is owned by `self`, which outlives `afd` (a local of this
        // function), so it stays open and names the same pidfd for all of `afd`'s life.
        let afd = unsafe { AsyncFd::register_with_interest(self.fd.as_fd(), Interest::READABLE) }?;
        match tokio::time::timeout(timeout, afd.readable()).await {
            Ok(guard) => guard.map(|_| true),
            Err(_) => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn signal_and_wait_see_the_process_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let p = Pidfd::open(child.id()).expect("open").expect("exists");
        assert!(!p.wait_exit(Duration::from_millis(50)).await.expect("wait"));
        p.signal(libc::SIGKILL).expect("kill");
        assert!(p.wait_exit(Duration::from_secs(5)).await.expect("wait"));
        // Exited but unreaped: signalling again is not an error.
        p.signal(libc::SIGKILL).expect("kill again");
        child.wait().expect("reap");
    }

    #[test]
    fn missing_pid_gives_none() {
        // pid_max is at most 2^22 on Linux: this pid cannot exist.
        assert!(Pidfd::open(i32::MAX as u32).expect("open").is_none());
        assert!(Pidfd::open(0).expect("open").is_none());
    }
}
