//! A VM's two logs, kept to a cap: the guest's serial console and QEMU's own output.
//!
//! Owns: the console follower (QEMU serves the serial console on `tty.sock`; the daemon
//! reads it and writes `console.log`, rotating it to `console.log.1` at the cap), the rotation of
//! `qemu.log` (QEMU appends to it with `O_APPEND`; the follower copies it to `qemu.log.1` and
//! empties it once it passes the cap), and reading a log's tail with a seek.
//! Never: blocks QEMU (output while no daemon follows the console is dropped by QEMU) or keeps
//! more than two caps of each log on disk (plus what QEMU appends to `qemu.log` between two
//! checks, one [`QEMU_LOG_CHECK`] apart).

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncReadExt;

/// Smallest cap (a smaller configured one is raised to it).
pub const MIN_CAP: u64 = 4096;
/// How often a follower looks at `qemu.log`'s size.
pub const QEMU_LOG_CHECK: Duration = Duration::from_secs(1);
/// How long a follower tries to connect to a new QEMU's console socket.
const CONNECT_FOR: Duration = Duration::from_secs(30);

/// `<path>.1`: where a rotated log goes (replacing the one before).
pub fn rotated(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".1");
    PathBuf::from(s)
}

/// The last `max` bytes of a log (reaching into `<path>.1` when the current file is shorter),
/// read with a seek, never the whole file; for error messages.
pub fn tail(path: &Path, max: usize) -> String {
    let cur = match read_tail(path, max as u64) {
        Ok(b) => b,
        Err(e) => return format!("({}: {e})", path.display()),
    };
    let mut out = Vec::new();
    if cur.len() < max
        && let Ok(prev) = read_tail(&rotated(path), (max - cur.len()) as u64)
    {
        out = prev;
    }
    out.extend_from_slice(&cur);
    String::from_utf8_lossy(&out).trim().to_owned()
}

/// The last `max` bytes of `path`.
pub fn read_tail(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let start = len.saturating_sub(max);
    f.seek(SeekFrom::Start(start))?;
    let mut out = Vec::with_capacity((len - start) as usize);
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// A log file the daemon writes, rotated to `<path>.1` when the next write would pass `cap`.
pub struct RotatingLog {
    path: PathBuf,
    cap: u64,
    file: File,
    len: u64,
}

impl RotatingLog {
    /// Open `path` for appending (what it holds counts towards the cap).
    pub fn open(path: &Path, cap: u64) -> std::io::Result<RotatingLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let len = file.metadata()?.len();
        Ok(RotatingLog {
            path: path.to_owned(),
            cap: cap.max(MIN_CAP),
            file,
            len,
        })
    }

    pub fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        if data.len() as u64 > self.cap {
            // Only the newest cap of one huge chunk can be kept anyway.
            data = &data[data.len() - self.cap as usize..];
        }
        if self.len + data.len() as u64 > self.cap {
            match std::fs::rename(&self.path, rotated(&self.path)) {
                Ok(()) => {}
                // Someone deleted the log: start a new one.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            self.file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?;
            self.len = 0;
        }
        self.file.write_all(data)?;
        self.len += data.len() as u64;
        Ok(())
    }
}

/// If the log another process appends to (`O_APPEND`) is over `cap`, copy its last `cap`
/// bytes to `<path>.1` and empty it (the writer's next line lands at the new end). Lines
/// written between the copy and the truncation are lost. True when it rotated.
pub fn rotate_appended(path: &Path, cap: u64) -> std::io::Result<bool> {
    let cap = cap.max(MIN_CAP);
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= cap {
        return Ok(false);
    }
    let keep = read_tail(path, cap)?;
    std::fs::write(rotated(path), keep)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(true)
}

/// The QEMUs (VM directory and pid) whose console is followed now: one follower per QEMU
/// (a reattach does not start a second one; a restore's new QEMU in the same directory gets its
/// own while the old one's follower finishes).
#[derive(Debug, Clone, Default)]
pub struct Followers(Arc<Mutex<HashSet<(PathBuf, u32)>>>);

impl Followers {
    /// Follow the console of the QEMU serving `sock` into `console` and keep `qemu_log` to
    /// `cap`, until that QEMU closes the console (it exited). Does nothing when that QEMU is
    /// followed already.
    pub fn spawn(&self, pid: u32, dir: &Path, paths: (PathBuf, PathBuf, PathBuf), cap: u64) {
        let (sock, console, qemu_log) = paths;
        {
            let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if !set.insert((dir.to_owned(), pid)) {
                return;
            }
        }
        let set = self.0.clone();
        let key = (dir.to_owned(), pid);
        tokio::spawn(async move {
            if let Err(e) = follow(pid, &sock, &console, &qemu_log, cap).await {
                tracing::warn!(vm_dir = %key.0.display(), pid, error = %e, "console follower stopped");
            }
            set.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
        });
    }
}

/// Connect to the console socket of QEMU `pid` once it is there; `None` when that QEMU is gone
/// first.
async fn connect(pid: u32, sock: &Path) -> std::io::Result<Option<tokio::net::UnixStream>> {
    let deadline = tokio::time::Instant::now() + CONNECT_FOR;
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    loop {
        match tokio::net::UnixStream::connect(sock).await {
            Ok(s) => return Ok(Some(s)),
            Err(_) if !proc_dir.exists() => return Ok(None),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

async fn follow(
    pid: u32,
    sock: &Path,
    console: &Path,
    qemu_log: &Path,
    cap: u64,
) -> std::io::Result<()> {
    let Some(mut s) = connect(pid, sock).await? else {
        return rotate_appended(qemu_log, cap).map(drop);
    };
    let mut log = RotatingLog::open(console, cap)?;
    let mut buf = vec![0u8; 16 * 1024];
    let mut tick = tokio::time::interval(QEMU_LOG_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = s.read(&mut buf) => match r? {
                0 => break,
                n => log.write(&buf[..n])?,
            },
            _ = tick.tick() => {
                rotate_appended(qemu_log, cap)?;
            }
        }
    }
    rotate_appended(qemu_log, cap)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotating_log_never_passes_its_cap_and_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("console.log");
        let mut l = RotatingLog::open(&p, MIN_CAP).unwrap();
        for i in 0..10_000u32 {
            l.write(format!("line {i}\n").as_bytes()).unwrap();
            assert!(std::fs::metadata(&p).unwrap().len() <= MIN_CAP);
        }
        l.write(&vec![b'z'; 3 * MIN_CAP as usize]).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), MIN_CAP);
        assert!(std::fs::metadata(rotated(&p)).unwrap().len() <= MIN_CAP);
        l.write(b"last\n").unwrap();
        let t = tail(&p, 100);
        assert!(t.ends_with("zzzzlast"), "{t}");
    }

    #[tokio::test]
    async fn the_follower_keeps_a_flooded_console_and_qemu_log_at_the_cap() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("tty.sock");
        let (console, qemu_log) = (d.path().join("console.log"), d.path().join("qemu.log"));
        // QEMU's side: the console server, and a qemu.log something keeps appending to.
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let mut qlog = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&qemu_log)
            .unwrap();
        let f = Followers::default();
        let paths = (sock, console.clone(), qemu_log.clone());
        f.spawn(std::process::id(), d.path(), paths.clone(), MIN_CAP);
        f.spawn(std::process::id(), d.path(), paths, MIN_CAP); // no second follower
        let (mut guest, _) = listener.accept().await.unwrap();
        let line = vec![b'x'; 999];
        for _ in 0..1000 {
            tokio::io::AsyncWriteExt::write_all(&mut guest, &line)
                .await
                .unwrap();
            qlog.write_all(&line[..100]).unwrap();
        }
        tokio::io::AsyncWriteExt::write_all(&mut guest, b"END")
            .await
            .unwrap();
        drop(guest); // QEMU exits
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f.0.lock().unwrap().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the follower did not end"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for p in [&console, &rotated(&console), &qemu_log, &rotated(&qemu_log)] {
            let n = std::fs::metadata(p).unwrap().len();
            assert!(n <= MIN_CAP, "{} is {n} bytes", p.display());
        }
        assert!(std::fs::read(&console).unwrap().ends_with(b"xxEND"));
        assert_eq!(
            std::fs::metadata(rotated(&qemu_log)).unwrap().len(),
            MIN_CAP
        );
    }

    #[test]
    fn an_appended_log_is_rotated_and_its_writer_goes_on() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("qemu.log");
        let mut w = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .unwrap();
        w.write_all(&vec![b'a'; 10_000]).unwrap();
        assert!(!rotate_appended(&p, 20_000).unwrap());
        w.write_all(&vec![b'b'; 20_000]).unwrap();
        assert!(rotate_appended(&p, 20_000).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 0);
        assert_eq!(std::fs::metadata(rotated(&p)).unwrap().len(), 20_000);
        w.write_all(b"next").unwrap();
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"next",
            "no hole before the new line"
        );
        // The tail reaches back into the rotated file.
        assert_eq!(tail(&p, 8), "bbbbnext");
        assert_eq!(read_tail(&p, 2).unwrap(), b"xt");
    }
}
