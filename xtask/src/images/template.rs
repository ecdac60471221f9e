//! Template rootfs layers: `guest-image/templates/<name>/` (`packages`, optional
//! `customize.sh`) on top of the base rootfs, shipped as a qcow2 layer whose backing file is
//! the base (`rootfs.ext4`, by relative name, so it resolves next to the layer in any images
//! directory).
//!
//! How (root): copy the base image (sparse), loop-mount it, `apt-get install` the packages in a
//! chroot (host DNS, `/dev` and `/proc` bound in, apt's lists and caches and `/tmp` on tmpfs so
//! the build's throwaway files never touch the image, no services started), run `customize.sh`,
//! write `/etc/tryboxi-template`, unmount; then `qemu-img rebase` (safe mode) of a qcow2 over the
//! modified copy onto the base keeps only the clusters that differ. Modifying a copy of the
//! base (rather than a fresh mmdebstrap + mkfs) keeps the base's block layout, which is what
//! makes the layer small; files the layer does not touch are read from the shared base (one
//! page cache for all templates).
//!
//! Cache key = sha256(recipe version, template name, the base rootfs sha256, packages,
//! customize.sh, and any other files beside them that customize.sh installs, e.g. the code
//! interpreter's `server.py`). A template with no packages and no customize.sh (`base`) is the
//! rootfs itself.
//!
//! A run builds only the layers it is asked for ([`Wanted`]): `cargo xtask images` the base
//! alone, `--template NAME` that one too, `--all` every recipe without an `on-demand` file
//! (go, node, python, rust; `code-interpreter` has one), `cargo xtask demo` the one its repo
//! picks, `cargo xtask ci` every recipe. A run that does not ask for a layer still ships it
//! when the cache has it for the current recipe.

use super::cache::{Begin, Cache, Entry};
use super::rootfs::parse_packages;
use crate::util::{Step, is_root, recipe_key, repo_root, run_logged, sha256_file};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Bump when the build procedure below changes in a way that changes the output.
const RECIPE_VERSION: &str = "template-3";
const KIND: &str = "template";

pub fn recipes_dir() -> PathBuf {
    repo_root().join("guest-image/templates")
}

/// A template recipe from `guest-image/templates/<name>/`.
#[derive(Debug, Clone)]
pub struct Recipe {
    pub name: String,
    pub packages_text: Vec<u8>,
    pub customize: Option<(PathBuf, Vec<u8>)>,
    /// Other files in the recipe directory (name, content), by name: part of the cache key.
    pub files: Vec<(String, Vec<u8>)>,
    /// Built only when asked (a file `on-demand` in the directory).
    pub on_demand: bool,
}

impl Recipe {
    pub fn packages(&self) -> Vec<String> {
        parse_packages(&String::from_utf8_lossy(&self.packages_text))
    }
    /// Nothing to add: the template is the base rootfs.
    pub fn is_base(&self) -> bool {
        self.packages().is_empty() && self.customize.is_none()
    }
    pub fn file(&self) -> String {
        format!("template-{}.qcow2", self.name)
    }
}

/// Every recipe directory, by name.
pub fn recipes() -> Result<Vec<Recipe>> {
    let dir = recipes_dir();
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    for e in rd {
        let e = e?;
        if !e.file_type()?.is_dir() {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            bail!("template directory name {name:?}: use [a-z0-9-] only");
        }
        let packages_text = match std::fs::read(e.path().join("packages")) {
            Ok(t) => t,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(err) => return Err(err).context("reading a template package list"),
        };
        let cz = e.path().join("customize.sh");
        let customize = match std::fs::read(&cz) {
            Ok(t) => Some((cz, t)),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(err) => return Err(err).context("reading a template customize.sh"),
        };
        let mut files = Vec::new();
        let mut on_demand = false;
        for f in std::fs::read_dir(e.path())? {
            let f = f?;
            let fname = f.file_name().to_string_lossy().into_owned();
            match fname.as_str() {
                "packages" | "customize.sh" => {}
                "on-demand" => on_demand = true,
                _ if f.file_type()?.is_file() => {
                    let text = std::fs::read(f.path())
                        .with_context(|| format!("reading {}", f.path().display()))?;
                    files.push((fname, text));
                }
                _ => {}
            }
        }
        files.sort();
        out.push(Recipe {
            name,
            packages_text,
            customize,
            files,
            on_demand,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Which template layers a run builds. The others are shipped only when the image cache
/// already has them for the current recipe (a later `tryboxi install` picks them up).
#[derive(Debug, Clone, Default)]
pub struct Wanted {
    /// Every template without an `on-demand` file: `cargo xtask images --all`.
    pub standard: bool,
    /// Every template, the on-demand ones too (CI).
    pub every: bool,
    /// These, by name (`--template NAME`; the demo's pick for its repo).
    pub names: Vec<String>,
}

impl Wanted {
    fn builds(&self, r: &Recipe) -> bool {
        self.every || (self.standard && !r.on_demand) || self.names.contains(&r.name)
    }
}

/// Build (or find in the cache) the template layers over `base` that `want` asks for; ship
/// any other whose layer the cache has. Returns (name, entry).
pub fn build_all(cache: &Cache, base: &Entry, want: &Wanted) -> Result<Vec<(String, Entry)>> {
    let all = recipes()?;
    for n in &want.names {
        if !all.iter().any(|r| &r.name == n) {
            bail!(
                "no template recipe `{n}` in {} (there are: {})",
                recipes_dir().display(),
                all.iter()
                    .map(|r| r.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for r in all {
        if r.is_base() {
            continue;
        }
        if !want.builds(&r) {
            match cache.lookup(KIND, &key(base, &r)) {
                Some(e) => out.push((r.name.clone(), e)),
                None => skipped.push(r.name.clone()),
            }
            continue;
        }
        out.push((r.name.clone(), build(cache, base, &r)?));
    }
    if !skipped.is_empty() {
        println!(
            "==> templates not built: {} (on first use: `cargo xtask images --template NAME`, or \
             `--all`; ~20-40 s each)",
            skipped.join(", ")
        );
    }
    Ok(out)
}

/// The recipe hash. Extra files join the key only when there are some, so the keys of
/// recipes without them did not change when they were introduced.
fn key(base: &Entry, r: &Recipe) -> String {
    let empty = Vec::new();
    let mut files = Vec::new();
    for (name, text) in &r.files {
        files.extend_from_slice(&(name.len() as u64).to_le_bytes());
        files.extend_from_slice(name.as_bytes());
        files.extend_from_slice(&(text.len() as u64).to_le_bytes());
        files.extend_from_slice(text);
    }
    let mut parts: Vec<(&str, &[u8])> = vec![
        ("recipe", RECIPE_VERSION.as_bytes()),
        ("name", r.name.as_bytes()),
        ("base", base.meta.sha256.as_bytes()),
        ("packages", &r.packages_text),
        (
            "customize",
            r.customize.as_ref().map(|(_, t)| t).unwrap_or(&empty),
        ),
    ];
    if !files.is_empty() {
        parts.push(("files", &files));
    }
    recipe_key(&parts)
}

pub fn build(cache: &Cache, base: &Entry, r: &Recipe) -> Result<Entry> {
    let key = key(base, r);
    if let Some(e) = cache.lookup(KIND, &key) {
        println!(
            "==> template {}: cached (built {})",
            r.name, e.meta.built_at
        );
        return Ok(e);
    }
    if !is_root() {
        bail!("building template layers needs root (loop mount + chroot): use sudo");
    }
    let packages = r.packages();
    let step = Step::start_expect(
        format!(
            "template {}: {} packages over the base rootfs",
            r.name,
            packages.len()
        ),
        "~20-40 s; cached afterwards",
    );
    let pending = match cache.begin(KIND, &key)? {
        Begin::Build(p) => p,
        Begin::Done(e) => return Ok(e),
    };
    let log = pending.log.clone();
    let base_img = std::path::absolute(base.file_path())?;
    let work = pending.dir.join("work.ext4");
    crate::util::run_inherit(
        Command::new("cp")
            .arg("--sparse=always")
            .arg(&base_img)
            .arg(&work),
        "cp",
    )?;
    // The copy must be writable whatever the cache entry's mode.
    std::fs::set_permissions(&work, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    let mnt = pending.dir.join("mnt");
    std::fs::create_dir(&mnt)?;
    {
        let mut m = Mounts::default();
        m.mount(&log, &["-o", "loop,noatime"], &work, &mnt)?;
        m.mount(&log, &["--bind"], Path::new("/dev"), &mnt.join("dev"))?;
        m.mount(&log, &["-t", "proc"], Path::new("proc"), &mnt.join("proc"))?;
        // What the build writes and throws away (package lists, downloaded .debs, apt's caches,
        // customize.sh's temp files) goes to tmpfs, not into the image: blocks written and
        // freed again would still differ from the base and land in the layer (the node layer
        // was 497 MiB with them). Lists are re-fetched by `apt-get update` in a sandbox.
        for (dir, mode, sub) in [
            ("var/lib/apt/lists", "mode=0755", "partial"),
            ("var/cache/apt", "mode=0755", "archives/partial"),
            ("tmp", "mode=1777", ""),
        ] {
            let at = mnt.join(dir);
            m.mount(&log, &["-t", "tmpfs", "-o", mode], Path::new("tmpfs"), &at)?;
            std::fs::create_dir_all(at.join(sub))?;
        }
        install(&mnt, r, &packages, &log)?;
        m.unmount_all()?;
    }
    let file = r.file();
    let layer = pending.dir.join(&file);
    let qimg = |args: &[&str], what: &str| -> Result<()> {
        run_logged(Command::new("qemu-img").args(args), what, &log)
    };
    let work_s = std::path::absolute(&work)?.display().to_string();
    let layer_s = layer.display().to_string();
    qimg(
        &[
            "create", "-q", "-f", "qcow2", "-F", "raw", "-b", &work_s, &layer_s,
        ],
        "qemu-img create",
    )?;
    // Safe mode: every cluster where the modified copy differs from the base goes into the layer.
    qimg(
        &[
            "rebase",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            &base_img.display().to_string(),
            &layer_s,
        ],
        "qemu-img rebase",
    )?;
    // Name the backing file relatively: it is resolved next to the layer (`_out/images/`,
    // `artifacts/images/`), where the same base rootfs is.
    qimg(
        &[
            "rebase",
            "-u",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            super::rootfs::FILE,
            &layer_s,
        ],
        "qemu-img rebase -u",
    )?;
    std::fs::remove_file(&work).context("removing the work copy")?;
    std::fs::remove_dir(&mnt).context("removing the mount point")?;
    let sha = sha256_file(&layer)?;
    let mut extra = serde_json::Map::new();
    extra.insert("template".into(), r.name.clone().into());
    extra.insert("base_sha256".into(), base.meta.sha256.clone().into());
    extra.insert("packages".into(), packages.into());
    let elapsed = step.elapsed();
    let entry = pending.commit(&file, sha, elapsed, extra)?;
    step.done(&format!("{} MiB layer", entry.meta.size >> 20));
    Ok(entry)
}

/// apt-get install in a chroot of the mounted copy, customize, mark, clean.
fn install(root: &Path, r: &Recipe, packages: &[String], log: &Path) -> Result<()> {
    let policy = root.join("usr/sbin/policy-rc.d");
    std::fs::write(
        &policy,
        "#!/bin/sh\n# No services start while a template is built.\nexit 101\n",
    )?;
    std::fs::set_permissions(&policy, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let resolv = root.join("etc/resolv.conf");
    let placeholder = std::fs::read(&resolv).unwrap_or_default();
    std::fs::write(
        &resolv,
        std::fs::read("/etc/resolv.conf").unwrap_or_default(),
    )?;
    let res = (|| -> Result<()> {
        if !packages.is_empty() {
            let chroot = |args: &[&str], what: &str| -> Result<()> {
                run_logged(
                    Command::new("chroot")
                        .arg(root)
                        .args(["env", "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C"])
                        .args(args),
                    what,
                    log,
                )
            };
            chroot(
                &["apt-get", "-o", "Acquire::Retries=3", "update"],
                "apt-get update",
            )?;
            let mut args = vec![
                "apt-get",
                "-o",
                "Acquire::Retries=3",
                "-o",
                "Dpkg::Options::=--path-exclude=/usr/share/man/*",
                "-o",
                "Dpkg::Options::=--path-exclude=/usr/share/info/*",
                "-o",
                "Dpkg::Options::=--path-exclude=/usr/share/doc/*",
                "-o",
                "Dpkg::Options::=--path-include=/usr/share/doc/*/copyright",
                "install",
                "-y",
                "--no-install-recommends",
            ];
            args.extend(packages.iter().map(String::as_str));
            chroot(&args, "apt-get install")?;
            chroot(&["apt-get", "clean"], "apt-get clean")?;
        }
        if let Some((script, _)) = &r.customize {
            run_logged(
                Command::new("sh").arg(script).arg(root),
                "template customize.sh",
                log,
            )?;
        }
        Ok(())
    })();
    std::fs::write(&resolv, placeholder)?;
    std::fs::remove_file(&policy)?;
    res?;
    std::fs::write(root.join("etc/tryboxi-template"), format!("{}\n", r.name))?;
    Ok(())
}

/// Mounts made for a build, unmounted in reverse order (also on error, by `Drop`).
#[derive(Default)]
struct Mounts(Vec<PathBuf>);

impl Mounts {
    fn mount(&mut self, log: &Path, opts: &[&str], src: &Path, dst: &Path) -> Result<()> {
        std::fs::create_dir_all(dst)?;
        run_logged(
            Command::new("mount").args(opts).arg(src).arg(dst),
            "mount",
            log,
        )?;
        self.0.push(dst.to_path_buf());
        Ok(())
    }

    fn unmount_all(&mut self) -> Result<()> {
        while let Some(p) = self.0.pop() {
            let st = Command::new("umount").arg(&p).status()?;
            if !st.success() {
                bail!("umount {} failed ({st})", p.display());
            }
        }
        Ok(())
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        while let Some(p) = self.0.pop() {
            // Lazy: a failed build must not leave a mount behind a process still using it.
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_recipes_have_base_node_python_and_the_interpreter() {
        let r = recipes().unwrap();
        let names: Vec<&str> = r.iter().map(|r| r.name.as_str()).collect();
        for want in ["base", "node", "python"] {
            assert!(names.contains(&want), "{names:?}");
        }
        let get = |n: &str| r.iter().find(|r| r.name == n).unwrap();
        assert!(get("base").is_base());
        assert!(get("node").packages().contains(&"nodejs".to_string()));
        let py = get("python").packages();
        assert!(
            py.contains(&"python3-venv".to_string()) && py.contains(&"python3-pip".to_string())
        );
        assert_eq!(get("node").file(), "template-node.qcow2");
        assert!(!get("node").on_demand && get("node").files.is_empty());
        // The code interpreter: on demand, and its server is part of the cache key.
        let ci = get("code-interpreter");
        assert!(ci.on_demand);
        assert!(ci.packages().contains(&"python3-ipykernel".to_string()));
        let names: Vec<&str> = ci.files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["server.py"]);
    }
}
