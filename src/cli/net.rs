//! `tryboxi net ...`: a sandbox's egress policy and the agent's access requests.
//! `policy` shows, `allow`/`deny` add rules, `requests` lists what the agent asked for,
//! `approve`/`reject` decide (only the user: the MCP face has no such tool), `setup` runs a
//! command with a wider policy and narrows it back.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Subcommand)]
pub enum Cmd {
    /// Show the policy: presets, rules, pending requests.
    Policy {
        /// Sandbox id.
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Allow `HOST`, `*.SUFFIX`, `IP` or `CIDR`, optionally `:PORTS` (names: 80/443 only).
    Allow { id: String, target: String },
    /// Deny `HOST`, `*.SUFFIX`, `IP` or `CIDR`, optionally `:PORTS`; deny rules win.
    Deny { id: String, target: String },
    /// List the agent's access requests.
    Requests {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Approve an access request (adds its allow rule at once).
    Approve {
        id: String,
        /// Request id (`req_...`).
        request: String,
    },
    /// Reject an access request.
    Reject { id: String, request: String },
    /// Run CMD with the policy widened by PRESET/rules, then narrow it back.
    Setup {
        id: String,
        /// Presets and allow rules for the command, comma-separated (e.g. `registries`).
        #[arg(long = "network", value_name = "POLICY", default_value = "registries")]
        network: String,
        #[arg(long)]
        timeout: Option<f64>,
        /// The command line (run by /bin/sh -c in /workspace).
        cmd: String,
    },
}

pub async fn run(cmd: Cmd) -> Result<(), TopError> {
    let c = super::client()?;
    match cmd {
        Cmd::Policy { id, json } => {
            let p: api::NetworkPolicy = c.get(&format!("/v1/sandboxes/{id}/network")).await?;
            print_policy(&p, json);
        }
        Cmd::Allow { id, target } => change(&c, &id, "allow", target).await?,
        Cmd::Deny { id, target } => change(&c, &id, "deny", target).await?,
        Cmd::Requests { id, json } => {
            let l: api::AccessRequestList = c
                .get(&format!("/v1/sandboxes/{id}/network/requests"))
                .await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&l).expect("serializable")
                );
                return Ok(());
            }
            println!("{:<22} {:<9} {:<32} REASON", "ID", "STATE", "RULE");
            for r in l.requests {
                println!(
                    "{:<22} {:<9} {:<32} {}",
                    r.id,
                    format!("{:?}", r.state).to_lowercase(),
                    r.rule,
                    r.reason.as_deref().unwrap_or("-")
                );
            }
        }
        Cmd::Approve { id, request } => decide(&c, &id, &request, "approve").await?,
        Cmd::Reject { id, request } => decide(&c, &id, &request, "reject").await?,
        Cmd::Setup {
            id,
            network,
            timeout,
            cmd,
        } => {
            let req = api::NetworkSetupRequest {
                cmd,
                policy: network.split(',').map(|s| s.trim().to_owned()).collect(),
                timeout_s: timeout,
            };
            let r: api::NetworkSetupReport = c
                .send(
                    hyper::Method::POST,
                    &format!("/v1/sandboxes/{id}/network/setup"),
                    Some(&req),
                )
                .await?;
            print!("{}", r.stdout_tail);
            eprint!("{}", r.stderr_tail);
            if let Some(e) = r.error {
                return Err(TopError::Other(anyhow::anyhow!("setup failed: {e}")));
            }
            eprintln!(
                "setup finished in {} ms (exit {}); the policy is narrowed back",
                r.duration_ms,
                r.exit_code.map_or("-".into(), |c| c.to_string())
            );
            match r.exit_code {
                Some(0) => {}
                Some(code) => return Err(TopError::ExitStatus(code.clamp(1, 255) as u8)),
                None => return Err(TopError::ExitStatus(1)),
            }
        }
    }
    Ok(())
}

async fn change(
    c: &crate::client::Client,
    id: &str,
    verdict: &str,
    target: String,
) -> Result<(), TopError> {
    let p: api::NetworkPolicy = c
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/network/rules"),
            Some(&api::NetworkRuleChange {
                verdict: verdict.into(),
                target,
            }),
        )
        .await?;
    print_policy(&p, false);
    Ok(())
}

async fn decide(
    c: &crate::client::Client,
    id: &str,
    request: &str,
    verb: &str,
) -> Result<(), TopError> {
    let r: api::AccessRequest = c
        .send::<(), _>(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/network/requests/{request}/{verb}"),
            None,
        )
        .await?;
    println!(
        "{} {} {}",
        r.id,
        format!("{:?}", r.state).to_lowercase(),
        r.rule
    );
    Ok(())
}

fn print_policy(p: &api::NetworkPolicy, json: bool) {
    if json {
        println!("{}", serde_json::to_string_pretty(p).expect("serializable"));
        return;
    }
    println!(
        "presets: {}",
        if p.presets.is_empty() {
            "none".into()
        } else {
            p.presets.join(", ")
        }
    );
    for r in &p.rules {
        println!("  {r}");
    }
    if !p.setup_widening.is_empty() {
        println!(
            "setup running, also allows: {}",
            p.setup_widening.join(", ")
        );
    }
    println!(
        "always blocked: loopback, private (RFC 1918), CGNAT, link-local/metadata, ULA, the host"
    );
    if p.pending_requests > 0 {
        println!(
            "{} access request(s) pending: tryboxi net requests {}",
            p.pending_requests, p.sandbox_id
        );
    }
}
