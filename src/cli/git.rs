//! `tryboxi git allow|ls|deny`: which repositories a sandbox's git reaches over HTTPS with a
//! token the daemon injects (the token never enters the VM), and which branches it may push.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Subcommand)]
pub enum Cmd {
    /// Let a sandbox's git reach HOST/OWNER/REPO with the token of a secret it holds.
    Allow {
        /// Sandbox id.
        id: String,
        /// `HOST/OWNER/REPO` (e.g. `github.com/acme/app`).
        repo: String,
        /// A branch pattern pushes may update (`agent/*`; `!main` denies, deny wins);
        /// repeatable. None: no push.
        #[arg(long = "push", value_name = "PATTERN")]
        push: Vec<String>,
        /// The stored secret holding the token (`tryboxi secret set NAME --host HOST`), given
        /// to the sandbox (`create --secret NAME`).
        #[arg(long, value_name = "NAME")]
        token_secret: String,
    },
    /// List a sandbox's repository grants.
    Ls {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove a repository grant.
    Deny { id: String, repo: String },
}

pub async fn run(c: Cmd) -> Result<(), TopError> {
    let client = super::client()?;
    let (l, json): (api::GitGrantList, bool) = match c {
        Cmd::Allow {
            id,
            repo,
            push,
            token_secret,
        } => {
            let req = api::GitAllowRequest {
                repo,
                push,
                token_secret,
            };
            let l = client
                .send(
                    hyper::Method::POST,
                    &format!("/v1/sandboxes/{id}/git"),
                    Some(&req),
                )
                .await?;
            (l, false)
        }
        Cmd::Ls { id, json } => (client.get(&format!("/v1/sandboxes/{id}/git")).await?, json),
        Cmd::Deny { id, repo } => {
            let q: String = form_urlencoded::byte_serialize(repo.as_bytes()).collect();
            let l = client
                .send::<(), _>(
                    hyper::Method::DELETE,
                    &format!("/v1/sandboxes/{id}/git?repo={q}"),
                    None,
                )
                .await?;
            (l, false)
        }
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&l).expect("serializable")
        );
        return Ok(());
    }
    println!("{:<40} {:<16} PUSH", "REPO", "TOKEN SECRET");
    for g in l.grants {
        let push = if g.push.is_empty() {
            "(no push)".to_owned()
        } else {
            g.push.join(",")
        };
        println!("{:<40} {:<16} {push}", g.repo, g.token_secret);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::Cmd;
    use crate::cli::{Cli, Command};

    #[test]
    fn allow_takes_repeated_push_patterns_and_needs_the_token_secret() {
        let cli = Cli::try_parse_from([
            "tryboxi",
            "git",
            "allow",
            "sbx_0123456789abcdef",
            "github.com/acme/app",
            "--push",
            "agent/*",
            "--push",
            "!agent/main",
            "--token-secret",
            "GH_TOKEN",
        ])
        .unwrap();
        let Command::Git(Cmd::Allow {
            id,
            repo,
            push,
            token_secret,
        }) = cli.command
        else {
            panic!("{:?}", cli.command)
        };
        assert_eq!(
            (id.as_str(), repo.as_str(), token_secret.as_str()),
            ("sbx_0123456789abcdef", "github.com/acme/app", "GH_TOKEN")
        );
        assert_eq!(push, ["agent/*", "!agent/main"]);
        let no_token = ["tryboxi", "git", "allow", "sbx_1", "github.com/a/b"];
        assert!(Cli::try_parse_from(no_token).is_err());
        assert!(Cli::try_parse_from(["tryboxi", "git", "deny", "sbx_1", "github.com/a/b"]).is_ok());
        assert!(Cli::try_parse_from(["tryboxi", "git", "ls", "sbx_1", "--json"]).is_ok());
    }
}
