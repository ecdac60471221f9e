//! `tryboxi create -w DIR`: prints `<sbx_id> <state> <accel> <template>` (the id first, for scripts).

use std::path::PathBuf;

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The workspace (repo) directory; default: the current directory.
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
    /// Print the sandbox as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let dir = match a.workspace {
        Some(d) => d,
        None => std::env::current_dir().map_err(|e| TopError::Other(e.into()))?,
    };
    let dir = std::path::absolute(&dir)
        .map_err(|e| TopError::Usage(format!("{}: {e}", dir.display())))?;
    let req = api::CreateSandboxRequest {
        workspace: api::WorkspaceSpec {
            host_path: dir.display().to_string(),
            exclude: a.exclude,
        },
        template: Some(a.template),
        vcpus: a.vcpus,
        memory_mib: a.memory_mib,
    };
    let sbx: api::Sandbox = super::client()?
        .send(hyper::Method::POST, "/v1/sandboxes", Some(&req))
        .await?;
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
