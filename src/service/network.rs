//! Each sandbox's network stack: started before its VM boots (QEMU's NIC connects to it),
//! started again for VMs found after a daemon restart (QEMU reconnects on its own), kept across
//! a restore (the new QEMU connects to the same socket), dropped when the sandbox goes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::{Service, ServiceError};
use crate::network::gate::SharedGate;
use crate::network::stack::{NetStack, StackConfig};
use crate::vmm::qemu::VmPaths;

/// The running stacks, by sandbox id.
#[derive(Default)]
pub struct Nets {
    stacks: Mutex<HashMap<String, Arc<NetStack>>>,
}

impl Nets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<NetStack>>> {
        self.stacks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<NetStack>> {
        self.lock().get(id).cloned()
    }
}

impl Service {
    /// The gate deciding `id`'s traffic: its policy gate, or (no policy record) nothing leaves.
    fn gate_for(&self, id: &str) -> SharedGate {
        match self.network_gate(id) {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "no network policy; denying all egress");
                Arc::new(crate::network::deny::DenyAll)
            }
        }
    }

    /// Make sure `id` has a stack listening on its VM's network socket (idempotent).
    pub(super) fn ensure_network(&self, id: &str, dir: &Path) -> Result<(), ServiceError> {
        if self.nets.get(id).is_some() {
            return Ok(());
        }
        let path = VmPaths::new(dir).net;
        let stack = NetStack::listen(&path, self.gate_for(id), StackConfig::default())
            .map_err(|e| ServiceError::Internal(e.to_string()))?;
        // QEMU (the VM user under a root daemon) connects to it, also after a daemon restart.
        crate::vmm::jail::give_socket(&path)
            .map_err(|e| ServiceError::Internal(format!("{}: {e}", path.display())))?;
        tracing::debug!(sandbox = %id, socket = %path.display(), "network stack listening");
        self.nets.lock().insert(id.to_owned(), Arc::new(stack));
        Ok(())
    }

    /// Stop `id`'s stack (every relayed connection closes).
    pub(super) fn stop_network(&self, id: &str) {
        self.nets.lock().remove(id);
    }
}
