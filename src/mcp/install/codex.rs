//! Codex: `[mcp_servers.sandbox]` merged into `~/.codex/config.toml` (`$CODEX_HOME` if set;
//! backup `config.toml.bak`; other tables, comments and formatting kept), and the rules in a
//! marked block of the project's `AGENTS.md` (`--global`: `~/.codex/AGENTS.md`), appended once
//! and updated in place later.

use toml_edit::{Array, DocumentMut, InlineTable, Item, Table, value};

use super::files::update;
use super::{Env, InstallError, RULES, Report, Scope, ServerCommand};

pub const BEGIN: &str = "<!-- tryboxi:sandbox:begin (managed by `tryboxi mcp install`) -->";
pub const END: &str = "<!-- tryboxi:sandbox:end -->";

pub fn install(
    scope: &Scope,
    cmd: &ServerCommand,
    env: &Env,
    report: &mut Report,
) -> Result<(), InstallError> {
    let config = env.codex_home.join("config.toml");
    update(&config, report, |old| {
        merge_config(old.unwrap_or(""), cmd).map_err(|detail| InstallError::Unparsable {
            path: config.clone(),
            format: "TOML",
            detail,
        })
    })?;

    let agents = match scope {
        Scope::Project(p) => p.join("AGENTS.md"),
        Scope::Global => env.codex_home.join("AGENTS.md"),
    };
    update(&agents, report, |old| Ok(with_rules(old.unwrap_or(""))))?;
    report
        .next
        .push("Restart Codex; `/mcp` in Codex lists the sandbox server.".into());
    Ok(())
}

/// `config.toml` with `[mcp_servers.sandbox]` set; everything else as it was.
pub fn merge_config(old: &str, cmd: &ServerCommand) -> Result<String, String> {
    let mut doc: DocumentMut = old
        .parse()
        .map_err(|e: toml_edit::TomlError| e.to_string())?;
    let servers = doc
        .entry("mcp_servers")
        .or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        })
        .as_table_like_mut()
        .ok_or("`mcp_servers` is not a table")?;
    if servers.get("sandbox").is_none() {
        servers.insert("sandbox", Item::Table(Table::new()));
    }
    let sandbox = servers
        .get_mut("sandbox")
        .and_then(Item::as_table_like_mut)
        .ok_or("`mcp_servers.sandbox` is not a table")?;
    let mut args = Array::new();
    for a in &cmd.args {
        args.push(a.as_str());
    }
    let mut envt = InlineTable::new();
    envt.insert("SANDBOX_CLIENT", "codex".into());
    // Keys this installer owns; any other key the user put in the table stays.
    sandbox.insert("command", value(cmd.program.display().to_string()));
    sandbox.insert("args", value(args));
    sandbox.insert("env", value(envt));
    sandbox.insert("startup_timeout_sec", value(30));
    sandbox.insert("tool_timeout_sec", value(900));
    Ok(doc.to_string())
}

/// `AGENTS.md` with the rules block: replaced where the markers are, else appended.
pub fn with_rules(old: &str) -> String {
    let block = format!("{BEGIN}\n{}{END}\n", ensure_newline(RULES));
    if let Some(b) = old.find(BEGIN)
        && let Some(e) = old[b..].find(END)
    {
        let mut end = b + e + END.len();
        if old[end..].starts_with('\n') {
            end += 1;
        }
        return format!("{}{block}{}", &old[..b], &old[end..]);
    }
    if old.trim().is_empty() {
        return block;
    }
    format!("{}\n{block}", ensure_newline(old))
}

fn ensure_newline(s: &str) -> String {
    if s.ends_with('\n') {
        s.to_owned()
    } else {
        format!("{s}\n")
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cmd, env};
    use super::super::{Harness, install as run};
    use super::*;

    #[test]
    fn fresh_config_is_exactly_the_documented_table() {
        let got = merge_config("", &cmd()).unwrap();
        assert_eq!(
            got,
            "[mcp_servers.sandbox]\n\
             command = \"/opt/tryboxi/_out/bin/sandbox-mcp\"\n\
             args = []\n\
             env = { SANDBOX_CLIENT = \"codex\" }\n\
             startup_timeout_sec = 30\n\
             tool_timeout_sec = 900\n"
        );
    }

    #[test]
    fn existing_config_keeps_its_tables_comments_and_user_keys() {
        let old = "# my codex\nmodel = \"o4\"\n\n[mcp_servers.other]\ncommand = \"x\" # keep\n\n\
                   [mcp_servers.sandbox]\ncommand = \"/old/path\"\nenabled = true\n\n[profiles.fast]\nmodel = \"mini\"\n";
        let got = merge_config(old, &cmd()).unwrap();
        let v: toml::Table = toml::from_str(&got).unwrap();
        assert_eq!(v["model"].as_str(), Some("o4"));
        assert_eq!(v["mcp_servers"]["other"]["command"].as_str(), Some("x"));
        assert_eq!(v["profiles"]["fast"]["model"].as_str(), Some("mini"));
        let s = &v["mcp_servers"]["sandbox"];
        assert_eq!(
            s["command"].as_str(),
            Some("/opt/tryboxi/_out/bin/sandbox-mcp")
        );
        assert_eq!(s["enabled"].as_bool(), Some(true), "user key kept");
        assert_eq!(s["tool_timeout_sec"].as_integer(), Some(900));
        assert_eq!(s["env"]["SANDBOX_CLIENT"].as_str(), Some("codex"));
        assert!(got.starts_with("# my codex\n"), "{got}");
        assert!(got.contains("command = \"x\" # keep"), "{got}");
        assert_eq!(merge_config(&got, &cmd()).unwrap(), got, "idempotent");
    }

    #[test]
    fn rules_are_appended_once_and_updated_in_place() {
        let user = "# Project\n\nUse tabs.";
        let once = with_rules(user);
        assert!(
            once.starts_with("# Project\n\nUse tabs.\n\n<!-- tryboxi:sandbox:begin"),
            "{once}"
        );
        assert_eq!(with_rules(&once), once, "second install does not duplicate");
        assert_eq!(once.matches(BEGIN).count(), 1);
        // An old block in the middle is replaced, the text after it kept.
        let stale = format!("{user}\n{BEGIN}\nold rules\n{END}\n## After\n");
        let fixed = with_rules(&stale);
        assert!(
            !fixed.contains("old rules") && fixed.ends_with("## After\n"),
            "{fixed}"
        );
        assert!(fixed.contains(RULES.trim_end()), "{fixed}");
    }

    #[test]
    fn install_backs_up_both_files_and_is_idempotent() {
        let home = tempfile::tempdir().unwrap();
        let proj = tempfile::tempdir().unwrap();
        let codex = home.path().join(".codex");
        std::fs::create_dir_all(&codex).unwrap();
        std::fs::write(codex.join("config.toml"), "model = \"o4\"\n").unwrap();
        std::fs::write(proj.path().join("AGENTS.md"), "# Rules\n").unwrap();
        let install = || {
            run(
                Harness::Codex,
                &Scope::Project(proj.path().into()),
                &cmd(),
                &env(home.path()),
            )
            .unwrap()
        };
        let r = install();
        assert_eq!(r.written.len(), 2, "{r:?}");
        assert_eq!(
            std::fs::read_to_string(codex.join("config.toml.bak")).unwrap(),
            "model = \"o4\"\n"
        );
        assert_eq!(
            std::fs::read_to_string(proj.path().join("AGENTS.md.bak")).unwrap(),
            "# Rules\n"
        );
        let cfg = std::fs::read_to_string(codex.join("config.toml")).unwrap();
        assert!(
            cfg.starts_with("model = \"o4\"\n") && cfg.contains("[mcp_servers.sandbox]"),
            "{cfg}"
        );

        let again = install();
        assert!(
            again.written.is_empty() && again.backups.is_empty(),
            "{again:?}"
        );
        assert_eq!(again.unchanged.len(), 2);
    }
}
