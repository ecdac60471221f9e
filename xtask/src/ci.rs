//! `cargo xtask ci`: the whole pipeline `.ci/run` calls, fail-fast, one header per step.
//! Runs on a fresh machine as root with no stdin and `CI=true`. Never skips a failing step.
//! Steps: deps, fmt, clippy, fuzz-build (the fuzz crate compiles), dist, images, demo (the
//! README's first command on this checkout), test.

use crate::util::{Step, fmt_dur, out_dir, repo_root, run_inherit};
use crate::{deps, dist, images};
use anyhow::{Context, Result, anyhow};
use std::process::Command;
use std::time::Instant;

pub fn run() -> Result<()> {
    let start = Instant::now();
    let root = repo_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let cargo_cmd = |args: &[&str]| {
        let mut c = Command::new(&cargo);
        c.current_dir(&root).args(args);
        c
    };
    let mut binary = out_dir().join("bin").join("tryboxi");
    let steps: [&str; 8] = [
        "deps",
        "fmt",
        "clippy",
        "fuzz-build",
        "dist",
        "images",
        "demo",
        "test",
    ];
    for (i, name) in steps.iter().enumerate() {
        println!();
        let step = Step::start(format!("CI step {}/{}: {name}", i + 1, steps.len()));
        let result = match *name {
            "deps" => deps::run(),
            "fmt" => run_inherit(&mut cargo_cmd(&["fmt", "--all", "--check"]), "cargo fmt"),
            "clippy" => run_inherit(
                &mut cargo_cmd(&[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--",
                    "-D",
                    "warnings",
                ]),
                "cargo clippy",
            ),
            // The fuzz crate compiles the parsers' source files by path with its own dependency
            // list, so it can fall behind the main crate unnoticed; it builds on stable (only
            // running it needs nightly: `cargo xtask fuzz`). CI replays the saved corpora
            // through `cargo test`.
            // `--cfg fuzzing` is what cargo-fuzz sets: the targets' entry points exist only
            // under it.
            "fuzz-build" => run_inherit(
                cargo_cmd(&[
                    "check",
                    "--manifest-path",
                    "fuzz/Cargo.toml",
                    "--bins",
                    "--locked",
                ])
                .env("RUSTFLAGS", "--cfg fuzzing"),
                "cargo check (fuzz crate)",
            ),
            "dist" => dist::run().map(|b| binary = b),
            "images" => {
                // Every template, the on-demand ones too (the code interpreter's test runs in
                // CI, and the template tests boot each language's layer).
                let all = images::template::Wanted {
                    every: true,
                    ..Default::default()
                };
                images::run(
                    &binary,
                    images::Rebuild::default(),
                    &all,
                    Default::default(),
                )
                .map(|_| ())
            }
            // The README's first command as a user runs it (its deps, dist and images steps
            // find everything built by the steps above: seconds), on this checkout.
            "demo" => crate::demo::run(Some(root.clone())),
            "test" => run_inherit(
                cargo_cmd(&["test", "--workspace"]).env("TRYBOXI_ARTIFACTS", out_dir()),
                "cargo test",
            ),
            other => Err(anyhow!("unknown CI step {other}")),
        };
        result.with_context(|| format!("CI step `{name}` failed"))?;
        step.done("ok");
    }
    println!("\n==> CI passed in {}", fmt_dur(start.elapsed()));
    Ok(())
}
