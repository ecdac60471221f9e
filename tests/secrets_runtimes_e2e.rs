//! End to end with TWO real VMs (issue 16, guest side, the runtimes people use): a `node`
//! template sandbox and a `rust` template sandbox reach an intercepted HTTPS upstream with a
//! secret's placeholder, and the upstream sees the real value.
//!
//! Node: the built-in `fetch` and `https.get` with `Authorization: Bearer $API_KEY`, run with
//! `--use-bundled-ca` so that the sandbox CA can only come from `NODE_EXTRA_CA_CERTS` (without
//! it the same request fails verification); the upstream's echo of the value comes back as the
//! placeholder; `npm view` against a registry on the secret's host with
//! `//api.test/npm/:_authToken=${API_KEY}` in its npmrc.
//!
//! cargo: a private sparse registry (`auth-required`) on the secret's host: `config.json`, one
//! index entry and one `.crate` built here, every request refused without the real token.
//! `cargo fetch` with `CARGO_REGISTRIES_PRIVATE_TOKEN=$API_KEY` succeeds: cargo trusted the CA
//! through `CARGO_HTTP_CAINFO` and the upstream saw the value on config, index and download.
//!
//! The upstream and the daemon config come from `common::tls` (as in `secrets_tls_e2e.rs`).
//! Uses the guest images from `TRYBOXI_ARTIFACTS` or `_out/` (skips without them, except under
//! CI).

mod common;

use std::io::Write as _;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::tls::{Reply, Seen, https_upstream, intercept_config};
use common::{Daemon, SMALL_VMS, bash, create_with, placeholder, set_secret, vm_daemon};
use sha2::Digest as _;

const VALUE: &str = "sk-runtimes-e2e-Vb7Nm2Kq9Lp4Zx";
const HOST: &str = "api.test";
const CRATE: &str = "secretdep";
/// Where the sparse index keeps [`CRATE`] (names of 4+ characters: `ab/cd/name`).
const INDEX_ENTRY: &str = "/index/se/cr/secretdep";
const CRATE_DL: &str = "/dl/secretdep/0.1.0/download";
const LIB_RS: &str = "pub fn answer() -> u32 {\n    42\n}\n";

/// A `.crate` for [`CRATE`] 0.1.0: a gzipped tar of `Cargo.toml` and `src/lib.rs` under
/// `secretdep-0.1.0/`.
fn crate_file() -> Vec<u8> {
    let manifest = format!(
        "[package]\nname = \"{CRATE}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[lib]\n"
    );
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    for (path, body) in [("Cargo.toml", manifest.as_str()), ("src/lib.rs", LIB_RS)] {
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        tar.append_data(&mut h, format!("{CRATE}-0.1.0/{path}"), body.as_bytes())
            .unwrap();
    }
    let mut gz = tar.into_inner().unwrap();
    gz.flush().unwrap();
    gz.finish().unwrap()
}

/// The upstream's answers. `/echo/*`: the request's `Authorization` back. `/npm/tinypkg`: a
/// packument whose description echoes the `Authorization`, only with `Bearer <value>`. The
/// cargo registry (`/index/`, `/dl/`): only with the raw value as `Authorization` (401 without,
/// which is how cargo learns it must send its token).
fn answer(r: &Seen, krate: &[u8]) -> Reply {
    let path = r.path.split('?').next().unwrap_or_default();
    if path.starts_with("/echo/") {
        return Reply::ok("text/plain", format!("auth=[{}]\n", r.auth));
    }
    if path == "/npm/tinypkg" {
        if r.auth != format!("Bearer {VALUE}") {
            return Reply::status(401);
        }
        let doc = serde_json::json!({
            "name": "tinypkg",
            "description": format!("auth=[{}]", r.auth),
            "dist-tags": {"latest": "1.0.0"},
            "versions": {"1.0.0": {
                "name": "tinypkg",
                "version": "1.0.0",
                "description": format!("auth=[{}]", r.auth),
                "dist": {"tarball": "https://api.test/npm/tinypkg/-/tinypkg-1.0.0.tgz"},
            }},
        });
        return Reply::ok("application/json", doc.to_string());
    }
    if r.auth != VALUE {
        return Reply::status(401);
    }
    match path {
        "/index/config.json" => Reply::ok(
            "application/json",
            format!(
                r#"{{"dl": "https://{HOST}/dl", "api": "https://{HOST}", "auth-required": true}}"#
            ),
        ),
        INDEX_ENTRY => {
            let entry = serde_json::json!({
                "name": CRATE, "vers": "0.1.0", "deps": [],
                "cksum": hex::encode(sha2::Sha256::digest(krate)),
                "features": {}, "yanked": false,
            });
            Reply::ok("application/json", format!("{entry}\n"))
        }
        CRATE_DL => Reply::ok("application/octet-stream", krate.to_vec()),
        _ => Reply::status(404),
    }
}

/// What the upstream saw until every path of `want` was asked with `auth` (or 60 s passed),
/// plus whatever else is already queued.
fn seen_until(rx: &mpsc::Receiver<Seen>, want: &[&str], auth: &str) -> Vec<Seen> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen: Vec<Seen> = Vec::new();
    while !want
        .iter()
        .all(|w| seen.iter().any(|s| s.path == *w && s.auth == auth))
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(s) => seen.push(s),
            Err(_) => break,
        }
    }
    seen.extend(rx.try_iter());
    seen
}

/// Every path of `want` was asked with `auth`; no request carried the placeholder.
fn check_seen(
    bad: &mut Vec<String>,
    what: &str,
    seen: &[Seen],
    want: &[&str],
    auth: &str,
    ph: &str,
) {
    for w in want {
        if !seen.iter().any(|s| s.path == *w && s.auth == auth) {
            bad.push(format!("{what}: {w} not asked with the value: {seen:?}"));
        }
    }
    if seen.iter().any(|s| s.auth.contains(ph)) {
        bad.push(format!(
            "{what}: the upstream saw the placeholder: {seen:?}"
        ));
    }
}

/// A sandbox of `template` with the secret, allowed to reach [`HOST`]; its id and placeholder.
fn sandbox(d: &Daemon, ws: &std::path::Path, template: &str) -> (String, String) {
    let id = create_with(d, ws, &["--template", template, "--secret", "API_KEY"]);
    let o = d.cli(&["net", "allow", &id, HOST]);
    assert!(o.status.success(), "net allow: {o:?}");
    let ph = placeholder(d, &id, "API_KEY", VALUE);
    (id, ph)
}

/// Node's `fetch` and `https.get`, then the last line reports; exit 3 with the error's code.
const NODE_SCRIPT: &str = r#"
const https = require("https");
const h = { Authorization: "Bearer " + process.env.API_KEY };
(async () => {
  const r = await fetch("https://api.test/echo/fetch", { headers: h });
  console.log("fetch " + r.status + " " + (await r.text()).trim());
  await new Promise((ok, err) => https.get("https://api.test/echo/https", { headers: h }, (res) => {
    let b = "";
    res.on("data", (d) => (b += d));
    res.on("end", () => { console.log("https " + res.statusCode + " " + b.trim()); ok(); });
  }).on("error", err));
  process.exit(0);
})().catch((e) => { console.log("ERR " + ((e.cause && e.cause.code) || e.code) + " " + e.message); process.exit(3); });
"#;

fn node_checks(d: &Daemon, rx: &mpsc::Receiver<Seen>, bad: &mut Vec<String>) {
    let ws = tempfile::tempdir().unwrap();
    let (id, ph) = sandbox(d, ws.path(), "node");
    let echoed = format!("auth=[Bearer {ph}]");
    let out = bash(
        d,
        &id,
        &format!(
            "node --version; npm --version; printf 'reject=%s\\n' \"$NODE_TLS_REJECT_UNAUTHORIZED\"; \
             cat > /tmp/t.js <<'EOF'\n{NODE_SCRIPT}\nEOF\n\
             node --use-bundled-ca /tmp/t.js; echo rc=$?"
        ),
    );
    eprintln!("node: {out}");
    for want in [
        format!("fetch 200 {echoed}"),
        format!("https 200 {echoed}"),
        "reject=\n".into(),
        "rc=0".into(),
    ] {
        if !out.contains(&want) {
            bad.push(format!("node: no {want:?}: {out}"));
        }
    }
    if out.contains(VALUE) {
        bad.push("node: the value reached the guest".into());
    }
    let seen = seen_until(
        rx,
        &["/echo/fetch", "/echo/https"],
        &format!("Bearer {VALUE}"),
    );
    check_seen(
        bad,
        "node",
        &seen,
        &["/echo/fetch", "/echo/https"],
        &format!("Bearer {VALUE}"),
        &ph,
    );

    // The control: without NODE_EXTRA_CA_CERTS the bundled CAs alone refuse the sandbox's leaf
    // (the interceptor sends its CA in the chain, so node names it self-signed).
    let out = bash(
        d,
        &id,
        "env -u NODE_EXTRA_CA_CERTS node --use-bundled-ca /tmp/t.js; echo rc=$?",
    );
    if !out.contains("rc=3")
        || ![
            "SELF_SIGNED_CERT_IN_CHAIN",
            "UNABLE_TO_GET_ISSUER_CERT_LOCALLY",
        ]
        .iter()
        .any(|c| out.contains(&format!("ERR {c} ")))
    {
        bad.push(format!(
            "node without NODE_EXTRA_CA_CERTS did not fail verification: {out}"
        ));
    }

    // npm against a registry on the secret's host, its token the placeholder in the npmrc.
    let out = bash(
        d,
        &id,
        "printf '%s\\n' 'registry=https://api.test/npm/' '//api.test/npm/:_authToken=${API_KEY}' \
         > /tmp/npmrc && NPM_CONFIG_USERCONFIG=/tmp/npmrc npm view tinypkg version description \
         --no-update-notifier --fetch-retries=0; echo rc=$?",
    );
    eprintln!("npm: {out}");
    if !out.contains("1.0.0") || !out.contains(&echoed) || !out.contains("rc=0") {
        bad.push(format!("npm view: {out}"));
    }
    if out.contains(VALUE) {
        bad.push("npm: the value reached the guest".into());
    }
    let seen = seen_until(rx, &["/npm/tinypkg"], &format!("Bearer {VALUE}"));
    check_seen(
        bad,
        "npm",
        &seen,
        &["/npm/tinypkg"],
        &format!("Bearer {VALUE}"),
        &ph,
    );
    let o = d.cli(&["rm", &id]);
    assert!(o.status.success(), "rm: {o:?}");
}

fn cargo_checks(d: &Daemon, rx: &mpsc::Receiver<Seen>, bad: &mut Vec<String>) {
    let ws = tempfile::tempdir().unwrap();
    let (id, ph) = sandbox(d, ws.path(), "rust");
    let out = bash(
        d,
        &id,
        &format!(
            "cargo --version; mkdir -p /tmp/app/src /tmp/app/.cargo && cd /tmp/app && \
             printf 'fn main() {{}}\\n' > src/main.rs && \
             printf '[registries.private]\\nindex = \"sparse+https://{HOST}/index/\"\\n\
credential-provider = \"cargo:token\"\\n' \
               > .cargo/config.toml && \
             printf '[package]\\nname = \"app\"\\nversion = \"0.1.0\"\\nedition = \"2021\"\\n\\n\
[dependencies]\\n{CRATE} = {{ version = \"0.1\", registry = \"private\" }}\\n' > Cargo.toml && \
             printf 'cainfo=%s\\n' \"$CARGO_HTTP_CAINFO\" && \
             CARGO_REGISTRIES_PRIVATE_TOKEN=$API_KEY cargo fetch; echo rc=$?; \
             cat ${{CARGO_HOME:-$HOME/.cargo}}/registry/src/*/{CRATE}-0.1.0/src/lib.rs"
        ),
    );
    eprintln!("cargo: {out}");
    for want in [
        "cainfo=/etc/ssl/certs/ca-certificates.crt\n",
        "rc=0",
        LIB_RS,
    ] {
        if !out.contains(want) {
            bad.push(format!("cargo fetch: no {want:?}: {out}"));
        }
    }
    if out.contains(VALUE) {
        bad.push("cargo: the value reached the guest".into());
    }
    let want = ["/index/config.json", INDEX_ENTRY, CRATE_DL];
    let seen = seen_until(rx, &want, VALUE);
    check_seen(bad, "cargo", &seen, &want, VALUE, &ph);
    let o = d.cli(&["rm", &id]);
    assert!(o.status.success(), "rm: {o:?}");
}

#[test]
fn node_and_cargo_in_template_vms_get_the_value_swapped_in() {
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("upstream-ca.pem");
    let krate = crate_file();
    let (addr, seen) = https_upstream(&ca_path, &[HOST], move |r| answer(r, &krate));
    let cfg =
        SMALL_VMS.to_owned() + &intercept_config(&ca_path, &[(HOST, "203.0.113.10", 443, addr)]);
    let Some(d) = vm_daemon(&cfg) else { return };
    set_secret(&d, "API_KEY", VALUE, HOST);
    let mut bad: Vec<String> = Vec::new();
    let t = Instant::now();
    node_checks(&d, &seen, &mut bad);
    eprintln!("node sandbox: {:?}", t.elapsed());
    let t = Instant::now();
    cargo_checks(&d, &seen, &mut bad);
    eprintln!("rust sandbox: {:?}", t.elapsed());
    if d.log_text().contains(VALUE) {
        bad.push("the daemon log holds the value".into());
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
