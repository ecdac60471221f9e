//! `tryboxi install --artifacts DIR`: copy guest images (as built by `cargo xtask images`) into
//! the data root, verified against their manifest, replacing the installed set atomically; put
//! the binary, its alias names, shell completions and man pages under the prefix; write the
//! systemd unit and start it (unless `--no-service`). Every step leaves what is already right
//! alone, so a second run changes nothing and says so. Where things go: `crate::install`.

use std::path::{Path, PathBuf};

use crate::config::Paths;
use crate::error::TopError;
use crate::install::systemd::{self, Manager};
use crate::install::{
    self, ALIASES, COMPLETION_SHELLS, InstallError, Layout, Record, Report, Scope, UNIT_NAME,
};
use crate::vmm::{Images, image_sets};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Directory holding `images/manifest.json` (e.g. `_out`).
    #[arg(long, value_name = "DIR", default_value = "_out")]
    pub artifacts: PathBuf,
    /// Do not write or start the systemd unit (run `tryboxi serve` yourself).
    #[arg(long)]
    pub no_service: bool,
    /// Where the binary, its aliases, completions and man pages go (`PREFIX/bin`,
    /// `PREFIX/share`; default `/usr/local` as root, `~/.local` otherwise).
    #[arg(long, value_name = "DIR")]
    pub prefix: Option<PathBuf>,
    /// Write every host file below DIR as if it were `/` (packaging, tests); the service is
    /// started only if `DIR/run/systemd/system` exists.
    #[arg(long, value_name = "DIR")]
    pub destdir: Option<PathBuf>,
}

impl From<InstallError> for TopError {
    fn from(e: InstallError) -> Self {
        match e {
            InstallError::NotOurs(_) => TopError::Usage(e.to_string()),
            _ => TopError::Other(e.into()),
        }
    }
}

pub fn run(a: Args) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    let layout = Layout::discover(a.prefix, a.destdir)?;
    let mut record = Record::load(&paths.root)?.unwrap_or_else(|| Record {
        destdir: layout.destdir.clone(),
        ..Record::default()
    });
    // One install per data root: another destdir or unit would be lost from the record.
    let other_unit = record
        .unit
        .as_ref()
        .filter(|u| !a.no_service && **u != layout.unit);
    if record.destdir != layout.destdir || other_unit.is_some() {
        return Err(TopError::Usage(format!(
            "this data root ({}) records an install below {} (unit {}): run `tryboxi uninstall` \
             first, or use another TRYBOXI_HOME",
            paths.root.display(),
            record.destdir.display(),
            record
                .unit
                .as_ref()
                .map_or("none".into(), |u| u.display().to_string())
        )));
    }
    let mut report = Report::default();
    images(&a.artifacts, &paths, &mut report)?;
    println!("programs under {}:", layout.prefix.display());
    let binary_changed = host_files(&layout, &mut record, &mut report)?;
    let unit_changed = if a.no_service {
        println!("service: not installed (--no-service); run `tryboxi serve` yourself");
        false
    } else {
        unit_file(&layout, &paths, &mut record, &mut report)?
    };
    record.save(&paths.root)?;
    if !a.no_service {
        let r = service(
            &layout,
            &mut record,
            (unit_changed, binary_changed),
            &mut report,
        );
        record.save(&paths.root)?;
        // The files are in place: say how to go on by hand (e.g. no user bus for --user).
        r.map_err(|e| {
            InstallError::Setup(format!(
                "{e}\nthe files are installed; {}",
                systemd::absent_message(
                    "the service manager refused",
                    layout.scope,
                    &layout.binary()
                )
            ))
        })?;
    }
    if report.changed.is_empty() {
        println!(
            "tryboxi is installed already: nothing changed ({} items checked)",
            report.unchanged
        );
    } else {
        println!(
            "installed: {} changed, {} already in place",
            report.changed.len(),
            report.unchanged
        );
    }
    Ok(())
}

/// The guest images into their own set directory `<data root>/artifacts/images-<hash>/`
/// (`vmm::image_sets`), made current once complete, unless the same set is current already.
/// An older set is removed unless a disk layer (a sandbox, paused or running, a snapshot, a
/// golden snapshot) still uses it: a layer's base never changes under it.
fn images(artifacts: &Path, paths: &Paths, report: &mut Report) -> Result<(), TopError> {
    let src = Images::load(artifacts)
        .map_err(|e| TopError::Usage(format!("{e} (build them with `cargo xtask images`)")))?;
    let dest_root = paths.artifacts_dir();
    let manifest =
        std::fs::read(src.dir.join("manifest.json")).map_err(|e| TopError::Other(e.into()))?;
    let name = image_sets::set_name(&manifest);
    let dest = dest_root.join(&name);
    let intact = |dir: &Path| {
        std::fs::read(dir.join("manifest.json")).ok().as_deref() == Some(&manifest[..])
            && Images::load_dir(dir).is_ok_and(|i| i.verify(false).is_ok())
    };
    let current = image_sets::current_dir(&dest_root);
    if intact(&current) {
        println!("guest images: unchanged in {}", current.display());
        report.unchanged += 1;
    } else if intact(&dest) {
        // Installed before (then replaced): current again.
        image_sets::switch_to(&dest_root, &name).map_err(|e| TopError::Other(e.into()))?;
        report.did(format!("guest images: {} is current again", dest.display()));
    } else {
        println!("verifying {} ...", src.dir.display());
        src.verify(true).map_err(|e| TopError::Other(e.into()))?;
        std::fs::create_dir_all(&dest_root).map_err(|e| TopError::Other(e.into()))?;
        let staging = dest_root.join(format!(".images-{}", std::process::id()));
        let _ = crate::safefs::remove_under(&paths.root, &staging);
        std::fs::create_dir_all(&staging).map_err(|e| TopError::Other(e.into()))?;
        let mut files: Vec<&str> = src
            .manifest
            .artifacts
            .iter()
            .map(|a| a.file.as_str())
            .collect();
        files.push("manifest.json");
        for f in files {
            let (from, to) = (src.dir.join(f), staging.join(f));
            // A hard link costs nothing (images are immutable once built: never written in
            // place); else copy. The small manifest is always copied, so it is the data
            // root's own file.
            if f == "manifest.json" || std::fs::hard_link(&from, &to).is_err() {
                std::fs::copy(&from, &to).map_err(|e| {
                    TopError::Other(anyhow::anyhow!("copy {}: {e}", from.display()))
                })?;
            }
            println!("  {f}");
        }
        // A damaged copy of this same set: replaced, unless a layer is built on it (then its
        // files must not change under that layer; the user decides).
        if dest.exists() {
            let layers = [paths.sandboxes_dir(), paths.golden_dir()];
            let roots: Vec<&Path> = layers.iter().map(PathBuf::as_path).collect();
            if let Some(user) = image_sets::user_of(&dest, &roots) {
                let _ = crate::safefs::remove_under(&paths.root, &staging);
                return Err(TopError::Usage(format!(
                    "the installed guest images in {} differ from their manifest, and {} is \
                     built on them: not replaced under it (remove that sandbox or snapshot, \
                     or check the files with `tryboxi doctor`)",
                    dest.display(),
                    user.display()
                )));
            }
            crate::safefs::remove_under(&paths.root, &dest)
                .map_err(|e| TopError::Other(e.into()))?;
        }
        std::fs::rename(&staging, &dest).map_err(|e| TopError::Other(e.into()))?;
        Images::load_dir(&dest)
            .and_then(|i| i.verify(false))
            .map_err(|e| TopError::Other(e.into()))?;
        image_sets::switch_to(&dest_root, &name).map_err(|e| TopError::Other(e.into()))?;
        report.did(format!("installed guest images into {}", dest.display()));
    }
    for p in image_sets::prune(&paths.root, false, crate::service::disk_usage) {
        match p {
            image_sets::Pruned::Removed { set, bytes } => report.did(format!(
                "removed older guest images {} ({} MiB)",
                set.display(),
                bytes >> 20
            )),
            image_sets::Pruned::Kept { set, user } => println!(
                "guest images: keeping the older set {} while {} uses it (`tryboxi gc` removes \
                 it once nothing does)",
                set.display(),
                user.display()
            ),
            image_sets::Pruned::Failed { set, error } => {
                println!(
                    "warning: cannot remove the older guest images {}: {error}",
                    set.display()
                )
            }
        }
    }
    Ok(())
}

/// Write `content` at `path` (a runtime path of the layout) and record it.
fn put(
    layout: &Layout,
    record: &mut Record,
    report: &mut Report,
    path: PathBuf,
    content: &[u8],
    mode: u32,
) -> Result<bool, InstallError> {
    let staged = layout.staged(&path);
    let wrote = install::put(&staged, content, mode)?;
    if wrote {
        report.did(format!("wrote {}", staged.display()));
    } else {
        report.unchanged += 1;
    }
    record.add(path);
    Ok(wrote)
}

/// The binary (a copy of this one), its alias symlinks, completions and man pages. Returns
/// whether the binary changed (a running service must restart to run it).
fn host_files(
    layout: &Layout,
    record: &mut Record,
    report: &mut Report,
) -> Result<bool, InstallError> {
    let exe = std::env::current_exe().map_err(io_here("the running binary"))?;
    let bin = layout.binary();
    let staged_bin = layout.staged(&bin);
    // Running the installed binary itself: it is in place.
    let same_file = std::fs::canonicalize(&staged_bin).is_ok_and(|p| p == exe);
    let binary_changed = if same_file {
        report.unchanged += 1;
        record.add(bin.clone());
        false
    } else {
        let bytes = std::fs::read(&exe).map_err(install::io(&exe))?;
        put(layout, record, report, bin, &bytes, 0o755)?
    };
    for name in ALIASES {
        let link = layout.alias(name);
        let staged = layout.staged(&link);
        if install::put_symlink(&staged, "tryboxi")? {
            report.did(format!("linked {} -> tryboxi", staged.display()));
        } else {
            report.unchanged += 1;
        }
        record.add(link);
    }
    for shell in COMPLETION_SHELLS {
        if let Some(path) = layout.completion(shell) {
            let text = super::docs::completion(shell);
            put(layout, record, report, path, &text, 0o644)?;
        }
    }
    // Many pages: one line for all of them.
    let pages = super::docs::man_pages().map_err(io_here("man pages"))?;
    let (total, mut wrote) = (pages.len(), 0);
    for (name, text) in pages {
        let path = layout.man_dir().join(name);
        if install::put(&layout.staged(&path), &text, 0o644)? {
            wrote += 1;
        }
        record.add(path);
    }
    if wrote > 0 {
        let dir = layout.staged(&layout.man_dir());
        report.did(format!(
            "wrote {wrote} of {total} man pages in {}",
            dir.display()
        ));
    } else {
        report.unchanged += 1;
    }
    Ok(binary_changed)
}

fn io_here(what: &str) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: PathBuf::from(what),
        source,
    }
}

/// The unit file. Returns whether it changed.
fn unit_file(
    layout: &Layout,
    paths: &Paths,
    record: &mut Record,
    report: &mut Report,
) -> Result<bool, InstallError> {
    let text = systemd::render(layout.scope, &layout.binary(), &paths.root)?;
    let staged = layout.staged(&layout.unit);
    let wrote = install::put(&staged, text.as_bytes(), 0o644)?;
    if wrote {
        report.did(format!("wrote {}", staged.display()));
    } else {
        report.unchanged += 1;
    }
    record.scope = Some(layout.scope);
    record.unit = Some(layout.unit.clone());
    Ok(wrote)
}

/// Enable and start the unit (restart it when the unit or the binary changed); lingering
/// first for a user unit. Without systemd: say so and how to run the daemon by hand.
fn service(
    layout: &Layout,
    record: &mut Record,
    (unit_changed, binary_changed): (bool, bool),
    report: &mut Report,
) -> Result<(), InstallError> {
    let scope = layout.scope;
    let m = Manager::detect(&layout.destdir);
    if let Manager::Absent(why) = &m {
        println!(
            "service: {}",
            systemd::absent_message(why, scope, &layout.binary())
        );
        return Ok(());
    }
    println!("service ({}):", scope_name(scope));
    if let (Scope::User, Some(user)) = (scope, &layout.user) {
        if m.linger_on(user) {
            report.unchanged += 1;
        } else {
            m.linger(user, true)?;
            record.linger_enabled = Some(user.clone());
            report.did(format!(
                "lingering on for {user} (the service runs without a login session)"
            ));
        }
    }
    if unit_changed {
        m.systemctl(scope, &["daemon-reload"])?;
    }
    if m.query(scope, "is-enabled") {
        report.unchanged += 1;
    } else {
        m.systemctl(scope, &["enable", UNIT_NAME])?;
        report.did(format!("enabled {UNIT_NAME}"));
    }
    if !m.query(scope, "is-active") {
        m.systemctl(scope, &["start", UNIT_NAME])?;
        report.did(format!("started {UNIT_NAME}"));
    } else if unit_changed || binary_changed {
        m.systemctl(scope, &["restart", UNIT_NAME])?;
        report.did(format!(
            "restarted {UNIT_NAME} (running sandboxes were paused to disk and resume now)"
        ));
    } else {
        report.unchanged += 1;
        println!("  {UNIT_NAME} is enabled and running");
    }
    Ok(())
}

pub fn scope_name(scope: Scope) -> &'static str {
    match scope {
        Scope::System => "system unit",
        Scope::User => "user unit",
    }
}
