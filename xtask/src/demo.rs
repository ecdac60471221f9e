//! `cargo xtask demo`: the main job on a fresh machine. Installs what is needed, builds the
//! binary and images (cached), starts the daemon on a scratch data root (outside the repo),
//! creates a sandbox for a repo, runs commands in it, removes it and stops the daemon. CI runs
//! it too (step `demo`), so the README's first command cannot break unseen.
//!
//! It builds only what it runs: the Debian packages (not the test SDKs `cargo xtask deps`
//! adds), the base image and the one template layer its repo picks (`tryboxi template
//! detect`); the other templates come with `cargo xtask images --all` or `--template NAME`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::daemon::Daemon;
use crate::util;

pub fn run(repo: Option<std::path::PathBuf>) -> Result<()> {
    let started = std::time::Instant::now();
    println!(
        "==> demo: a fresh 2-core machine takes about 12 min, once: Debian packages (~0.5 min), \
         the static build (~4-6 min), the guest kernel (~6 min), the rootfs (~1 min), one \
         template (~0.5 min), the demo itself (~0.5 min). Later runs reuse all of it (cached in \
         /var/cache/tryboxi and target/)."
    );
    crate::deps::debian()?;
    let bin = crate::dist::run()?;
    let repo = repo.unwrap_or_else(util::repo_root);
    let template = picked_template(&bin, &repo)?;
    println!("==> {} asks for the `{template}` template", repo.display());
    let wanted = crate::images::template::Wanted {
        names: if template == "base" {
            Vec::new()
        } else {
            vec![template]
        },
        ..Default::default()
    };
    crate::images::run(
        &bin,
        crate::images::Rebuild::default(),
        &wanted,
        Default::default(),
    )?;
    with_built(&bin, &repo)?;
    println!(
        "\n==> demo done in {}. Next, with the daemon as a service:\n\
         \x20 ./_out/bin/tryboxi install --artifacts _out   # the daemon (systemd), the images, `tryboxi` on PATH\n\
         \x20 tryboxi create -w ~/src/your-repo            # a sandbox for a repo: prints its id\n\
         \x20 tryboxi exec ID -- make test                  # a command in it (exit code, stdout, stderr)\n\
         \x20 tryboxi diff ID; tryboxi apply ID            # what changed, brought back with a backup (`tryboxi undo ID`)\n\
         \x20 tryboxi rm ID\n\
         \x20 tryboxi mcp install claude --project ~/src/your-repo   # the sandbox tools for an agent (or cursor, codex)\n\
         \x20 cargo xtask images --all && ./_out/bin/tryboxi install --artifacts _out   # the go/node/python/rust templates",
        util::fmt_dur(started.elapsed())
    );
    Ok(())
}

/// The template `auto` picks for `repo`, asked of the binary itself (one rule, the daemon's).
fn picked_template(bin: &std::path::Path, repo: &std::path::Path) -> Result<String> {
    let o = Command::new(bin)
        .args(["template", "detect"])
        .arg(repo)
        .output()
        .with_context(|| format!("running {} template detect", bin.display()))?;
    if !o.status.success() {
        bail!(
            "tryboxi template detect {}: {}",
            repo.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let name = String::from_utf8(o.stdout)?.trim().to_owned();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        bail!("tryboxi template detect printed {name:?}");
    }
    Ok(name)
}

/// The demo proper, with the binary `bin` and the images in `_out` built.
fn with_built(bin: &std::path::Path, repo: &std::path::Path) -> Result<()> {
    let out = util::out_dir();
    let repo = repo.to_path_buf();
    let home = demo_home(&repo);
    println!(
        "\n==> installing the guest images into the data root {}",
        home.display()
    );
    // A scratch install: the images go into the demo's data root, the programs below
    // `_out/demo-root` (not the host's /usr/local) and no service is started.
    let st = Command::new(bin)
        .args(["install", "--no-service", "--artifacts"])
        .arg(&out)
        .arg("--destdir")
        .arg(out.join("demo-root"))
        .env("TRYBOXI_HOME", &home)
        .status()?;
    if !st.success() {
        bail!("tryboxi install failed");
    }
    println!("\n==> starting the daemon");
    let d = Daemon::start(bin, &home, &home.join("artifacts"), "")?;
    let res = session(bin, &d, &repo);
    println!("\n==> stopping the daemon");
    d.stop()?;
    res
}

/// The demo's scratch data root: outside the repo, because a folder that holds the data root
/// is never a workspace (the daemon refuses it: a sync would copy the VMs' own files into a VM).
/// On disk under /var/tmp (VM RAM files live there; /tmp may be RAM), one per user and checkout.
fn demo_home(repo: &std::path::Path) -> std::path::PathBuf {
    use sha2::Digest;
    let key = hex::encode(sha2::Sha256::digest(repo.as_os_str().as_encoded_bytes()));
    // SAFETY: `getuid` has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::path::PathBuf::from("/var/tmp").join(format!("tryboxi-demo-{uid}-{}", &key[..12]))
}

fn session(bin: &std::path::Path, d: &Daemon, repo: &std::path::Path) -> Result<()> {
    let cli = |args: &[&str]| -> Result<std::process::Output> {
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("'{a}'")
                } else {
                    a.to_string()
                }
            })
            .collect();
        println!("$ tryboxi {}", shown.join(" "));
        let o = Command::new(bin)
            .args(args)
            .env("TRYBOXI_HOME", &d.home)
            .output()?;
        print!("{}", String::from_utf8_lossy(&o.stdout));
        eprint!("{}", String::from_utf8_lossy(&o.stderr));
        Ok(o)
    };
    cli(&["doctor"])?;
    println!(
        "\n==> creating a sandbox for {} (boots a microVM)",
        repo.display()
    );
    let started = std::time::Instant::now();
    let o = cli(&["create", "-w", &repo.display().to_string()])?;
    if !o.status.success() {
        bail!("create failed; daemon log: {}", d.log.display());
    }
    println!("   (ready in {})", util::fmt_dur(started.elapsed()));
    let id = String::from_utf8(o.stdout)?
        .split_whitespace()
        .next()
        .context("no id")?
        .to_owned();
    let o = cli(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "uname -a; cat /etc/os-release | head -2; nproc; free -m | head -2",
    ])?;
    let o2 = cli(&["exec", &id, "--", "sh", "-c", "echo to-stderr >&2; exit 3"])?;
    match o2.status.code() {
        Some(3) => println!("   (exit code 3, as the command asked)"),
        Some(c) => println!("   (exit code {c}, but the command exits with 3)"),
        None => println!("   (the CLI ended without an exit code, by a signal)"),
    }
    cli(&["ls"])?;
    cli(&["rm", &id])?;
    if !o.status.success() || o2.status.code() != Some(3) {
        bail!(
            "the demo's commands did not behave as expected; daemon log: {}",
            d.log.display()
        );
    }
    Ok(())
}
