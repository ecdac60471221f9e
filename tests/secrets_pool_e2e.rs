//! End to end (issue 16, item 2 and 3 for sandboxes that do not boot): a sandbox taken from the
//! warm pool (a clone of the golden snapshot, waiting without a network) and given a secret
//! at create gets its own fresh placeholder, and its guest trusts the sandbox CA at once (the
//! bundle is written on the claim): the placeholder reaches the intercepted upstream as the
//! value and the echo comes back as the placeholder. A cold-booted sandbox with the same
//! secret has another placeholder, which is not swapped in the pool sandbox.
//!
//! Same upstream and config as `secrets_tls_e2e.rs` (`common::tls`), plus `[pool] golden =
//! true, size = 1`. Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without
//! them, except under CI).

mod common;

use std::time::{Duration, Instant};

use common::tls::{
    Reply, foreign_placeholder_stays_a_string, https_upstream, intercept_config, seen_path,
};
use common::{SMALL_VMS, bash, create_with, placeholder, set_secret, vm_daemon};

const VALUE: &str = "sk-pool-e2e-Tg5Hy8Uj2Ik4Ol6Pz0";
const HOST: &str = "api.test";

/// Poll `cond` every 100 ms until it holds or `limit` passes.
fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_pool_sandbox_gets_a_fresh_placeholder_and_trusts_the_ca_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("upstream-ca.pem");
    let (addr, seen) = https_upstream(&ca_path, &[HOST], |r| {
        Reply::ok("text/plain", format!("auth=[{}]\n", r.auth))
    });
    // CPU pressure ignored: on a saturated host the golden build would not start.
    let cfg = SMALL_VMS.to_owned()
        + &intercept_config(&ca_path, &[(HOST, "203.0.113.10", 443, addr)])
        + "[pool]\ngolden = true\nsize = 1\n[limits]\ncpu_pressure_psi_avg60 = 0\n";
    let Some(d) = vm_daemon(&cfg) else { return };
    let mut bad: Vec<String> = Vec::new();
    set_secret(&d, "API_KEY", VALUE, HOST);
    let ws = tempfile::tempdir().unwrap();
    let cold = create_with(&d, ws.path(), &["--secret", "API_KEY"]);
    let cold_ph = placeholder(&d, &cold, "API_KEY", VALUE);

    // The golden snapshot is built after that first boot, then the pool fills.
    wait_for(Duration::from_secs(300), "a pool VM", || {
        d.log_text().contains("pool VM ready")
    });
    let warm = create_with(&d, ws.path(), &["--secret", "API_KEY"]);
    assert!(
        d.log_text().contains("created from the warm pool"),
        "{}",
        d.log_text()
    );
    let o = d.cli(&["net", "allow", &warm, HOST]);
    assert!(
        o.status.success(),
        "net allow: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let warm_ph = placeholder(&d, &warm, "API_KEY", VALUE);
    if warm_ph == cold_ph {
        bad.push("the pool sandbox got the cold sandbox's placeholder".into());
    }
    let out = bash(
        &d,
        &warm,
        "curl -sS -m 60 -H \"Authorization: Bearer $API_KEY\" https://api.test/warm",
    );
    if !out.contains(&format!("auth=[Bearer {warm_ph}]")) || out.contains(VALUE) {
        bad.push(format!("pool sandbox: no scrubbed echo: {out}"));
    }
    match seen_path(&seen, "/warm", Duration::from_secs(30)) {
        Some(s) if s.auth == format!("Bearer {VALUE}") => {}
        Some(s) => bad.push(format!(
            "pool sandbox: the upstream saw {} bytes",
            s.auth.len()
        )),
        None => bad.push(format!("pool sandbox: the upstream saw no request: {out}")),
    }
    // The other sandbox's placeholder is only a string here.
    bad.extend(foreign_placeholder_stays_a_string(
        &d,
        &warm,
        &cold_ph,
        &seen,
        "/other",
        VALUE,
        "pool sandbox",
    ));
    for id in [&warm, &cold] {
        assert!(d.cli(&["rm", id]).status.success());
    }
    if d.log_text().contains(VALUE) {
        bad.push("the daemon log holds the value".into());
    }
    assert!(bad.is_empty(), "{}\n{}", bad.join("\n"), d.log_text());
}
