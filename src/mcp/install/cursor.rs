//! Cursor: `mcpServers.sandbox` in `.cursor/mcp.json` of the project (or `~/.cursor/mcp.json`).
//! Other servers and keys are kept, in their order.

use std::path::Path;

use indexmap::IndexMap;
use serde_json::Value;

use super::files::update;
use super::{Env, InstallError, Report, Scope, ServerCommand};

pub fn install(
    scope: &Scope,
    cmd: &ServerCommand,
    env: &Env,
    report: &mut Report,
) -> Result<(), InstallError> {
    let path = match scope {
        Scope::Project(p) => p.join(".cursor/mcp.json"),
        Scope::Global => env.home.join(".cursor/mcp.json"),
    };
    update(&path, report, |old| merge_config(&path, old, cmd))?;
    report.next.push(
        "Open Cursor Settings -> MCP, enable `sandbox`, and reload the window if it is not listed."
            .into(),
    );
    Ok(())
}

/// `mcp.json` (`old`; `None` or blank: a new file) with `mcpServers.sandbox` set; every other
/// key and server kept, in its order.
fn merge_config(
    path: &Path,
    old: Option<&str>,
    cmd: &ServerCommand,
) -> Result<String, InstallError> {
    let text = old.filter(|s| !s.trim().is_empty()).unwrap_or("{}");
    let unparsable = |e: serde_json::Error| InstallError::Unparsable {
        path: path.to_path_buf(),
        format: "JSON (an object)",
        detail: e.to_string(),
    };
    // Parsed twice so that both levels keep their key order: the document, and the servers.
    let doc: IndexMap<String, Value> = serde_json::from_str(text).map_err(unparsable)?;
    if doc.get("mcpServers").is_some_and(|v| !v.is_object()) {
        return Err(InstallError::WrongShape {
            path: path.to_path_buf(),
            key: "mcpServers".into(),
            expected: "JSON object",
        });
    }
    let mut servers: IndexMap<String, Server> = serde_json::from_str::<ServersOnly>(text)
        .map_err(unparsable)?
        .servers
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, Server::Other(v)))
        .collect();
    servers.insert(
        "sandbox".into(),
        Server::Ours(Entry {
            command: cmd.program.display().to_string(),
            args: cmd.args.clone(),
            env: IndexMap::from([
                ("SANDBOX_WORKSPACE", "${workspaceFolder}"),
                ("SANDBOX_CLIENT", "cursor"),
            ]),
        }),
    );
    let mut out: IndexMap<String, Node> =
        doc.into_iter().map(|(k, v)| (k, Node::Plain(v))).collect();
    match out.get_mut("mcpServers") {
        Some(n) => *n = Node::Servers(servers),
        None => {
            out.shift_insert(0, "mcpServers".into(), Node::Servers(servers));
        }
    }
    let mut text = serde_json::to_string_pretty(&out).unwrap_or_default();
    text.push('\n');
    Ok(text)
}

#[derive(serde::Deserialize)]
struct ServersOnly {
    #[serde(rename = "mcpServers", default)]
    servers: Option<IndexMap<String, Value>>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum Node {
    Servers(IndexMap<String, Server>),
    Plain(Value),
}

/// Our entry, with its keys in the documented order.
#[derive(serde::Serialize)]
struct Entry {
    command: String,
    args: Vec<String>,
    env: IndexMap<&'static str, &'static str>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum Server {
    Ours(Entry),
    Other(Value),
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cmd, env};
    use super::super::{Harness, install as run};
    use super::*;

    #[test]
    fn fresh_project_gets_exactly_the_documented_file() {
        let home = tempfile::tempdir().unwrap();
        let proj = tempfile::tempdir().unwrap();
        let r = run(
            Harness::Cursor,
            &Scope::Project(proj.path().into()),
            &cmd(),
            &env(home.path()),
        )
        .unwrap();
        let path = proj.path().join(".cursor/mcp.json");
        assert_eq!(r.written, std::slice::from_ref(&path));
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"mcpServers": {"sandbox": {
                "command": "/opt/tryboxi/_out/bin/sandbox-mcp",
                "args": [],
                "env": {"SANDBOX_WORKSPACE": "${workspaceFolder}", "SANDBOX_CLIENT": "cursor"}
            }}})
        );
        assert!(r.backups.is_empty());
        assert_eq!(
            std::fs::read_dir(home.path()).unwrap().count(),
            0,
            "home untouched"
        );
    }

    #[test]
    fn existing_config_is_merged_backed_up_and_second_install_is_a_no_op() {
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join(".cursor");
        std::fs::create_dir_all(&dir).unwrap();
        let before = r#"{
  "theme": "dark",
  "mcpServers": {
    "zeta": { "command": "/bin/zeta", "args": ["-v"] },
    "alpha": { "url": "http://localhost:1" }
  },
  "zzz": 1
}
"#;
        std::fs::write(dir.join("mcp.json"), before).unwrap();
        let r = run(Harness::Cursor, &Scope::Global, &cmd(), &env(home.path())).unwrap();
        assert_eq!(r.backups, [dir.join("mcp.json.bak")]);
        assert_eq!(
            std::fs::read_to_string(dir.join("mcp.json.bak")).unwrap(),
            before
        );
        let after = std::fs::read_to_string(dir.join("mcp.json")).unwrap();
        let v: IndexMap<String, Value> = serde_json::from_str(&after).unwrap();
        assert_eq!(v.keys().collect::<Vec<_>>(), ["theme", "mcpServers", "zzz"]);
        let servers = serde_json::from_str::<ServersOnly>(&after)
            .unwrap()
            .servers
            .unwrap();
        assert_eq!(
            servers.keys().collect::<Vec<_>>(),
            ["zeta", "alpha", "sandbox"]
        );
        assert_eq!(servers["zeta"]["args"], serde_json::json!(["-v"]));
        assert_eq!(servers["sandbox"]["env"]["SANDBOX_CLIENT"], "cursor");

        let again = run(Harness::Cursor, &Scope::Global, &cmd(), &env(home.path())).unwrap();
        assert!(
            again.written.is_empty() && again.backups.is_empty(),
            "{again:?}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("mcp.json")).unwrap(),
            after
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("mcp.json.bak")).unwrap(),
            before
        );
    }

    #[test]
    fn broken_json_is_left_alone() {
        let home = tempfile::tempdir().unwrap();
        let dir = home.path().join(".cursor");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("mcp.json"), "{ not json").unwrap();
        let e = run(Harness::Cursor, &Scope::Global, &cmd(), &env(home.path())).unwrap_err();
        assert!(matches!(e, InstallError::Unparsable { .. }), "{e}");
        assert_eq!(
            std::fs::read_to_string(dir.join("mcp.json")).unwrap(),
            "{ not json"
        );
        assert!(!dir.join("mcp.json.bak").exists());
    }
}
