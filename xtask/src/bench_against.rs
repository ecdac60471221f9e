//! `cargo xtask bench --against REV`: the core rows measured for an older commit and for this
//! checkout in the same run, interleaved, with the ratio of each (issue 15's "nothing may slow
//! the benchmarks by more than 5 %, same run before/after").
//!
//! REV is checked out as a git worktree under `_out/bench-against/`, and its own xtask builds
//! its binary and guest images there (the image cache is shared, keyed by recipe, so an old
//! kernel that is cached is not built again). The agent is the binary, so an old daemon needs
//! its old initramfs; by default both builds boot this checkout's kernel and rootfs (REV gets
//! a set of its own initramfs with them), so the comparison is of the code, not of the guest's
//! kernel or distribution; `--against-own-images` gives each build its own whole set.
//!
//! Each round starts one daemon of each build on a fresh data root, both alive together, and
//! takes every sample in pairs: one from each daemon, back to back, the order alternating from
//! pair to pair and from round to round, so what the machine does meanwhile falls on both
//! alike. The rows: create to agent-ready, exec `true`, snapshot, restore, the first exec after
//! a restore, fork 10 to ready, a first sync of 10,000 files, a one-file delta sync and a
//! one-file diff. Only API calls both builds have are used. The verdict per row is in
//! `bench_against_stats`: a bootstrap interval of the ratio of medians against the target.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::{MEM_MIB, VCPUS, fmt, median};
use crate::bench_against_stats::{Verdict, paired_ci, ratio_ci};
use crate::bench_ws::{ws_generate, ws_sync};
use crate::daemon::Daemon;
use crate::{http, util};

pub const HEADING: &str = "## Before and after (issue 15)";

/// Ratio (this checkout / REV) of a row's median that the 5 % rule allows.
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

pub fn run(rev: &str, rounds: usize, reps: usize, own_images: bool) -> Result<()> {
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
    let mut old = build_rev(&root, &sha)?;
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
    if !own_images {
        let shared = scratch.join("old-artifacts");
        shared_images(&old.artifacts, &new.artifacts, &shared)?;
        println!(
            "==> {}: its own initramfs (its agent) with this checkout's kernel and rootfs",
            old.label
        );
        old.artifacts = shared;
    }
    // One tree per build: both daemons are alive at once, each with the tree in its workspace.
    let trees = [scratch.join("tree-0"), scratch.join("tree-1")];
    for t in &trees {
        ws_generate(t)?;
    }
    let st = Command::new("sync").status().context("sync")?;
    if !st.success() {
        bail!("sync failed");
    }

    let load_before = crate::bench::loadavg();
    let started = crate::bench::now_utc()?;
    let mut samples: [Samples; 2] = [vec![Vec::new(); ROWS.len()], vec![Vec::new(); ROWS.len()]];
    let builds = [&old, &new];
    for round in 0..rounds {
        println!(
            "==> round {}/{rounds}: {} and {} side by side",
            round + 1,
            old.label,
            new.label
        );
        measure_round(builds, &scratch, &trees, round, reps, &mut samples)?;
    }
    let sec = section(
        &Labels {
            old: &old.label,
            new: &new.label,
            own_images,
        },
        rounds,
        reps,
        &samples,
        &started,
        &load_before,
    )?;
    println!("\n{sec}");
    save_samples(
        &out.join("bench-against").join("samples.json"),
        &old,
        &new,
        &samples,
    )?;
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::write(&path, crate::bench::replace_section(&text, HEADING, &sec))?;
    println!("wrote {}", path.display());
    std::fs::remove_dir_all(&scratch).ok();
    Ok(())
}

/// Every sample of the run in microseconds, by build and row, pairs at equal indices (kept
/// after the run, for another look at the figures).
fn save_samples(path: &Path, old: &Build, new: &Build, s: &[Samples; 2]) -> Result<()> {
    let side = |b: &Build, rows: &Samples| {
        let rows: serde_json::Map<String, serde_json::Value> = ROWS
            .iter()
            .zip(rows)
            .map(|(what, v)| {
                let us: Vec<u64> = v.iter().map(|d| d.as_micros() as u64).collect();
                ((*what).to_owned(), us.into())
            })
            .collect();
        serde_json::json!({ "build": b.label, "rows_us": rows })
    };
    let doc = serde_json::json!({ "old": side(old, &s[0]), "new": side(new, &s[1]) });
    std::fs::create_dir_all(path.parent().context("samples path")?)?;
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    println!("wrote {}", path.display());
    Ok(())
}

/// An artifacts directory for the old build: its own initramfs (its agent) with the new
/// build's kernel and rootfs, hard-linked (copied across file systems), and a manifest in the
/// old build's format naming them. Templates are left out: no row uses one.
fn shared_images(old: &Path, new: &Path, dir: &Path) -> Result<()> {
    let images = dir.join("images");
    std::fs::create_dir_all(&images)?;
    let read = |p: &Path| -> Result<serde_json::Value> {
        let m = p.join("images").join("manifest.json");
        serde_json::from_slice(&std::fs::read(&m).with_context(|| m.display().to_string())?)
            .with_context(|| format!("parsing {}", m.display()))
    };
    let (mut om, nm) = (read(old)?, read(new)?);
    let entry = |m: &serde_json::Value, name: &str| -> Result<serde_json::Value> {
        m["artifacts"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["name"] == name))
            .cloned()
            .with_context(|| format!("no {name} in a manifest"))
    };
    let mut artifacts = Vec::new();
    for (name, manifest, dir) in [
        ("kernel", &nm, new),
        ("rootfs", &nm, new),
        ("initramfs", &om, old),
    ] {
        let e = entry(manifest, name)?;
        let file = e["file"].as_str().context("an artifact without a file")?;
        let src = dir.join("images").join(file);
        let dst = images.join(file);
        if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst).with_context(|| format!("copying {}", src.display()))?;
        }
        artifacts.push(e);
    }
    om["artifacts"] = serde_json::Value::Array(artifacts);
    om["kernel_version"] = nm["kernel_version"].clone();
    if let Some(r) = om["recipes"].as_object_mut() {
        r.retain(|k, _| k == "initramfs");
        for k in ["kernel", "rootfs"] {
            r.insert(k.into(), nm["recipes"][k].clone());
        }
    }
    std::fs::write(images.join("manifest.json"), serde_json::to_vec(&om)?)?;
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

/// One build's daemon in a round, with its long-lived sandbox and its workspace directory.
struct Side<'a> {
    b: &'a Build,
    d: Daemon,
    sock: PathBuf,
    keep: String,
    ws: PathBuf,
}

/// The order of the two builds for the `i`-th pair of a round: alternating from pair to pair,
/// and starting with the other build in odd rounds.
fn order(round: usize, i: usize) -> [usize; 2] {
    if (round + i).is_multiple_of(2) {
        [0, 1]
    } else {
        [1, 0]
    }
}

/// One round: a daemon of each build, both alive, every row sampled in pairs (`reps` pairs
/// where the row is quick), appended to `s[build][row]`.
fn measure_round(
    builds: [&Build; 2],
    scratch: &Path,
    trees: &[PathBuf; 2],
    round: usize,
    reps: usize,
    s: &mut [Samples; 2],
) -> Result<()> {
    // A strict vCPU limit with room for the fork of 10 (the old scheduler's default is lower).
    let config = format!(
        "default_memory_mib = {MEM_MIB}\ndefault_vcpus = {VCPUS}\n[pool]\ngolden = false\n\
         [limits]\nmax_vcpus = {}\n",
        VCPUS * (FORKS as u32 + 4)
    );
    let mut sides = Vec::new();
    for (which, b) in builds.iter().enumerate() {
        let home = scratch.join(format!("home-{round}-{which}"));
        let d = Daemon::start(&b.bin, &home, &b.artifacts, &config)?;
        let sock = d.socket();
        let ws = util::beside(&home, "ws")?;
        let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
        // Not timed: the first create resolves the acceleration (a probe boot) and warms the
        // cache.
        let keep = create(&sock, &body).with_context(|| b.label.clone())?.0;
        sides.push(Side {
            b,
            d,
            sock,
            keep,
            ws,
        });
    }
    let pairs = |n: usize| (0..n).flat_map(move |i| order(round, i));
    for w in pairs(reps) {
        let x = &sides[w];
        let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, x.ws.display());
        let (id, took) = create(&x.sock, &body).with_context(|| x.b.label.clone())?;
        s[w][0].push(took);
        delete(&x.sock, &id)?;
    }
    for x in &sides {
        exec_true(&x.sock, &x.keep)?;
    }
    for w in pairs(reps * 4) {
        let x = &sides[w];
        s[w][1].push(exec_true(&x.sock, &x.keep).with_context(|| x.b.label.clone())?);
    }
    for (i, w) in pairs(reps).enumerate() {
        let x = &sides[w];
        let (snap, restore) =
            crate::bench::snapshot_then_restore(&x.sock, &x.keep, &format!("r{i}"))
                .with_context(|| x.b.label.clone())?;
        s[w][2].push(snap);
        s[w][3].push(restore);
        s[w][4].push(exec_true(&x.sock, &x.keep)?);
    }
    for w in pairs(2) {
        let x = &sides[w];
        s[w][5].push(fork(x)?);
    }
    for x in &sides {
        delete(&x.sock, &x.keep)?;
    }

    // The workspace rows: a sandbox on an empty directory per build, then its tree moved in.
    let mut ws_ids = Vec::new();
    for (w, x) in sides.iter().enumerate() {
        let big = util::beside(&x.d.home, "ws-big")?;
        let (id, _) = create(
            &x.sock,
            &format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, big.display()),
        )?;
        std::fs::remove_dir(&big)?;
        std::fs::rename(&trees[w], &big)?;
        ws_ids.push((id, big));
    }
    let files = crate::bench_ws::WS_DIRS * crate::bench_ws::WS_FILES_PER_DIR;
    for w in order(round, 0) {
        let (x, (id, _)) = (&sides[w], &ws_ids[w]);
        let (took, rep) = ws_sync(&x.sock, id).with_context(|| x.b.label.clone())?;
        if !rep.contains(&format!("\"files_sent\":{files}")) {
            bail!(
                "{}: the first sync did not send every file: {rep}",
                x.b.label
            );
        }
        s[w][6].push(took);
    }
    // Unique per build and round: every change is new content, since a tree is carried from
    // one round to the next.
    let salt = |w: usize| 1_000_000 * (1 + 2 * round + w) as u64;
    for (i, w) in pairs(reps * 2).enumerate() {
        let (x, (id, big)) = (&sides[w], &ws_ids[w]);
        let f = big.join(format!("d{:02}/f000.bin", i / 2 % crate::bench_ws::WS_DIRS));
        std::fs::write(&f, crate::bench_ws::ws_content(salt(w) + i as u64))?;
        let (took, body) = ws_sync(&x.sock, id)?;
        if !body.contains("\"files_sent\":1,") {
            bail!(
                "{}: the delta sync sent more than one file: {body}",
                x.b.label
            );
        }
        s[w][7].push(took);
    }
    for (i, w) in pairs(reps).enumerate() {
        let (x, (id, _)) = (&sides[w], &ws_ids[w]);
        s[w][8].push(diff_one(&x.sock, id, i / 2, salt(w))?);
    }
    // The trees go back for the next round (with this round's changes: new content next
    // time), without the files the diff rows added.
    for (w, (x, (id, big))) in sides.iter().zip(&ws_ids).enumerate() {
        for i in 0..reps {
            let added = big.join(format!("d{:02}/f001.txt", i % crate::bench_ws::WS_DIRS));
            match std::fs::remove_file(&added) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
        std::fs::rename(big, &trees[w])?;
        delete(&x.sock, id)?;
    }
    for x in sides {
        x.d.stop()?;
        std::fs::remove_dir_all(&x.ws).ok();
    }
    Ok(())
}

/// A fork of `FORKS` children of the side's long-lived sandbox, timed to the API's answer
/// (children ready); the children are then removed.
fn fork(x: &Side) -> Result<Duration> {
    let t = Instant::now();
    let (st, out) = http::request(
        &x.sock,
        "POST",
        &format!("/v1/sandboxes/{}/fork", x.keep),
        Some(&format!(r#"{{"count":{FORKS}}}"#)),
    )?;
    let took = t.elapsed();
    if st != 201 {
        bail!("{}: fork: HTTP {st}: {out}", x.b.label);
    }
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let kids: Vec<String> = v["sandboxes"]
        .as_array()
        .context("fork: no children")?
        .iter()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect();
    if kids.len() != FORKS {
        bail!("{}: fork gave {} children: {out}", x.b.label, kids.len());
    }
    for k in &kids {
        delete(&x.sock, k)?;
    }
    Ok(took)
}

/// The `i`-th one-file diff: a file written in the VM, the diff timed, then the file pulled
/// to the host so the next diff shows one change again.
fn diff_one(sock: &Path, id: &str, i: usize, salt: u64) -> Result<Duration> {
    let rel = format!("d{:02}/f001.txt", i % crate::bench_ws::WS_DIRS);
    let cmd = format!(r#"{{"cmd":"echo changed-{salt}-{i} > /workspace/{rel}"}}"#);
    http::exec(sock, id, &cmd)?;
    let t = Instant::now();
    let (st, body) = http::request(sock, "GET", &format!("/v1/sandboxes/{id}/diff"), None)?;
    let took = t.elapsed();
    if st != 200 || !body.contains(&rel) || body.matches("\"path\"").count() != 1 {
        bail!("the diff did not show exactly {rel}: HTTP {st}: {body}");
    }
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
    Ok(took)
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

/// The two builds' labels and how their images were chosen, for the section's text.
struct Labels<'a> {
    old: &'a str,
    new: &'a str,
    own_images: bool,
}

fn section(
    l: &Labels,
    rounds: usize,
    reps: usize,
    s: &[Samples; 2],
    started: &str,
    load_before: &str,
) -> Result<String> {
    let (old, new) = (l.old, l.new);
    let images = if l.own_images {
        "each with the binary and the guest images its own xtask builds (`--against-own-images`)"
    } else {
        "each with its own binary and initramfs (its agent), both booting this checkout's \
         kernel and rootfs, so that the guest's kernel and distribution are not compared"
    };
    let mut md = String::new();
    writeln!(md, "{HEADING}\n")?;
    writeln!(
        md,
        "Measured on {started}, accel **tcg** (both builds); host load average at the start \
         {load_before}, at the end {}. `cargo xtask bench --against {old} --against-rounds \
         {rounds}`: `{old}` (before the hardening) and `{new}` (this checkout), {images}. \
         Each of the {rounds} rounds starts a daemon of each build, both alive together, and \
         takes the samples in pairs, one from each daemon back to back, the order alternating \
         from pair to pair and from round to round ({reps} pairs per round where a row is \
         quick). Two ratios of this checkout to `{old}`: of the medians, and of the pairs \
         (the median of the per-pair ratios, which cancels what both samples of a pair \
         share: the machine's load at that moment), each with a 95 % bootstrap interval \
         (2,000 resamples; of each side apart, and of whole pairs). The verdict is the \
         pairs': target <= {TARGET_RATIO:.2}, a row is ok when its whole interval is at or \
         under it, slower when its whole interval is over it, and not shown when the \
         interval straddles it. Raw samples: `_out/bench-against/samples.json`.\n",
        crate::bench::loadavg()
    )?;
    writeln!(
        md,
        "| what | pairs | `{old}` | `{new}` | ratio of medians (95 %) | ratio of pairs (95 %) | |\n\
         |---|---|---|---|---|---|---|"
    )?;
    let (mut slower, mut unshown) = (Vec::new(), Vec::new());
    for (i, what) in ROWS.iter().enumerate() {
        let (Some(m), Some(ci)) = (
            ratio_ci(&s[0][i], &s[1][i], 0x5EED + i as u64),
            paired_ci(&s[0][i], &s[1][i], 0xFA1B + i as u64),
        ) else {
            continue;
        };
        let mark = match ci.verdict(TARGET_RATIO) {
            Verdict::Ok => "ok",
            Verdict::Slower => {
                slower.push(format!("{what} ({:.2})", ci.ratio));
                "**slower**"
            }
            Verdict::NotShown => {
                unshown.push(format!(
                    "{what} ({:.2}, {:.2}-{:.2})",
                    ci.ratio, ci.lo, ci.hi
                ));
                "not shown"
            }
        };
        writeln!(
            md,
            "| {what} | {} | {} | {} | {:.3} ({:.3}-{:.3}) | {:.3} ({:.3}-{:.3}) | {mark} |",
            s[0][i].len().min(s[1][i].len()),
            fmt(median(&s[0][i])),
            fmt(median(&s[1][i])),
            m.ratio,
            m.lo,
            m.hi,
            ci.ratio,
            ci.lo,
            ci.hi
        )?;
    }
    writeln!(md)?;
    if slower.is_empty() && unshown.is_empty() {
        writeln!(
            md,
            "Every row is shown to be within {:.0} % of before.\n",
            (TARGET_RATIO - 1.0) * 100.0
        )?;
    }
    if !slower.is_empty() {
        writeln!(md, "Slower than the target: {}.\n", slower.join("; "))?;
    }
    if !unshown.is_empty() {
        writeln!(
            md,
            "Not shown either way (the interval straddles the target): {}.\n",
            unshown.join("; ")
        )?;
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake image set: each artifact's file holds `tag/name`.
    fn set(dir: &Path, tag: &str, names: &[&str]) {
        let images = dir.join("images");
        std::fs::create_dir_all(&images).unwrap();
        let mut artifacts = Vec::new();
        let mut recipes = serde_json::Map::new();
        for n in names {
            let file = format!("{n}.bin");
            std::fs::write(images.join(&file), format!("{tag}/{n}")).unwrap();
            artifacts.push(serde_json::json!({"name": n, "file": file, "sha256": tag}));
            recipes.insert((*n).into(), format!("{tag}-{n}").into());
        }
        let m = serde_json::json!({"version": 1, "kernel_version": tag, "artifacts": artifacts, "recipes": recipes});
        std::fs::write(images.join("manifest.json"), m.to_string()).unwrap();
    }

    #[test]
    fn the_old_build_gets_its_initramfs_with_the_new_kernel_and_rootfs() {
        let t = tempfile::tempdir().unwrap();
        let (old, new, out) = (
            t.path().join("old"),
            t.path().join("new"),
            t.path().join("out"),
        );
        set(
            &old,
            "old",
            &["kernel", "rootfs", "initramfs", "template.go"],
        );
        set(&new, "new", &["kernel", "rootfs", "initramfs"]);
        shared_images(&old, &new, &out).unwrap();
        let images = out.join("images");
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(images.join("manifest.json")).unwrap()).unwrap();
        let names: Vec<&str> = m["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["kernel", "rootfs", "initramfs"]);
        for (n, tag) in [("kernel", "new"), ("rootfs", "new"), ("initramfs", "old")] {
            let body = std::fs::read_to_string(images.join(format!("{n}.bin"))).unwrap();
            assert_eq!(body, format!("{tag}/{n}"));
            assert_eq!(m["recipes"][n], format!("{tag}-{n}"));
        }
        assert_eq!(m["kernel_version"], "new");
        assert!(m["recipes"].get("template.go").is_none(), "{m}");
    }
}
