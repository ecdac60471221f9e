//! `deploy/kubernetes/` (docs/SCALING.md), checked offline, without a cluster:
//!
//! - every manifest passes kubernetes-validate (pinned, from `cargo xtask deps`, in the venv
//!   `_out/k8s-validate-venv` or next to `TRYBOXI_ARTIFACTS`; its package carries the
//!   Kubernetes JSON schemas, nothing is fetched) in strict mode against pinned Kubernetes
//!   releases, and a deliberately broken copy of each kind of mistake is refused. Without the
//!   venv that test skips with a line saying so, except in CI where it fails;
//! - the manifests agree with each other and with the daemon's data root layout;
//! - a real daemon runs on the ConfigMap's `config.toml` with the token and the certificate
//!   made as the DaemonSet's comment says (the Secret's keys, placed where its `subPath`
//!   mounts put them), and a client pinned to that certificate reaches it over TLS.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{BIN, Daemon, free_port, new_home, skip_unless_ci};
use yaml_rust2::{Yaml, YamlLoader};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");

/// The Kubernetes releases the manifests must be valid for: the oldest one docs/SCALING.md
/// claims and the newest one the pinned validator carries schemas for.
const K8S_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

/// The kinds the directory holds.
const KINDS: [&str; 5] = [
    "ConfigMap",
    "DaemonSet",
    "Namespace",
    "NetworkPolicy",
    "Service",
];

/// How the DaemonSet's comment tells the operator to make the Secret's certificate.
const OPENSSL_REQ: &str =
    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650";

fn validator() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(a) = std::env::var_os("TRYBOXI_ARTIFACTS") {
        candidates.push(PathBuf::from(a).join("k8s-validate-venv/bin/kubernetes-validate"));
    }
    candidates.push(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/_out/k8s-validate-venv/bin/kubernetes-validate"
        )
        .into(),
    );
    candidates.into_iter().find(|p| p.is_file())
}

/// Every file of the directory, sorted; each must be a `.yaml` manifest (nothing unchecked).
fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(DIR)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in &files {
        assert!(
            f.is_file() && f.extension().is_some_and(|x| x == "yaml"),
            "{}: deploy/kubernetes/ holds only .yaml manifests, all of them validated",
            f.display()
        );
    }
    assert!(!files.is_empty());
    files
}

fn load(path: &Path) -> Vec<Yaml> {
    let text = std::fs::read_to_string(path).unwrap();
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every resource of the directory.
fn resources() -> Vec<Yaml> {
    manifests().iter().flat_map(|f| load(f)).collect()
}

fn one(kind: &str) -> Yaml {
    let mut found: Vec<Yaml> = resources()
        .into_iter()
        .filter(|r| r["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found.remove(0)
}

/// Run the pinned validator on `files` in strict mode against [`K8S_VERSIONS`]: the number of
/// (resource, release) pairs that passed, or what it said. A kind or apiVersion it has no
/// schema for is only a warning to the validator (exit 0); here it is a failure too.
fn validate(kv: &Path, files: &[PathBuf]) -> Result<usize, String> {
    let mut cmd = Command::new(kv);
    cmd.arg("--strict");
    for v in K8S_VERSIONS {
        cmd.args(["-k", v]);
    }
    let out = cmd
        .args(files)
        .stdin(Stdio::null())
        .output()
        .expect("run kubernetes-validate");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let passed = lines
        .iter()
        .filter(|l| l.starts_with("INFO ") && l.contains(" passed for resource "))
        .count();
    if !out.status.success() || passed != lines.len() {
        return Err(format!("exit {:?}:\n{text}", out.status.code()));
    }
    Ok(passed)
}

#[test]
fn every_manifest_passes_the_pinned_validator_in_strict_mode() {
    let Some(kv) = validator() else {
        return skip_unless_ci(
            "kubernetes-validate not found in _out/k8s-validate-venv (run `cargo xtask deps`)",
        );
    };
    let files = manifests();
    let passed = validate(&kv, &files).unwrap_or_else(|e| panic!("{e}"));
    let resources = resources();
    assert_eq!(passed, resources.len() * K8S_VERSIONS.len());
    let kinds: BTreeSet<&str> = resources
        .iter()
        .filter_map(|r| r["kind"].as_str())
        .collect();
    assert_eq!(kinds, BTreeSet::from(KINDS));
    println!(
        "{passed} resource/release pairs valid ({} files, Kubernetes {})",
        files.len(),
        K8S_VERSIONS.join(", ")
    );
}

#[test]
fn the_validator_refuses_broken_manifests() {
    let Some(kv) = validator() else {
        return skip_unless_ci(
            "kubernetes-validate not found in _out/k8s-validate-venv (run `cargo xtask deps`)",
        );
    };
    // (file, text, replaced by, the kind of mistake)
    let breakages = [
        (
            "daemonset.yaml",
            "privileged: true",
            "priviledged: true",
            "a misspelt field (strict mode)",
        ),
        (
            "daemonset.yaml",
            "containerPort: 7443",
            "containerPort: \"seven\"",
            "a value of the wrong type",
        ),
        (
            "daemonset.yaml",
            "  selector:\n    matchLabels:\n      app.kubernetes.io/name: tryboxi\n  updateStrategy:",
            "  updateStrategy:",
            "a required field left out",
        ),
        (
            "daemonset.yaml",
            "apiVersion: apps/v1\n",
            "apiVersion: extensions/v1beta1\n",
            "an API version no pinned release serves",
        ),
        (
            "service.yaml",
            "kind: Service\n",
            "kind: Servce\n",
            "an unknown kind",
        ),
        (
            "networkpolicy.yaml",
            "        - protocol: TCP\n          port: 7443",
            "        - protocol: TCP\n          port: 7443\n          portt: 7444",
            "a misspelt field deep in a list (strict mode)",
        ),
    ];
    let scratch = tempfile::tempdir().unwrap();
    for (file, from, to, what) in breakages {
        let text = std::fs::read_to_string(Path::new(DIR).join(file)).unwrap();
        assert!(text.contains(from), "{file} no longer contains {from:?}");
        let broken = scratch.path().join(file);
        std::fs::write(&broken, text.replacen(from, to, 1)).unwrap();
        match validate(&kv, std::slice::from_ref(&broken)) {
            Ok(n) => panic!("{what} in {file} passed ({n} pairs)"),
            Err(e) => println!(
                "refused, {what}: {}",
                e.lines()
                    .find(|l| l.starts_with("ERROR ") || l.starts_with("WARN "))
                    .unwrap_or(&e)
            ),
        }
    }
}

/// Labels `sub` are all in `labels` (a selector matches a pod).
fn selects(sub: &Yaml, labels: &Yaml) -> bool {
    let (Some(sub), Some(labels)) = (sub.as_hash(), labels.as_hash()) else {
        return false;
    };
    !sub.is_empty() && sub.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn the_manifests_agree_with_each_other_and_with_the_daemon() {
    let ns = one("Namespace");
    let ns_name = ns["metadata"]["name"].as_str().unwrap();
    for r in resources() {
        if r["kind"].as_str() != Some("Namespace") {
            assert_eq!(r["metadata"]["namespace"].as_str(), Some(ns_name), "{r:?}");
        }
    }
    // The daemon pod must be allowed to be privileged in its namespace.
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(),
        Some("privileged")
    );

    let ds = one("DaemonSet");
    let pod = &ds["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert!(selects(&ds["spec"]["selector"]["matchLabels"], labels));
    assert!(selects(&one("Service")["spec"]["selector"], labels));
    assert!(selects(
        &one("NetworkPolicy")["spec"]["podSelector"]["matchLabels"],
        labels
    ));
    let spec = &pod["spec"];
    // As PID 1 the binary is the guest agent (src/lib.rs): the pause process must be PID 1.
    assert_eq!(spec["shareProcessNamespace"].as_bool(), Some(true));
    let c = &spec["containers"][0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
    assert!(
        c["resources"]["limits"].is_badvalue(),
        "no limits: the QEMUs' cgroups sit inside the container's"
    );
    let script = c["args"][0].as_str().unwrap();
    assert!(script.contains("exec tryboxi serve"), "{script}");

    // The API port: the ConfigMap's tcp_listen, the container's named port, the Service's
    // target and the NetworkPolicy's ingress port are one port.
    let config = one("ConfigMap");
    assert_eq!(
        spec["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some("config"))
            .unwrap()["configMap"]["name"],
        config["metadata"]["name"]
    );
    let toml = config["data"]["config.toml"].as_str().unwrap();
    let port: i64 = toml
        .lines()
        .find_map(|l| l.strip_prefix("tcp_listen = \"0.0.0.0:"))
        .and_then(|p| p.strip_suffix('"'))
        .expect("tcp_listen on all addresses")
        .parse()
        .unwrap();
    let api = &c["ports"][0];
    assert_eq!(
        (api["name"].as_str(), api["containerPort"].as_i64()),
        (Some("api"), Some(port))
    );
    let svc_port = &one("Service")["spec"]["ports"][0];
    assert_eq!(svc_port["targetPort"].as_str(), Some("api"));
    assert_eq!(
        one("NetworkPolicy")["spec"]["ingress"][0]["ports"][0]["port"].as_i64(),
        Some(port)
    );

    // The data root: TRYBOXI_HOME is the hostPath mount, and the ConfigMap and Secret keys
    // land on the file names the daemon reads there (src/config.rs, `Paths`).
    let env: Vec<(&str, &str)> = c["env"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e["value"].as_str().unwrap()))
        .collect();
    let home = env.iter().find(|(k, _)| *k == "TRYBOXI_HOME").unwrap().1;
    let mounts = c["volumeMounts"].as_vec().unwrap();
    let mount = |path: &str| {
        mounts
            .iter()
            .find(|m| m["mountPath"].as_str() == Some(path))
            .unwrap_or_else(|| panic!("nothing mounted at {path}"))
    };
    assert_eq!(mount(home)["name"].as_str(), Some("data"));
    for (file, volume) in [
        ("config.toml", "config"),
        ("token", "api"),
        ("tls-cert.pem", "api"),
        ("tls-key.pem", "api"),
    ] {
        let m = mount(&format!("{home}/{file}"));
        assert_eq!(
            (m["name"].as_str(), m["subPath"].as_str()),
            (Some(volume), Some(file))
        );
        assert_eq!(m["readOnly"].as_bool(), Some(true));
    }
    let volume = |name: &str| {
        spec["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };
    assert_eq!(volume("data")["hostPath"]["path"].as_str(), Some(home));
    assert_eq!(
        volume("kvm")["hostPath"]["type"].as_str(),
        Some("CharDevice")
    );
    assert_eq!(mount("/dev/kvm")["name"].as_str(), Some("kvm"));
    let secret = volume("api")["secret"]["secretName"]
        .as_str()
        .unwrap()
        .to_owned();
    let ds_text = std::fs::read_to_string(Path::new(DIR).join("daemonset.yaml")).unwrap();
    assert!(ds_text.contains(&format!("create secret generic {secret}")));
    assert!(ds_text.contains(OPENSSL_REQ));
}

fn openssl(args: &str, dir: &Path) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn the_configmap_config_serves_tls_with_the_secrets_token_and_certificate() {
    if Command::new("openssl").arg("version").output().is_err() {
        return skip_unless_ci("openssl not found (`cargo xtask deps` installs it)");
    }
    let home = new_home();
    // The Secret's keys, made as the DaemonSet's comment says, where its subPath mounts put
    // them (mode 0400, its defaultMode).
    openssl(
        &format!(
            "{OPENSSL_REQ} -subj /CN=tryboxi -keyout tls-key.pem -out tls-cert.pem 2>/dev/null"
        ),
        home.path(),
    );
    let token = openssl("echo \"tbx_$(openssl rand -hex 24)\"", home.path());
    std::fs::write(home.path().join("token"), &token).unwrap();
    for f in ["token", "tls-cert.pem", "tls-key.pem"] {
        let p = home.path().join(f);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    let fingerprint = format!(
        "sha256:{}",
        openssl(
            "openssl x509 -in tls-cert.pem -outform der | sha256sum | cut -d' ' -f1",
            home.path()
        )
    );

    // The ConfigMap's config.toml as it is, but on a loopback port (tests reach nothing else).
    let yaml = one("ConfigMap");
    let toml = yaml["data"]["config.toml"].as_str().unwrap();
    let port = free_port();
    let listen = "tcp_listen = \"0.0.0.0:7443\"";
    assert_eq!(toml.matches(listen).count(), 1, "{toml}");
    let config = toml.replace(listen, &format!("tcp_listen = \"127.0.0.1:{port}\""));
    let d = Daemon::start_in(home, Some(&config), &[], &[]);

    // The daemon took the Secret's token and certificate rather than making its own.
    let out = d.cli(&["token"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), token);
    let out = d.cli(&["token", "--fingerprint"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), fingerprint);

    // A client elsewhere (its own empty data root) with the three values reaches it.
    let client_home = tempfile::tempdir().unwrap();
    let client = |token: &str, fingerprint: &str| {
        Command::new(BIN)
            .arg("ls")
            .env("TRYBOXI_HOME", client_home.path())
            .env("TRYBOXI_URL", format!("https://127.0.0.1:{port}"))
            .env("TRYBOXI_TOKEN", token)
            .env("TRYBOXI_FINGERPRINT", fingerprint)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let ok = client(&token, &fingerprint);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad_token = client("tbx_not_the_token", &fingerprint);
    assert!(!bad_token.status.success());
    assert!(
        String::from_utf8_lossy(&bad_token.stderr).contains("invalid token"),
        "{}",
        String::from_utf8_lossy(&bad_token.stderr)
    );
    let other_cert = format!("sha256:{}", "0".repeat(64));
    let bad_pin = client(&token, &other_cert);
    assert!(!bad_pin.status.success());
}
