//! Golden snapshots (the warm pool built on them is `pool.rs`).
//!
//! A golden snapshot is a VM booted once until its agent answered, then paused to disk, kept
//! in `<data root>/golden/<key>/`: `vm/` (the VM's directory: `mem.ram`, `disk.qcow2`, logs),
//! `state/state.bin`, and `golden.json` (the checkpoint; written last, so its presence means
//! complete). The key hashes everything the snapshot depends on: the image manifest (kernel,
//! initramfs, rootfs sha256), the rootfs path, size and mtime, the QEMU version, the vCPUs,
//! memory and acceleration, and the whole QEMU argument list of such a VM (the device layout,
//! including devices other parts of the daemon add). Anything changes: a new key, so a stale
//! snapshot is never used (old directories are left for GC).
//!
//! `create` first takes a sandbox from the warm pool (VMs already started from the golden
//! snapshot, with their own id and directory, waiting without a record), else starts one from
//! the golden snapshot, else boots. A missing snapshot is built in the background after the
//! first boot of its kind; a broken one (its clone fails) is marked `broken` and not used
//! again (event `golden.broken`). The VM booted to build a snapshot is in the scheduler's
//! ledger ([`Holder::Golden`]) while it runs; the build is skipped (retried at the next cold
//! boot of its kind) when the host has no room for it right now.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::pool::PoolVm;
use super::scheduler::{Holder, Resources};
use super::vms::LiveVm;
use super::{Service, ServiceError};
use crate::vmm::qemu::{Checkpoint, VmPaths, qemu_args};
use crate::vmm::{Images, VmSpec};

const GOLDEN_FILE: &str = "golden.json";
const BROKEN_FILE: &str = "broken";

#[derive(Default)]
pub struct GoldenState {
    /// Keys whose snapshot is being built right now.
    pub(super) building: Mutex<std::collections::HashSet<String>>,
    /// Keys whose pool is being refilled right now; `true`: asked again meanwhile (room was
    /// freed), so the refill goes round once more before it ends.
    pub(super) filling: Mutex<HashMap<String, bool>>,
    /// Keys with a warm pool, and the shape of their VMs: refilled when room is freed.
    pub(super) wanted: Mutex<HashMap<String, VmSpec>>,
    /// The warm pool: idle VMs by golden key (see `pool.rs`).
    pub(super) pool: Mutex<HashMap<String, Vec<PoolVm>>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Golden {
    key: String,
    pub(super) checkpoint: Checkpoint,
    built_at: String,
    boot_ms: u64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The golden key of VMs shaped like `spec` (its id and directory do not count).
pub fn golden_key(spec: &VmSpec, images: &Images, qemu_version: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"tryboxi-golden-v1\0");
    for a in &images.manifest.artifacts {
        h.update(format!("{}={}:{}\0", a.name, a.sha256, a.size).as_bytes());
    }
    // The rootfs is not on the command line (the drive is the VM's overlay over it).
    h.update(b"rootfs=");
    h.update(spec.rootfs.as_os_str().as_encoded_bytes());
    h.update(b"\0");
    if let Ok(m) = std::fs::metadata(&spec.rootfs) {
        use std::os::unix::fs::MetadataExt;
        h.update(format!("rootfs={}:{}:{}\0", m.len(), m.mtime(), m.mtime_nsec()).as_bytes());
    }
    h.update(format!("qemu={qemu_version}\0").as_bytes());
    if is_interpreter(spec) {
        // What [`warm_up`] leaves running is part of the snapshot.
        h.update(b"warm=code-interpreter-1\0");
    }
    let shape = VmSpec {
        id: "golden".into(),
        dir: PathBuf::from("/golden"),
        ..spec.clone()
    };
    for arg in qemu_args(&shape, &VmPaths::new(&shape.dir)) {
        h.update(arg.as_encoded_bytes());
        h.update(b"\0");
    }
    hex::encode(&h.finalize()[..8])
}

/// The code interpreter's template image: its golden snapshot has the interpreter server (and
/// its default kernel) already running, because the kernel starts slowly (tens of seconds
/// under TCG). The E2B face finds it running and does not start another.
const INTERPRETER_IMAGE: &str = "template-code-interpreter.qcow2";

fn is_interpreter(spec: &VmSpec) -> bool {
    spec.rootfs.file_name() == Some(std::ffi::OsStr::new(INTERPRETER_IMAGE))
}

/// Before a golden VM is paused: start what its template serves (only the code interpreter
/// has something), and wait until it is ready.
async fn warm_up(vm: &LiveVm, spec: &VmSpec) -> Result<(), ServiceError> {
    if !is_interpreter(spec) {
        return Ok(());
    }
    // Its own session (setsid): it outlives this exec and its process group.
    let start = "setsid -f /usr/bin/python3 /opt/tryboxi/interpreter/server.py \
                 </dev/null >/dev/null 2>&1";
    // The server opens its port once its default kernel answered.
    let wait = "for i in $(seq 1200); do \
                python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 49999), 1)' \
                2>/dev/null && exit 0; sleep 0.25; done; exit 1";
    for (what, shell, secs) in [("start", start, 30), ("wait for", wait, 330)] {
        let req = crate::rpc::client::ExecRequest {
            shell: Some(shell.into()),
            env: vec![("HOME".into(), "/home/user".into())],
            cwd: Some("/home/user".into()),
            user: Some("user".into()),
            timeout: Some(std::time::Duration::from_secs(secs)),
            ..Default::default()
        };
        let fail = |e: String| {
            ServiceError::Internal(format!("golden: cannot {what} the code interpreter: {e}"))
        };
        let mut s = vm.agent.exec(req).await.map_err(|e| fail(e.to_string()))?;
        loop {
            match s.next().await {
                Some(Ok(crate::rpc::client::ExecEvent::Exit { code: Some(0), .. })) => break,
                Some(Ok(crate::rpc::client::ExecEvent::Exit { code, signal, .. })) => {
                    return Err(fail(format!("exit {code:?}, signal {signal:?}")));
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(fail(e.to_string())),
                None => return Err(fail("the exec stream ended".into())),
            }
        }
    }
    Ok(())
}

impl Service {
    pub(super) fn golden_dir(&self, key: &str) -> PathBuf {
        self.paths.root.join("golden").join(key)
    }

    /// `<images key>-<shape key>`: the first half is `gc::golden_key` of the kernel, initramfs
    /// and this VM's rootfs/template image, which is how `tryboxi gc` tells stale snapshots.
    pub(super) fn key_of(&self, spec: &VmSpec) -> Option<String> {
        let images = self.images().ok()?;
        let driver = self.driver().ok()?;
        let sha = |pred: &dyn Fn(&crate::vmm::images::Artifact) -> bool| {
            images
                .manifest
                .artifacts
                .iter()
                .find(|a| pred(a))
                .map(|a| a.sha256.clone())
        };
        let rootfs_file = spec.rootfs.file_name()?.to_str()?.to_owned();
        let images_key = super::gc::golden_key(
            &sha(&|a| a.name == "kernel")?,
            &sha(&|a| a.name == "initramfs")?,
            &sha(&|a| a.file == rootfs_file)?,
        );
        let shape = golden_key(spec, &images, &driver.version().to_string());
        Some(format!("{images_key}-{shape}"))
    }

    /// The complete, not broken golden snapshot of `key`, if any.
    pub(super) fn golden(&self, key: &str) -> Option<Golden> {
        let dir = self.golden_dir(key);
        if dir.join(BROKEN_FILE).exists() {
            return None;
        }
        let data = std::fs::read(dir.join(GOLDEN_FILE)).ok()?;
        serde_json::from_slice(&data).ok()
    }

    /// Start `spec`'s VM from its golden snapshot when there is one, else boot it (and build
    /// the snapshot in the background for next time). The one call site `create` uses.
    pub(super) async fn boot_or_clone(
        self: &Arc<Self>,
        driver: &crate::vmm::QemuDriver,
        spec: &VmSpec,
    ) -> Result<LiveVm, ServiceError> {
        if !self.config.pool.golden {
            return self.boot(driver, spec).await;
        }
        let Some(key) = self.key_of(spec) else {
            return self.boot(driver, spec).await;
        };
        if let Some(g) = self.golden(&key) {
            let t0 = Instant::now();
            let span = self.telemetry.traces.span(&spec.id, "vm.golden_restore");
            match self.start_clone(spec, &g.checkpoint, false).await {
                Ok(vm) => {
                    drop(span);
                    tracing::info!(sandbox = %spec.id, golden = %key, ms = t0.elapsed().as_millis() as u64, "created from the golden snapshot");
                    self.fill_pool(&key, spec);
                    return Ok(vm);
                }
                Err(e) => {
                    drop(span);
                    self.mark_broken(&key, &e.to_string());
                    // Leftovers of the failed clone must not confuse the boot.
                    self.kill_leftover(&spec.dir).await;
                    clear_dir(&self.paths.root, &spec.dir);
                }
            }
        } else {
            tracing::info!(sandbox = %spec.id, golden = %key, "no golden snapshot yet: cold boot");
        }
        let vm = self.boot(driver, spec).await?;
        self.build_golden(key, spec.clone());
        Ok(vm)
    }

    pub(super) fn mark_broken(&self, key: &str, why: &str) {
        tracing::warn!(golden = %key, error = %why, "golden snapshot broken: falling back to a cold boot");
        let _ = std::fs::write(self.golden_dir(key).join(BROKEN_FILE), why);
        self.telemetry.events.publish(
            "golden.broken",
            "",
            None,
            serde_json::json!({"key": key, "error": why}),
        );
    }

    /// Build `key`'s golden snapshot in the background (once at a time per key), if the host
    /// has room for one more VM right now (it never waits in the scheduler's queue).
    fn build_golden(self: &Arc<Self>, key: String, spec: VmSpec) {
        if self.life.shutting_down() || !lock(&self.life.golden.building).insert(key.clone()) {
            return;
        }
        let need = Resources::new(spec.vcpus, u64::from(spec.memory_mib));
        let Some(reservation) =
            self.ledger
                .try_reserve(&format!("golden-{key}"), need, Holder::Golden)
        else {
            tracing::info!(golden = %key, "no room on the host to build the golden snapshot now; the next cold boot of its kind tries again");
            lock(&self.life.golden.building).remove(&key);
            return;
        };
        let svc = self.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let built = svc.build_golden_now(&key, &spec).await;
            // The build's VM is gone (paused to disk, or failed): its room is free again.
            drop(reservation);
            match built {
                Ok(()) => {
                    tracing::info!(golden = %key, ms = t0.elapsed().as_millis() as u64, "golden snapshot built");
                    svc.fill_pool(&key, &spec);
                }
                Err(e) => {
                    tracing::warn!(golden = %key, error = %e, "cannot build the golden snapshot")
                }
            }
            lock(&svc.life.golden.building).remove(&key);
        });
    }

    async fn build_golden_now(&self, key: &str, spec: &VmSpec) -> Result<(), ServiceError> {
        let driver = self.driver()?;
        let gdir = self.golden_dir(key);
        if gdir.exists() {
            // An earlier attempt (incomplete or broken): start over.
            self.kill_leftover(&gdir.join("vm")).await;
            crate::safefs::remove_under(&self.paths.root, &gdir)
                .map_err(|e| ServiceError::Internal(e.to_string()))?;
        }
        let vm_dir = gdir.join("vm");
        std::fs::create_dir_all(&vm_dir).map_err(|e| {
            ServiceError::Internal(format!("cannot create {}: {e}", vm_dir.display()))
        })?;
        let gspec = VmSpec {
            id: format!("golden-{key}"),
            dir: vm_dir.clone(),
            ..spec.clone()
        };
        let t0 = Instant::now();
        let vm = self.boot(&driver, &gspec).await?;
        warm_up(&vm, spec).await?;
        let boot_ms = t0.elapsed().as_millis() as u64;
        let cp = driver
            .pause_to_disk(&vm.info, &gdir.join("state"))
            .await
            .map_err(|e| ServiceError::Internal(format!("cannot pause the golden VM: {e}")))?;
        drop(vm);
        let g = Golden {
            key: key.to_owned(),
            checkpoint: cp,
            built_at: super::now_rfc3339(),
            boot_ms,
        };
        let tmp = gdir.join("golden.json.tmp");
        let data = serde_json::to_vec_pretty(&g)
            .map_err(|e| ServiceError::Internal(format!("cannot encode golden.json: {e}")))?;
        std::fs::write(&tmp, data)
            .and_then(|()| std::fs::rename(&tmp, gdir.join(GOLDEN_FILE)))
            .map_err(|e| ServiceError::Internal(format!("cannot write golden.json: {e}")))?;
        self.telemetry.events.publish(
            "golden.built",
            "",
            None,
            serde_json::json!({"key": key, "boot_ms": boot_ms}),
        );
        Ok(())
    }

    /// Daemon start: a golden snapshot left incomplete (no `golden.json`) by a daemon that
    /// died while building it is ended and deleted.
    pub(super) async fn clean_incomplete_golden(&self) {
        let Ok(entries) = std::fs::read_dir(self.paths.root.join("golden")) else {
            return;
        };
        for e in entries.flatten() {
            let dir = e.path();
            if dir.join(GOLDEN_FILE).exists() {
                continue;
            }
            tracing::warn!(dir = %dir.display(), "removing an incomplete golden snapshot");
            self.kill_leftover(&dir.join("vm")).await;
            if let Err(e) = crate::safefs::remove_under(&self.paths.root, &dir) {
                tracing::warn!(error = %e, "cannot remove an incomplete golden snapshot");
            }
        }
    }
}

/// Empty a sandbox directory after a failed clone (fenced to the data root).
fn clear_dir(root: &Path, dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if let Err(e) = crate::safefs::remove_under(root, &e.path()) {
                tracing::warn!(error = %e, "cannot clean up after a failed clone");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::Accel;
    use crate::vmm::images::{Artifact, Manifest};

    fn images(kernel_sha: &str) -> Images {
        Images {
            dir: "/img".into(),
            kernel: "/img/vmlinuz".into(),
            initramfs: "/img/initramfs.cpio.gz".into(),
            rootfs: "/img/rootfs.ext4".into(),
            manifest: Manifest {
                version: 1,
                artifacts: vec![Artifact {
                    name: "kernel".into(),
                    file: "vmlinuz".into(),
                    size: 1,
                    sha256: kernel_sha.into(),
                }],
                acpi: false,
            },
        }
    }

    fn spec(id: &str, vcpus: u32) -> VmSpec {
        VmSpec {
            id: id.into(),
            dir: format!("/data/sandboxes/{id}").into(),
            kernel: "/img/vmlinuz".into(),
            initramfs: "/img/initramfs.cpio.gz".into(),
            rootfs: "/img/rootfs.ext4".into(),
            vcpus,
            memory_mib: 256,
            accel: Accel::Tcg,
        }
    }

    #[test]
    fn only_the_code_interpreter_template_is_warmed_before_its_snapshot() {
        assert!(!is_interpreter(&spec("sbx_a", 1)));
        let ci = VmSpec {
            rootfs: "/img/template-code-interpreter.qcow2".into(),
            ..spec("sbx_a", 1)
        };
        assert!(is_interpreter(&ci));
    }

    #[test]
    fn key_ignores_identity_and_follows_everything_the_snapshot_depends_on() {
        let k = golden_key(&spec("sbx_a", 1), &images("aa"), "10.0.2");
        assert_eq!(k, golden_key(&spec("sbx_b", 1), &images("aa"), "10.0.2"));
        assert_ne!(k, golden_key(&spec("sbx_a", 2), &images("aa"), "10.0.2"));
        assert_ne!(k, golden_key(&spec("sbx_a", 1), &images("bb"), "10.0.2"));
        assert_ne!(k, golden_key(&spec("sbx_a", 1), &images("aa"), "10.1.0"));
        let other_rootfs = VmSpec {
            rootfs: "/img/templates/python.ext4".into(),
            ..spec("sbx_a", 1)
        };
        assert_ne!(k, golden_key(&other_rootfs, &images("aa"), "10.0.2"));
    }
}
