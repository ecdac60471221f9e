//! Free space before the data root's big writes: a create is refused up front when the root
//! is nearly full, and a snapshot, pause or fork is refused when what it will write (known in
//! advance: the guest RAM it copies plus a small state file and overlay) would leave less than
//! `[limits] disk_reserve_mib` free. The writes themselves still map an ENOSPC to
//! [`ServiceError::NoSpace`] (see [`ServiceError::of_write`]) and remove their partial files.

use std::path::Path;

use super::{SandboxRecord, Service, ServiceError};
use crate::diskspace;

/// Room for a checkpoint's state file (device state without RAM is tens of KB), a new qcow2
/// overlay and the sync base saved with it.
const CHECKPOINT_SLACK: u64 = 8 << 20;

impl Service {
    /// Refuse a create when the data root has less than `[limits] min_free_disk_mib` free.
    pub(super) fn ensure_create_room(&self) -> Result<(), ServiceError> {
        let min = self.config.limits.min_free_disk_mib.saturating_mul(1 << 20);
        diskspace::ensure_room(&self.paths.root, "a new sandbox", 0, min)?;
        Ok(())
    }

    /// Refuse a write of about `need` bytes under `at` that would leave less than
    /// `[limits] disk_reserve_mib` free.
    pub(super) fn ensure_room_for(
        &self,
        at: &Path,
        what: &str,
        need: u64,
    ) -> Result<(), ServiceError> {
        // Test hook: let the write run into the full disk, to exercise its ENOSPC path.
        if std::env::var_os("TRYBOXI_TEST_SKIP_ROOM_CHECK").is_some() {
            tracing::warn!(what, "TRYBOXI_TEST_SKIP_ROOM_CHECK: free space not checked");
            return Ok(());
        }
        diskspace::ensure_room(at, what, need, self.config.limits.disk_reserve())?;
        Ok(())
    }
}

/// What a checkpoint of `rec`'s running VM writes, about: a VM with its own RAM file copies
/// that file's allocated part (`copy_ram`: a snapshot; a pause leaves it in place); a VM on a
/// borrowed mapping (a fork child, a golden clone) writes its whole RAM into the state file.
pub(super) fn checkpoint_bytes(rec: &SandboxRecord, copy_ram: bool) -> u64 {
    let own_ram = rec.dir.join("mem.ram");
    let ram = if own_ram.exists() {
        if copy_ram {
            // Its data, not its blocks: the reserve a running VM holds is not copied.
            crate::vmm::qemu::ramfile::data_bytes(&own_ram)
        } else {
            0
        }
    } else {
        u64::from(rec.api.memory_mib) << 20
    };
    ram + CHECKPOINT_SLACK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::WorkspaceError;

    #[test]
    fn enospc_anywhere_becomes_no_space_and_other_failures_do_not() {
        let dir = tempfile::tempdir().unwrap();
        // A backup or first-sync write that hit ENOSPC.
        let e = ServiceError::from(WorkspaceError::Io {
            what: "write",
            path: dir.path().join("artifacts/art_1/files/0"),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        });
        let ServiceError::NoSpace(m) = &e else {
            panic!("{e:?}")
        };
        assert!(
            m.contains("artifacts/art_1/files/0") && m.contains("MiB are free"),
            "{m}"
        );
        // The same write failing otherwise is not about space.
        let e = ServiceError::from(WorkspaceError::Io {
            what: "write",
            path: dir.path().into(),
            source: std::io::Error::from_raw_os_error(libc::EACCES),
        });
        assert!(matches!(e, ServiceError::Unprocessable(_)), "{e:?}");
        // A checkpoint whose migration QEMU reports as out of space.
        let e = ServiceError::of_write(
            dir.path(),
            "a snapshot of sbx_1",
            "cannot checkpoint sandbox `sbx_1`",
            "QMP error: migration \"failed\": Unable to write to file: No space left on device",
        );
        assert!(matches!(e, ServiceError::NoSpace(_)), "{e:?}");
        let e = ServiceError::of_write(dir.path(), "x", "cannot checkpoint", "timed out");
        let ServiceError::Internal(m) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(m, "cannot checkpoint: timed out");
    }

    #[test]
    fn a_checkpoint_counts_the_ram_it_copies() {
        let dir = tempfile::tempdir().unwrap();
        let mut rec = SandboxRecord::creating(
            "sbx_0000000000000001",
            dir.path().to_owned(),
            Some((dir.path(), vec![])),
            "base".into(),
            (1, 256, crate::vmm::Accel::Tcg),
        );
        // No RAM file of its own (a fork child): its whole RAM goes into the state file.
        assert_eq!(checkpoint_bytes(&rec, true), (256 << 20) + CHECKPOINT_SLACK);
        assert_eq!(
            checkpoint_bytes(&rec, false),
            (256 << 20) + CHECKPOINT_SLACK
        );
        // Its own RAM file: a snapshot copies what the guest touched (not the blocks reserved
        // for the rest); a pause leaves it.
        std::fs::write(dir.path().join("mem.ram"), vec![1u8; 1 << 20]).unwrap();
        crate::vmm::qemu::ramfile::preallocate(&dir.path().join("mem.ram"), 64 << 20).unwrap();
        rec.api.memory_mib = 256;
        let snap = checkpoint_bytes(&rec, true);
        assert!(((1 << 20) + CHECKPOINT_SLACK..(2 << 20) + CHECKPOINT_SLACK).contains(&snap));
        assert_eq!(checkpoint_bytes(&rec, false), CHECKPOINT_SLACK);
    }
}
