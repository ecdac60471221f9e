//! The command line: argument parsing and one file per command. Talks to the daemon only
//! through `client`.

mod apply;
mod create;
mod diff;
mod docs;
mod events;
mod exec;
mod execs;
mod fork;
mod gc;
mod git;
mod install;
mod interactive;
mod logs;
mod ls;
mod mcp;
mod net;
mod pause;
mod port;
mod pull;
mod rm;
mod secret;
mod shell;
mod snapshot;
mod sync;
mod template;
mod trace;
mod undo;
mod uninstall;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::client::{Client, ClientError};
use crate::config::Paths;
use crate::error::TopError;

#[derive(Debug, Parser)]
#[command(
    name = "tryboxi",
    version,
    about = "Disposable Linux microVMs on your own machine, for AI agents",
    after_help = "Also answers to the names sandboxd (= serve), sandboxctl and sandbox-mcp (= mcp).\n\
                  The data root is $TRYBOXI_HOME (default /var/lib/tryboxi as root, else ~/.local/share/tryboxi)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground (also: argv[0] `sandboxd`).
    Serve {
        /// Use guest images from this directory (holding `images/manifest.json`) in place.
        #[arg(long, value_name = "DIR")]
        artifacts: Option<PathBuf>,
        /// Also export per-phase traces over OTLP/HTTP to this collector (e.g.
        /// `http://127.0.0.1:4318`, the `/v1/traces` path is added).
        #[arg(long, value_name = "URL")]
        otlp_endpoint: Option<String>,
        /// Also serve the E2B-compatible API on this address (e.g. `127.0.0.1:49982`; config
        /// `e2b_listen`): E2B SDK code runs with `E2B_API_URL=E2B_SANDBOX_URL=http://ADDR` and
        /// `E2B_API_KEY=$(tryboxi token)`.
        #[arg(long = "e2b", value_name = "ADDR")]
        e2b: Option<std::net::SocketAddr>,
    },
    /// Install: guest images (from `cargo xtask images`) into the data root; the binary, its
    /// aliases, completions and man pages under a prefix; and the systemd unit, started (a
    /// system unit as root, a user unit with lingering otherwise; `--no-service`: none).
    Install(install::Args),
    /// Stop and remove the service and everything install put on the host; the data root
    /// stays unless `--purge` (confirmed).
    Uninstall(uninstall::Args),
    /// Create a sandbox (`-w DIR`: synced from that host folder; none: no host workspace);
    /// prints its id first on the line.
    Create(create::Args),
    /// Run a command in a sandbox; exits with the command's exit code.
    Exec(exec::Args),
    /// An interactive login shell in a sandbox (bash, else sh) on a pseudo-terminal: raw mode,
    /// window resizes, Ctrl-C to the guest; Ctrl-P Ctrl-Q detaches (`tryboxi attach` returns).
    Shell(shell::Args),
    /// Follow a running (or ended) exec: its output so far, then live; exits with its code.
    /// A pty exec attached from a terminal is interactive again (input, resizes, detach keys).
    Attach {
        /// Exec id (`exe_...`, printed by `exec -d`).
        exec_id: String,
        /// Only what comes from now on.
        #[arg(long)]
        no_replay: bool,
        /// Send standard input to the command (default for a pty exec when stdin is a
        /// terminal).
        #[arg(short = 'i', long)]
        interactive: bool,
    },
    /// List a sandbox's running execs (id, pid, start, flags, tag, command).
    Execs {
        /// Sandbox id.
        id: String,
    },
    /// Send a signal to a running exec's process group.
    Kill {
        /// Exec id.
        exec_id: String,
        /// A signal number or name (TERM, SIGKILL, 9...).
        #[arg(short = 's', long, default_value = "TERM")]
        signal: String,
    },
    /// List sandboxes.
    Ls(ls::Args),
    /// Remove a sandbox (its VM and every file of it).
    Rm(rm::Args),
    /// Send the host repo's changes into a sandbox now (exec and create do it too).
    Sync(sync::Args),
    /// Show what changed inside a sandbox since the last sync.
    Diff(diff::Args),
    /// Bring a sandbox's changes into the host repo (with a backup; prints `art_...`).
    Apply(apply::Args),
    /// Copy selected files from a sandbox (with a backup).
    Pull(pull::Args),
    /// Restore what an apply or pull changed.
    Undo(undo::Args),
    /// Follow the daemon's events live (sandbox created/ready/failed/removed, exec started/finished).
    Events(events::Args),
    /// Per-phase waterfall of a sandbox or exec.
    Trace(trace::Args),
    /// Checkpoint a sandbox, or list its snapshots.
    #[command(subcommand)]
    Snapshot(snapshot::Cmd),
    /// New sandboxes that start from the current state of a sandbox, or from one of its
    /// snapshots (prints their ids).
    Fork {
        /// Sandbox id.
        id: String,
        /// How many children.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Start the children from this snapshot (id or name) of the sandbox instead of its
        /// current state (the sandbox may be paused or retired).
        #[arg(long, value_name = "SNAPSHOT")]
        from: Option<String>,
    },
    /// Pause a sandbox to disk (any use resumes it).
    Pause {
        /// Sandbox id.
        id: String,
        /// Keep the disk alone (E2B's mode "filesystem"): the guest writes back its files and
        /// powers off; the next start boots afresh on that disk (processes are gone).
        #[arg(long)]
        filesystem: bool,
    },
    /// Resume a paused sandbox.
    Resume {
        /// Sandbox id.
        id: String,
        /// Boot afresh on the sandbox's disk, dropping its memory state: files kept,
        /// processes gone (the way back when a pause's state cannot be loaded any more).
        #[arg(long)]
        reboot: bool,
    },
    /// Put a sandbox back to a snapshot (memory, processes and disk).
    Restore {
        /// Sandbox id.
        id: String,
        /// Snapshot id or name.
        snapshot: String,
        /// Boot afresh on the snapshot's disk instead of loading its memory (the way back
        /// when its state cannot be loaded any more, e.g. after an upgrade).
        #[arg(long)]
        reboot: bool,
    },
    /// A sandbox's egress policy and the agent's access requests (show, allow, deny,
    /// requests, approve, reject, setup).
    #[command(subcommand)]
    Net(net::Cmd),
    /// The host's secrets (set, ls, rm): values stay on the host; sandboxes given one
    /// (`create --secret NAME`) see only a placeholder.
    #[command(subcommand)]
    Secret(secret::Cmd),
    /// A sandbox's git repository grants (allow, ls, deny): git over HTTPS to an allowed
    /// repository gets the token (injected outside the VM); pushes only to allowed branches.
    #[command(subcommand)]
    Git(git::Cmd),
    /// Expose a guest port on a host loopback port (prints the URL), `--rm PORT` to stop,
    /// no port to list.
    Port(port::Args),
    /// Print an exec's kept output (stdout and stderr).
    Logs(logs::Args),
    /// List templates (`base` and the layers built by `cargo xtask images`).
    #[command(subcommand)]
    Template(template::Cmd),
    /// Delete orphaned VM directories, old snapshots, stale golden snapshots and old backups.
    Gc(gc::Args),
    /// Check the host: QEMU, KVM or TCG, guest images, data root, daemon, memory, disk.
    Doctor {
        /// Check the guest images in this directory instead of the installed ones.
        #[arg(long, value_name = "DIR")]
        artifacts: Option<PathBuf>,
    },
    /// MCP stdio server for agents (also: argv[0] `sandbox-mcp`); `mcp install` sets up
    /// Cursor, Claude Code or Codex.
    Mcp(mcp::Args),
    /// Print the API token for TCP clients (and, with `tcp_tls`, the certificate fingerprint
    /// they pin, on stderr).
    Token {
        /// Print only the TLS certificate's SHA-256 fingerprint (making the certificate if
        /// there is none yet), for `TRYBOXI_FINGERPRINT`.
        #[arg(long)]
        fingerprint: bool,
    },
    /// Print a shell completion script (e.g. `tryboxi completions bash >
    /// ~/.local/share/bash-completion/completions/tryboxi`; install puts them in place).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff; `tryboxi man | man -l -`), or write every page with `--dir`.
    Man(docs::ManArgs),
    /// Print the version.
    Version,
}

/// Entry for every face but the guest agent. `argv0` picks the face for alias names.
pub fn run(argv0: &str) -> ExitCode {
    let args = match alias_args(argv0, std::env::args_os().collect()) {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{argv0}: {msg}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(args);
    match dispatch(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(TopError::ExitStatus(c)) => ExitCode::from(c),
        Err(e) => {
            eprintln!("tryboxi: {e}");
            e.exit_code()
        }
    }
}

/// The daemon's own commands, which `sandboxd` takes as `tryboxi` does.
const DAEMON_COMMANDS: [&str; 6] = ["serve", "install", "uninstall", "doctor", "token", "help"];

/// The arguments as `tryboxi` would take them, for the alias names of the spec:
/// `sandboxd [serve|install|uninstall|doctor|token] ...` (nothing, or only options: `serve`),
/// `sandboxctl <any command>` (as `tryboxi`), `sandbox-mcp ...` (= `tryboxi mcp ...`).
fn alias_args(argv0: &str, mut args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let first = args.get(1).map(|a| a.to_string_lossy().into_owned());
    match argv0 {
        "sandboxd" => match first.as_deref() {
            Some(c) if DAEMON_COMMANDS.contains(&c) => {}
            None => args.insert(1.min(args.len()), "serve".into()),
            Some("-h" | "--help" | "-V" | "--version") => {}
            Some(o) if o.starts_with('-') => args.insert(1, "serve".into()),
            Some(other) => {
                return Err(format!(
                    "`{other}` is not a daemon command (sandboxd takes serve, install, uninstall, \
                     doctor, token); the CLI is `sandboxctl {other}`"
                ));
            }
        },
        // `sandbox-mcp` is `tryboxi mcp`: usage lines say so (not `sandbox-mcp mcp`).
        "sandbox-mcp" => {
            if let Some(name) = args.first_mut() {
                *name = "tryboxi".into();
            }
            args.insert(1.min(args.len()), "mcp".into());
        }
        _ => {}
    }
    Ok(args)
}

fn dispatch(cmd: Command) -> Result<(), TopError> {
    match cmd {
        Command::Serve {
            artifacts,
            otlp_endpoint,
            e2b,
        } => {
            // Before the runtime's threads exist (see `oom::HEAP_ARENAS`).
            let heap_limited = crate::oom::limit_heap_arenas();
            init_logging(false);
            if !heap_limited {
                tracing::warn!(
                    "glibc refused the daemon's malloc settings; running with its defaults"
                );
            }
            runtime()?
                .block_on(crate::daemon::serve(crate::daemon::ServeOptions {
                    artifacts,
                    otlp_endpoint,
                    e2b,
                }))
                .map_err(|e| TopError::Other(e.into()))
        }
        Command::Install(a) => install::run(a),
        Command::Uninstall(a) => uninstall::run(a),
        Command::Completions { shell } => docs::completions(shell),
        Command::Man(a) => docs::man(a),
        Command::Create(a) => runtime()?.block_on(create::run(a)),
        Command::Exec(a) => runtime()?.block_on(exec::run(a)),
        Command::Shell(a) => runtime()?.block_on(shell::run(a)),
        Command::Attach {
            exec_id,
            no_replay,
            interactive,
        } => runtime()?.block_on(execs::attach(exec_id, no_replay, interactive)),
        Command::Execs { id } => runtime()?.block_on(execs::list(id)),
        Command::Kill { exec_id, signal } => runtime()?.block_on(execs::kill(exec_id, signal)),
        Command::Ls(a) => runtime()?.block_on(ls::run(a)),
        Command::Rm(a) => runtime()?.block_on(rm::run(a)),
        Command::Sync(a) => runtime()?.block_on(sync::run(a)),
        Command::Diff(a) => runtime()?.block_on(diff::run(a)),
        Command::Apply(a) => runtime()?.block_on(apply::run(a)),
        Command::Pull(a) => runtime()?.block_on(pull::run(a)),
        Command::Undo(a) => runtime()?.block_on(undo::run(a)),
        Command::Mcp(a) => mcp::run(a),
        Command::Doctor { artifacts } => runtime()?.block_on(crate::doctor::run(artifacts)),
        Command::Token { fingerprint } => token(fingerprint),
        Command::Version => {
            println!("tryboxi {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Command::Events(a) => runtime()?.block_on(events::run(a)),
        Command::Trace(a) => runtime()?.block_on(trace::run(a)),
        Command::Snapshot(c) => runtime()?.block_on(snapshot::run(c)),
        Command::Restore {
            id,
            snapshot,
            reboot,
        } => runtime()?.block_on(snapshot::restore(id, snapshot, reboot)),
        Command::Fork { id, count, from } => runtime()?.block_on(fork::run(id, count, from)),
        Command::Pause { id, filesystem } => runtime()?.block_on(pause::pause(id, !filesystem)),
        Command::Resume { id, reboot } => runtime()?.block_on(pause::resume(id, reboot)),
        Command::Port(a) => runtime()?.block_on(port::run(a)),
        Command::Logs(a) => runtime()?.block_on(logs::run(a)),
        Command::Template(c) => runtime()?.block_on(template::run(c)),
        Command::Gc(a) => runtime()?.block_on(gc::run(a)),
        Command::Net(c) => runtime()?.block_on(net::run(c)),
        Command::Secret(c) => runtime()?.block_on(secret::run(c)),
        Command::Git(c) => runtime()?.block_on(git::run(c)),
    }
}

/// `tryboxi token`: the token on stdout (scripts use `$(tryboxi token)`); with `tcp_tls`
/// the fingerprint and how to use both on stderr. `--fingerprint`: only the fingerprint.
fn token(only_fingerprint: bool) -> Result<(), TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    std::fs::create_dir_all(&paths.root).map_err(|e| TopError::Other(e.into()))?;
    let other = |e: crate::daemon::DaemonError| TopError::Other(e.into());
    if only_fingerprint {
        println!(
            "{}",
            crate::daemon::tls::ensure_identity(&paths)
                .map_err(other)?
                .fingerprint()
        );
        return Ok(());
    }
    let token = crate::daemon::ensure_token(&paths).map_err(other)?;
    println!("{token}");
    let config = crate::config::Config::load(&paths).map_err(|e| TopError::Usage(e.to_string()))?;
    if let (Some(addr), true) = (config.tcp_listen, config.tcp_tls) {
        let fp = crate::daemon::tls::ensure_identity(&paths)
            .map_err(other)?
            .fingerprint();
        eprintln!("tls fingerprint: {fp}");
        eprintln!(
            "clients: TRYBOXI_URL=https://<this host>:{} TRYBOXI_TOKEN=<the token> \
             TRYBOXI_FINGERPRINT={fp}",
            addr.port()
        );
    }
    Ok(())
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, TopError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| TopError::Other(e.into()))
}

/// Logs to stderr, filtered by `TRYBOXI_LOG` (default `info`); `plain`: never colours (else
/// the subscriber's default).
fn init_logging(plain: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TRYBOXI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let fmt = if plain { fmt.with_ansi(false) } else { fmt };
    let _ = fmt.try_init();
}

/// The client for this data root's daemon, or the one `TRYBOXI_URL` names.
pub(crate) fn client() -> Result<Client, TopError> {
    let paths = Paths::discover().map_err(|e| TopError::Usage(e.to_string()))?;
    Client::from_env(&paths).map_err(TopError::Usage)
}

impl From<ClientError> for TopError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Unreachable { .. } => TopError::Unreachable(e.to_string()),
            ClientError::Api { code, message, .. } => TopError::Api { code, message },
            ClientError::NotAllowed(m) => TopError::Refused(m),
            ClientError::Protocol(m) => TopError::Other(anyhow::anyhow!(m)),
        }
    }
}
