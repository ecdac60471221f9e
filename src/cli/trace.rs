//! `tryboxi trace ID`: the per-phase waterfall of a sandbox (`sbx_…`: reserve, boot, connect)
//! or an exec (`exe_…`: sync, spawn, run, flush).

use crate::error::TopError;
use crate::telemetry::traces::{Trace, waterfall};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A sandbox id (`sbx_…`) or an exec id (`exe_…`).
    id: String,
    /// Print the spans as JSON instead of the waterfall.
    #[arg(long)]
    json: bool,
    /// Width of the bars, in characters.
    #[arg(long, default_value_t = 50)]
    width: usize,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let t: Trace = super::client()?
        .get(&format!("/v1/traces/{}", a.id))
        .await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&t).expect("traces serialize")
        );
    } else {
        print!("{}", waterfall(&t, a.width.clamp(10, 400)));
    }
    Ok(())
}
