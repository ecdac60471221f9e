//! `cargo xtask bench`: boot and exec benchmarks against a baseline measured in the same run;
//! writes `BENCHMARKS.md`. Timings are medians over `--reps` repetitions. Never run as tests.
//!
//! (a) baseline: bare QEMU with the same kernel and initramfs, whose init powers off at once
//!     (`tryboxi.probe=1`), launch to exit;
//! (b) `POST /v1/sandboxes` to agent-ready (the call returns when the agent answers);
//! (c) exec round trip of `true` on a ready sandbox, via the API and via the CLI;
//! (d) QEMU RSS of an idle sandbox and the daemon's RSS;
//! (e) workspace: a generated repo of 10,000 files / 100 MB, `rsync -a` of it into a local
//!     directory vs the first sync into a VM, a one-file delta sync, and a diff of one file
//!     changed in the VM;
//! (f) snapshot and restore of a ready sandbox;
//! (g)-(i) golden-snapshot create, fork of 10, memory of 10 idle forks (`bench_snap.rs`).
//! (j) network (`bench_net.rs`): one TCP stream and connections per second from a guest through
//!     its userspace stack to a local server, vs the same host-local.
//! (k), (l) secrets (`bench_secrets.rs`): an intercepted HTTPS request with a swap and a 64 MiB
//!     intercepted download vs pass-through; first sync with one secret stored vs none.
//! (m) E2B (`bench_e2b.rs`): create + run `true` + kill through the E2B Python SDK vs the native
//!     API, interleaved.
//! (n) sustained load (`bench_load.rs`): 5 sandboxes x 4 concurrent execs for `--load-secs`,
//!     latency vs the same commands on an idle sandbox, errors, the daemon's RSS.
//! (o) workspace cost curves (`bench_curves.rs`): rsync -a vs first sync, delta sync, diff and
//!     apply at 1k / 10k / 100k files, a per-row budget, a growth check, `bench-curves.svg`.
//! (p) density (`bench_density.rs`): `--density-count` forks of one sandbox and
//!     `--density-creates` creates alive at once with the default config: PSS, daemon RSS, idle
//!     CPU of all QEMUs, `true` on random sandboxes vs on one alone.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench_ws::{workspace_bench, ws_section};
use crate::daemon::{Daemon, rss_kib};
use crate::http;
use crate::util;

pub(crate) const MEM_MIB: u32 = 512;
pub(crate) const VCPUS: u32 = 1;

pub fn run(
    reps: usize,
    load_secs: u64,
    curves: crate::bench_curves::Options,
    density: crate::bench_density::DensityArgs,
) -> Result<()> {
    let reps = reps.max(5);
    let bin = crate::images::dist_and_defaults()?;
    let out = util::out_dir();
    let images = out.join("images");
    let home = out.join("bench-home");
    if home.exists() {
        std::fs::remove_dir_all(&home)?;
    }
    let qemu = "qemu-system-x86_64";
    let qemu_version = util::output(Command::new(qemu).arg("--version"), "qemu --version")?
        .lines()
        .next()
        .unwrap_or("")
        .to_owned();

    let load_before = loadavg();
    println!(
        "==> (a) baseline: bare QEMU, same kernel + initramfs, init powers off at once ({reps}x)"
    );
    let mut base = Vec::new();
    for _ in 0..reps {
        base.push(bare_boot(qemu, &images, &home)?);
    }

    progress("(a) bare boot", &base);
    println!("==> starting the daemon");
    // Golden snapshots off: (b) measures a cold boot; (g) runs on a second daemon.
    let config = format!(
        "default_memory_mib = {MEM_MIB}\ndefault_vcpus = {VCPUS}\n[pool]\ngolden = false\n"
    );
    let d = Daemon::start(&bin, &home, &out, &config)?;
    let sock = d.socket();
    let ws = crate::util::beside(&home, "ws")?;
    let create_body = format!(r#"{{"workspace":{{"host_path":"{}"}}}}"#, ws.display());

    // The first create resolves the acceleration (probe, cached) — not timed.
    let (st, first) = http::request(&sock, "POST", "/v1/sandboxes", Some(&create_body))?;
    if st != 201 {
        bail!("create failed: HTTP {st}: {first}");
    }
    let keep = http::json_str(&first, "id").context("no id")?;
    let accel = http::json_str(&first, "accel").unwrap_or_else(|| "?".into());

    println!("==> (b) create to agent-ready ({reps}x, accel {accel})");
    let mut create = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let (st, body) = http::request(&sock, "POST", "/v1/sandboxes", Some(&create_body))?;
        create.push(t.elapsed());
        if st != 201 {
            bail!("create failed: HTTP {st}: {body}");
        }
        let id = http::json_str(&body, "id").context("no id")?;
        http::request(&sock, "DELETE", &format!("/v1/sandboxes/{id}"), None)?;
    }

    progress("(b) create", &create);
    let exec_reps = reps * 4;
    println!("==> (c) exec `true` round trip ({exec_reps}x API, {reps}x CLI)");
    http::exec(&sock, &keep, r#"{"argv":["true"]}"#)?; // warm the page cache
    let mut api = Vec::new();
    for _ in 0..exec_reps {
        let t = Instant::now();
        let line = http::exec(&sock, &keep, r#"{"argv":["true"]}"#)?;
        api.push(t.elapsed());
        if !line.contains("\"exit_code\":0") {
            bail!("`true` failed: {line}");
        }
    }
    let mut cli = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let st = Command::new(&bin)
            .args(["exec", &keep, "--", "true"])
            .env("TRYBOXI_HOME", &home)
            .status()?;
        cli.push(t.elapsed());
        if !st.success() {
            bail!("CLI exec of `true` failed");
        }
    }

    progress("(c) exec API", &api);
    progress("(c) exec CLI", &cli);
    println!("==> (f) snapshot and restore of a ready sandbox ({reps}x each)");
    let mut snap = Vec::new();
    let mut restore = Vec::new();
    let (mut after_restore_1, mut after_restore_2) = (Vec::new(), Vec::new());
    for i in 0..reps {
        let (s, r) = snapshot_then_restore(&sock, &keep, &format!("b{i}"))?;
        snap.push(s);
        restore.push(r);
        // The restored VM is a new QEMU process: under TCG its translation cache starts empty,
        // so the first exec pays for translating the guest's fork/exec paths again.
        for v in [&mut after_restore_1, &mut after_restore_2] {
            let t = Instant::now();
            let line = http::exec(&sock, &keep, r#"{"argv":["true"]}"#)?;
            v.push(t.elapsed());
            if !line.contains("\"exit_code\":0") {
                bail!("exec after restore failed: {line}");
            }
        }
    }
    progress("(f) snapshot", &snap);
    progress("(f) restore", &restore);
    progress("(f) first exec after a restore", &after_restore_1);
    progress("(f) second exec after a restore", &after_restore_2);
    let after = http::exec(&sock, &keep, r#"{"argv":["true"]}"#)?;
    if !after.contains("\"exit_code\":0") {
        bail!("exec after restore failed: {after}");
    }

    println!("==> (d) memory of an idle sandbox and of the daemon");
    std::thread::sleep(Duration::from_secs(2));
    let vm: serde_json::Value = serde_json::from_slice(&std::fs::read(
        home.join("sandboxes").join(&keep).join("vm.json"),
    )?)?;
    let qemu_pid = vm["pid"].as_u64().context("vm.json pid")? as u32;
    let qemu_rss = rss_kib(qemu_pid).context("QEMU RSS")?;
    http::request(&sock, "DELETE", &format!("/v1/sandboxes/{keep}"), None)?;
    std::thread::sleep(Duration::from_secs(1));
    let daemon_rss = rss_kib(d.pid()).context("daemon RSS")?;

    println!("==> (e) workspace sync: 10,000 files / 100 MB vs rsync -a");
    let ws = workspace_bench(&sock, &home, reps)?;
    d.stop()?;
    let sn = crate::bench_snap::run(&bin, &home.join("snap"), &out, MEM_MIB, VCPUS, reps)?;
    let net = crate::bench_net::run(&bin, &home.join("net"), &out, &config)?;
    let secrets = crate::bench_secrets::run(&bin, &home.join("secrets"), &out, &config)?;
    let e2b = crate::bench_e2b::run(&bin, &home.join("e2b"), &out, &config, reps.min(5))?;
    let load = crate::bench_load::run(&bin, &home.join("load"), &out, &config, load_secs)?;
    let curves = crate::bench_curves::run(&bin, &home.join("curves"), &out, &config, &curves)?;
    let dens = crate::bench_density::run(&bin, &home.join("density"), &out, density)?;

    let (a, b, c_api, c_cli) = (median(&base), median(&create), median(&api), median(&cli));
    let ratio = b.as_secs_f64() / a.as_secs_f64();
    let mut md = String::new();
    writeln!(md, "# Benchmarks\n")?;
    writeln!(
        md,
        "Measured by `cargo xtask bench` on {} ({} cores, {}), {}; medians over the stated repetitions.",
        util::output(
            Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M UTC"),
            "date"
        )?
        .trim(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        cpu_model(),
        qemu_version
    )?;
    writeln!(
        md,
        "Guests: {VCPUS} vCPU, {MEM_MIB} MiB. Accel mode for every row: **{accel}**."
    )?;
    writeln!(
        md,
        "Host load average (1/5/15 min) at the start: {load_before}; at the end: {}. Other work on \
         the machine slows (a) and (b) alike, which is why (b) is reported as a ratio to (a) of the \
         same run.\n",
        loadavg()
    )?;
    writeln!(md, "## Boot and exec\n")?;
    writeln!(md, "| what | reps | median | min | max | target |")?;
    writeln!(md, "|---|---|---|---|---|---|")?;
    row(
        &mut md,
        "(a) baseline: bare QEMU launch -> init -> poweroff -> exit",
        &base,
        "",
    )?;
    row(
        &mut md,
        "(b) create -> agent ready (API)",
        &create,
        "(b)/(a) <= 1.3",
    )?;
    row(&mut md, "(c) exec `true` round trip, API", &api, "<= 25 ms")?;
    row(&mut md, "(c) exec `true` round trip, CLI process", &cli, "")?;
    row(
        &mut md,
        "(f) snapshot: pause, state file, freeze disk layer, continue (API)",
        &snap,
        "<= 50 ms (issue 7)",
    )?;
    row(
        &mut md,
        "(f) restore: new QEMU from the state file, agent answering (API)",
        &restore,
        "<= 100 ms (issue 7)",
    )?;
    row(
        &mut md,
        "(f) first exec `true` after a restore (new QEMU: empty TCG translation cache)",
        &after_restore_1,
        "",
    )?;
    row(
        &mut md,
        "(f) second exec `true` after a restore",
        &after_restore_2,
        "",
    )?;
    row(
        &mut md,
        "(g) create taking a warm-pool VM (pre-restored from the golden snapshot) -> exec `true` done (API)",
        &sn.pool_create,
        "<= 100 ms, (g)/(a) <= 0.07 (issue 7)",
    )?;
    row(
        &mut md,
        "(g) create restoring the golden snapshot on demand (pool empty) -> exec `true` done (API)",
        &sn.golden_create,
        "",
    )?;
    row(
        &mut md,
        "(h) fork 10 children -> API answered, 10 children ready (agents connected)",
        &sn.fork10_api,
        "<= 0.6 s (issue 7)",
    )?;
    row(
        &mut md,
        "(h) fork 10 children -> one exec `true` done in each (side by side)",
        &sn.fork10,
        "",
    )?;
    writeln!(md, "\nRatio (b)/(a) = **{ratio:.2}** (target <= 1.3).")?;
    writeln!(
        md,
        "Ratio (g)/(a) = **{:.3}** (target <= 0.07) from the warm pool; {:.3} restoring on demand.\n",
        median(&sn.pool_create).as_secs_f64() / a.as_secs_f64(),
        median(&sn.golden_create).as_secs_f64() / a.as_secs_f64()
    )?;
    writeln!(
        md,
        "Restore, golden restore on demand and fork children each start a new QEMU process; \
         under **{accel}** its translation cache starts empty, so the guest code the first \
         commands run is translated again: in this run the first exec `true` after a restore took \
         {} and the second {}. A warm-pool VM has paid that before it is taken; a fork child or \
         a restored VM pays it on its first commands (with KVM there is no such cost).\n",
        fmt(median(&after_restore_1)),
        fmt(median(&after_restore_2))
    )?;
    writeln!(md, "## Memory\n")?;
    writeln!(md, "| what | RSS | target |\n|---|---|---|")?;
    writeln!(
        md,
        "| (d) QEMU of an idle sandbox ({MEM_MIB} MiB guest) | {:.1} MiB | |",
        qemu_rss as f64 / 1024.0
    )?;
    writeln!(
        md,
        "| (d) daemon, idle after the run | {:.1} MiB | <= 30 MiB |",
        daemon_rss as f64 / 1024.0
    )?;
    writeln!(
        md,
        "| (i) {} idle forks of one sandbox: sum of PSS (shared pages split between sharers) | {:.1} MiB ({:.1} MiB each) | |",
        sn.forks,
        sn.forks_pss_kib as f64 / 1024.0,
        sn.forks_pss_kib as f64 / 1024.0 / sn.forks.max(1) as f64
    )?;
    writeln!(
        md,
        "| (i) the same {} forks: sum of RSS (shared pages counted in each) | {:.1} MiB | |",
        sn.forks,
        sn.forks_rss_kib as f64 / 1024.0
    )?;
    writeln!(
        md,
        "## Network (one sandbox, through its userspace stack)\n"
    )?;
    writeln!(
        md,
        "| what | through the stack | host-local | ratio |\n|---|---|---|---|"
    )?;
    writeln!(
        md,
        "| (j) one TCP stream, 64 MiB, bash `/dev/tcp` -> local server | {:.1} MB/s | {:.1} MB/s | {:.3} |",
        net.stream_vm,
        net.stream_host,
        net.stream_vm / net.stream_host
    )?;
    writeln!(
        md,
        "| (j) connections per second, one after another (connect + close; from the median gap between accepts) | {:.0}/s | {:.0}/s | {:.3} |",
        net.cps_vm,
        net.cps_host,
        net.cps_vm / net.cps_host
    )?;
    writeln!(
        md,
        "\nThe guest side runs under **{accel}**: with TCG the guest kernel's TCP and bash are \
         emulated, so the ratio mostly measures the emulation, not the stack.\n"
    )?;
    md.push_str(&crate::bench_secrets::section(&secrets, &now_utc()?)?);
    md.push_str(&crate::bench_e2b::section(&e2b, &now_utc()?)?);
    md.push_str(&crate::bench_load::section(&load, &now_utc()?)?);
    md.push_str(&crate::bench_curves::section_and_plot(&curves)?);
    md.push_str(&crate::bench_density::section(&dens, &now_utc()?)?);
    md.push_str(&ws_section(&ws)?);
    println!("\n{md}");
    let path = util::repo_root().join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    md.push_str(&kept_sections(&old));
    std::fs::write(&path, md)?;
    println!("wrote {}", path.display());
    println!(
        "(a) {}  (b) {}  ratio {ratio:.2}  (c) api {} cli {}",
        fmt(a),
        fmt(b),
        fmt(c_api),
        fmt(c_cli)
    );
    Ok(())
}

/// `--workspace-only`: the daemon, then only (e); replaces the workspace section of
/// BENCHMARKS.md (everything from its heading on) and leaves the other rows as they were.
pub fn run_workspace_only(reps: usize) -> Result<()> {
    let reps = reps.max(5);
    let bin = crate::images::dist_and_defaults()?;
    let out = util::out_dir();
    let home = out.join("bench-home");
    if home.exists() {
        std::fs::remove_dir_all(&home)?;
    }
    let load_before = loadavg();
    // As the full run's daemon: no golden snapshots or warm pool restoring in the background
    // while the rows are measured.
    let config = format!(
        "default_memory_mib = {MEM_MIB}\ndefault_vcpus = {VCPUS}\n[pool]\ngolden = false\n"
    );
    let d = Daemon::start(&bin, &home, &out, &config)?;
    println!("==> (e) workspace sync: 10,000 files / 100 MB vs rsync -a");
    let ws = workspace_bench(&d.socket(), &home, reps)?;
    d.stop()?;
    let mut sec = ws_section(&ws)?;
    writeln!(
        sec,
        "These rows: `cargo xtask bench --workspace-only` on {}; host load average at the start \
         {load_before}, at the end {}.\n",
        util::output(
            Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M UTC"),
            "date"
        )?
        .trim(),
        loadavg()
    )?;
    println!("\n{sec}");
    let path = util::repo_root().join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    // The old workspace section is replaced; what follows it stays.
    let (head, tail) = match old.find(WS_HEADING) {
        Some(i) => {
            let end = old[i + WS_HEADING.len()..]
                .find("\n## ")
                .map_or(old.len(), |j| i + WS_HEADING.len() + j + 1);
            (&old[..i], &old[end..])
        }
        None => (old.as_str(), ""),
    };
    std::fs::write(&path, format!("{head}{sec}{tail}"))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// A `--*-only` run: the binary and images, a fresh bench home, `rows` measured on its own
/// daemon (`rows(bin, home, artifacts, config)` gives the section), and that section of
/// BENCHMARKS.md replaced (`heading`), the rest left as it was.
pub(crate) fn run_only(
    flag: &str,
    heading: &str,
    rows: impl FnOnce(&Path, &Path, &Path, &str) -> Result<String>,
) -> Result<()> {
    let bin = crate::images::dist_and_defaults()?;
    let out = util::out_dir();
    let home = out.join("bench-home");
    if home.exists() {
        std::fs::remove_dir_all(&home)?;
    }
    let config = format!(
        "default_memory_mib = {MEM_MIB}\ndefault_vcpus = {VCPUS}\n[pool]\ngolden = false\n"
    );
    let mut sec = rows(&bin, &home, &out, &config)?;
    writeln!(sec, "These rows: `cargo xtask bench {flag}`.\n")?;
    println!("\n{sec}");
    let path = util::repo_root().join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::write(&path, replace_section(&old, heading, &sec))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// `--secrets-only`: only the secrets rows (k), (l) on their own daemon; replaces the secrets
/// section of BENCHMARKS.md (or puts it before the workspace section) and leaves the rest.
pub fn run_secrets_only() -> Result<()> {
    run_only(
        "--secrets-only",
        crate::bench_secrets::HEADING,
        |bin, home, out, config| {
            let rows = crate::bench_secrets::run(bin, &home.join("secrets"), out, config)?;
            crate::bench_secrets::section(&rows, &now_utc()?)
        },
    )
}

/// `--e2b-only`: only row (m) on its own daemon; replaces the E2B section of BENCHMARKS.md.
pub fn run_e2b_only(reps: usize) -> Result<()> {
    run_only(
        "--e2b-only",
        crate::bench_e2b::HEADING,
        |bin, home, out, config| {
            let rows = crate::bench_e2b::run(bin, &home.join("e2b"), out, config, reps)?;
            crate::bench_e2b::section(&rows, &now_utc()?)
        },
    )
}

/// `--load-only`: only row (n) on its own daemon; replaces the sustained-load section.
pub fn run_load_only(secs: u64) -> Result<()> {
    run_only(
        "--load-only",
        crate::bench_load::HEADING,
        |bin, home, out, config| {
            let rows = crate::bench_load::run(bin, &home.join("load"), out, config, secs)?;
            crate::bench_load::section(&rows, &now_utc()?)
        },
    )
}

/// `--net-peer-only`: only the native-peer network rows on their own daemon; replaces that
/// section.
pub fn run_net_peer_only() -> Result<()> {
    run_only(
        "--net-peer-only",
        crate::bench_peer::HEADING,
        |bin, home, out, config| {
            let rows = crate::bench_peer::run(bin, &home.join("peer"), out, config)?;
            crate::bench_peer::section(&rows, &now_utc()?)
        },
    )
}

/// `--density-only`: only row (o) on its own daemon; replaces the density section.
pub fn run_density_only(args: crate::bench_density::DensityArgs) -> Result<()> {
    run_only(
        "--density-only",
        crate::bench_density::HEADING,
        |bin, home, out, _config| {
            let rows = crate::bench_density::run(bin, &home.join("density"), out, args)?;
            crate::bench_density::section(&rows, &now_utc()?)
        },
    )
}

/// `old` with the section under `heading` (up to the next `## `) replaced by `sec`; without
/// one, `sec` goes before the workspace section, else before the hand-measured one, else last.
pub(crate) fn replace_section(old: &str, heading: &str, sec: &str) -> String {
    if let Some(start) = old.find(heading) {
        let rest = &old[start + heading.len()..];
        let end = rest
            .find("\n## ")
            .map_or(old.len(), |i| start + heading.len() + i + 1);
        return format!("{}{sec}{}", &old[..start], &old[end..]);
    }
    let at = old
        .find(WS_HEADING)
        .or_else(|| old.find("## Templates, scheduler, gc (measured by hand"))
        .unwrap_or(old.len());
    format!("{}{sec}{}", &old[..at], &old[at..])
}

pub(crate) fn now_utc() -> Result<String> {
    Ok(util::output(
        Command::new("date").arg("-u").arg("+%Y-%m-%d %H:%M UTC"),
        "date",
    )?
    .trim()
    .to_owned())
}

const WS_HEADING: &str = "## Workspace sync";

/// Whether `heading` starts a section a full `cargo xtask bench` writes.
fn generated(heading: &str) -> bool {
    [
        "## Boot and exec",
        "## Memory",
        "## Network (",
        crate::bench_secrets::HEADING,
        crate::bench_e2b::HEADING,
        crate::bench_load::HEADING,
        crate::bench_curves::HEADING,
        crate::bench_density::HEADING,
        WS_HEADING,
    ]
    .iter()
    .any(|h| heading.starts_with(h))
}

/// Every section of `old` that a full run does not write (those measured by hand, the
/// `--against` comparison), in their order: kept when the bench rewrites the file.
fn kept_sections(old: &str) -> String {
    let mut starts: Vec<usize> = old.match_indices("\n## ").map(|(i, _)| i + 1).collect();
    if old.starts_with("## ") {
        starts.insert(0, 0);
    }
    let mut out = String::new();
    for (k, &at) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(old.len());
        let sec = &old[at..end];
        if !generated(sec) {
            out.push_str(sec);
        }
    }
    out
}

/// One bare boot: launch to QEMU exit, checking the guest really ran our init.
fn bare_boot(qemu: &str, images: &Path, scratch: &Path) -> Result<Duration> {
    std::fs::create_dir_all(scratch)?;
    let console: PathBuf = scratch.join("baseline-console.log");
    let t = Instant::now();
    let st = Command::new(qemu)
        .args(["-M", "microvm,acpi=off", "-accel", "tcg", "-cpu", "max"])
        .args(["-m", &MEM_MIB.to_string(), "-smp", &VCPUS.to_string()])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(images.join("vmlinuz"))
        .arg("-initrd")
        .arg(images.join("initramfs.cpio.gz"))
        .args([
            "-append",
            "console=ttyS0 reboot=t panic=-1 no_timer_check quiet tryboxi.probe=1",
        ])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()?;
    let el = t.elapsed();
    let log = std::fs::read_to_string(&console).unwrap_or_default();
    if !log.contains("TRYBOXI_PROBE_OK") {
        bail!("the baseline guest did not reach init (QEMU {st}): {log}");
    }
    Ok(el)
}

/// Snapshot `id` as `name`, then restore it: how long each API call took.
pub(crate) fn snapshot_then_restore(
    sock: &Path,
    id: &str,
    name: &str,
) -> Result<(Duration, Duration)> {
    let t = Instant::now();
    let (st, out) = http::request(
        sock,
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(&format!(r#"{{"name":"{name}"}}"#)),
    )?;
    let snap = t.elapsed();
    if st != 201 {
        bail!("snapshot failed: HTTP {st}: {out}");
    }
    let t = Instant::now();
    let (st, out) = http::request(
        sock,
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        Some(&format!(r#"{{"snapshot":"{name}"}}"#)),
    )?;
    let restore = t.elapsed();
    if st != 200 {
        bail!("restore failed: HTTP {st}: {out}");
    }
    Ok((snap, restore))
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Print a row as soon as it is measured, so a later failure does not lose it.
pub(crate) fn progress(what: &str, v: &[Duration]) {
    if v.is_empty() {
        return;
    }
    let min = v.iter().min().copied().unwrap_or_default();
    let max = v.iter().max().copied().unwrap_or_default();
    println!(
        "    {what}: median {} (min {}, max {}, {} reps)",
        fmt(median(v)),
        fmt(min),
        fmt(max),
        v.len()
    );
}

pub(crate) fn median(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[s.len() / 2]
}

pub(crate) fn fmt(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    } else {
        format!("{:.3} s", d.as_secs_f64())
    }
}

pub(crate) fn row(md: &mut String, what: &str, v: &[Duration], target: &str) -> Result<()> {
    let min = v.iter().min().copied().unwrap_or_default();
    let max = v.iter().max().copied().unwrap_or_default();
    writeln!(
        md,
        "| {what} | {} | {} | {} | {} | {target} |",
        v.len(),
        fmt(median(v)),
        fmt(min),
        fmt(max)
    )?;
    Ok(())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sections_the_full_run_does_not_write_survive_a_rewrite() {
        let old = "# B\n## Boot and exec\nx\n## Templates, scheduler, gc (measured by hand, 2026)\n\
                   | a |\n\n## Before and after (issue 15)\nr\n## Workspace sync (10,000 files)\nw\n\
                   ## Kernel plan (by hand)\nk\n";
        assert_eq!(
            super::kept_sections(old),
            "## Templates, scheduler, gc (measured by hand, 2026)\n| a |\n\n\
             ## Before and after (issue 15)\nr\n## Kernel plan (by hand)\nk\n"
        );
        assert_eq!(super::kept_sections("# B\n## Boot and exec\n"), "");
        let only = "## Fresh machine\n| a |\n";
        assert_eq!(super::kept_sections(only), only);
    }

    #[test]
    fn the_secrets_section_is_replaced_or_put_before_the_workspace_rows() {
        let h = crate::bench_secrets::HEADING;
        let sec = format!("{h}\nnew\n\n");
        let without = "# B\n## Network\nn\n## Workspace sync (x)\nw\n";
        assert_eq!(
            super::replace_section(without, h, &sec),
            format!("# B\n## Network\nn\n{sec}## Workspace sync (x)\nw\n")
        );
        let with = format!("# B\n{h}\nold\nold\n\n## Workspace sync (x)\nw\n");
        assert_eq!(
            super::replace_section(&with, h, &sec),
            format!("# B\n{sec}## Workspace sync (x)\nw\n")
        );
        let last = format!("# B\n{h}\nold\n");
        assert_eq!(
            super::replace_section(&last, h, &sec),
            format!("# B\n{sec}")
        );
        assert_eq!(
            super::replace_section("# B\n", h, &sec),
            format!("# B\n{sec}")
        );
    }
}
