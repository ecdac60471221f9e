//! Clones (fork children, golden-snapshot sandboxes) and pause to disk / resume.
//!
//! A clone is a new QEMU with the same devices as the checkpointed VM, its RAM a private
//! (copy-on-write) mapping of the checkpoint's frozen RAM file, a fresh qcow2 overlay over the
//! checkpoint's frozen disk layer, and `-incoming file:state.bin`. Every clone of one
//! checkpoint shares the pages it has not written.
//!
//! Pause writes the device state (and, for a VM on a borrowed mapping, its RAM) to a state
//! file and ends QEMU; the RAM file and the active overlay stay where they are. Resume starts
//! a new QEMU on the same overlay and RAM file from that state file.

use std::path::Path;
use std::time::Duration;

use super::snapshot::{Checkpoint, Resumed, absolute, active_disk, owned_ram, save_state};
use super::{QMP_TIMEOUT, QemuDriver, RamBacking, VmPaths, abs, our_process, ramfile};
use crate::vmm::qmp::QmpClient;
use crate::vmm::{VmInfo, VmSpec, VmmError};

/// How long a paused-to-disk QEMU gets to exit after `quit`.
const QUIT_WAIT: Duration = Duration::from_secs(10);

impl QemuDriver {
    /// Start `spec`'s VM as a clone of `cp` with the new overlay `overlay` (see the module doc).
    /// `cp` must have a frozen RAM file.
    pub async fn clone_vm(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
        overlay: &Path,
    ) -> Result<Resumed, VmmError> {
        let ram = cp.ram_file.as_ref().ok_or_else(|| {
            VmmError::Other("this checkpoint has no RAM file: it cannot be cloned".into())
        })?;
        let paths = VmPaths::for_checkpoint_start(
            spec,
            absolute(overlay)?,
            Some(RamBacking::Borrowed(abs(ram)?)),
            cp.workspace_disk.as_deref(),
        )?;
        self.qcow2_over(&cp.disk_layer, "qcow2", &paths.disk)
            .await?;
        self.start_incoming(spec, &paths, &cp.state_file, true, Default::default())
            .await
    }

    /// Pause `vm` to disk: its state goes to `dest/state.bin`, then QEMU exits. The returned
    /// checkpoint names the VM's active overlay (not frozen: resume goes on writing it).
    pub async fn pause_to_disk(&self, vm: &VmInfo, dest: &Path) -> Result<Checkpoint, VmmError> {
        std::fs::create_dir_all(dest).map_err(super::io_err(dest))?;
        let dest = abs(dest)?;
        let state = dest.join("state.bin");
        // QEMU sees only its own directory (jail.rs): a state file meant for elsewhere (a
        // golden snapshot's) is written there first and moved once QEMU has gone.
        let staged = if dest.starts_with(&vm.dir) {
            self.jail.share_dir(&dest, &vm.dir)?;
            None
        } else {
            Some(vm.dir.join("state.bin.pausing"))
        };
        let written = staged.as_ref().unwrap_or(&state);
        let qmp = QmpClient::connect(&vm.qmp_socket, QMP_TIMEOUT).await?;
        let (disk, _) = active_disk(&qmp).await?;
        let ram = owned_ram(&qmp).await;
        qmp.stop().await?;
        if let Err(e) = save_state(&qmp, written, ram.is_some()).await {
            let _ = qmp.cont().await;
            return Err(e);
        }
        let proc = our_process(vm);
        qmp.quit().await?;
        if let Some(p) = proc
            && !p.wait_exit(QUIT_WAIT).await.unwrap_or(false)
        {
            tracing::warn!(vm = %vm.id, "QEMU did not exit after quit; killing it");
            Self::kill_and_wait(vm).await?;
        }
        if let Some(tmp) = &staged {
            std::fs::rename(tmp, &state).map_err(super::io_err(&state))?;
        }
        if let Some(r) = &ram {
            // A paused VM keeps only what its guest wrote; resume reserves the rest again.
            let freed = ramfile::release_reserve(r);
            tracing::debug!(vm = %vm.id, freed, "RAM file reserve given back");
        }
        let state_bytes = std::fs::metadata(&state)
            .map_err(super::io_err(&state))?
            .len();
        Ok(Checkpoint {
            state_file: state,
            disk_layer: disk,
            state_bytes,
            ram_file: ram,
            workspace_disk: None,
            disk_only: false,
        })
    }

    /// Start `spec`'s VM again from a [`QemuDriver::pause_to_disk`] checkpoint: same overlay,
    /// its own RAM file (filled from the state file if the VM ran on a borrowed mapping).
    pub async fn resume_from_disk(
        &self,
        spec: &VmSpec,
        cp: &Checkpoint,
    ) -> Result<Resumed, VmmError> {
        let paths = VmPaths::for_checkpoint_start(spec, cp.disk_layer.clone(), None, None)?;
        let filling = match &cp.ram_file {
            Some(r) if r != paths.ram.path() => Some(ramfile::fill_in_place(r, paths.ram.path())?),
            Some(_) => None,
            None => {
                ramfile::remove(paths.ram.path())?;
                None
            }
        };
        let after = super::snapshot::StartAfter {
            filling,
            old_gone: None,
        };
        self.start_incoming(spec, &paths, &cp.state_file, cp.ram_file.is_some(), after)
            .await
    }
}
