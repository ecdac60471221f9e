//! `cargo xtask bench --against REV`: the core rows measured for an older commit and for this
//! checkout in the same run, interleaved, with the ratio of each (issue 15's "nothing may slow
//! the benchmarks by more than 5 %, same run before/after").
//!
//! REV is checked out as a git worktree under `_out/bench-against/`, and its own xtask builds
//! its binary and guest images there (the image cache is shared, keyed by recipe, so an old
//! kernel that is cached is not built again). Each build runs with its own images: the agent is
//! the binary, so an old daemon needs its old agent. Every round starts one daemon of each
//! build on a fresh data root, in alternating order (old first in even rounds), and measures
//! the same rows with the same code: create to agent-ready, exec `true`, snapshot, restore,
//! the first exec after a restore, fork 10 to ready, a first sync of 10,000 files, a one-file
//! delta sync and a one-file diff. Only API calls both builds have are used.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::{MEM_MIB, VCPUS, fmt, median};
use crate::bench_ws::{ws_generate, ws_sync};
use crate::daemon::Daemon;
use crate::{http, util};

pub const HEADING: &str = "## Before and after (issue 15)";

/// Ratio (this checkout / REV) of a row's median above which the row is marked as slower.
const TARGET_RATIO: f64 = 1.05;
const FORKS: usize = 10;

/// One build under test: its binary and the artifacts directory its daemon is given.
struct Build {
    label: String,
    bin: PathBuf,
    artifacts: PathBuf,
}

/// The rows, in table order.
const ROWS: &[&str] = &[
    "(b) create -> agent ready (API)",
    "(c) exec `true` round trip (API)",
    "(f) snapshot (API)",
    "(f) restore (API)",
    "(f) first exec `true` after a restore",
    "(h) fork 10 -> 10 children ready (API)",
    "(e) first sync, 10,000 files / 100 MB",
    "(e) delta sync, one changed file",
    "(e) diff, one file changed in the VM",
];

/// Samples per row, in `ROWS` order.
type Samples = Vec<Vec<Duration>>;

pub fn run(rev: &str, rounds: usize, reps: usize) -> Result<()> {
    let rounds = rounds.max(2);
    let reps = reps.max(5);
    let root = util::repo_root();
    let sha = util::output(
        Command::new("git")
            .current_dir(&root)
            .args(["rev-parse", "--verify"])
            .arg(format!("{rev}^{{commit}}")),
        "git rev-parse",
    )?
    .trim()
    .to_owned();
    let old = build_rev(&root, &sha)?;
    let bin = crate::images::dist_and_defaults()?;
    let head = util::output(
        Command::new("git")
            .current_dir(&root)
            .args(["rev-parse", "--short=12", "HEAD"]),
        "git rev-parse HEAD",
    )?
    .trim()
    .to_owned();
    let dirty = !util::output(
        Command::new("git").current_dir(&root).args([
            "status",
            "--porcelain",
            "--untracked-files=no",
        ]),
        "git status",
    )?
    .trim()
    .is_empty();
    let new = Build {
        label: format!("{head}{}", if dirty { " + changes" } else { "" }),
        bin,
        artifacts: util::out_dir(),
    };

    let out = util::out_dir();
    let scratch = out.join("bench-against-run");
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch)?;
    }
    std::fs::create_dir_all(&scratch)?;
    let tree = scratch.join("ws-gen");
    ws_generate(&tree)?;
    let st = Command::new("sync").status().context("sync")?;
    if !st.success() {
        bail!("sync failed");
    }

    let load_before = crate::bench::loadavg();
    let started = crate::bench::now_utc()?;
    let mut samples: [Samples; 2] = [vec![Vec::new(); ROWS.len()], vec![Vec::new(); ROWS.len()]];
    let builds = [&old, &new];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let b = builds[which];
            println!("==> round {}/{rounds}: {}", round + 1, b.label);
            let home = scratch.join(format!("home-{round}-{which}"));
            let salt = 1_000_000 * (1 + 2 * round + which) as u64;
            measure(b, &home, &tree, reps, salt, &mut samples[which])?;
            std::fs::remove_dir_all(&home).ok();
        }
    }
    let sec = section(
        &old.label,
        &new.label,
        rounds,
        reps,
        &samples,
        &started,
        &load_before,
    )?;
    println!("\n{sec}");
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::write(&path, crate::bench::replace_section(&text, HEADING, &sec))?;
    println!("wrote {}", path.display());
    std::fs::remove_dir_all(&scratch).ok();
    Ok(())
}

/// REV's worktree (made once, under `_out/bench-against/`), its binary and images built by
/// its own xtask.
fn build_rev(root: &Path, sha: &str) -> Result<Build> {
    let short = &sha[..12];
    let wt = util::out_dir().join("bench-against").join(short);
    if !wt.join("Cargo.toml").exists() {
        std::fs::create_dir_all(wt.parent().context("worktree parent")?)?;
        util::run_inherit(
            Command::new("git")
                .current_dir(root)
                .args(["worktree", "add", "--detach"])
                .arg(&wt)
                .arg(sha),
            "git worktree add",
        )?;
    }
    let at = util::output(
        Command::new("git")
            .current_dir(&wt)
            .args(["rev-parse", "HEAD"]),
        "git rev-parse in the worktree",
    )?;
    if at.trim() != sha {
        bail!(
            "{} is at {} instead of {sha}: remove it (git worktree remove --force)",
            wt.display(),
            at.trim()
        );
    }
    println!(
        "==> {short}: binary and images by its own xtask (in {})",
        wt.display()
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Its own xtask, as a user of that commit would run it; nothing of this build's cargo
    // environment leaks in (its RUSTFLAGS would rebuild everything).
    util::run_inherit(
        Command::new(cargo)
            .current_dir(&wt)
            .args(["xtask", "images"])
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_TARGET_DIR"),
        &format!("cargo xtask images (at {short})"),
    )?;
    let out = wt.join("_out");
    let bin = out.join("bin").join("tryboxi");
    if !bin.exists() || !out.join("images").join("vmlinuz").exists() {
        bail!("{short}'s xtask did not leave _out/bin/tryboxi and _out/images");
    }
    Ok(Build {
        label: short.to_owned(),
        bin,
        artifacts: out,
    })
}

/// One daemon of `b` on `home`: every row once per round (`reps` samples where the row is
/// quick), appended to `s`.
fn measure(
    b: &Build,
    home: &Path,
    tree: &Path,
    reps: usize,
    salt: u64,
    s: &mut Samples,
) -> Result<()> {
    // A strict vCPU limit with room for the fork of 10 (the old scheduler's default is lower).
    let config = format!(
        "default_memory_mib = {MEM_MIB}\ndefault_vcpus = {VCPUS}\n[pool]\ngolden = false\n\
         [limits]\nmax_vcpus = {}\n",
        VCPUS * (FORKS as u32 + 4)
    );
    let d = Daemon::start(&b.bin, home, &b.artifacts, &config)?;
    let sock = d.socket();
    let ws = util::beside(home, "ws")?;
    let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
    // Not timed: the first create resolves the acceleration (a probe boot) and warms the cache.
    let keep = create(&sock, &body)?.0;
    for _ in 0..reps {
        let (id, took) = create(&sock, &body)?;
        s[0].push(took);
        delete(&sock, &id)?;
    }
    exec_true(&sock, &keep)?;
    for _ in 0..reps * 4 {
        s[1].push(exec_true(&sock, &keep)?);
    }
    for i in 0..reps {
        let (snap, restore) = crate::bench::snapshot_then_restore(&sock, &keep, &format!("r{i}"))
            .with_context(|| b.label.clone())?;
        s[2].push(snap);
        s[3].push(restore);
        s[4].push(exec_true(&sock, &keep)?);
    }
    for _ in 0..2 {
        let t = Instant::now();
        let (st, out) = http::request(
            &sock,
            "POST",
            &format!("/v1/sandboxes/{keep}/fork"),
            Some(&format!(r#"{{"count":{FORKS}}}"#)),
        )?;
        let took = t.elapsed();
        if st != 201 {
            bail!("{}: fork: HTTP {st}: {out}", b.label);
        }
        let v: serde_json::Value = serde_json::from_str(&out)?;
        let kids: Vec<String> = v["sandboxes"]
            .as_array()
            .context("fork: no children")?
            .iter()
            .filter_map(|c| c["id"].as_str().map(str::to_owned))
            .collect();
        if kids.len() != FORKS {
            bail!("{}: fork gave {} children: {out}", b.label, kids.len());
        }
        s[5].push(took);
        for k in &kids {
            delete(&sock, k)?;
        }
    }
    delete(&sock, &keep)?;

    // The workspace rows: a sandbox on an empty directory, then the tree moved in and synced.
    let big = util::beside(home, "ws-big")?;
    let (id, _) = create(
        &sock,
        &format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, big.display()),
    )?;
    std::fs::remove_dir(&big)?;
    std::fs::rename(tree, &big)?;
    let synced = ws_sync(&sock, &id);
    let (took, rep) = match synced {
        Ok(r) => r,
        Err(e) => {
            std::fs::rename(&big, tree)?;
            return Err(e);
        }
    };
    let files = crate::bench_ws::WS_DIRS * crate::bench_ws::WS_FILES_PER_DIR;
    if !rep.contains(&format!("\"files_sent\":{files}")) {
        std::fs::rename(&big, tree)?;
        bail!("{}: the first sync did not send every file: {rep}", b.label);
    }
    s[6].push(took);
    let rows = ws_rows(&sock, &id, &big, reps, salt, s);
    // The tree goes back for the next daemon (with this one's changes: new content next time),
    // without the files the diff rows added.
    for i in 0..reps {
        let added = big.join(format!("d{:02}/f001.txt", i % crate::bench_ws::WS_DIRS));
        match std::fs::remove_file(&added) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
    }
    std::fs::rename(&big, tree)?;
    rows?;
    delete(&sock, &id)?;
    d.stop()?;
    std::fs::remove_dir_all(&ws).ok();
    Ok(())
}

/// Delta syncs and diffs on a synced tree. `salt` (unique per daemon) makes every change new
/// content, since the tree is carried from one daemon to the next.
fn ws_rows(
    sock: &Path,
    id: &str,
    ws: &Path,
    reps: usize,
    salt: u64,
    s: &mut Samples,
) -> Result<()> {
    for i in 0..reps * 2 {
        let f = ws.join(format!("d{:02}/f000.bin", i % crate::bench_ws::WS_DIRS));
        std::fs::write(&f, crate::bench_ws::ws_content(salt + i as u64))?;
        let (took, body) = ws_sync(sock, id)?;
        if !body.contains("\"files_sent\":1,") {
            bail!("the delta sync sent more than one file: {body}");
        }
        s[7].push(took);
    }
    for i in 0..reps {
        let rel = format!("d{:02}/f001.txt", i % crate::bench_ws::WS_DIRS);
        let cmd = format!(r#"{{"cmd":"echo changed-{salt}-{i} > /workspace/{rel}"}}"#);
        http::exec(sock, id, &cmd)?;
        let t = Instant::now();
        let (st, body) = http::request(sock, "GET", &format!("/v1/sandboxes/{id}/diff"), None)?;
        s[8].push(t.elapsed());
        if st != 200 || !body.contains(&rel) || body.matches("\"path\"").count() != 1 {
            bail!("the diff did not show exactly {rel}: HTTP {st}: {body}");
        }
        // Taken to the host, so the next diff shows one change again.
        let pull = format!(r#"{{"paths":["{rel}"],"force":true}}"#);
        let (st, body) = http::request(
            sock,
            "POST",
            &format!("/v1/sandboxes/{id}/pull"),
            Some(&pull),
        )?;
        if st != 200 {
            bail!("pull after a diff: HTTP {st}: {body}");
        }
    }
    Ok(())
}

fn create(sock: &Path, body: &str) -> Result<(String, Duration)> {
    let t = Instant::now();
    let (st, out) = http::request(sock, "POST", "/v1/sandboxes", Some(body))?;
    let took = t.elapsed();
    if st != 201 {
        bail!("create: HTTP {st}: {out}");
    }
    Ok((http::json_str(&out, "id").context("create: no id")?, took))
}

fn delete(sock: &Path, id: &str) -> Result<()> {
    let (st, out) = http::request(sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    if !(200..300).contains(&st) {
        bail!("delete {id}: HTTP {st}: {out}");
    }
    Ok(())
}

fn exec_true(sock: &Path, id: &str) -> Result<Duration> {
    let t = Instant::now();
    let line = http::exec(sock, id, r#"{"argv":["true"]}"#)?;
    let took = t.elapsed();
    if !line.contains("\"exit_code\":0") {
        bail!("`true` failed: {line}");
    }
    Ok(took)
}

fn section(
    old: &str,
    new: &str,
    rounds: usize,
    reps: usize,
    s: &[Samples; 2],
    started: &str,
    load_before: &str,
) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {started}, accel **tcg** (both builds); host load average at the start \
         {load_before}, at the end {}. `cargo xtask bench --against {old} --against-rounds \
         {rounds}`: `{old}` (before the hardening) and `{new}` (this checkout), each with the \
         binary and guest images its own xtask builds, measured by the same code in {rounds} \
         rounds of one daemon each, in alternating order. Medians over all rounds; ratio = \
         this checkout / `{old}`, target <= {TARGET_RATIO:.2} ({reps} reps per round where a row \
         is quick).\n",
        crate::bench::loadavg()
    )?;
    writeln!(
        md,
        "| what | samples each | `{old}` | `{new}` | ratio | |\n|---|---|---|---|---|---|"
    )?;
    let mut worse = Vec::new();
    for (i, what) in ROWS.iter().enumerate() {
        let (a, b) = (median(&s[0][i]), median(&s[1][i]));
        let r = b.as_secs_f64() / a.as_secs_f64().max(1e-9);
        let mark = if r <= TARGET_RATIO {
            "ok"
        } else {
            worse.push(format!("{what} ({r:.2})"));
            "**slower**"
        };
        writeln!(
            md,
            "| {what} | {} | {} | {} | {r:.2} | {mark} |",
            s[0][i].len().min(s[1][i].len()),
            fmt(a),
            fmt(b)
        )?;
    }
    if worse.is_empty() {
        writeln!(
            md,
            "\nNo row is more than {:.0} % slower than before.\n",
            (TARGET_RATIO - 1.0) * 100.0
        )?;
    } else {
        writeln!(
            md,
            "\nSlower than the target in this run: {}.\n",
            worse.join("; ")
        )?;
    }
    Ok(md)
}
