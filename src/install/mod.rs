//! Putting tryboxi on the host and taking it off again: the binary and its alias names, shell
//! completions, man pages and the systemd unit (`tryboxi install` / `tryboxi uninstall`; the
//! guest images are `cli/install.rs`).
//!
//! Owns: where each file goes ([`Layout`]: system-wide under `/usr/local` and
//! `/etc/systemd/system` for root, under `~/.local` and `~/.config/systemd/user` otherwise,
//! all below an optional `--destdir`), writing a file only when its content differs
//! ([`put`]), and the install record (`installed.json` in the data root: every path install
//! wrote, so uninstall removes exactly those).
//! Never: overwrites a file at an alias name that is not a symlink, or removes a path that is
//! not in the record.

pub mod systemd;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{0} exists and is not a symlink made by tryboxi: remove it or install elsewhere (--prefix)"
    )]
    NotOurs(PathBuf),
    #[error("{0}")]
    Setup(String),
}

pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The names the binary also answers to (symlinks next to it).
pub const ALIASES: [&str; 3] = ["sandboxd", "sandboxctl", "sandbox-mcp"];

/// The shells install puts a completion script in place for.
pub const COMPLETION_SHELLS: [clap_complete::Shell; 3] = [
    clap_complete::Shell::Bash,
    clap_complete::Shell::Zsh,
    clap_complete::Shell::Fish,
];

/// The unit's name, for both scopes.
pub const UNIT_NAME: &str = "tryboxi.service";

/// Which service manager instance runs the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// The system manager (root): `/etc/systemd/system`, `WantedBy=multi-user.target`.
    System,
    /// The user's own manager (with lingering, so it runs without a login session).
    User,
}

/// Where install puts each file. Paths are as the running system sees them; [`Layout::staged`]
/// is where they are written (below `destdir`, `/` unless `--destdir`).
#[derive(Debug, Clone)]
pub struct Layout {
    pub scope: Scope,
    pub destdir: PathBuf,
    /// `/usr/local` (system) or `~/.local` (user), or `--prefix`.
    pub prefix: PathBuf,
    /// The unit file.
    pub unit: PathBuf,
    /// The user whose lingering a user unit needs (`None` for the system scope).
    pub user: Option<String>,
}

impl Layout {
    /// The layout for this process: system scope as root, else user scope under `home`
    /// (`$HOME`). `config_home` is `$XDG_CONFIG_HOME` when set.
    pub fn new(
        is_root: bool,
        home: Option<&Path>,
        config_home: Option<&Path>,
        user: Option<String>,
        prefix: Option<PathBuf>,
        destdir: Option<PathBuf>,
    ) -> Result<Layout, InstallError> {
        let destdir = destdir.unwrap_or_else(|| PathBuf::from("/"));
        if is_root {
            return Ok(Layout {
                scope: Scope::System,
                destdir,
                prefix: prefix.unwrap_or_else(|| PathBuf::from("/usr/local")),
                unit: Path::new("/etc/systemd/system").join(UNIT_NAME),
                user: None,
            });
        }
        let home = home.ok_or_else(|| {
            InstallError::Setup("HOME is not set: cannot place a user install".into())
        })?;
        let config = config_home
            .map(Path::to_owned)
            .unwrap_or_else(|| home.join(".config"));
        Ok(Layout {
            scope: Scope::User,
            destdir,
            prefix: prefix.unwrap_or_else(|| home.join(".local")),
            unit: config.join("systemd/user").join(UNIT_NAME),
            user,
        })
    }

    /// [`Layout::new`] from this process's uid and environment.
    pub fn discover(
        prefix: Option<PathBuf>,
        destdir: Option<PathBuf>,
    ) -> Result<Layout, InstallError> {
        let uid = nix::unistd::geteuid();
        let env_path = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let user = crate::accounts::by_uid(uid.as_raw())
            .map(|u| u.name)
            .or_else(|| std::env::var("USER").ok());
        let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        Layout::new(
            uid.is_root(),
            env_path("HOME").as_deref(),
            env_path("XDG_CONFIG_HOME").as_deref(),
            user,
            prefix.map(abs),
            destdir.map(abs),
        )
    }

    /// Where a runtime path is written: below `destdir`.
    pub fn staged(&self, p: &Path) -> PathBuf {
        self.destdir.join(p.strip_prefix("/").unwrap_or(p))
    }
    pub fn bin_dir(&self) -> PathBuf {
        self.prefix.join("bin")
    }
    pub fn binary(&self) -> PathBuf {
        self.bin_dir().join("tryboxi")
    }
    pub fn alias(&self, name: &str) -> PathBuf {
        self.bin_dir().join(name)
    }
    pub fn man_dir(&self) -> PathBuf {
        self.prefix.join("share/man/man1")
    }
    /// The completion script for a shell, where that shell looks for it under the prefix
    /// (bash-completion, zsh's site-functions, fish's vendor completions).
    pub fn completion(&self, shell: clap_complete::Shell) -> Option<PathBuf> {
        let share = self.prefix.join("share");
        Some(match shell {
            clap_complete::Shell::Bash => share.join("bash-completion/completions/tryboxi"),
            clap_complete::Shell::Zsh => share.join("zsh/site-functions/_tryboxi"),
            clap_complete::Shell::Fish => share.join("fish/vendor_completions.d/tryboxi.fish"),
            _ => return None,
        })
    }
}

/// What one install or uninstall did, printed as it goes and summed up at the end.
#[derive(Debug, Default)]
pub struct Report {
    pub changed: Vec<String>,
    pub unchanged: usize,
}

impl Report {
    pub fn did(&mut self, what: String) {
        println!("  {what}");
        self.changed.push(what);
    }
}

/// Make `path` (already staged) hold `content` with `mode`: written to a temporary file next to
/// it and renamed over, only when the content or mode differs. Returns whether it wrote.
pub fn put(path: &Path, content: &[u8], mode: u32) -> Result<bool, InstallError> {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.is_file()
        && meta.len() == content.len() as u64
        && meta.permissions().mode() & 0o7777 == mode
        && std::fs::read(path).map_err(io(path))? == content
    {
        return Ok(false);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tryboxi-{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, content).map_err(io(&tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))?;
    Ok(true)
}

/// Make `link` a symlink to `target`. Returns whether it changed anything; refuses to replace
/// anything but a symlink.
pub fn put_symlink(link: &Path, target: &str) -> Result<bool, InstallError> {
    match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_symlink() => {
            if std::fs::read_link(link).map_err(io(link))? == Path::new(target) {
                return Ok(false);
            }
            std::fs::remove_file(link).map_err(io(link))?;
        }
        Ok(_) => return Err(InstallError::NotOurs(link.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(link)(e)),
    }
    if let Some(dir) = link.parent() {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    std::os::unix::fs::symlink(target, link).map_err(io(link))?;
    Ok(true)
}

/// Remove a file or symlink install wrote. Returns whether it was there.
pub fn remove(path: &Path) -> Result<bool, InstallError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(path)(e)),
    }
}

/// `installed.json` in the data root: what install put on the host, for uninstall.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The scope of the unit (and of the manager that runs it), if one was written.
    pub scope: Option<Scope>,
    /// The destdir the paths below are staged in (`/` normally).
    pub destdir: PathBuf,
    /// The unit file (runtime path), if one was written.
    pub unit: Option<PathBuf>,
    /// Every other file and symlink (runtime paths).
    pub files: Vec<PathBuf>,
    /// The user whose lingering install turned on (it was off): uninstall turns it off again.
    pub linger_enabled: Option<String>,
}

impl Default for Record {
    /// Nothing installed, below `/`.
    fn default() -> Record {
        Record {
            scope: None,
            destdir: PathBuf::from("/"),
            unit: None,
            files: Vec::new(),
            linger_enabled: None,
        }
    }
}

impl Record {
    pub fn path(data_root: &Path) -> PathBuf {
        data_root.join("installed.json")
    }

    /// The record, `None` when there is none.
    pub fn load(data_root: &Path) -> Result<Option<Record>, InstallError> {
        let p = Record::path(data_root);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| InstallError::Setup(format!("{}: {e}", p.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&p)(e)),
        }
    }

    pub fn save(&self, data_root: &Path) -> Result<bool, InstallError> {
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| InstallError::Setup(format!("install record: {e}")))?;
        put(&Record::path(data_root), &text, 0o600)
    }

    /// Add a file (kept unique, in install order).
    pub fn add(&mut self, p: PathBuf) {
        if !self.files.contains(&p) {
            self.files.push(p);
        }
    }

    pub fn staged(&self, p: &Path) -> PathBuf {
        self.destdir.join(p.strip_prefix("/").unwrap_or(p))
    }
}
