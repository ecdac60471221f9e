//! Writing configuration files safely: back up what was there, write a temporary file next to
//! the target and rename it over (a crash leaves the old or the new file, never half of one).

use std::path::{Path, PathBuf};

use super::{InstallError, Report};

pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The current content, or `None` if the file does not exist.
pub fn read(path: &Path) -> Result<Option<String>, InstallError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// `path` + `.bak` (`config.toml` -> `config.toml.bak`).
pub fn backup_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".bak");
    PathBuf::from(s)
}

/// Make `path` hold what `change` makes of its current content (`None`: absent), the way
/// [`put`] does: unchanged content left alone, changed content backed up first.
pub fn update(
    path: &Path,
    report: &mut Report,
    change: impl FnOnce(Option<&str>) -> Result<String, InstallError>,
) -> Result<(), InstallError> {
    let old = read(path)?;
    let new = change(old.as_deref())?;
    put(path, old.as_deref(), &new, report)
}

/// Make `path` hold `new`. `old` is its current content (`None`: absent). Unchanged content is
/// left alone; changed content is backed up first.
pub fn put(
    path: &Path,
    old: Option<&str>,
    new: &str,
    report: &mut Report,
) -> Result<(), InstallError> {
    if old == Some(new) {
        report.unchanged.push(path.to_path_buf());
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    if let Some(old) = old {
        let bak = backup_path(path);
        std::fs::write(&bak, old).map_err(io(&bak))?;
        report.backups.push(bak);
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tryboxi-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, new).map_err(io(&tmp))?;
    if let Ok(meta) = std::fs::metadata(path) {
        let _ = std::fs::set_permissions(&tmp, meta.permissions());
    }
    std::fs::rename(&tmp, path).map_err(io(path))?;
    report.written.push(path.to_path_buf());
    Ok(())
}
