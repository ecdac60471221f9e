//! Small helpers shared by the xtask commands: paths, step headers, running tools with a
//! live progress line, hashing. Never decides *what* to build; only how to run and report.

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root (the parent of `xtask/`).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// `_out/` in the checkout: where `dist` and `images` put their results.
pub fn out_dir() -> PathBuf {
    repo_root().join("_out")
}

pub fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else {
        format!("{}m{:02}s", (s as u64) / 60, (s as u64) % 60)
    }
}

/// Prints a step header now and its elapsed time when [`Step::done`] is called.
pub struct Step {
    name: String,
    start: Instant,
}

impl Step {
    pub fn start(name: impl Into<String>) -> Step {
        let name = name.into();
        println!("==> {name}");
        flush();
        Step {
            name,
            start: Instant::now(),
        }
    }

    /// A step with the time it is expected to take, shown at the start only (`expect` e.g.
    /// "~6 min on 2 cores; seconds when cached").
    pub fn start_expect(name: impl Into<String>, expect: &str) -> Step {
        let name = name.into();
        println!("==> {name} (expected: {expect})");
        flush();
        Step {
            name,
            start: Instant::now(),
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn done(self, detail: &str) -> Duration {
        let d = self.start.elapsed();
        if detail.is_empty() {
            println!("    {} done in {}", self.name, fmt_dur(d));
        } else {
            println!("    {} done in {} ({detail})", self.name, fmt_dur(d));
        }
        flush();
        d
    }
}

pub fn flush() {
    let _ = std::io::stdout().flush();
}

/// Runs `cmd` with inherited stdout/stderr (for tools that show their own progress, like cargo).
pub fn run_inherit(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("could not start {what} ({cmd:?}); is it installed?"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` with stdout and stderr going to `log`, printing a progress line (elapsed time and
/// the tool's latest output line) while it runs. On failure prints the log's tail.
pub fn run_logged(cmd: &mut Command, what: &str, log: &Path) -> Result<()> {
    // Appended to: one build runs several commands into the same log.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log {}", log.display()))?;
    let err_file = file.try_clone().context("duplicating log file handle")?;
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(err_file))
        .spawn()
        .with_context(|| format!("could not start {what} ({cmd:?}); is it installed?"))?;
    let tty = std::io::stdout().is_terminal();
    let every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(15)
    };
    let mut next_report = Instant::now() + every;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for child")? {
            break status;
        }
        if Instant::now() >= next_report {
            let last = last_line(log).unwrap_or_default();
            let mut line = format!("    [{what} {}] {last}", fmt_dur(start.elapsed()));
            if tty {
                line.truncate(line.floor_char_boundary(term_width()));
                print!("\r\x1b[K{line}");
            } else {
                println!("{line}");
            }
            flush();
            next_report = Instant::now() + every;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if tty {
        print!("\r\x1b[K");
        flush();
    }
    if !status.success() {
        eprintln!("---- last lines of {} ----", log.display());
        eprintln!("{}", tail(log, 40).unwrap_or_default());
        eprintln!("---- end of log ----");
        bail!(
            "{what} failed ({status}); full log: {} (command: {cmd:?})",
            log.display()
        );
    }
    Ok(())
}

fn term_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(120)
}

/// The last `n` lines of a text file (reads at most the last 64 KiB).
pub fn tail(path: &Path, n: usize) -> Result<String> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    Ok(lines[lines.len().saturating_sub(n)..].join("\n"))
}

fn last_line(path: &Path) -> Result<String> {
    let t = tail(path, 1)?;
    Ok(t.trim().chars().filter(|c| !c.is_control()).collect())
}

/// Runs a command and returns its trimmed stdout; fails with its stderr.
pub fn output(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not start {what} ({cmd:?})"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// A recipe hash: sha256 over labelled parts, so that moving bytes between parts changes it.
pub fn recipe_key(parts: &[(&str, &[u8])]) -> String {
    let mut h = Sha256::new();
    for (label, bytes) in parts {
        h.update((label.len() as u64).to_le_bytes());
        h.update(label.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    hex::encode(h.finalize())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A fresh directory next to `home` (the daemon's data root), for a bench's workspace: the
/// daemon refuses a workspace inside its own data root.
pub fn beside(home: &Path, name: &str) -> std::io::Result<PathBuf> {
    let base = home
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "home".into());
    let dir = home.with_file_name(format!("{base}-{name}"));
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_key_changes_when_bytes_move_between_parts() {
        let a = recipe_key(&[("a", b"xy"), ("b", b"z")]);
        let b = recipe_key(&[("a", b"x"), ("b", b"yz")]);
        assert_ne!(a, b);
        assert_eq!(a, recipe_key(&[("a", b"xy"), ("b", b"z")]));
    }

    #[test]
    fn tail_returns_only_the_last_lines() {
        let dir = std::env::temp_dir().join(format!("xtask-tail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("log");
        std::fs::write(&p, "one\ntwo\nthree\n").unwrap();
        assert_eq!(tail(&p, 2).unwrap(), "two\nthree");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
