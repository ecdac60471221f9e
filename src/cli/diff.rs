//! `tryboxi diff ID [--stat] [PATH...]`: what changed in the sandbox since the last sync.

use crate::api::{self, ChangeKind};
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    id: String,
    /// Repo-relative paths (files or directories) to limit the diff to.
    paths: Vec<String>,
    /// One line per file with counts, no patches.
    #[arg(long)]
    stat: bool,
    /// Print the DiffReport as JSON.
    #[arg(long)]
    json: bool,
}

/// `/v1/sandboxes/{id}/diff?stat=..&path=..`
pub fn query(id: &str, stat: bool, paths: &[String]) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    if stat {
        q.append_pair("stat", "true");
    }
    for p in paths {
        q.append_pair("path", p);
    }
    let q = q.finish();
    if q.is_empty() {
        format!("/v1/sandboxes/{id}/diff")
    } else {
        format!("/v1/sandboxes/{id}/diff?{q}")
    }
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let r: api::DiffReport = client.get(&query(&a.id, a.stat, &a.paths)).await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| TopError::Other(e.into()))?
        );
        return Ok(());
    }
    if a.stat {
        let (mut add, mut del) = (0, 0);
        for f in &r.files {
            add += f.additions;
            del += f.deletions;
            let what = match (f.kind, &f.old_path) {
                (ChangeKind::Renamed, Some(o)) => format!("{o} => {}", f.path),
                _ => f.path.clone(),
            };
            if f.binary {
                println!(" {what} | binary ({:?})", f.kind);
            } else {
                println!(" {what} | +{} -{}", f.additions, f.deletions);
            }
        }
        println!(
            " {} file(s) changed, {add} insertion(s)(+), {del} deletion(s)(-)",
            r.files.len()
        );
        print_refused(&r);
        return Ok(());
    }
    for f in &r.files {
        let from = f.old_path.as_deref().unwrap_or(&f.path);
        println!("diff --tryboxi a/{from} b/{}", f.path);
        match f.kind {
            ChangeKind::Added => println!("new file mode {:o}", f.new_mode.unwrap_or(0)),
            ChangeKind::Deleted => println!("deleted file mode {:o}", f.old_mode.unwrap_or(0)),
            ChangeKind::Renamed => println!("rename from {from}\nrename to {}", f.path),
            _ => {}
        }
        if let (Some(o), Some(n)) = (f.old_mode, f.new_mode)
            && o != n
        {
            println!("old mode {o:o}\nnew mode {n:o}");
        }
        if f.binary {
            println!("Binary files a/{from} and b/{} differ", f.path);
        } else if let Some(p) = &f.patch {
            print!("{p}");
        }
    }
    print_refused(&r);
    Ok(())
}

/// What apply will not bring back, on stderr (the patch on stdout stays applicable).
fn print_refused(r: &api::DiffReport) {
    for p in &r.refused {
        eprintln!("refused  {p}");
    }
    for t in &r.too_big {
        eprintln!(
            "too big  {} ({} bytes, over sync.max_file_mib): not brought back",
            t.path, t.size
        );
    }
}
