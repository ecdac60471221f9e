//! `cargo xtask bench` row (e): the workspace sync of a generated repo (10,000 files,
//! 100 MB): `rsync -a` of it into a local directory vs the first sync into a VM, a one-file
//! delta sync, a diff of one file changed in the VM; and the generated tree other rows reuse.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::{median, progress, row};
use crate::http;

/// The workspace section of BENCHMARKS.md.
pub(crate) fn ws_section(ws: &WsRows) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "## Workspace sync (10,000 files, 100 MB)\n")?;
    writeln!(md, "| what | reps | median | min | max | target |")?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    row(
        &mut md,
        "(e) `rsync -a` of the tree into a local directory",
        &ws.rsync,
        "",
    )?;
    row(
        &mut md,
        "(e) first sync of the tree into a VM (`POST /sync`)",
        &ws.first,
        "<= 2x rsync",
    )?;
    row(
        &mut md,
        "(e) delta sync, one changed file",
        &ws.delta,
        "<= 100 ms",
    )?;
    row(
        &mut md,
        "(e) diff, one file changed in the VM",
        &ws.diff,
        "<= 100 ms",
    )?;
    writeln!(
        md,
        "\nFirst sync / rsync = **{:.2}** (target <= 2).\n",
        median(&ws.first).as_secs_f64() / median(&ws.rsync).as_secs_f64()
    )?;
    Ok(md)
}

pub(crate) struct WsRows {
    rsync: Vec<Duration>,
    first: Vec<Duration>,
    delta: Vec<Duration>,
    diff: Vec<Duration>,
}

pub(crate) const WS_DIRS: usize = 100;
pub(crate) const WS_FILES_PER_DIR: usize = 100;
pub(crate) const WS_FILE_BYTES: usize = 10 * 1024;

/// Incompressible-ish content (xorshift), so nothing benefits from compression.
pub(crate) fn ws_content(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(WS_FILE_BYTES);
    while v.len() < WS_FILE_BYTES {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(WS_FILE_BYTES);
    v
}

pub(crate) fn ws_generate(dir: &Path) -> Result<()> {
    for d in 0..WS_DIRS {
        let sub = dir.join(format!("d{d:02}"));
        std::fs::create_dir_all(&sub)?;
        for f in 0..WS_FILES_PER_DIR {
            std::fs::write(
                sub.join(format!("f{f:03}.bin")),
                ws_content((d * 1000 + f) as u64),
            )?;
        }
    }
    Ok(())
}

pub(crate) fn ws_sync(sock: &Path, id: &str) -> Result<(Duration, String)> {
    let t = Instant::now();
    let (st, body) = http::request(sock, "POST", &format!("/v1/sandboxes/{id}/sync"), None)?;
    let el = t.elapsed();
    if st != 200 {
        bail!("sync failed: HTTP {st}: {body}");
    }
    Ok((el, body))
}

/// (e): rsync baseline, first sync (each into a fresh VM), one-file delta syncs, one-file diffs.
pub(crate) fn workspace_bench(sock: &Path, home: &Path, reps: usize) -> Result<WsRows> {
    // Outside the data root (the daemon refuses a workspace in it); one filesystem, so the
    // generated tree can be moved into the workspace.
    let scratch = crate::util::beside(home, "ws-bench")?;
    let gen_dir = scratch.join("ws-gen");
    ws_generate(&gen_dir)?;
    // The 100 MB just written would otherwise be written back by the kernel's flusher during
    // the rows below (rsync, first syncs, delta syncs), measuring the bench's own set-up.
    let st = Command::new("sync").status().context("sync")?;
    if !st.success() {
        bail!("sync failed");
    }
    let first_reps = 3;
    let mut rows = WsRows {
        rsync: vec![],
        first: vec![],
        delta: vec![],
        diff: vec![],
    };
    let dst = home.join("rsync-dst");
    for _ in 0..first_reps {
        if dst.exists() {
            std::fs::remove_dir_all(&dst)?;
        }
        let t = Instant::now();
        let st = Command::new("rsync")
            .arg("-a")
            .arg(format!("{}/", gen_dir.display()))
            .arg(format!("{}/", dst.display()))
            .status()
            .context("rsync (apt-get install rsync)")?;
        rows.rsync.push(t.elapsed());
        if !st.success() {
            bail!("rsync failed");
        }
    }
    std::fs::remove_dir_all(&dst)?;
    // Each first sync: a sandbox created on an empty directory, then the tree moved in.
    let ws = scratch.join("ws-big");
    let mut keep = String::new();
    for rep in 0..first_reps {
        std::fs::create_dir_all(&ws)?;
        let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
        let (st, created) = http::request(sock, "POST", "/v1/sandboxes", Some(&body))?;
        if st != 201 {
            bail!("create failed: HTTP {st}: {created}");
        }
        let id = http::json_str(&created, "id").context("no id")?;
        std::fs::remove_dir(&ws)?;
        std::fs::rename(&gen_dir, &ws)?;
        let (el, rep_body) = ws_sync(sock, &id)?;
        if !rep_body.contains(&format!("\"files_sent\":{}", WS_DIRS * WS_FILES_PER_DIR)) {
            bail!("first sync did not send every file: {rep_body}");
        }
        rows.first.push(el);
        if rep + 1 == first_reps {
            keep = id;
        } else {
            http::request(sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
            std::fs::rename(&ws, &gen_dir)?;
        }
    }
    for i in 0..reps * 2 {
        std::fs::write(
            ws.join(format!("d{:02}/f000.bin", i % WS_DIRS)),
            ws_content(1_000_000 + i as u64),
        )?;
        let (el, body) = ws_sync(sock, &keep)?;
        if !body.contains("\"files_sent\":1,") {
            bail!("delta sync sent more than one file: {body}");
        }
        rows.delta.push(el);
    }
    for i in 0..reps {
        let rel = format!("d{:02}/f001.txt", i % WS_DIRS);
        let cmd = format!(r#"{{"cmd":"echo changed-{i} > /workspace/{rel}"}}"#);
        http::exec(sock, &keep, &cmd)?;
        let t = Instant::now();
        let (st, body) = http::request(sock, "GET", &format!("/v1/sandboxes/{keep}/diff"), None)?;
        rows.diff.push(t.elapsed());
        if st != 200 || !body.contains(&rel) || body.matches("\"path\"").count() != 1 {
            bail!("diff did not show exactly the one change: HTTP {st}: {body}");
        }
        // Take it, so the next round has one changed file again.
        let pull = format!(r#"{{"paths":["{rel}"],"force":true}}"#);
        http::request(
            sock,
            "POST",
            &format!("/v1/sandboxes/{keep}/pull"),
            Some(&pull),
        )?;
    }
    http::request(sock, "DELETE", &format!("/v1/sandboxes/{keep}"), None)?;
    progress("(e) rsync", &rows.rsync);
    progress("(e) first sync", &rows.first);
    progress("(e) delta sync", &rows.delta);
    progress("(e) diff", &rows.diff);
    Ok(rows)
}
