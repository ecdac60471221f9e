//! Host-only tests of `ExecSpec::user` (the agent's privilege drop), with the host's own
//! `/etc/passwd` user `nobody`; they need root, like the agent in a VM.

use super::tests::{agent, link, run};
use crate::rpc::{ExecRequest, PtySize, RpcError};

/// Root and a `nobody` user in /etc/passwd, or why this cannot run here.
fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let nobody = super::users::lookup(std::path::Path::new("/"), "nobody").is_ok();
    if !(root && nobody) {
        let why = "needs root and a `nobody` user in /etc/passwd";
        assert!(
            std::env::var_os("CI").is_none(),
            "cannot run under CI: {why}"
        );
        eprintln!("skipped: {why}");
    }
    root && nobody
}

#[tokio::test]
async fn a_command_runs_as_the_named_user_with_its_groups_and_home() {
    if !can_run() {
        return;
    }
    let u = super::users::lookup(std::path::Path::new("/"), "nobody").unwrap();
    let a = agent();
    let (c, _w, _s) = link(&a).await;
    let req = ExecRequest {
        shell: Some("id -u; id -g; id -G; echo $HOME $USER $LOGNAME".into()),
        user: Some("nobody".into()),
        cwd: Some("/".into()),
        ..Default::default()
    };
    let o = run(&c, req.clone()).await;
    let groups: Vec<String> = u.groups.iter().map(|g| g.to_string()).collect();
    assert_eq!(
        String::from_utf8_lossy(&o.out),
        format!(
            "{}\n{}\n{}\n{} nobody nobody\n",
            u.uid,
            u.gid,
            groups.join(" "),
            u.home
        ),
        "{}",
        String::from_utf8_lossy(&o.err)
    );
    // Under a pty too.
    let o = run(
        &c,
        ExecRequest {
            shell: Some("id -u".into()),
            pty: Some(PtySize { rows: 24, cols: 80 }),
            ..req
        },
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&o.out).trim(), u.uid.to_string());
    // An unknown user is refused before anything runs.
    let e = c
        .exec(ExecRequest {
            shell: Some("true".into()),
            user: Some("no-such-user-here".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Remote(r) if r.message.contains("no user `no-such-user-here`")),
        "{e}"
    );
}
