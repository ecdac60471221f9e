//! The alias names work as the spec writes them: `sandboxd serve|install|uninstall|doctor|token`
//! (alone or with only options it serves), `sandboxctl <any CLI command>`, `sandbox-mcp`
//! (= `mcp`), and every subcommand's `--help` answers under every name; the shell completions
//! and man pages name every command (no VM, no daemon).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::BIN;

/// A directory holding the three alias names as symlinks to the binary.
fn aliases() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let link = |name: &str| {
        let p = dir.path().join(name);
        std::os::unix::fs::symlink(BIN, &p).unwrap();
        p
    };
    let (d, c, m) = (link("sandboxd"), link("sandboxctl"), link("sandbox-mcp"));
    (dir, d, c, m)
}

fn run(bin: &Path, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env("TRYBOXI_HOME", "/nonexistent-tryboxi-home")
        .output()
        .unwrap()
}

/// The subcommand names listed under `Commands:` in a help text.
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// `--help` of `prefix` and of every subcommand below it (two levels) answers with a usage.
fn all_helps(bin: &Path, prefix: &[&str]) -> usize {
    let mut args: Vec<&str> = prefix.to_vec();
    args.push("--help");
    let out = run(bin, &args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.contains("Usage:"),
        "{} {args:?}: {}\n{}",
        bin.display(),
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut n = 1;
    if prefix.len() < 2 {
        for c in commands(&text) {
            let mut p: Vec<&str> = prefix.to_vec();
            p.push(&c);
            n += all_helps(bin, &p);
        }
    }
    n
}

#[test]
fn every_help_answers_under_every_name() {
    let (_dir, sandboxd, sandboxctl, mcp) = aliases();
    let top = String::from_utf8(run(Path::new(BIN), &["--help"]).stdout).unwrap();
    let cmds = commands(&top);
    assert!(cmds.len() > 20, "{cmds:?}");
    // tryboxi and sandboxctl: every command and subcommand.
    let n = all_helps(Path::new(BIN), &[]);
    assert_eq!(all_helps(&sandboxctl, &[]), n);
    // sandboxd: the daemon's commands.
    for c in ["serve", "install", "uninstall", "doctor", "token"] {
        all_helps(&sandboxd, &[c]);
    }
    let serve = String::from_utf8(run(&sandboxd, &["serve", "--help"]).stdout).unwrap();
    assert!(serve.contains("--e2b"), "{serve}");
    // sandbox-mcp is `mcp`: its own help and its subcommands'.
    let mcp_help = String::from_utf8(run(&mcp, &["--help"]).stdout).unwrap();
    let direct = String::from_utf8(run(Path::new(BIN), &["mcp", "--help"]).stdout).unwrap();
    assert_eq!(mcp_help, direct);
    for c in commands(&direct) {
        all_helps(&mcp, &[&c]);
    }
}

#[test]
fn sandboxd_takes_the_daemon_commands_and_points_elsewhere_for_the_cli() {
    let (_dir, sandboxd, _, _) = aliases();
    // `sandboxd doctor` runs doctor (not `serve doctor`, a usage error before): it reports.
    let out = run(&sandboxd, &["doctor"]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(2),
        "doctor was a usage error: {text}"
    );
    assert!(text.to_lowercase().contains("qemu"), "{text}");
    // A CLI command under sandboxd is a clear usage error naming sandboxctl.
    let out = run(&sandboxd, &["exec", "sbx_x", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sandboxctl exec"), "{err}");
    // Only options: serve with them (an unknown option is serve's usage error).
    let out = run(&sandboxd, &["--no-such-option"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("serve"),
        "{out:?}"
    );
}

#[test]
fn fork_and_restore_say_what_they_do() {
    let help = |c: &str| String::from_utf8(run(Path::new(BIN), &[c, "--help"]).stdout).unwrap();
    assert!(help("restore").contains("Put a sandbox back to a snapshot"));
    let fork = help("fork");
    assert!(fork.contains("New sandboxes"), "{fork}");
    assert!(!fork.contains("Put a sandbox back"), "{fork}");
}

#[test]
fn completions_and_man_pages_name_every_command() {
    let top = String::from_utf8(run(Path::new(BIN), &["--help"]).stdout).unwrap();
    let cmds = commands(&top);
    for c in ["uninstall", "completions", "man", "serve", "exec"] {
        assert!(cmds.iter().any(|x| x == c), "{c} not in {cmds:?}");
    }
    for shell in ["bash", "zsh", "fish"] {
        let out = run(Path::new(BIN), &["completions", shell]);
        let script = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success() && !script.is_empty(), "{shell}");
        for c in &cmds {
            assert!(script.contains(c.as_str()), "{shell} completion lacks {c}");
        }
        // Subcommands of subcommands too.
        assert!(
            script.contains("allow") && script.contains("requests"),
            "{shell}"
        );
    }
    let out = run(Path::new(BIN), &["man"]);
    let page = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success() && page.starts_with(".ie"), "{page}");
    for c in &cmds {
        // roff escapes `-` as `\-`.
        assert!(page.contains(&c.replace('-', "\\-")), "man page lacks {c}");
    }
    // --dir: one page per command and subcommand.
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        Path::new(BIN),
        &["man", "--dir", dir.path().to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    for c in cmds.iter().map(|c| format!("tryboxi-{c}.1")).chain([
        "tryboxi.1".into(),
        "tryboxi-net-allow.1".into(),
        "tryboxi-mcp-install.1".into(),
    ]) {
        let len = std::fs::metadata(dir.path().join(&c)).map(|m| m.len());
        assert!(len.as_ref().is_ok_and(|n| *n > 0), "{c}: {len:?}");
    }
}
