//! The fences around each QEMU process (the idea of Firecracker's jailer, done in the driver).
//!
//! Owns: deciding which fences this host allows ([`Jail::detect`], reported by `doctor`),
//! preparing them for one launch before the fork ([`Jail::prepare`]) and entering them in the
//! forked child before exec ([`Prepared::enter`]), and removing what a launch left
//! ([`Prepared::release`], [`Jail::sweep`]).
//! The fences: a cgroup with memory, pids and CPU limits from the VM's size
//! (`jail/cgroup.rs`).
//! Never: falls back to an unfenced QEMU when the daemon is root (an error says which fence
//! could not be set up); an unprivileged daemon goes without a fence the host does not allow,
//! and `doctor` says why.

pub mod cgroup;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Mutex;

use super::{Accel, VmSpec, VmmError};

/// Names of cgroups made for launches not yet running: [`Jail::sweep`] leaves them alone.
static IN_FLIGHT: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn in_flight() -> std::sync::MutexGuard<'static, BTreeSet<String>> {
    IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which fences this host allows for QEMU, found once per driver.
#[derive(Debug)]
pub struct Jail {
    is_root: bool,
    /// The cgroup controllers, or why there are none.
    cgroups: Result<cgroup::Hierarchy, String>,
}

/// The fences of this host as `doctor` shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceReport {
    /// `cgroup v1 (...)`, `cgroup v2 (...)` or why there is none.
    pub cgroup: Result<String, String>,
}

impl Jail {
    /// Look at this host (no side effects).
    pub fn detect() -> Jail {
        let is_root = nix::unistd::geteuid().is_root();
        Jail {
            is_root,
            cgroups: cgroup::detect(is_root).map_err(|e| e.to_string()),
        }
    }

    /// What `doctor` prints. Checks that a cgroup can really be made (and removes it).
    pub fn report(&self) -> FenceReport {
        let cgroup = match &self.cgroups {
            Ok(h) => {
                let name = format!("doctor.{}", std::process::id());
                match cgroup::VmCgroup::create(h, &name, cgroup::Limits::for_vm(1, 64, false)) {
                    Ok(cg) => {
                        cgroup::remove_dirs(cg.dirs());
                        let at: Vec<String> = h
                            .parents()
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect();
                        Ok(format!("cgroup {} ({})", h.version(), at.join(", ")))
                    }
                    Err(e) => Err(e.to_string()),
                }
            }
            Err(e) => Err(e.clone()),
        };
        FenceReport { cgroup }
    }

    /// Make the fences of `spec`'s next QEMU. `Err` when a fence the daemon must have cannot
    /// be set up.
    pub(crate) fn prepare(&self, spec: &VmSpec) -> Result<Prepared, VmmError> {
        let cgroup = self.prepare_cgroup(spec)?;
        Ok(Prepared { cgroup })
    }

    fn prepare_cgroup(&self, spec: &VmSpec) -> Result<Option<Launch>, VmmError> {
        let h = match &self.cgroups {
            Ok(h) => h,
            Err(why) if self.is_root => {
                return Err(VmmError::Fence(format!(
                    "no cgroup for QEMU: {why} (QEMU would run without memory, pids and CPU \
                     limits)"
                )));
            }
            Err(why) => {
                tracing::debug!(reason = %why, "QEMU runs without a cgroup");
                return Ok(None);
            }
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let name = format!("{}.{nanos:x}", spec.id);
        let limits = cgroup::Limits::for_vm(spec.vcpus, spec.memory_mib, spec.accel == Accel::Tcg);
        in_flight().insert(name.clone());
        match cgroup::VmCgroup::create(h, &name, limits) {
            Ok(cg) => Ok(Some(Launch { name, cg })),
            Err(e) => {
                in_flight().remove(&name);
                if self.is_root {
                    Err(VmmError::Fence(format!("cannot make QEMU's cgroup: {e}")))
                } else {
                    tracing::warn!(error = %e, "QEMU runs without a cgroup");
                    Ok(None)
                }
            }
        }
    }

    /// Remove empty cgroups of QEMUs that are gone (a VM that ended while no daemon ran, or
    /// whose daemon could not remove them). Returns how many went.
    pub fn sweep(&self) -> usize {
        let Ok(h) = &self.cgroups else {
            return 0;
        };
        let busy = in_flight().clone();
        let n = cgroup::sweep(h, |name| busy.contains(name));
        if n > 0 {
            tracing::info!(removed = n, "removed the cgroups of ended VMs");
        }
        n
    }
}

#[derive(Debug)]
struct Launch {
    name: String,
    cg: cgroup::VmCgroup,
}

/// The fences of one launch, made before the fork.
#[derive(Debug)]
pub(crate) struct Prepared {
    cgroup: Option<Launch>,
}

impl Prepared {
    /// Enter the fences. Runs in the forked child before exec: only async-signal-safe system
    /// calls on data prepared before the fork.
    pub(crate) fn enter(&self) -> std::io::Result<()> {
        if let Some(l) = &self.cgroup {
            l.cg.enter()?;
        }
        Ok(())
    }

    /// QEMU runs (or never started): the cgroup is no longer "in flight".
    pub(crate) fn launched(&self) {
        if let Some(l) = &self.cgroup {
            in_flight().remove(&l.name);
        }
    }

    /// The cgroup directories, to remove once QEMU has exited.
    pub(crate) fn cgroup_dirs(&self) -> Vec<PathBuf> {
        self.cgroup
            .as_ref()
            .map(|l| l.cg.dirs().to_vec())
            .unwrap_or_default()
    }
}
