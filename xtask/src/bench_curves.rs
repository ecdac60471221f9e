//! Cost curves of the workspace (issue 19 item 2): for generated trees of 1,000 / 10,000 /
//! 100,000 files of 10 KiB (10 MB / 100 MB / 1 GB), `rsync -a` of the tree into a local
//! directory (the baseline of the same run), the first sync into a fresh VM, a delta sync of
//! three host files, a diff of three files the guest changed (the first one walks the whole
//! tree in the guest, later ones drain inotify) and the apply of that diff with its backup.
//! Every row (one operation at one size) has a wall-clock budget: a row that runs past it is
//! reported as over budget and the bench goes on. The table goes into BENCHMARKS.md, the plot
//! (`bench_curves_plot.rs`) into `bench-curves.svg` beside it. Never run as tests.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench::{fmt, loadavg, median, progress};
use crate::bench_ws::ws_content;
use crate::daemon::Daemon;
use crate::http;

pub const HEADING: &str = "## Workspace cost curves";
/// The plot, beside BENCHMARKS.md.
pub const SVG: &str = "bench-curves.svg";
/// Files per generated directory.
const PER_DIR: usize = 100;
/// Files changed per delta sync, per diff and so per apply.
const CHANGED: usize = 3;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    pub sizes: Vec<usize>,
    pub row_budget: Duration,
    /// Repetitions of each row (fewer when the budget runs out).
    pub reps: usize,
}

/// The operations, in table order: (short name for the plot, description for the table).
pub const OPS: [(&str, &str); 7] = [
    ("rsync -a", "`rsync -a` into a local directory (baseline)"),
    (
        "first sync",
        "first sync into a fresh VM (`POST /sync`, API call)",
    ),
    (
        "first sync (daemon)",
        "the same first sync as the daemon reports it (`duration_ms`)",
    ),
    ("delta sync", "delta sync, 3 files changed on the host"),
    (
        "first diff",
        "first diff, 3 files changed in the VM (the guest walks the whole tree)",
    ),
    ("diff", "diff, 3 files changed in the VM (inotify delta)"),
    ("apply", "apply of that diff (3 files, with their backup)"),
];
const RSYNC: usize = 0;
const FIRST: usize = 1;
pub(crate) const FIRST_DAEMON: usize = 2;
const DELTA: usize = 3;
const DIFF_FIRST: usize = 4;
const DIFF: usize = 5;
const APPLY: usize = 6;

/// One row: an operation at one size.
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    /// The repetitions done within the budget.
    Measured(Vec<Duration>),
    /// The first repetition was still running when the budget ran out (wall clock so far).
    OverBudget(Duration),
    /// Not run, and why.
    Skipped(String),
}

impl Row {
    pub fn median(&self) -> Option<Duration> {
        match self {
            Row::Measured(v) if !v.is_empty() => Some(median(v)),
            _ => None,
        }
    }
}

/// Every row of one tree size.
#[derive(Debug, Clone)]
pub struct SizeRows {
    pub files: usize,
    pub bytes: u64,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone)]
pub struct Curves {
    pub sizes: Vec<SizeRows>,
    pub accel: String,
    pub budget: Duration,
    pub load_before: String,
    pub load_after: String,
}

/// A row's wall-clock budget: what it has spent (set-up included) and its last repetition.
#[derive(Debug, Clone)]
pub struct Budget {
    limit: Duration,
    spent: Duration,
    last: Duration,
}

impl Budget {
    pub fn new(limit: Duration) -> Budget {
        Budget {
            limit,
            spent: Duration::ZERO,
            last: Duration::ZERO,
        }
    }

    /// Count one repetition (with its set-up).
    pub fn add(&mut self, d: Duration) {
        self.spent += d;
        self.last = d;
    }

    /// What is left: the longest the next call may take.
    pub fn remaining(&self) -> Duration {
        self.limit.saturating_sub(self.spent)
    }

    /// Whether another repetition like the last one still fits.
    pub fn another(&self) -> bool {
        self.spent + self.last <= self.limit
    }
}

/// Time per file at `big` over time per file at `small`: 1.0 is linear growth, above it worse.
pub fn growth(small: (usize, Duration), big: (usize, Duration)) -> f64 {
    let per = |(n, d): (usize, Duration)| d.as_secs_f64() / n.max(1) as f64;
    per(big) / per(small)
}

/// The bench: its own daemon on `home`, each size in turn.
pub fn run(bin: &Path, home: &Path, artifacts: &Path, config: &str, o: &Options) -> Result<Curves> {
    // The 100,000-file tree is 1,000 MiB of content: over the default one-sync limit with the
    // archive's headers counted or not, so the bench's daemon allows 2 GiB.
    let config = format!("{config}[sync]\nmax_sync_mib = 2048\nmax_diff_mib = 2048\n");
    let load_before = loadavg();
    let d = Daemon::start(bin, home, artifacts, &config)?;
    let sock = d.socket();
    let scratch = crate::util::beside(home, "curves")?;
    let mut accel = String::from("?");
    let mut sizes = Vec::new();
    for &n in &o.sizes {
        println!(
            "==> cost curve: {n} files / {} MB vs rsync -a (row budget {} s)",
            n * crate::bench_ws::WS_FILE_BYTES / 1_000_000,
            o.row_budget.as_secs()
        );
        let r = one_size(&sock, &scratch, home, n, o, &mut accel);
        // Whatever happened, the next size starts from a clean scratch directory.
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch)?;
        sizes.push(r?);
    }
    d.stop()?;
    Ok(Curves {
        sizes,
        accel,
        budget: o.row_budget,
        load_before,
        load_after: loadavg(),
    })
}

/// `n` files of 10 KiB in directories of [`PER_DIR`].
fn generate(dir: &Path, n: usize) -> Result<()> {
    for i in 0..n {
        let sub = dir.join(dir_name(i / PER_DIR));
        if i % PER_DIR == 0 {
            std::fs::create_dir_all(&sub)?;
        }
        std::fs::write(
            sub.join(format!("f{:03}.bin", i % PER_DIR)),
            ws_content(i as u64),
        )?;
    }
    Ok(())
}

fn dir_name(d: usize) -> String {
    format!("d{d:04}")
}

/// The `k`th of the `CHANGED` files of repetition `rep`: file `file` of one directory.
fn changed_path(n: usize, rep: usize, k: usize, file: &str) -> String {
    let dirs = n.div_ceil(PER_DIR).max(1);
    format!("{}/{file}", dir_name((rep * CHANGED + k) % dirs))
}

/// The rows of one size.
fn one_size(
    sock: &Path,
    scratch: &Path,
    home: &Path,
    n: usize,
    o: &Options,
    accel: &mut String,
) -> Result<SizeRows> {
    let mut rows = vec![Row::Skipped(String::new()); OPS.len()];
    let gen_dir = scratch.join("gen");
    let t = Instant::now();
    generate(&gen_dir, n)?;
    println!("    generated in {}", fmt(t.elapsed()));
    let bytes = (n * crate::bench_ws::WS_FILE_BYTES) as u64;

    // rsync and first sync in turns, so both see the same load. First syncs: each a sandbox
    // created on an empty directory, then the tree moved in.
    let dst = home.join("curves-rsync-dst");
    let ws = scratch.join("ws");
    let (mut b_rsync, mut budget) = (Budget::new(o.row_budget), Budget::new(o.row_budget));
    let mut rsync = Vec::new();
    let mut rsync_over = None;
    let (mut first, mut daemon_ms) = (Vec::new(), Vec::new());
    let mut keep = None;
    let mut over = None;
    while first.len() < o.reps {
        if rsync_over.is_none() && rsync.len() < o.reps && (rsync.is_empty() || b_rsync.another()) {
            let t = Instant::now();
            match rsync_once(&gen_dir, &dst, b_rsync.remaining())? {
                Some(el) => rsync.push(el),
                None => rsync_over = Some(b_rsync.spent + t.elapsed()),
            }
            b_rsync.add(t.elapsed());
        }
        let t = Instant::now();
        std::fs::create_dir_all(&ws)?;
        let body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());
        let (st, created) = http::request(sock, "POST", "/v1/sandboxes", Some(&body))?;
        if st != 201 {
            bail!("create failed: HTTP {st}: {created}");
        }
        let id = http::json_str(&created, "id").context("no id")?;
        if let Some(a) = http::json_str(&created, "accel") {
            *accel = a;
        }
        std::fs::remove_dir(&ws)?;
        std::fs::rename(&gen_dir, &ws)?;
        settle()?;
        let path = format!("/v1/sandboxes/{id}/sync");
        let call = Instant::now();
        let answer = http::request_within(sock, "POST", &path, None, budget.remaining())?;
        let el = call.elapsed();
        let Some((st, rep)) = answer else {
            budget.add(t.elapsed());
            over = Some(budget.spent);
            delete(sock, &id);
            break;
        };
        if st != 200 || !rep.contains(&format!("\"files_sent\":{n},")) {
            bail!("first sync did not send every file: HTTP {st}: {rep}");
        }
        first.push(el);
        let v: serde_json::Value = serde_json::from_str(&rep)?;
        daemon_ms.push(Duration::from_millis(
            v["duration_ms"].as_u64().context("no duration_ms")?,
        ));
        budget.add(t.elapsed());
        if first.len() < o.reps && budget.another() {
            delete(sock, &id);
            std::fs::rename(&ws, &gen_dir)?;
        } else {
            keep = Some(id);
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&dst);
    rows[RSYNC] = match rsync_over {
        Some(spent) => over_or_cut(rsync, spent),
        None => Row::Measured(rsync),
    };
    print_row(RSYNC, &rows[RSYNC]);
    match over {
        Some(spent) if first.is_empty() => {
            rows[FIRST] = Row::OverBudget(spent);
            rows[FIRST_DAEMON] = Row::Skipped("the first sync went over budget".into());
        }
        _ => {
            rows[FIRST] = Row::Measured(first);
            rows[FIRST_DAEMON] = Row::Measured(daemon_ms);
        }
    }
    print_row(FIRST, &rows[FIRST]);
    print_row(FIRST_DAEMON, &rows[FIRST_DAEMON]);
    let Some(id) = keep else {
        for r in &mut rows[DELTA..] {
            *r = Row::Skipped("the first sync went over budget".into());
        }
        return Ok(SizeRows {
            files: n,
            bytes,
            rows,
        });
    };

    let res = after_first(sock, &ws, &id, n, o, &mut rows);
    delete(sock, &id);
    res?;
    Ok(SizeRows {
        files: n,
        bytes,
        rows,
    })
}

/// Delta syncs, diffs and applies on the sandbox `id` whose first sync is done.
fn after_first(
    sock: &Path,
    ws: &Path,
    id: &str,
    n: usize,
    o: &Options,
    rows: &mut [Row],
) -> Result<()> {
    let skip_rest = |rows: &mut [Row], from: usize| {
        for r in &mut rows[from..] {
            if matches!(r, Row::Skipped(_)) {
                *r = Row::Skipped("an earlier row of this size went over budget".into());
            }
        }
    };
    let sync_path = format!("/v1/sandboxes/{id}/sync");
    let mut budget = Budget::new(o.row_budget);
    let mut delta = Vec::new();
    while delta.len() < o.reps && (delta.is_empty() || budget.another()) {
        let t = Instant::now();
        let rep = delta.len();
        for k in 0..CHANGED {
            std::fs::write(
                ws.join(changed_path(n, rep, k, "f000.bin")),
                ws_content(2_000_000 + (rep * CHANGED + k) as u64),
            )?;
        }
        let call = Instant::now();
        let answer = http::request_within(sock, "POST", &sync_path, None, budget.remaining())?;
        let el = call.elapsed();
        budget.add(t.elapsed());
        let Some((st, body)) = answer else {
            rows[DELTA] = over_or_cut(delta, budget.spent);
            print_row(DELTA, &rows[DELTA]);
            skip_rest(rows, DIFF_FIRST);
            return Ok(());
        };
        if st != 200 || !body.contains(&format!("\"files_sent\":{CHANGED},")) {
            bail!("delta sync did not send exactly the {CHANGED} changed files: HTTP {st}: {body}");
        }
        delta.push(el);
    }
    rows[DELTA] = Row::Measured(delta);
    print_row(DELTA, &rows[DELTA]);

    // Diff then apply, in turns: each apply takes the diff's changes, so the next round has
    // exactly CHANGED changed files again. The first diff walks the whole tree in the guest.
    let diff_path = format!("/v1/sandboxes/{id}/diff");
    let apply_path = format!("/v1/sandboxes/{id}/apply");
    let (mut b_first, mut b_diff, mut b_apply) = (
        Budget::new(o.row_budget),
        Budget::new(o.row_budget),
        Budget::new(o.row_budget),
    );
    let (mut diffs, mut applies) = (Vec::new(), Vec::new());
    for round in 0..=o.reps {
        if round > 1 && !(b_diff.another() && b_apply.another()) {
            break;
        }
        let t = Instant::now();
        let files: Vec<String> = (0..CHANGED)
            .map(|k| changed_path(n, round, k, "f001.bin"))
            .collect();
        let script = files
            .iter()
            .map(|f| format!("echo changed-{round} > /workspace/{f}"))
            .collect::<Vec<_>>()
            .join(" && ");
        let exit = http::exec(sock, id, &serde_json::json!({ "cmd": script }).to_string())?;
        if !exit.contains("\"exit_code\":0") {
            bail!("the guest's change failed: {exit}");
        }
        let b = if round == 0 {
            &mut b_first
        } else {
            &mut b_diff
        };
        let call = Instant::now();
        let answer = http::request_within(sock, "GET", &diff_path, None, b.remaining())?;
        let el = call.elapsed();
        b.add(t.elapsed());
        let Some((st, body)) = answer else {
            let (at, spent) = if round == 0 {
                (DIFF_FIRST, b_first.spent)
            } else {
                (DIFF, b_diff.spent)
            };
            rows[at] = over_or_cut(std::mem::take(&mut diffs), spent);
            print_row(at, &rows[at]);
            skip_rest(rows, at + 1);
            return Ok(());
        };
        let shown = body.matches("\"path\"").count();
        if st != 200 || shown != CHANGED || files.iter().any(|f| !body.contains(f.as_str())) {
            bail!("diff did not show exactly the {CHANGED} changes: HTTP {st}: {body}");
        }
        if round == 0 {
            rows[DIFF_FIRST] = Row::Measured(vec![el]);
            print_row(DIFF_FIRST, &rows[DIFF_FIRST]);
        } else {
            diffs.push(el);
        }
        let call = Instant::now();
        let answer =
            http::request_within(sock, "POST", &apply_path, Some("{}"), b_apply.remaining())?;
        let el = call.elapsed();
        b_apply.add(el);
        let Some((st, body)) = answer else {
            rows[DIFF] = Row::Measured(diffs);
            rows[APPLY] = over_or_cut(applies, b_apply.spent);
            print_row(DIFF, &rows[DIFF]);
            print_row(APPLY, &rows[APPLY]);
            return Ok(());
        };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let applied = v["applied"].as_array().map_or(0, Vec::len);
        if st != 200 || applied != CHANGED || !v["artifact_id"].is_string() {
            bail!("apply did not take the {CHANGED} changes with a backup: HTTP {st}: {body}");
        }
        applies.push(el);
    }
    rows[DIFF] = Row::Measured(diffs);
    rows[APPLY] = Row::Measured(applies);
    print_row(DIFF, &rows[DIFF]);
    print_row(APPLY, &rows[APPLY]);
    Ok(())
}

/// A row whose call ran out of budget: over budget if nothing was measured, else what was.
fn over_or_cut(done: Vec<Duration>, spent: Duration) -> Row {
    if done.is_empty() {
        Row::OverBudget(spent)
    } else {
        Row::Measured(done)
    }
}

/// Write back every dirty page (not timed): each rsync and each first sync starts with none
/// pending, so neither pays for the other's (or the generator's) write-back.
fn settle() -> Result<()> {
    if !Command::new("sync").status().context("sync")?.success() {
        bail!("sync failed");
    }
    Ok(())
}

fn delete(sock: &Path, id: &str) {
    if let Err(e) = http::request(sock, "DELETE", &format!("/v1/sandboxes/{id}"), None) {
        println!("    (could not delete {id}: {e:#})");
    }
}

/// One `rsync -a` of `src` into a fresh `dst` (removed first and dirty pages written back,
/// not timed): its time, or `None` when it was still running after `limit` (then killed).
fn rsync_once(src: &Path, dst: &Path, limit: Duration) -> Result<Option<Duration>> {
    if dst.exists() {
        std::fs::remove_dir_all(dst)?;
    }
    settle()?;
    let call = Instant::now();
    let mut child = Command::new("rsync")
        .arg("-a")
        .arg(format!("{}/", src.display()))
        .arg(format!("{}/", dst.display()))
        .spawn()
        .context("rsync (apt-get install rsync)")?;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if call.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let el = call.elapsed();
    if !status.success() {
        bail!("rsync failed: {status}");
    }
    Ok(Some(el))
}

fn print_row(op: usize, r: &Row) {
    match r {
        Row::Measured(v) => progress(OPS[op].0, v),
        Row::OverBudget(d) => println!("    {}: over budget ({:.0} s)", OPS[op].0, d.as_secs_f64()),
        Row::Skipped(why) => println!("    {}: skipped ({why})", OPS[op].0),
    }
}

/// One table cell: the median, its repetitions and the ratio to rsync of the same size.
fn cell(r: &Row, rsync: Option<Duration>, ratio: bool) -> String {
    match r {
        Row::Measured(v) if !v.is_empty() => {
            let m = median(v);
            match rsync.filter(|_| ratio) {
                Some(b) => format!(
                    "{} ({}) **{:.2}x**",
                    fmt(m),
                    v.len(),
                    m.as_secs_f64() / b.as_secs_f64()
                ),
                None => format!("{} ({})", fmt(m), v.len()),
            }
        }
        Row::Measured(_) => "no repetition within budget".into(),
        Row::OverBudget(d) => format!("over budget ({:.0} s)", d.as_secs_f64()),
        Row::Skipped(why) => format!("skipped: {why}"),
    }
}

/// The growth check, one line per operation: per-file time at each size over the one below.
pub fn growth_lines(c: &Curves) -> Vec<String> {
    let mut out = Vec::new();
    for (op, (name, _)) in OPS.iter().enumerate() {
        let mut parts = Vec::new();
        for w in c.sizes.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            if let (Some(ta), Some(tb)) = (a.rows[op].median(), b.rows[op].median()) {
                parts.push(format!(
                    "{}k -> {}k: {:.2}",
                    a.files / 1000,
                    b.files / 1000,
                    growth((a.files, ta), (b.files, tb))
                ));
            }
        }
        if !parts.is_empty() {
            out.push(format!("{name}: {}", parts.join(", ")));
        }
    }
    out
}

/// The BENCHMARKS.md section (the plot is written by the caller).
pub fn section(c: &Curves, when: &str) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "{HEADING} (issue 19)\n")?;
    writeln!(
        md,
        "Measured on {when}, accel **{}**; host load average at the start {}, at the end {}. \
         Trees of 10 KiB files (incompressible), 100 per directory; `rsync -a` copies the tree into a \
         fresh local directory on the same file system (the baseline, same run, in turns with the \
         first syncs, warm page cache like them; before each rsync and each first sync every dirty page is \
         written back, untimed). Sync, diff and apply times are the API call's wall clock as \
         the client measures it (HTTP over the daemon's unix socket); the first sync also as \
         the daemon reports it. Each cell: median (repetitions) and ratio to rsync at the same \
         size. Row budget {} s wall clock (set-up included): a row past it shows \
         \"over budget\" and the bench goes on.\n",
        c.accel,
        c.load_before,
        c.load_after,
        c.budget.as_secs()
    )?;
    write!(md, "| operation |")?;
    for s in &c.sizes {
        write!(
            md,
            " {} files ({} MB) |",
            thousands(s.files),
            thousands((s.bytes / 1_000_000) as usize)
        )?;
    }
    writeln!(md)?;
    writeln!(md, "|---|{}", "---|".repeat(c.sizes.len()))?;
    for (op, (_, what)) in OPS.iter().enumerate() {
        write!(md, "| {what} |")?;
        for s in &c.sizes {
            write!(
                md,
                " {} |",
                cell(&s.rows[op], s.rows[RSYNC].median(), op != RSYNC)
            )?;
        }
        writeln!(md)?;
    }
    if let Some(s) = c.sizes.iter().find(|s| s.files == 10_000)
        && let (Some(f), Some(r)) = (s.rows[FIRST].median(), s.rows[RSYNC].median())
    {
        let x = f.as_secs_f64() / r.as_secs_f64();
        writeln!(
            md,
            "\nFirst sync / rsync at 10,000 files = **{x:.2}** (target <= 1.0: {}).",
            if x <= 1.0 { "met" } else { "not met" }
        )?;
    }
    writeln!(
        md,
        "\nGrowth: time per file at each size over time per file at the size below (1.00 = \
         linear, below 1 = better than linear; delta sync, diff and apply change 3 files \
         whatever the tree's size):\n"
    )?;
    for l in growth_lines(c) {
        writeln!(md, "- {l}")?;
    }
    writeln!(
        md,
        "\n![time vs files, log-log]({SVG})\n\n`{SVG}`: time vs files, log-log, one line per \
         operation (medians; over-budget points left out). Where a first sync's time goes: \
         docs/ARCHITECTURE.md, \"What a first sync costs as the tree grows\".\n"
    )?;
    Ok(md)
}

/// `--curves-only`: only the workspace cost curves on their own daemon; replaces that section
/// of BENCHMARKS.md and writes the plot beside it.
pub fn run_only(o: Options) -> Result<()> {
    crate::bench::run_only("--curves-only", HEADING, |bin, home, out, config| {
        let c = run(bin, &home.join("curves"), out, config, &o)?;
        section_and_plot(&c)
    })
}

/// The cost curves' section, with `bench-curves.svg` written beside BENCHMARKS.md (a run
/// with nothing measured keeps the old plot and says so).
pub fn section_and_plot(c: &Curves) -> Result<String> {
    let mut md = section(c, &crate::bench::now_utc()?)?;
    let svg = crate::util::repo_root().join(SVG);
    match crate::bench_curves_plot::write_svg(c, &svg) {
        Ok(()) => println!("wrote {}", svg.display()),
        Err(e) => writeln!(md, "(The plot was not redrawn: {e:#}.)\n")?,
    }
    Ok(md)
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
#[path = "bench_curves_tests.rs"]
mod tests;
