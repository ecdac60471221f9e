//! `tryboxi apply ID [PATH...]`: bring the sandbox's changes into the host repo, with a backup.
//! Prints the backup id (`art_...`) first; exits 1 when a merge left conflict markers.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    id: String,
    /// Repo-relative paths (files or directories); default: everything.
    paths: Vec<String>,
    /// Print the ApplyReport as JSON.
    #[arg(long)]
    json: bool,
}

/// Print an apply/pull report; conflicts make the exit status 1.
pub fn print_report(r: &api::ApplyReport, json: bool) -> Result<(), TopError> {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(r).map_err(|e| TopError::Other(e.into()))?
        );
    } else {
        match &r.artifact_id {
            Some(a) => println!("{a}"),
            None => println!("nothing changed on the host"),
        }
        for p in &r.applied {
            println!("applied  {p}");
        }
        for p in &r.conflicts {
            println!("CONFLICT {p} (merged with conflict markers)");
        }
        for p in &r.refused {
            eprintln!("refused  {p}");
        }
        for t in &r.too_big {
            eprintln!(
                "too big  {} ({} bytes, over sync.max_file_mib): not brought back, the host's copy left as it is",
                t.path, t.size
            );
        }
        if let Some(a) = &r.artifact_id {
            eprintln!("undo with: tryboxi undo {a}");
        }
    }
    if r.conflicts.is_empty() {
        Ok(())
    } else {
        Err(TopError::ExitStatus(1))
    }
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let req = api::ApplyRequest {
        paths: a.paths,
        force: false,
    };
    let r: api::ApplyReport = client
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{}/apply", a.id),
            Some(&req),
        )
        .await?;
    print_report(&r, a.json)
}
