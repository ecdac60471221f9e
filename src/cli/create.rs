//! `tryboxi create [-w DIR]`: prints `<sbx_id> <state> <accel> <template>` (the id first, for scripts).

use std::path::PathBuf;

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The workspace (repo) directory synced into /workspace (`-w .` for the current one);
    /// without it the sandbox has no host workspace (an empty /workspace; no sync, diff or
    /// apply).
    #[arg(short = 'w', long = "workspace", value_name = "DIR")]
    workspace: Option<PathBuf>,
    /// Template (`auto` picks one from the repo's files).
    #[arg(long, default_value = "auto")]
    template: String,
    #[arg(long)]
    vcpus: Option<u32>,
    /// Memory in MiB.
    #[arg(long = "memory", value_name = "MIB")]
    memory_mib: Option<u32>,
    /// Never sync paths matching this pattern into this sandbox (like `sync.exclude` in the
    /// config, for this sandbox only). Repeatable.
    #[arg(long = "exclude", value_name = "PATTERN")]
    exclude: Vec<String>,
    /// Egress policy: presets (`registries`, `github`, `none`) and `HOST|CIDR[:PORTS]` allow
    /// rules, comma-separated. Default: the daemon's `[network] default_policy`.
    #[arg(long, value_name = "POLICY")]
    network: Option<String>,
    /// Give the sandbox this stored secret (`tryboxi secret set`): its execs see
    /// `NAME=<placeholder>`, never the value. Repeatable.
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    /// Run this command once the sandbox is ready, with the policy widened by
    /// `--setup-network`, then narrow it back (e.g. `--setup 'npm ci'`).
    #[arg(long, value_name = "CMD")]
    setup: Option<String>,
    /// What the setup command may reach on top of `--network`.
    #[arg(
        long,
        value_name = "POLICY",
        default_value = "registries",
        requires = "setup"
    )]
    setup_network: String,
    /// Print the sandbox as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let workspace = match a.workspace {
        Some(dir) => {
            let dir = std::path::absolute(&dir)
                .map_err(|e| TopError::Usage(format!("{}: {e}", dir.display())))?;
            Some(api::WorkspaceSpec {
                host_path: dir.display().to_string(),
                exclude: a.exclude,
            })
        }
        None if !a.exclude.is_empty() => {
            return Err(TopError::Usage(
                "--exclude needs a workspace (-w DIR)".into(),
            ));
        }
        None => None,
    };
    // What `auto` would pick for this repo, to say so when that layer is not built.
    let wanted = match (&workspace, a.template.as_str()) {
        (Some(w), "auto") => Some(crate::service::templates::detect(std::path::Path::new(
            &w.host_path,
        ))),
        _ => None,
    };
    let req = api::CreateSandboxRequest {
        workspace,
        template: Some(a.template),
        vcpus: a.vcpus,
        memory_mib: a.memory_mib,
        network: a.network.as_ref().map(|n| api::NetworkSpec {
            policy: n.split(',').map(|s| s.trim().to_owned()).collect(),
        }),
        secrets: a.secrets,
    };
    let client = super::client()?;
    let sbx: api::Sandbox = client
        .send(hyper::Method::POST, "/v1/sandboxes", Some(&req))
        .await?;
    if let Some(cmd) = a.setup {
        let setup = api::NetworkSetupRequest {
            cmd,
            policy: a
                .setup_network
                .split(',')
                .map(|s| s.trim().to_owned())
                .collect(),
            timeout_s: None,
        };
        let r: api::NetworkSetupReport = client
            .send(
                hyper::Method::POST,
                &format!("/v1/sandboxes/{}/network/setup", sbx.id),
                Some(&setup),
            )
            .await?;
        eprint!("{}", r.stderr_tail);
        eprintln!(
            "setup: exit {} in {} ms{}; policy narrowed back",
            r.exit_code.map_or("-".into(), |c| c.to_string()),
            r.duration_ms,
            r.error.map(|e| format!(" ({e})")).unwrap_or_default()
        );
    }
    if let Some(note) =
        wanted.and_then(|w| crate::service::templates::fallback_note(w, &sbx.template))
    {
        eprintln!("{note}");
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&sbx).expect("serializable")
        );
    } else {
        println!(
            "{} {} {} {}",
            sbx.id,
            sbx.state,
            sbx.accel.as_deref().unwrap_or("-"),
            sbx.template
        );
    }
    Ok(())
}
