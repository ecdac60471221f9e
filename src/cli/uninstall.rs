//! `tryboxi uninstall [--purge [--yes]]`: stop and disable the service, remove the unit and
//! every file `install` recorded (binary, aliases, completions, man pages), turn lingering off
//! again if install turned it on. The data root (sandboxes, snapshots, secrets, images,
//! config) stays unless `--purge` is given and confirmed: on a terminal by typing `yes`, else
//! with `--yes` (without either it is refused before anything changes). A second run finds
//! nothing and says so.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::path::Path;

use crate::config::Paths;
use crate::error::TopError;
use crate::install::systemd::Manager;
use crate::install::{self, Record, Report, UNIT_NAME};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Also delete the data root: every sandbox, snapshot, secret, image and the config.
    /// Asks first (type `yes`); without a terminal it needs `--yes`.
    #[arg(long)]
    pub purge: bool,
    /// Confirm `--purge` without asking.
    #[arg(long, short = 'y', requires = "purge")]
    pub yes: bool,
}

pub fn run(a: Args) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    let purge = a.purge && confirm_purge(&paths.root, a.yes)?;
    // No record: this data root's install wrote nothing on the host (installs before records
    // were kept copied only the images, which are in the data root).
    let record = Record::load(&paths.root)?.unwrap_or_default();
    let mut report = Report::default();
    let m = Manager::detect(&record.destdir);
    if let (Some(unit), Some(scope)) = (&record.unit, record.scope) {
        let staged = record.staged(unit);
        match &m {
            Manager::Running { .. } => {
                if m.query(scope, "is-enabled") || m.query(scope, "is-active") {
                    m.systemctl(scope, &["disable", "--now", UNIT_NAME])?;
                    report.did(format!(
                        "stopped and disabled {UNIT_NAME} (running sandboxes were paused to disk)"
                    ));
                }
            }
            Manager::Absent(why) if staged.exists() => {
                println!("service: nothing to stop: {why}");
            }
            Manager::Absent(_) => {}
        }
        if install::remove(&staged)? {
            report.did(format!("removed {}", staged.display()));
            m.systemctl(scope, &["daemon-reload"])?;
        }
    }
    // Man pages are many: one line for them.
    let mut pages = 0;
    for f in &record.files {
        let staged = record.staged(f);
        if install::remove(&staged)? {
            if f.parent().is_some_and(|d| d.ends_with("man/man1")) {
                pages += 1;
            } else {
                report.did(format!("removed {}", staged.display()));
            }
        }
    }
    if pages > 0 {
        report.did(format!("removed {pages} man pages"));
    }
    if let Some(user) = &record.linger_enabled
        && m.linger_on(user)
    {
        m.linger(user, false)?;
        report.did(format!("lingering off for {user} (install turned it on)"));
    }
    install::remove(&Record::path(&paths.root))?;
    let running = daemon_pid(&paths);
    if let Some(pid) = &running {
        println!(
            "a daemon (pid {pid}) still serves {}: stop it with Ctrl-C or `kill -TERM {pid}`",
            paths.root.display()
        );
    }
    if purge {
        if let Some(pid) = running {
            return Err(TopError::Usage(format!(
                "not purged: the daemon (pid {pid}) still uses {}; stop it and run \
                 `tryboxi uninstall --purge` again",
                paths.root.display()
            )));
        }
        if let Some((dir, pid)) = running_qemu(&paths) {
            return Err(TopError::Usage(format!(
                "not purged: a QEMU (pid {pid}) still runs for {} (left running by `shutdown = \
                 \"leave\"`?): start the daemon and `tryboxi rm` its sandbox, or stop it, then run \
                 `tryboxi uninstall --purge` again",
                dir.display()
            )));
        }
        if purge_root(&paths.root)? {
            report.did(format!("deleted the data root {}", paths.root.display()));
        }
    } else if paths.root.exists() {
        println!(
            "kept the data root {} (sandboxes, snapshots, secrets, images); \
             `tryboxi uninstall --purge` deletes it",
            paths.root.display()
        );
    }
    if report.changed.is_empty() {
        println!("tryboxi is not installed here: nothing to remove");
    } else {
        println!("uninstalled: {} removed", report.changed.len());
    }
    Ok(())
}

/// Whether to purge: `--yes`, or `yes` typed on a terminal. No terminal and no `--yes`: a
/// usage error before anything changes.
fn confirm_purge(root: &Path, yes: bool) -> Result<bool, TopError> {
    check_purgeable(root)?;
    if yes {
        return Ok(true);
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(TopError::Usage(format!(
            "--purge deletes {} with every sandbox, snapshot and secret in it, and there is no \
             terminal to confirm on: add --yes (nothing was changed)",
            root.display()
        )));
    }
    eprint!(
        "Delete {} with every sandbox, snapshot, secret and image in it? Type `yes`: ",
        root.display()
    );
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    stdin
        .lock()
        .read_line(&mut line)
        .map_err(|e| TopError::Other(e.into()))?;
    if line.trim() == "yes" {
        Ok(true)
    } else {
        Err(TopError::Usage(
            "not confirmed: nothing was changed".to_owned(),
        ))
    }
}

/// Files only a tryboxi data root has; a purge refuses a directory with none of them.
const MARKERS: [&str; 5] = [
    "tryboxi.redb",
    "tryboxi.lock",
    "token",
    "artifacts",
    "installed.json",
];

/// Refuse to purge `/`, the home directory, or a directory that holds nothing of tryboxi
/// (a `TRYBOXI_HOME` pointing somewhere else by mistake).
fn check_purgeable(root: &Path) -> Result<(), TopError> {
    let Ok(real) = root.canonicalize() else {
        return Ok(()); // Not there: nothing to delete.
    };
    let home = std::env::var_os("HOME").and_then(|h| Path::new(&h).canonicalize().ok());
    let ours = MARKERS.iter().any(|m| real.join(m).exists());
    if real == Path::new("/") || Some(&real) == home.as_ref() || !ours {
        return Err(TopError::Usage(format!(
            "refusing to purge {}: it does not look like a tryboxi data root (nothing was changed)",
            real.display()
        )));
    }
    Ok(())
}

/// Delete everything in the data root (each entry through the fenced delete), then the root
/// itself. Returns whether it was there.
fn purge_root(root: &Path) -> Result<bool, TopError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(TopError::Other(install::io(root)(e).into())),
    };
    for e in entries {
        let e = e.map_err(|e| TopError::Other(install::io(root)(e).into()))?;
        crate::safefs::remove_under(root, &e.path()).map_err(|e| TopError::Other(e.into()))?;
    }
    std::fs::remove_dir(root).map_err(|e| TopError::Other(install::io(root)(e).into()))?;
    Ok(true)
}

/// The pid of a daemon holding the data root's lock, if one runs.
fn daemon_pid(paths: &Paths) -> Option<String> {
    use nix::fcntl::{Flock, FlockArg};
    let path = paths.lock_file();
    let file = std::fs::File::open(&path).ok()?;
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(_) => None,
        Err(_) => Some(
            std::fs::read_to_string(&path)
                .unwrap_or_default()
                .trim()
                .to_owned(),
        ),
    }
}

/// A sandbox whose QEMU still runs (it outlives the daemon by design), and its pid.
fn running_qemu(paths: &Paths) -> Option<(std::path::PathBuf, u32)> {
    let entries = std::fs::read_dir(paths.sandboxes_dir()).ok()?;
    entries.flatten().map(|e| e.path()).find_map(|dir| {
        let pid: u32 = std::fs::read_to_string(dir.join("qemu.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        crate::vmm::qemu::cmdline_matches(&cmdline, &dir).then_some((dir, pid))
    })
}
