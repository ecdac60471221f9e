//! Keepalive of long requests: a request that works for a long time without a word (deleting a
//! big tree before an unpack, a first walk, unpacking a big archive) counts its work in a
//! [`Work`] counter, and a ticker sends `Progress` on its stream every [`every`] while that
//! counter moves. The host restarts the request's deadline on each one, so a legitimate long
//! request is not taken for a hung agent; a request stuck without progress (a read of a file that
//! never ends) sends none and meets its deadline.
//!
//! Owns only that counting and the ticker; never decides what a request does.

use crate::rpc::msg::{Body, Frame};
use crate::rpc::outbox::Outbox;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Units of work done by one request (entries deleted, walked or unpacked).
pub type Work = Arc<AtomicU64>;

/// How often a working request reports progress (short in tests so they stay quick; a fifth of
/// the tests' 150 ms reply deadline, so a loaded test machine's scheduling delays do not turn a
/// late tick into a missed deadline).
pub fn every() -> Duration {
    if cfg!(test) {
        Duration::from_millis(30)
    } else {
        Duration::from_secs(5)
    }
}

/// Sends `Progress` on `stream` each [`every`] in which `work` moved; stops when dropped.
pub struct Ticker(tokio::task::JoinHandle<()>);

impl Ticker {
    pub fn start(outbox: Arc<Outbox>, stream: u32, work: Work) -> Ticker {
        Self::watching(outbox, stream, move || work.load(Ordering::Relaxed))
    }

    /// Like [`Self::start`], reading the work done from `work`.
    pub fn watching(
        outbox: Arc<Outbox>,
        stream: u32,
        work: impl Fn() -> u64 + Send + 'static,
    ) -> Ticker {
        let mut seen = work();
        Ticker(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every()).await;
                let now = work();
                if now == seen {
                    continue;
                }
                seen = now;
                let progress = Frame {
                    stream,
                    body: Body::Progress,
                };
                if outbox.send_control(progress).is_err() {
                    return;
                }
            }
        }))
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Removes the tree at `p` without following symlinks, counting each entry removed in `work`
/// (`remove_dir_all` says nothing until it is done, which for 100k files under TCG is minutes).
pub fn remove_tree(p: &Path, work: &AtomicU64) -> std::io::Result<()> {
    let md = std::fs::symlink_metadata(p)?;
    if md.is_dir() {
        for ent in std::fs::read_dir(p)? {
            let ent = ent?;
            match remove_tree(&ent.path(), work) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                r => r?,
            }
        }
        std::fs::remove_dir(p)?;
    } else {
        std::fs::remove_file(p)?;
    }
    work.fetch_add(1, Ordering::Relaxed);
    #[cfg(test)]
    pace::after_entry(p);
    Ok(())
}

/// Test-only pacing of [`remove_tree`]: a test that must prove a delete outlasts a deadline
/// slows the deletes under its own temporary root by a fixed time per entry, so the proof holds
/// by construction rather than by how fast this machine's disk is (a warm page cache deleted
/// 40,400 entries in 270 ms, under the 300 ms the test needed).
#[cfg(test)]
pub(crate) mod pace {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;
    use std::time::Duration;

    static ROOTS: Mutex<Vec<(PathBuf, Duration)>> = Mutex::new(Vec::new());

    /// Each entry deleted under `root` from now on takes at least `per_entry` more.
    pub(crate) fn slow_under(root: &Path, per_entry: Duration) {
        ROOTS.lock().unwrap().push((root.to_path_buf(), per_entry));
    }

    pub(super) fn after_entry(p: &Path) {
        let d = ROOTS
            .lock()
            .unwrap()
            .iter()
            .find(|(r, _)| p.starts_with(r))
            .map(|(_, d)| *d);
        if let Some(d) = d {
            std::thread::sleep(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::frame::read_frame;

    #[test]
    fn remove_tree_counts_every_entry_and_keeps_link_targets() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        let t = d.path().join("t");
        for i in 0..10 {
            let sub = t.join(format!("d{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            for j in 0..10 {
                std::fs::write(sub.join(format!("f{j}")), b"").unwrap();
            }
        }
        std::os::unix::fs::symlink(&outside, t.join("link")).unwrap();
        let work = AtomicU64::new(0);
        remove_tree(&t, &work).unwrap();
        assert!(!t.exists());
        assert!(outside.join("keep").exists());
        // 100 files + 10 directories + the link + the root.
        assert_eq!(work.load(Ordering::Relaxed), 112);
    }

    #[tokio::test]
    async fn ticker_reports_only_while_work_moves() {
        let ob = Arc::new(Outbox::new());
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let w = ob.clone();
        tokio::spawn(async move { w.run_writer(a).await });
        let work: Work = Arc::default();
        let _t = Ticker::start(ob.clone(), 7, work.clone());
        work.fetch_add(1, Ordering::Relaxed);
        let f = tokio::time::timeout(Duration::from_secs(5), read_frame(&mut b))
            .await
            .expect("no progress while working")
            .unwrap()
            .unwrap();
        assert_eq!((f.stream, f.body), (7, Body::Progress));
        // No work, no progress.
        let idle = tokio::time::timeout(every() * 5, read_frame(&mut b)).await;
        assert!(idle.is_err(), "progress without work: {idle:?}");
    }
}
