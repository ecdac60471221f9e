//! The systemd unit and the service manager.
//!
//! Owns: rendering the unit from its one template (`deploy/systemd/tryboxi.service.in`, built
//! into the binary), finding out whether systemd runs (the `sd_booted` test:
//! `/run/systemd/system` is a directory, below the destdir), and the `systemctl` / `loginctl`
//! calls install and uninstall make. `TRYBOXI_SYSTEMCTL` and `TRYBOXI_LOGINCTL` name other
//! programs to call (tests use a stand-in that records its arguments).
//!
//! Why `KillMode=process` and `Delegate=yes`: see the template's comments and README
//! "Running as a service".

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{InstallError, Scope, UNIT_NAME};

/// The unit template; `@SCOPE@`, `@EXEC_START@`, `@ENVIRONMENT@` and `@WANTED_BY@` are
/// filled in by [`render`].
pub const TEMPLATE: &str = include_str!("../../deploy/systemd/tryboxi.service.in");

/// The unit text for `binary` serving the data root `data_root`.
pub fn render(scope: Scope, binary: &Path, data_root: &Path) -> Result<String, InstallError> {
    let (scope_name, wanted_by) = match scope {
        Scope::System => ("System", "multi-user.target"),
        Scope::User => ("User (with lingering)", "default.target"),
    };
    let exec = format!("{} serve", exec_word(binary)?);
    let env = format!(
        "Environment={}",
        quoted(&format!("TRYBOXI_HOME={}", plain(data_root)?))
    );
    Ok(TEMPLATE
        .replace("@SCOPE@", scope_name)
        .replace("@EXEC_START@", &exec)
        .replace("@ENVIRONMENT@", &env)
        .replace("@WANTED_BY@", wanted_by))
}

/// A path as unit text, refused when it has a character a unit line cannot carry.
fn plain(p: &Path) -> Result<String, InstallError> {
    let s = p
        .to_str()
        .filter(|s| !s.contains(['\n', '\r']))
        .ok_or_else(|| {
            InstallError::Setup(format!(
                "{}: a path a systemd unit cannot name",
                p.display()
            ))
        })?;
    // `%` starts a specifier in every unit setting.
    Ok(s.replace('%', "%%"))
}

/// ExecStart's first word: `$` would expand a variable; quoted when it has spaces or quotes.
fn exec_word(binary: &Path) -> Result<String, InstallError> {
    let s = plain(binary)?.replace('$', "$$");
    if s.contains([' ', '\t', '"', '\'', '\\']) {
        Ok(quoted(&s))
    } else {
        Ok(s)
    }
}

fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The service manager of this host, or why there is none.
#[derive(Debug, Clone)]
pub enum Manager {
    Running {
        systemctl: OsString,
        loginctl: OsString,
        destdir: PathBuf,
    },
    Absent(String),
}

impl Manager {
    /// Whether systemd runs (below `destdir`: with a destdir other than `/` it normally does
    /// not, so nothing on this host is started or stopped).
    pub fn detect(destdir: &Path) -> Manager {
        let booted = destdir.join("run/systemd/system");
        if !booted.is_dir() {
            return Manager::Absent(format!(
                "systemd is not running on this host ({} is not a directory)",
                booted.display()
            ));
        }
        let prog = |var: &str, default: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.into())
        };
        Manager::Running {
            systemctl: prog("TRYBOXI_SYSTEMCTL", "systemctl"),
            loginctl: prog("TRYBOXI_LOGINCTL", "loginctl"),
            destdir: destdir.to_owned(),
        }
    }

    fn systemctl_cmd(&self, scope: Scope) -> Option<Command> {
        let Manager::Running { systemctl, .. } = self else {
            return None;
        };
        let mut c = Command::new(systemctl);
        if scope == Scope::User {
            c.arg("--user");
        }
        Some(c)
    }

    /// `systemctl [--user] ARGS`; an error says what failed and what it printed.
    pub fn systemctl(&self, scope: Scope, args: &[&str]) -> Result<(), InstallError> {
        let Some(mut c) = self.systemctl_cmd(scope) else {
            return Ok(());
        };
        run(c.args(args))
    }

    /// `systemctl [--user] is-active|is-enabled --quiet tryboxi.service` succeeded.
    pub fn query(&self, scope: Scope, what: &str) -> bool {
        self.systemctl_cmd(scope).is_some_and(|mut c| {
            c.args([what, "--quiet", UNIT_NAME])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
    }

    /// Whether `user`'s lingering is on (logind's flag file).
    pub fn linger_on(&self, user: &str) -> bool {
        match self {
            Manager::Running { destdir, .. } => {
                destdir.join("var/lib/systemd/linger").join(user).exists()
            }
            Manager::Absent(_) => false,
        }
    }

    /// `loginctl enable-linger USER` / `disable-linger USER`.
    pub fn linger(&self, user: &str, on: bool) -> Result<(), InstallError> {
        let Manager::Running { loginctl, .. } = self else {
            return Ok(());
        };
        let verb = if on {
            "enable-linger"
        } else {
            "disable-linger"
        };
        run(Command::new(loginctl).args([verb, user]))
    }
}

fn run(c: &mut Command) -> Result<(), InstallError> {
    let shown = format!(
        "{} {}",
        c.get_program().to_string_lossy(),
        c.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = c
        .output()
        .map_err(|e| InstallError::Setup(format!("cannot run `{shown}`: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(InstallError::Setup(format!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// What install prints when it cannot start the service: the files are in place, and this is
/// how to run the daemon by hand.
pub fn absent_message(why: &str, scope: Scope, binary: &Path) -> String {
    let ctl = match scope {
        Scope::System => "systemctl",
        Scope::User => "systemctl --user",
    };
    let b = binary.display();
    format!(
        "the service could not be started: {why}.\n\
         The unit file is in place; on a host booted with systemd, start it with \
         `{ctl} daemon-reload && {ctl} enable --now {UNIT_NAME}`.\n\
         Here, run the daemon by hand: `{b} serve` in the foreground (Ctrl-C pauses sandboxes \
         to disk), or in the background: `nohup {b} serve >>tryboxi.log 2>&1 &`."
    )
}
