//! `tryboxi completions SHELL` and `tryboxi man`: shell completion scripts (clap_complete) and
//! man pages (clap_mangen), made from the same clap definition the parser uses, so they always
//! list the commands the binary has. `install` puts them in place too.

use std::io::Write as _;
use std::path::PathBuf;

use clap::CommandFactory as _;

use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write every page (`tryboxi.1` and one per subcommand, e.g. `tryboxi-serve.1`) into DIR
    /// instead of printing `tryboxi.1`.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// The completion script for `shell`, for the command name `tryboxi`.
pub fn completion(shell: clap_complete::Shell) -> Vec<u8> {
    let mut cmd = super::Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "tryboxi", &mut out);
    out
}

/// Every man page as (file name, roff text): the top page first, then one per subcommand
/// at every depth (`tryboxi-net-allow.1`).
pub fn man_pages() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut cmd = super::Cli::command().disable_help_subcommand(true);
    cmd.build();
    let mut pages = Vec::new();
    collect(cmd, &mut pages)?;
    Ok(pages)
}

fn collect(cmd: clap::Command, pages: &mut Vec<(String, Vec<u8>)>) -> std::io::Result<()> {
    let subs: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let man = clap_mangen::Man::new(cmd);
    let mut text = Vec::new();
    man.render(&mut text)?;
    pages.push((man.get_filename(), text));
    for s in subs {
        collect(s, pages)?;
    }
    Ok(())
}

pub fn completions(shell: clap_complete::Shell) -> Result<(), TopError> {
    std::io::stdout()
        .write_all(&completion(shell))
        .map_err(|e| TopError::Other(e.into()))
}

pub fn man(a: ManArgs) -> Result<(), TopError> {
    let pages = man_pages().map_err(|e| TopError::Other(e.into()))?;
    let Some(dir) = a.dir else {
        let top = pages.first().map(|(_, t)| t.as_slice()).unwrap_or_default();
        return std::io::stdout()
            .write_all(top)
            .map_err(|e| TopError::Other(e.into()));
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| TopError::Other(anyhow::anyhow!("{}: {e}", dir.display())))?;
    for (name, text) in &pages {
        let p = dir.join(name);
        std::fs::write(&p, text)
            .map_err(|e| TopError::Other(anyhow::anyhow!("{}: {e}", p.display())))?;
    }
    println!("wrote {} man pages into {}", pages.len(), dir.display());
    Ok(())
}
