//! A sandbox created without a host workspace (`tryboxi create` with no `-w`, as the E2B face
//! creates them), in a real VM: `/workspace` is empty, exec runs without a sync, the files API
//! works, sync/diff/apply/pull answer 409 `no_workspace`, snapshot/restore, fork and
//! pause/resume work, rm removes it.
//! Skips (with a message) without guest images, except under CI.

mod common;

use common::{SMALL_VMS, first_word, sh_out, vm_daemon};

#[test]
fn a_sandbox_without_a_workspace() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    // No `-w`: no workspace (the current directory is not used).
    let o = d.cli(&["create"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_tail(100)
    );
    let id = first_word(&o);
    assert!(
        id.starts_with("sbx_"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let sbx = d
        .request("GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert!(sbx.get("workspace").is_none(), "{sbx}");
    assert_eq!(sbx["template"], "base", "{sbx}");
    let ls = d.cli(&["ls"]);
    let line = String::from_utf8_lossy(&ls.stdout)
        .lines()
        .find(|l| l.starts_with(&id))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(line.trim_end().ends_with(" -"), "ls: {line}");

    // An empty /workspace, and exec works there.
    assert_eq!(
        sh_out(&d, &id, "ls -A /workspace; pwd"),
        (Some(0), "/workspace\n".into())
    );

    // The files API writes and reads inside the VM.
    let put = d.request(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/workspace/hello.txt"),
        Some(r#"{"path":"","content":"hi there\n"}"#),
    );
    assert_eq!(put.status, 200, "{}", put.text());
    let get = d.request(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/workspace/hello.txt"),
        None,
    );
    assert_eq!(get.status, 200, "{}", get.text());
    assert_eq!(get.json()["content"], "hi there\n");
    assert_eq!(sh_out(&d, &id, "cat /workspace/hello.txt").1, "hi there\n");

    // Workspace operations: 409 no_workspace, naming the sandbox.
    for (method, path, body) in [
        ("GET", format!("/v1/sandboxes/{id}/diff"), None),
        ("POST", format!("/v1/sandboxes/{id}/sync"), None),
        ("POST", format!("/v1/sandboxes/{id}/apply"), None),
        (
            "POST",
            format!("/v1/sandboxes/{id}/pull"),
            Some(r#"{"paths":["hello.txt"]}"#),
        ),
    ] {
        let r = d.request(method, &path, body);
        assert_eq!(r.status, 409, "{method} {path}: {}", r.text());
        assert_eq!(r.error_code(), "no_workspace", "{path}");
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&format!("sandbox {id} has no host workspace")),
            "{}",
            r.text()
        );
    }
    let o = d.cli(&["diff", &id]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no host workspace"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Snapshot and restore.
    let o = d.cli(&["snapshot", "create", &id, "--name", "s"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        sh_out(&d, &id, "rm /workspace/hello.txt; ls -A /workspace").1,
        ""
    );
    let o = d.cli(&["restore", &id, "s"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sh_out(&d, &id, "cat /workspace/hello.txt").1, "hi there\n");

    // A fork child has no workspace either and sees the parent's files; pause and resume.
    let o = d.cli(&["fork", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let child = first_word(&o);
    let c = d
        .request("GET", &format!("/v1/sandboxes/{child}"), None)
        .json();
    assert!(c.get("workspace").is_none(), "{c}");
    assert_eq!(
        sh_out(&d, &child, "cat /workspace/hello.txt").1,
        "hi there\n"
    );
    let r = d.request("GET", &format!("/v1/sandboxes/{child}/diff"), None);
    assert_eq!(r.error_code(), "no_workspace");
    assert!(d.cli(&["rm", &child]).status.success());
    let o = d.cli(&["pause", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Refused from the record: the paused sandbox is not resumed for a diff.
    let r = d.request("GET", &format!("/v1/sandboxes/{id}/diff"), None);
    assert_eq!(r.error_code(), "no_workspace");
    let s = d
        .request("GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert_eq!(s["state"], "paused", "{s}");
    // An exec resumes it (no sync to do).
    assert_eq!(sh_out(&d, &id, "cat /workspace/hello.txt").1, "hi there\n");

    let o = d.cli(&["rm", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        d.request("GET", &format!("/v1/sandboxes/{id}"), None)
            .status,
        404
    );
}
