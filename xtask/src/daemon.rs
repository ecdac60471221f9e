//! Start and stop a real `tryboxi serve` on a temporary data root (for `demo` and `bench`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub struct Daemon {
    pub home: PathBuf,
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn start(bin: &Path, home: &Path, artifacts: &Path, config: &str) -> Result<Daemon> {
        std::fs::create_dir_all(home)?;
        std::fs::write(home.join("config.toml"), config)?;
        let log = home.join("daemon.log");
        let f = std::fs::File::create(&log)?;
        // TRYBOXI_BENCH_DAEMON: another executable to start as the daemon (e.g. a wrapper
        // that execs `bin` in its own mount namespace); it gets the same arguments.
        let daemon = std::env::var_os("TRYBOXI_BENCH_DAEMON")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| bin.to_path_buf());
        let child = Command::new(&daemon)
            .args(["serve", "--artifacts"])
            .arg(artifacts)
            .env("TRYBOXI_HOME", home)
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("start {}", daemon.display()))?;
        let d = Daemon {
            home: home.to_path_buf(),
            child,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while crate::http::request(&d.socket(), "GET", "/v1/health", None).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the daemon did not answer within 30 s; see {}",
                    d.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    pub fn socket(&self) -> PathBuf {
        self.home.join("tryboxi.sock")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM and wait (bounded).
    pub fn stop(mut self) -> Result<()> {
        self.terminate()
    }

    fn terminate(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet (so the pid
        // cannot have been reused); no memory is shared with the call.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.child.kill()?;
                bail!("the daemon did not stop within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

/// A run that fails half way (`?` in demo or bench) must not leave a daemon and its VMs
/// behind: SIGTERM makes the daemon end (pause) its sandboxes' QEMUs before it exits.
impl Drop for Daemon {
    fn drop(&mut self) {
        if let Err(e) = self.terminate() {
            eprintln!("warning: stopping the daemon: {e}");
        }
    }
}

/// Resident set size of a process in KiB (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
