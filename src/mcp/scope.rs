//! Which host folders the MCP face may use as a workspace: the default workspace
//! (`SANDBOX_WORKSPACE`, else the server's working directory) and the folders the user listed
//! with `--allow-workspace`, each with everything below it. The model cannot widen this.
//!
//! Compared after symlinks are resolved, so `ws/link -> /home/me` or `ws/../..` do not get
//! out; a folder that does not exist is refused (nothing to resolve). The daemon's own refusals
//! (`/`, home folders, the data root) apply on top.

use std::path::{Path, PathBuf};

use super::{Options, ToolError};

/// The roots this server may use, resolved (the default workspace first).
pub fn roots(opts: &Options) -> Vec<PathBuf> {
    std::iter::once(&opts.workspace)
        .chain(&opts.allowed_workspaces)
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .collect()
}

/// A sandbox this server may use: one whose host workspace is allowed (a sandbox without a
/// host workspace belongs to another client of the daemon, e.g. the E2B face).
pub fn allowed_sandbox(opts: &Options, s: &crate::api::Sandbox) -> Result<(), ToolError> {
    match &s.workspace {
        Some(w) => allowed_workspace(opts, Path::new(&w.host_path)).map(|_| ()),
        None => Err(ToolError::WorkspaceNotAllowed {
            path: "(none)".into(),
            why: format!("sandbox {} has no host workspace", s.id),
            allowed: roots(opts)
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// `requested` (absolute) resolved, if it is one of the [`roots`] or below one.
pub fn allowed_workspace(opts: &Options, requested: &Path) -> Result<PathBuf, ToolError> {
    let roots = roots(opts);
    let refused = |why: &str| ToolError::WorkspaceNotAllowed {
        path: requested.display().to_string(),
        why: why.to_owned(),
        allowed: roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    };
    let resolved = requested
        .canonicalize()
        .map_err(|e| refused(&format!("it cannot be resolved: {e}")))?;
    if roots.iter().any(|r| resolved.starts_with(r)) {
        Ok(resolved)
    } else {
        Err(refused(&format!(
            "it resolves to {}, outside the allowed folders",
            resolved.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_workspace_and_allowed_folders_and_below_resolve() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().canonicalize().unwrap();
        for p in ["ws/sub", "ws-evil", "extra/a", "secret"] {
            std::fs::create_dir_all(base.join(p)).unwrap();
        }
        std::os::unix::fs::symlink(base.join("secret"), base.join("ws/link")).unwrap();
        std::os::unix::fs::symlink(base.join("ws/sub"), base.join("inlink")).unwrap();
        let mut o = Options::new(base.join("sock"), base.join("ws"));
        for ok in ["ws", "ws/sub", "ws/sub/../sub", "inlink"] {
            assert_eq!(
                allowed_workspace(&o, &base.join(ok)).unwrap(),
                base.join(ok).canonicalize().unwrap()
            );
        }
        for bad in [
            "ws-evil",
            "ws/link",
            "ws/..",
            "ws/sub/../../secret",
            "extra/a",
            "nope",
        ] {
            let e = allowed_workspace(&o, &base.join(bad)).unwrap_err();
            assert!(
                matches!(e, ToolError::WorkspaceNotAllowed { .. }),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains("--allow-workspace"), "{e}");
        }
        assert!(allowed_workspace(&o, Path::new("/")).is_err());
        o.allowed_workspaces.push(base.join("extra"));
        assert!(allowed_workspace(&o, &base.join("extra/a")).is_ok());
        assert!(allowed_workspace(&o, &base.join("ws/link")).is_err());
    }

    #[test]
    fn a_sandbox_without_a_workspace_is_not_this_servers() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().canonicalize().unwrap();
        std::fs::create_dir_all(base.join("ws")).unwrap();
        let o = Options::new(base.join("sock"), base.join("ws"));
        let mut s: crate::api::Sandbox = serde_json::from_value(serde_json::json!({
            "id": "sbx_0000000000000001", "state": "ready", "template": "base", "vcpus": 1,
            "memory_mib": 256, "accel": null, "created_at": "2026-01-01T00:00:00Z"
        }))
        .unwrap();
        let e = allowed_sandbox(&o, &s).unwrap_err();
        assert!(e.to_string().contains("has no host workspace"), "{e}");
        s.workspace = Some(crate::api::WorkspaceSpec {
            host_path: base.join("ws").display().to_string(),
            exclude: Vec::new(),
        });
        assert!(allowed_sandbox(&o, &s).is_ok());
    }
}
