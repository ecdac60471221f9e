//! The default secret patterns (`sync.secrets`), one test per pattern of the spec, at the sync
//! level: a host tree goes through the real scan and delta, and the archive the VM would get
//! holds none of the secret paths (and reports them as skipped), but does hold the look-alikes.

use super::manifest::Base;
use super::rules::{Rules, scan};
use super::sync::compute;
use crate::config::SyncConfig;

/// Files every tree gets: never secrets.
const PLAIN: &[&str] = &[
    "src/main.rs",
    "docker/config.json",
    "kube/config",
    "ids.rs",
    "identity.rs",
    "env.txt",
    "keys.rs",
    "pem.md",
];

/// Sync a tree holding `secrets` and [`PLAIN`]; assert what the VM would receive.
fn assert_never_sent(secrets: &[&str]) {
    let repo = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    let root = repo.path();
    for p in secrets.iter().chain(PLAIN) {
        let p = root.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "TOP-SECRET-VALUE").unwrap();
    }
    let rules = Rules::new(&SyncConfig::default()).unwrap();
    let s = scan(root, &rules).unwrap();
    let skipped = s.secrets_skipped.clone();
    let d = compute(root, &s, &Base::new(data.path().join("ws"))).unwrap();
    let mut sent = Vec::new();
    for e in tar::Archive::new(d.archive.as_slice()).entries().unwrap() {
        sent.push(e.unwrap().path().unwrap().to_string_lossy().into_owned());
    }
    for secret in secrets {
        assert!(
            !sent.iter().any(|p| p == secret),
            "secret `{secret}` was sent to the VM; sent: {sent:?}"
        );
        assert!(
            skipped
                .iter()
                .any(|k| k == secret || secret.starts_with(&format!("{k}/"))),
            "`{secret}` not reported as skipped: {skipped:?}"
        );
        assert!(!d.manifest.entries.contains_key(*secret), "{secret}");
    }
    for plain in PLAIN {
        assert!(sent.iter().any(|p| p == plain), "`{plain}` was not sent");
    }
}

macro_rules! never_sent {
    ($($name:ident: [$($path:expr),+ $(,)?];)+) => {
        $(
            #[test]
            fn $name() {
                assert_never_sent(&[$($path),+]);
            }
        )+
    };
}

never_sent! {
    secret_env_star: [".env", ".env.local", ".env-dev", ".env_local", "app/.env-staging", ".envrc"];
    secret_pem: ["server.pem", "certs/deep/ca.pem"];
    secret_key: ["tls.key", "a/b/private.key"];
    secret_id_any: ["id_rsa", "id_ed25519.pub", "keys/id_deploy", "id_custom"];
    secret_npmrc: [".npmrc", "web/.npmrc"];
    secret_pypirc: [".pypirc", "py/.pypirc"];
    secret_netrc: [".netrc", "sub/.netrc"];
    secret_aws_dir: [".aws/credentials", ".aws/config", "home/.aws/credentials"];
    secret_ssh_dir: [".ssh/id_ed25519", ".ssh/config", "home/u/.ssh/authorized_keys"];
    secret_docker_config: [".docker/config.json", "ci/.docker/config.json"];
    secret_kube_config: [".kube/config", "ops/.kube/config"];
    secret_p12: ["cert.p12", "a/store.p12"];
    secret_pfx: ["cert.pfx", "win/store.pfx"];
    secret_credentials_json: ["credentials.json", "gcp/credentials.json"];
}

// Host file systems that fold case (macOS, Windows shares) and people who type in capitals:
// the secret patterns match in any case.
never_sent! {
    secret_env_any_case: [".ENV", ".Env.Local", "app/.ENV-DEV"];
    secret_id_any_case: ["ID_RSA", "Id_Ed25519.PUB", "keys/ID_DEPLOY"];
    secret_credentials_any_case: ["Credentials.json", "conf/CREDENTIALS.JSON"];
    secret_pem_key_any_case: ["SERVER.PEM", "tls.Key", "cert.P12"];
    secret_dirs_any_case: [".SSH/id_x", ".Aws/credentials", ".KUBE/config", ".Docker/Config.json"];
    secret_netrc_npmrc_any_case: [".NETRC", ".NpmRC", ".PyPIrc"];
}

/// A secret pattern without a trailing `/` matches files only: a directory named like one
/// (`id_service/`, `.env.d/`, `app.key/`) is synced with what is in it, and the committed
/// `.env` templates are not secrets; the files themselves still are.
#[test]
fn file_patterns_spare_directories_and_env_templates_are_synced() {
    let repo = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    let root = repo.path();
    let synced = [
        "id_service/main.go",
        "svc/id_mapper/lib.rs",
        ".env.d/README.md",
        "certs.key/notes.txt",
        ".env.example",
        "web/.env.sample",
        ".env.template",
        ".env.dist",
    ];
    let secret = ["id_service/id_rsa", ".env.d/.env", "web/.env.local"];
    for p in synced.iter().chain(&secret) {
        let p = root.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "x").unwrap();
    }
    let rules = Rules::new(&SyncConfig::default()).unwrap();
    let s = scan(root, &rules).unwrap();
    let d = compute(root, &s, &Base::new(data.path().join("ws"))).unwrap();
    let mut sent = Vec::new();
    for e in tar::Archive::new(d.archive.as_slice()).entries().unwrap() {
        sent.push(e.unwrap().path().unwrap().to_string_lossy().into_owned());
    }
    for p in synced {
        assert!(sent.iter().any(|s| s == p), "`{p}` was not sent: {sent:?}");
    }
    for p in secret {
        assert!(!sent.iter().any(|s| s == p), "secret `{p}` was sent");
        assert!(s.secrets_skipped.iter().any(|k| k == p), "{p}");
    }
    // Directory patterns still take the whole directory.
    assert!(rules.is_secret(".ssh", true) && rules.is_secret("a/.aws/config", false));
    assert!(!rules.is_secret("id_service", true) && rules.is_secret("id_service", false));
}
