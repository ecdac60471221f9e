//! Child reaping: the only code in the agent that calls `waitpid`.
//!
//! Owns exit statuses. As PID 1 ([`ReapMode::All`]) it reaps every zombie, including orphans
//! re-parented to init, and routes the statuses of processes the exec service spawned to their
//! owners. As an ordinary process ([`ReapMode::OwnOnly`], tests on the host) it waits only for
//! the pids it spawned, so it never steals another part of the program's children.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, oneshot};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Code(i32),
    Signal(i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapMode {
    All,
    OwnOnly,
}

pub struct Reaper {
    mode: ReapMode,
    /// Held across fork+registration and across `waitpid` in `All` mode, so a status is never
    /// collected before its owner is registered, and std's own wait after a failed exec is
    /// never raced.
    owners: Mutex<HashMap<i32, oneshot::Sender<Status>>>,
    kick: Notify,
}

impl Reaper {
    /// Starts the reaper task on the current tokio runtime.
    pub fn start(mode: ReapMode) -> std::io::Result<Arc<Self>> {
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
        let r = Arc::new(Self {
            mode,
            owners: Mutex::new(HashMap::new()),
            kick: Notify::new(),
        });
        let me = r.clone();
        tokio::spawn(async move {
            loop {
                let kicked = me.kick.notified();
                tokio::pin!(kicked);
                kicked.as_mut().enable();
                me.reap();
                tokio::select! {
                    s = sigchld.recv() => if s.is_none() { return },
                    _ = &mut kicked => {},
                }
            }
        });
        Ok(r)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, oneshot::Sender<Status>>> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spawns `cmd` and returns the child (take its pipes; never `wait` on it: the reaper owns
    /// the status) and a receiver for its exit status.
    pub fn spawn(
        &self,
        cmd: &mut Command,
    ) -> std::io::Result<(std::process::Child, oneshot::Receiver<Status>)> {
        let (tx, rx) = oneshot::channel();
        let mut owners = self.lock();
        let child = cmd.spawn()?;
        owners.insert(child.id() as i32, tx);
        drop(owners);
        // The child may already have exited (and its SIGCHLD been consumed): look again.
        self.kick.notify_one();
        Ok((child, rx))
    }

    fn reap(&self) {
        let mut owners = self.lock();
        match self.mode {
            ReapMode::All => {
                while let Some((pid, st)) = wait(-1) {
                    if let Some(tx) = owners.remove(&pid) {
                        let _ = tx.send(st);
                    } else {
                        tracing::trace!(pid, "reaped orphan");
                    }
                }
            }
            ReapMode::OwnOnly => {
                let pids: Vec<i32> = owners.keys().copied().collect();
                for pid in pids {
                    if let Some((pid, st)) = wait(pid)
                        && let Some(tx) = owners.remove(&pid)
                    {
                        let _ = tx.send(st);
                    }
                }
            }
        }
    }
}

/// One non-blocking `waitpid`; `None` if nothing (more) to collect.
fn wait(pid: i32) -> Option<(i32, Status)> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid only writes the status int we pass by pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r > 0 {
            let st = if libc::WIFEXITED(status) {
                Status::Code(libc::WEXITSTATUS(status))
            } else if libc::WIFSIGNALED(status) {
                Status::Signal(libc::WTERMSIG(status))
            } else {
                continue; // stopped/continued: not an exit
            };
            return Some((r, st));
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn own_only_reaper_routes_exit_codes_and_signals() {
        let r = Reaper::start(ReapMode::OwnOnly).unwrap();
        let (_c, rx) = r.spawn(Command::new("sh").args(["-c", "exit 7"])).unwrap();
        let st = tokio::time::timeout(Duration::from_secs(10), rx)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(st, Status::Code(7));
        let (_c, rx) = r
            .spawn(Command::new("sh").args(["-c", "kill -9 $$"]))
            .unwrap();
        let st = tokio::time::timeout(Duration::from_secs(10), rx)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(st, Status::Signal(9));
    }

    #[tokio::test]
    async fn own_only_reaper_leaves_other_children_alone() {
        let _r = Reaper::start(ReapMode::OwnOnly).unwrap();
        let mut other = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        // std's own wait must still get the status (the reaper did not steal it).
        let st = tokio::task::spawn_blocking(move || other.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(st.code(), Some(3));
    }
}
