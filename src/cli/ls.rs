//! `tryboxi ls`: one line per sandbox (and, under a failed one, why it failed).

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let list: api::SandboxList = super::client()?.get("/v1/sandboxes").await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&list).expect("serializable")
        );
        return Ok(());
    }
    println!(
        "{:<22} {:<9} {:<5} {:<8} {:>5} {:>7}  {:<20} WORKSPACE",
        "ID", "STATE", "ACCEL", "TEMPLATE", "VCPUS", "MEM_MIB", "CREATED"
    );
    for s in list.sandboxes {
        println!(
            "{:<22} {:<9} {:<5} {:<8} {:>5} {:>7}  {:<20} {}",
            s.id,
            s.state,
            s.accel.as_deref().unwrap_or("-"),
            s.template,
            s.vcpus,
            s.memory_mib,
            s.created_at,
            s.workspace.as_ref().map_or("-", |w| w.host_path.as_str())
        );
        // Its exposed ports, on a line under it.
        if !s.ports.is_empty() {
            let ports: Vec<String> = (s.ports.iter())
                .map(|p| {
                    let down = if p.error.is_some() {
                        " (not listening)"
                    } else {
                        ""
                    };
                    format!("{} -> {}{down}", p.port, p.url)
                })
                .collect();
            println!("  ports: {}", ports.join(", "));
        }
        // Why a sandbox failed, on its own line under it.
        if let Some(e) = s
            .error
            .as_deref()
            .filter(|_| s.state == api::SandboxState::Failed)
        {
            println!("  error: {}", e.lines().next().unwrap_or_default());
        }
    }
    Ok(())
}
