//! Which acceleration really works here: KVM is used only after a real guest booted under it.
//!
//! Owns: the KVM probe (boot the guest kernel + initramfs under `-accel kvm` with
//! `tryboxi.probe=1` and wait for the agent's `TRYBOXI_PROBE_OK` on the console), its cache
//! (`<cache_dir>/accel-probe.json`, keyed by host kernel, QEMU version and image hashes), and
//! turning the `accel = auto|kvm|tcg` setting into an [`Accel`]. The probe's QEMU runs in the
//! fences of a VM's (`Jail::prepare_probe`: the VM user's uid, mount namespace, no new
//! privileges), so KVM is chosen only when a fenced QEMU can use it.
//! Never: trusts `/dev/kvm` merely existing (a nested paravirtual KVM opens fine and then
//! fails on real guests), or fails the daemon start: any probe trouble means TCG.

use crate::oom::ResetOomScore as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::images::{ImageError, sha256_update};
use super::qemu::{QemuDriver, machine_args};
use super::{Accel, VmmError};

/// What the guest agent prints on the console when booted with `tryboxi.probe=1`.
pub const PROBE_MARKER: &str = "TRYBOXI_PROBE_OK";
pub const PROBE_CMDLINE: &str = "console=ttyS0 reboot=t panic=-1 no_timer_check tryboxi.probe=1";
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
const CACHE_FILE: &str = "accel-probe.json";

/// The `accel` setting of the configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelSetting {
    #[default]
    Auto,
    Kvm,
    Tcg,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("probe I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot hash the guest images for the probe cache: {0}")]
    Image(#[from] ImageError),
    #[error(transparent)]
    Vmm(#[from] VmmError),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeReport {
    pub accel: Accel,
    pub kvm_ok: bool,
    /// Why: `no /dev/kvm`, `marker seen after 1.2 s`, `QEMU exited: KVM internal error...`.
    pub detail: String,
    /// How long the probe boot took (of the original run, when `cached`).
    pub elapsed: Duration,
    /// Read from the cache rather than measured now.
    #[serde(default)]
    pub cached: bool,
}

/// Everything that can change the probe's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ProbeKey {
    host_kernel: String,
    qemu_version: String,
    images_sha256: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct CacheEntry {
    key: ProbeKey,
    report: ProbeReport,
}

/// How one probe boot ended.
#[derive(Debug, Clone)]
pub(crate) struct ProbeBoot {
    pub(crate) marker_seen: bool,
    pub(crate) detail: String,
    pub(crate) elapsed: Duration,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ProbeError + '_ {
    move |source| ProbeError::Io {
        path: path.to_owned(),
        source,
    }
}

fn tcg(detail: String, elapsed: Duration) -> ProbeReport {
    ProbeReport {
        accel: Accel::Tcg,
        kvm_ok: false,
        detail,
        elapsed,
        cached: false,
    }
}

/// Find out whether KVM can run our guest; cached per (host kernel, QEMU, images).
pub async fn probe_accel(
    qemu: &QemuDriver,
    kernel: &Path,
    initramfs: &Path,
    cache_dir: &Path,
) -> Result<ProbeReport, ProbeError> {
    let kvm = Path::new("/dev/kvm");
    if !kvm.exists() {
        return Ok(tcg("no /dev/kvm on this host".into(), Duration::ZERO));
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(kvm) {
        return Ok(tcg(format!("cannot open /dev/kvm: {e}"), Duration::ZERO));
    }

    let key = probe_key(qemu, kernel, initramfs)?;
    let cache = cache_dir.join(CACHE_FILE);
    if let Some(r) = read_cache(&cache, &key) {
        return Ok(r);
    }

    std::fs::create_dir_all(cache_dir).map_err(io_err(cache_dir))?;
    let boot = match probe_boot(
        qemu,
        Accel::Kvm,
        kernel,
        initramfs,
        cache_dir,
        PROBE_TIMEOUT,
    )
    .await
    {
        Ok(b) => b,
        // A VM's QEMU would meet the same fence (a root-only /dev/kvm): TCG, not cached (the
        // fix, a `kvm` group on /dev/kvm, is not part of the cache key).
        Err(ProbeError::Vmm(VmmError::Fence(why))) => {
            return Ok(tcg(
                format!("the fenced probe QEMU cannot start: {why}"),
                Duration::ZERO,
            ));
        }
        Err(e) => return Err(e),
    };
    let report = ProbeReport {
        accel: if boot.marker_seen {
            Accel::Kvm
        } else {
            Accel::Tcg
        },
        kvm_ok: boot.marker_seen,
        detail: boot.detail,
        elapsed: boot.elapsed,
        cached: false,
    };
    let entry = CacheEntry {
        key,
        report: report.clone(),
    };
    let tmp = cache_dir.join(format!("{CACHE_FILE}.tmp"));
    let data = serde_json::to_vec_pretty(&entry)
        .map_err(|e| VmmError::Other(format!("cannot encode the probe cache: {e}")))?;
    std::fs::write(&tmp, data).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &cache).map_err(io_err(&cache))?;
    Ok(report)
}

fn probe_key(qemu: &QemuDriver, kernel: &Path, initramfs: &Path) -> Result<ProbeKey, ProbeError> {
    let host_kernel = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut h = Sha256::new();
    sha256_update(&mut h, kernel)?;
    sha256_update(&mut h, initramfs)?;
    Ok(ProbeKey {
        host_kernel,
        qemu_version: qemu.version().to_string(),
        images_sha256: hex::encode(h.finalize()),
    })
}

fn read_cache(path: &Path, key: &ProbeKey) -> Option<ProbeReport> {
    let data = std::fs::read(path).ok()?;
    let entry: CacheEntry = serde_json::from_slice(&data).ok()?;
    (entry.key == *key).then_some(ProbeReport {
        cached: true,
        ..entry.report
    })
}

/// Boot `kernel` + `initramfs` with `tryboxi.probe=1` under `accel`, without disk or
/// sockets, and report whether the marker reached the console within `timeout`. The QEMU
/// process never outlives this call.
pub(crate) async fn probe_boot(
    qemu: &QemuDriver,
    accel: Accel,
    kernel: &Path,
    initramfs: &Path,
    work_dir: &Path,
    timeout: Duration,
) -> Result<ProbeBoot, ProbeError> {
    // QEMU runs fenced (jail.rs `prepare_probe`) in a directory of its own: under a root
    // daemon it is made root's, shared with the probe's group only.
    let dir = work_dir.join("probe");
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let console = dir.join("probe-console.log");
    let log = work_dir.join("probe-qemu.log");
    let mut console_opt = std::ffi::OsString::from("file,id=console,path=");
    console_opt.push(console.as_os_str());
    // Empty the console before QEMU starts: a marker left by an earlier probe must not be read
    // as this one's (QEMU opens the file only after its own start-up). QEMU makes it anew.
    match std::fs::remove_file(&console) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&console)(e)),
        _ => {}
    }
    let out = std::fs::File::create(&log).map_err(io_err(&log))?;
    let err = out.try_clone().map_err(io_err(&log))?;
    let dir = std::fs::canonicalize(&dir).map_err(io_err(&dir))?;
    let reads = [kernel, initramfs]
        .iter()
        .map(|p| std::fs::canonicalize(p).map_err(io_err(p)))
        .collect::<Result<Vec<_>, _>>()?;
    let fence = std::sync::Arc::new(qemu.jail().prepare_probe(&dir, &reads, accel)?);
    let t0 = Instant::now();
    let mut cmd = tokio::process::Command::new(qemu.binary());
    cmd.reset_oom_score()
        .args(machine_args(accel, 1, 256))
        .arg("-kernel")
        .arg(&reads[0])
        .arg("-initrd")
        .arg(&reads[1])
        .args(["-append", PROBE_CMDLINE, "-chardev"])
        .arg(console_opt)
        .args(["-serial", "chardev:console"])
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    // SAFETY: `Prepared::enter` runs in the forked child before exec and makes only
    // async-signal-safe system calls on data made before the fork.
    unsafe {
        cmd.pre_exec(move || fence.enter());
    }
    let mut child = cmd.spawn().map_err(|source| VmmError::Spawn {
        binary: qemu.binary().display().to_string(),
        source,
    })?;

    let seen = || {
        std::fs::read(&console)
            .map(|b| {
                b.windows(PROBE_MARKER.len())
                    .any(|w| w == PROBE_MARKER.as_bytes())
            })
            .unwrap_or(false)
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let outcome = loop {
        tokio::select! {
            st = child.wait() => {
                let st = st.map_err(io_err(&log))?;
                break if seen() {
                    (true, format!("marker seen; QEMU exited with {st}"))
                } else {
                    (false, format!("QEMU exited with {st} before the marker: {}",
                        last_line(&log).or_else(|| last_line(&console)).unwrap_or_default()))
                };
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if seen() {
                    break (true, "marker seen".to_owned());
                }
                if tokio::time::Instant::now() >= deadline {
                    break (false, format!("no marker within {timeout:?} (guest hung); last console line: {}",
                        last_line(&console).unwrap_or_default()));
                }
            }
        }
    };
    // The guest may only halt (no ACPI power-off): end QEMU ourselves.
    if let Err(e) = child.start_kill() {
        tracing::debug!(error = %e, "probe QEMU already gone");
    }
    let _ = child.wait().await;
    let elapsed = t0.elapsed();
    Ok(ProbeBoot {
        marker_seen: outcome.0,
        detail: format!("{accel}: {} after {:.2}s", outcome.1, elapsed.as_secs_f64()),
        elapsed,
    })
}

/// The last non-empty line of a log, for a one-line reason.
fn last_line(path: &Path) -> Option<String> {
    let b = std::fs::read(path).ok()?;
    String::from_utf8_lossy(&b)
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

/// Turn the `accel` setting into the acceleration VMs will use, probing for `auto`.
pub async fn resolve_accel(
    setting: AccelSetting,
    qemu: &QemuDriver,
    kernel: &Path,
    initramfs: &Path,
    cache_dir: &Path,
) -> Accel {
    match setting {
        AccelSetting::Kvm => {
            tracing::info!(
                accel = "kvm",
                reason = "accel = kvm in the configuration",
                "acceleration chosen"
            );
            Accel::Kvm
        }
        AccelSetting::Tcg => {
            tracing::info!(
                accel = "tcg",
                reason = "accel = tcg in the configuration",
                "acceleration chosen"
            );
            Accel::Tcg
        }
        AccelSetting::Auto => match probe_accel(qemu, kernel, initramfs, cache_dir).await {
            Ok(r) if r.kvm_ok => {
                tracing::info!(accel = "kvm", reason = %r.detail, cached = r.cached, "acceleration chosen");
                Accel::Kvm
            }
            Ok(r) => {
                tracing::warn!(
                    accel = "tcg", reason = %r.detail, cached = r.cached,
                    "KVM cannot run the guest here; using TCG emulation (several times slower)"
                );
                Accel::Tcg
            }
            Err(e) => {
                tracing::warn!(accel = "tcg", error = %e, "the KVM probe failed; using TCG emulation");
                Accel::Tcg
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_hit_requires_the_same_key() {
        let t = tempfile::tempdir().expect("tempdir");
        let path = t.path().join(CACHE_FILE);
        let key = ProbeKey {
            host_kernel: "6.1.0".into(),
            qemu_version: "10.0.2".into(),
            images_sha256: "ab".into(),
        };
        let entry = CacheEntry {
            key: key.clone(),
            report: tcg("KVM internal error".into(), Duration::from_millis(1500)),
        };
        std::fs::write(&path, serde_json::to_vec(&entry).expect("json")).expect("write");
        let hit = read_cache(&path, &key).expect("hit");
        assert!(hit.cached);
        assert_eq!(hit.detail, "KVM internal error");
        assert_eq!(hit.elapsed, Duration::from_millis(1500));
        let other = ProbeKey {
            images_sha256: "cd".into(),
            ..key
        };
        assert!(read_cache(&path, &other).is_none());
    }

    #[test]
    fn accel_setting_parses_lowercase() {
        let s: AccelSetting = serde_json::from_str("\"auto\"").expect("auto");
        assert_eq!(s, AccelSetting::Auto);
        let s: AccelSetting = serde_json::from_str("\"kvm\"").expect("kvm");
        assert_eq!(s, AccelSetting::Kvm);
        assert!(serde_json::from_str::<AccelSetting>("\"fast\"").is_err());
    }

    use crate::vmm::testkit::{self, skip_unless};

    #[tokio::test]
    async fn probe_boot_sees_the_marker_under_tcg_and_not_from_a_broken_kernel() {
        let _serial = testkit::SERIAL.lock().await;
        let kernel = skip_unless!(testkit::kernel());
        let initramfs = skip_unless!(testkit::test_initramfs());
        let qemu = skip_unless!(testkit::driver());
        let t = tempfile::tempdir().expect("tempdir");
        let ok = probe_boot(
            &qemu,
            Accel::Tcg,
            &kernel,
            &initramfs,
            t.path(),
            PROBE_TIMEOUT,
        )
        .await
        .expect("probe boot");
        println!("TCG probe boot: {}", ok.detail);
        assert!(ok.marker_seen, "{}", ok.detail);

        let bad = t.path().join("garbage");
        std::fs::write(&bad, vec![0u8; 4096]).expect("write");
        let ko = probe_boot(&qemu, Accel::Tcg, &bad, &initramfs, t.path(), PROBE_TIMEOUT)
            .await
            .expect("probe boot");
        assert!(!ko.marker_seen);
        assert!(ko.detail.contains("QEMU exited"), "{}", ko.detail);
        assert!(testkit::processes_mentioning(t.path()).is_empty());
    }

    /// The probe's QEMU (root daemon): the shared VM user's uid, not root's; no new
    /// privileges; its own mount namespace without `/etc/passwd`.
    #[tokio::test]
    async fn the_probe_qemu_runs_fenced() {
        let _serial = testkit::SERIAL.lock().await;
        if !nix::unistd::geteuid().is_root() {
            println!("SKIPPED: the probe's uid drop is a root daemon's fence");
            return;
        }
        let kernel = skip_unless!(testkit::kernel());
        let initramfs = skip_unless!(testkit::test_initramfs());
        let qemu = skip_unless!(testkit::driver());
        let t = tempfile::tempdir().expect("tempdir");
        let dir = t.path().to_owned();
        let q = qemu.clone();
        let boot = tokio::spawn(async move {
            probe_boot(&q, Accel::Tcg, &kernel, &initramfs, &dir, PROBE_TIMEOUT).await
        });
        let mut seen = None;
        for _ in 0..400 {
            if let Some(pid) = testkit::processes_mentioning(&t.path().join("probe")).first() {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status"));
                let passwd = std::path::PathBuf::from(format!("/proc/{pid}/root/etc/passwd"));
                if let Ok(st) = status {
                    seen = Some((st, passwd.exists()));
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ok = boot.await.expect("join").expect("probe boot");
        let (status, passwd) = seen.expect("the probe's QEMU was never seen");
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{k}:")))
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let u = crate::vmm::jail::user::lookup().expect("tryboxi-vm");
        assert_eq!(field("Uid"), vec![u.uid.to_string(); 4], "{status}");
        assert_eq!(field("NoNewPrivs"), ["1"]);
        assert!(!passwd, "the probe's QEMU sees /etc/passwd");
        assert!(ok.marker_seen, "{}", ok.detail);
    }

    #[tokio::test]
    async fn probe_on_this_host_is_consistent_and_cached() {
        let _serial = testkit::SERIAL.lock().await;
        let kernel = skip_unless!(testkit::kernel());
        let initramfs = skip_unless!(testkit::test_initramfs());
        let qemu = skip_unless!(testkit::driver());
        let t = tempfile::tempdir().expect("tempdir");
        let first = probe_accel(&qemu, &kernel, &initramfs, t.path())
            .await
            .expect("probe");
        println!("KVM probe on this host: {first:?}");
        assert_eq!(first.kvm_ok, first.accel == Accel::Kvm);
        assert!(!first.cached);
        if first
            .detail
            .starts_with("the fenced probe QEMU cannot start")
        {
            // A root-only /dev/kvm: nothing was booted, nothing cached.
            assert!(!first.kvm_ok);
        } else if Path::new("/dev/kvm").exists() {
            let again = probe_accel(&qemu, &kernel, &initramfs, t.path())
                .await
                .expect("probe");
            assert!(again.cached);
            assert_eq!(again.accel, first.accel);
            assert_eq!(again.detail, first.detail);
        }
        assert!(testkit::processes_mentioning(t.path()).is_empty());
    }
}
