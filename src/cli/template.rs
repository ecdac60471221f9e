//! `tryboxi template ls`: the root filesystems a sandbox can boot; `tryboxi template detect`:
//! which one `auto` picks for a folder (offline, no daemon).

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Subcommand)]
pub enum Cmd {
    /// List the templates the installed images provide.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the template `auto` picks for a repo (by its top-level files), without a daemon.
    Detect {
        /// The repo (default: the current directory).
        dir: Option<std::path::PathBuf>,
    },
}

pub async fn run(cmd: Cmd) -> Result<(), TopError> {
    match cmd {
        Cmd::Detect { dir } => {
            let dir = match dir {
                Some(d) => d,
                None => std::env::current_dir()
                    .map_err(|e| TopError::Usage(format!("the current directory: {e}")))?,
            };
            if !dir.is_dir() {
                return Err(TopError::Usage(format!(
                    "{} is not a directory",
                    dir.display()
                )));
            }
            println!("{}", crate::service::templates::detect(&dir));
        }
        Cmd::Ls { json } => {
            let l: api::TemplateList = super::client()?.get("/v1/templates").await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&l).expect("serializable")
                );
                return Ok(());
            }
            println!("{:<10} {:<28} {:>10}  SHA256", "NAME", "FILE", "SIZE_MIB");
            for t in l.templates {
                println!(
                    "{:<10} {:<28} {:>10}  {}",
                    t.name,
                    t.file,
                    t.size >> 20,
                    t.sha256.get(..16).unwrap_or(&t.sha256)
                );
            }
        }
    }
    Ok(())
}
