//! Claude Code: the skill (`.claude/skills/sandbox/SKILL.md` in the project, or under
//! `~/.claude/skills/`) and the server registered with `claude mcp add` (run when `claude` is
//! on PATH, else printed for the user).

use std::path::Path;
use std::process::Command;

use super::files::update;
use super::{Env, InstallError, Report, SKILL, Scope, ServerCommand};

/// The `claude mcp add` argv (without the program name). The server name comes right after
/// `add`, before the options: `-e/--env` takes several values and would swallow a name that
/// follows it (`error: missing required argument 'commandOrUrl'` from the real CLI).
pub fn mcp_add_args(scope: &Scope, cmd: &ServerCommand) -> Vec<String> {
    let scope = match scope {
        Scope::Project(_) => "project",
        Scope::Global => "user",
    };
    let mut a: Vec<String> = [
        "mcp",
        "add",
        "sandbox",
        "--scope",
        scope,
        "-e",
        "SANDBOX_CLIENT=claude",
        "--",
    ]
    .map(String::from)
    .to_vec();
    a.push(cmd.program.display().to_string());
    a.extend(cmd.args.iter().cloned());
    a
}

/// A command line for a human to paste (single-quoted where needed).
pub fn shell_line(program: &str, args: &[String]) -> String {
    std::iter::once(program)
        .chain(args.iter().map(String::as_str))
        .map(|w| {
            if !w.is_empty()
                && w.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:@%+,".contains(&b))
            {
                w.to_owned()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn install(
    scope: &Scope,
    cmd: &ServerCommand,
    env: &Env,
    report: &mut Report,
) -> Result<(), InstallError> {
    let (skill, cwd) = match scope {
        Scope::Project(p) => (p.join(".claude/skills/sandbox/SKILL.md"), p.as_path()),
        Scope::Global => (
            env.home.join(".claude/skills/sandbox/SKILL.md"),
            env.home.as_path(),
        ),
    };
    update(&skill, report, |_| Ok(SKILL.to_owned()))?;
    let args = mcp_add_args(scope, cmd);
    let line = shell_line("claude", &args);
    match env.which("claude") {
        Some(claude) => run_claude(&claude, &args, cwd, &line, report)?,
        None => {
            let mut l = line;
            if let Scope::Project(p) = scope {
                l = format!("cd {} && {l}", shell_line(&p.display().to_string(), &[]));
            }
            report.to_run.push(l);
        }
    }
    if let Scope::Project(_) = scope {
        report.next.push(
            "Start `claude` in the project and approve the `sandbox` server from .mcp.json \
             (Claude Code asks once per project)."
                .into(),
        );
    }
    report
        .next
        .push("Inside Claude Code, run /mcp to confirm the sandbox server is connected.".into());
    Ok(())
}

fn run_claude(
    claude: &Path,
    args: &[String],
    cwd: &Path,
    line: &str,
    report: &mut Report,
) -> Result<(), InstallError> {
    let out = Command::new(claude)
        .args(args)
        .current_dir(cwd)
        .output()
        .map_err(|source| InstallError::Io {
            path: claude.to_path_buf(),
            source,
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        report.ran.push(line.to_owned());
    } else if text.contains("already exists") {
        // A second install: the server is registered already.
        report.ran.push(format!("{line}   (already registered)"));
    } else {
        return Err(InstallError::Command {
            command: line.to_owned(),
            output: text.trim().to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cmd, env};
    use super::super::{Harness, install as run};
    use super::*;

    #[test]
    fn command_line_matches_the_readme() {
        let args = mcp_add_args(&Scope::Project("/r".into()), &cmd());
        assert_eq!(
            shell_line("claude", &args),
            "claude mcp add sandbox --scope project -e SANDBOX_CLIENT=claude -- \
             /opt/tryboxi/_out/bin/sandbox-mcp"
        );
        let global = mcp_add_args(&Scope::Global, &cmd());
        assert_eq!(global[2..5], ["sandbox", "--scope", "user"]);
        assert_eq!(shell_line("a b", &["it's".into()]), r"'a b' 'it'\''s'");
    }

    #[test]
    fn without_claude_on_path_the_skill_is_written_and_the_command_printed() {
        let home = tempfile::tempdir().unwrap();
        let proj = tempfile::tempdir().unwrap();
        let env = Env {
            path: Some(home.path().join("empty-bin").into()),
            ..env(home.path())
        };
        let install = || {
            run(
                Harness::Claude,
                &Scope::Project(proj.path().into()),
                &cmd(),
                &env,
            )
            .unwrap()
        };
        let r = install();
        let skill = proj.path().join(".claude/skills/sandbox/SKILL.md");
        assert_eq!(std::fs::read_to_string(&skill).unwrap(), SKILL);
        assert!(
            SKILL.starts_with("---\nname: sandbox\n"),
            "skill front matter"
        );
        assert_eq!(r.to_run.len(), 1);
        assert!(
            r.to_run[0].contains("claude mcp add sandbox --scope project"),
            "{:?}",
            r.to_run
        );
        assert!(r.ran.is_empty());

        // Edited by the user: backed up, then replaced; a second run changes nothing.
        std::fs::write(&skill, "my notes").unwrap();
        let r = install();
        assert_eq!(r.backups.len(), 1);
        assert_eq!(std::fs::read_to_string(&r.backups[0]).unwrap(), "my notes");
        let r = install();
        assert!(r.written.is_empty() && r.backups.is_empty(), "{r:?}");
    }

    #[test]
    fn global_skill_goes_to_the_home() {
        let home = tempfile::tempdir().unwrap();
        run(Harness::Claude, &Scope::Global, &cmd(), &env(home.path())).unwrap();
        assert!(
            home.path()
                .join(".claude/skills/sandbox/SKILL.md")
                .is_file()
        );
    }
}
