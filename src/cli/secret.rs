//! `tryboxi secret set|ls|rm`: the host's secret store. `set` reads the value from stdin, or
//! from a prompt that does not echo when stdin is a terminal; never from argv (it would show
//! in `ps` and the shell history).

use std::io::{IsTerminal as _, Read as _};

use zeroize::Zeroizing;

use crate::api;
use crate::error::TopError;
use crate::secrets::store::MAX_VALUE;

#[derive(Debug, clap::Subcommand)]
pub enum Cmd {
    /// Store a secret; the value is read from stdin (or a prompt without echo).
    Set {
        /// Its name, also the env var sandboxes see: `[A-Z_][A-Z0-9_]*`.
        name: String,
        /// A host (DNS name) whose HTTPS requests get the value; repeatable.
        #[arg(long = "host", value_name = "HOST", required = true)]
        hosts: Vec<String>,
        /// One more header that carries the value (beyond Authorization, X-Api-Key, ...);
        /// repeatable.
        #[arg(long = "header", value_name = "NAME")]
        headers: Vec<String>,
        /// The value may also be swapped into request bodies.
        #[arg(long)]
        in_body: bool,
    },
    /// List stored secrets: names, hosts, headers, dates (never values).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Remove a stored secret (sandboxes holding it lose it).
    Rm { name: String },
}

pub async fn run(c: Cmd) -> Result<(), TopError> {
    let client = super::client()?;
    match c {
        Cmd::Set {
            name,
            hosts,
            headers,
            in_body,
        } => {
            crate::secrets::store::check_name(&name).map_err(|e| TopError::Usage(e.to_string()))?;
            let value = read_value(&name)?;
            let req = api::SetSecretRequest {
                value: api::SecretText(value),
                hosts,
                headers,
                in_body,
            };
            let s: api::SecretInfo = client
                .send(
                    hyper::Method::PUT,
                    &format!("/v1/secrets/{name}"),
                    Some(&req),
                )
                .await?;
            println!("{} stored for {}", s.name, s.hosts.join(", "));
            for id in &s.already_synced_to {
                eprintln!(
                    "warning: the synced files of {id} already hold this value (synced before it \
                     was stored): remove the sandbox, or remove the file and sync again"
                );
            }
        }
        Cmd::Ls { json } => {
            let l: api::SecretList = client
                .send::<(), _>(hyper::Method::GET, "/v1/secrets", None)
                .await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&l).expect("serializable")
                );
                return Ok(());
            }
            println!("{:<24} {:<32} {:<21} LAST USED", "NAME", "HOSTS", "CREATED");
            for s in l.secrets {
                let mut hosts = s.hosts.join(",");
                if !s.headers.is_empty() {
                    hosts.push_str(&format!(" (+{})", s.headers.join(",")));
                }
                println!(
                    "{:<24} {:<32} {:<21} {}",
                    s.name,
                    hosts,
                    s.created_at,
                    s.last_used_at.as_deref().unwrap_or("-")
                );
            }
        }
        Cmd::Rm { name } => {
            let s: api::SecretInfo = client
                .send::<(), _>(hyper::Method::DELETE, &format!("/v1/secrets/{name}"), None)
                .await?;
            println!("{} removed", s.name);
        }
    }
    Ok(())
}

/// The value: a prompt without echo on a terminal, else all of stdin. One trailing newline
/// (`echo`, a heredoc) is dropped.
fn read_value(name: &str) -> Result<Zeroizing<String>, TopError> {
    let stdin = std::io::stdin();
    let mut raw = Zeroizing::new(Vec::new());
    if stdin.is_terminal() {
        // Echo off before the prompt: nothing typed (or pasted) after the prompt shows.
        let _echo = NoEcho::new().map_err(|e| TopError::Other(e.into()))?;
        eprint!("value of {name} (not shown): ");
        let mut line = Zeroizing::new(String::new());
        stdin
            .read_line(&mut line)
            .map_err(|e| TopError::Other(e.into()))?;
        eprintln!();
        raw.extend_from_slice(line.as_bytes());
    } else {
        stdin
            .lock()
            .take(MAX_VALUE as u64 + 2)
            .read_to_end(&mut raw)
            .map_err(|e| TopError::Other(e.into()))?;
    }
    if raw.last() == Some(&b'\n') {
        raw.pop();
        if raw.last() == Some(&b'\r') {
            raw.pop();
        }
    }
    if raw.is_empty() {
        return Err(TopError::Usage(format!("no value for {name} on stdin")));
    }
    if raw.len() > MAX_VALUE {
        return Err(TopError::Usage(format!(
            "the value of {name} is longer than {MAX_VALUE} bytes"
        )));
    }
    let s = std::str::from_utf8(&raw)
        .map_err(|_| TopError::Usage(format!("the value of {name} is not UTF-8 text")))?;
    Ok(Zeroizing::new(s.to_owned()))
}

/// Terminal echo off while alive (restored on drop).
struct NoEcho {
    saved: nix::sys::termios::Termios,
}

impl NoEcho {
    fn new() -> nix::Result<NoEcho> {
        use nix::sys::termios::{LocalFlags, SetArg, tcgetattr, tcsetattr};
        let fd = std::io::stdin();
        let saved = tcgetattr(&fd)?;
        let mut t = saved.clone();
        t.local_flags.remove(LocalFlags::ECHO);
        t.local_flags.insert(LocalFlags::ECHONL);
        tcsetattr(&fd, SetArg::TCSANOW, &t)?;
        Ok(NoEcho { saved })
    }
}

impl Drop for NoEcho {
    fn drop(&mut self) {
        let _ = nix::sys::termios::tcsetattr(
            std::io::stdin(),
            nix::sys::termios::SetArg::TCSANOW,
            &self.saved,
        );
    }
}
