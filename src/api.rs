//! The HTTP API's request and response types, shared by the daemon, the CLI client and the
//! MCP server. JSON via serde. Nothing here does I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod execs;
mod ports;
pub use execs::*;
pub use ports::*;

/// Every error response: `{"error":{"code":"not_found","message":"..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
    pub version: String,
    pub pid: u32,
    pub data_root: String,
    /// `kvm` or `tcg` once known (resolved at the first boot), else `null`.
    pub accel: Option<String>,
    pub sandboxes: usize,
    /// The scheduler's ledger (absent from daemons that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Capacity>,
}

/// The host's vCPU and memory ledger, in `GET /v1/health` (docs/ARCHITECTURE.md,
/// "Scheduler").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Capacity {
    /// vCPUs all VMs may hold together: `[limits] max_vcpus`, else `vcpu_overcommit` x the
    /// host's CPUs.
    pub max_vcpus: u32,
    #[serde(default)]
    pub host_cpus: u32,
    /// `max_vcpus` / `host_cpus`: how far vCPUs are overcommitted.
    #[serde(default)]
    pub vcpu_overcommit: f64,
    /// `[limits] max_memory_mib`: a strict cap on the configured memory of all VMs together;
    /// `null`: none (memory is admitted by use, see `memory`).
    pub max_memory_mib: Option<u64>,
    pub reserved_vcpus: u32,
    /// The configured memory of all reservations together (what they could grow to).
    pub reserved_memory_mib: u64,
    #[serde(default)]
    pub memory: MemoryUse,
    #[serde(default)]
    pub cpu: CpuPressure,
    /// Requests waiting for room.
    pub queued: usize,
    /// Requests that waited in the queue since the daemon started.
    #[serde(default)]
    pub waited: u64,
    /// Of `waited`, the ones that had room (vCPUs, memory) but met a CPU-saturated host.
    #[serde(default)]
    pub waited_cpu: u64,
    pub reservations: Vec<LedgerEntry>,
}

/// Memory by use: what the VMs really hold and the room for new ones.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemoryUse {
    /// MemTotal (`null`: unknown).
    pub total_mib: Option<u64>,
    /// MemAvailable now (`null`: unknown; then memory is not checked by use).
    pub available_mib: Option<u64>,
    /// `[limits] memory_reserve_mib`: kept free for the daemon and the host.
    pub reserve_mib: u64,
    /// `[limits] memory_headroom_mib`: growth each measured VM counts for on top of its PSS.
    pub headroom_mib: u64,
    /// `[limits] memory_new_vm_mib`: what a VM counts for until measured.
    pub new_vm_mib: u64,
    /// The measured VMs' PSS together.
    pub used_mib: u64,
    /// What all VMs count for together (PSS + headroom, at most each one's size).
    pub counted_mib: u64,
    /// Room for new VMs now: MemAvailable - reserve - what running VMs may still grow into.
    pub room_mib: Option<u64>,
}

/// CPU pressure as admission sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CpuPressure {
    /// `psi` (`/proc/pressure/cpu`) or `none` (no PSI: only the vCPU ratio applies).
    pub source: String,
    /// PSI `some avg60`, percent.
    pub some_avg60: Option<f64>,
    /// `[limits] cpu_pressure_psi_avg60` (0: ignored).
    pub limit: f64,
    /// Requests wait and no background VM starts while this is true.
    pub saturated: bool,
}

/// One reservation in the ledger.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LedgerEntry {
    /// A sandbox id (pool VMs have theirs already), or `golden-<key>`.
    pub id: String,
    /// `sandbox`, `pool` (a warm-pool VM) or `golden` (building a golden snapshot).
    pub holder: String,
    pub vcpus: u32,
    /// Its configured memory (the most it ever counts for).
    pub memory_mib: u64,
    /// Its QEMU's measured PSS (`null`: not measured yet).
    #[serde(default)]
    pub used_mib: Option<u64>,
    /// What it counts for now.
    #[serde(default)]
    pub counted_mib: u64,
}

/// The workspace of a sandbox: a directory on the host.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkspaceSpec {
    pub host_path: String,
    /// More `sync.exclude` patterns for this sandbox's whole life (sync, diff, apply), on top
    /// of the config's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// The host folder synced into `/workspace`; absent: the sandbox has no host workspace
    /// (an empty `/workspace`; sync, diff, apply, pull and undo answer 409 `no_workspace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceSpec>,
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub vcpus: Option<u32>,
    #[serde(default)]
    pub memory_mib: Option<u32>,
    /// Egress policy; absent: the daemon's `[network] default_policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
    /// Stored secrets (by name) this sandbox gets: each appears in every exec as
    /// `NAME=<placeholder>`, never as its value. An unknown name is a 400.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// Lifecycle of a sandbox. `creating -> ready -> (removing) -> removed`; `ready <-> paused`
/// (pause to disk: no QEMU runs, memory and state are files; an exec, sync, diff or resume
/// brings it back); any state may go to `failed` (VM died, boot failed); `failed` sandboxes
/// can only be removed or restored. `retired`: ended by the E2B face while other sandboxes
/// still use its files or it still has snapshots to create sandboxes from: no VM runs, its
/// directory stays until the last of those goes (then it is removed on its own). See
/// docs/ARCHITECTURE.md, "Sandbox state machine".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Creating,
    Ready,
    Failed,
    Removing,
    Paused,
    Retired,
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(match self {
            SandboxState::Creating => "creating",
            SandboxState::Ready => "ready",
            SandboxState::Failed => "failed",
            SandboxState::Removing => "removing",
            SandboxState::Paused => "paused",
            SandboxState::Retired => "retired",
        })
    }
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    pub state: SandboxState,
    /// Absent for a sandbox created without a host workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<WorkspaceSpec>,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// `kvm` or `tcg`.
    pub accel: Option<String>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Why the sandbox failed, when `state` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Guest ports forwarded from a host loopback port (`tryboxi port`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ExposedPort>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/exec`. Exactly one of `cmd` (run by `/bin/sh -c`) or `argv`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Standard input, UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Standard input, base64 (for binary input); wins over `stdin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    /// Paths (`sync.exclude` patterns) the sync before this exec leaves alone: not sent and
    /// not deleted in the VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sync_exclude: Vec<String>,
    /// Keep running when the caller goes away (see `/v1/execs/{id}/attach`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub detach: bool,
    /// Run under a pseudo-terminal of this size (stdout and stderr are then one stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Run as this guest user (from the guest's `/etc/passwd`); default root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Keep standard input open after `stdin` for `POST /v1/execs/{id}/stdin`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_open: bool,
    /// A label listed with the exec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// One line of the NDJSON exec stream (`application/x-ndjson`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ExecEvent {
    /// First line: the exec's id.
    Started {
        exec_id: String,
        sandbox_id: String,
        /// The command's pid in the guest.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pid: Option<u32>,
    },
    /// A chunk of standard output: `data` when the chunk is valid UTF-8, else `data_b64`.
    Stdout {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// Same as `stdout`, for standard error.
    Stderr {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// Last line when the command ran to the end (or was killed).
    Exit {
        exit_code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        duration_ms: u64,
    },
    /// Last line when the exec could not finish (VM died, agent lost...).
    Error { code: String, message: String },
}

impl ExecEvent {
    /// Build a `stdout`/`stderr` event from raw bytes.
    pub fn output(stderr: bool, bytes: &[u8]) -> ExecEvent {
        let (data, data_b64) = match std::str::from_utf8(bytes) {
            Ok(s) => (Some(s.to_owned()), None),
            Err(_) => (None, Some(b64::encode(bytes))),
        };
        if stderr {
            ExecEvent::Stderr { data, data_b64 }
        } else {
            ExecEvent::Stdout { data, data_b64 }
        }
    }

    /// The raw bytes of an output event.
    pub fn output_bytes(
        data: &Option<String>,
        data_b64: &Option<String>,
    ) -> Result<Vec<u8>, String> {
        match (data, data_b64) {
            (Some(s), _) => Ok(s.as_bytes().to_vec()),
            (None, Some(b)) => b64::decode(b),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// Standard base64 (RFC 4648, padded), used for binary payloads in JSON.
pub mod b64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_output_round_trips_through_base64() {
        let bytes = [0u8, 159, 146, 150, 255];
        let ev = ExecEvent::output(false, &bytes);
        let line = serde_json::to_string(&ev).unwrap();
        assert!(line.contains("data_b64"), "{line}");
        let back: ExecEvent = serde_json::from_str(&line).unwrap();
        let ExecEvent::Stdout { data, data_b64 } = back else {
            panic!("{line}")
        };
        assert_eq!(ExecEvent::output_bytes(&data, &data_b64).unwrap(), bytes);
    }

    #[test]
    fn text_output_is_plain_json_string() {
        let line = serde_json::to_string(&ExecEvent::output(true, b"hi\n")).unwrap();
        assert_eq!(line, r#"{"type":"stderr","data":"hi\n"}"#);
    }

    #[test]
    fn create_request_rejects_unknown_fields() {
        let r: Result<CreateSandboxRequest, _> =
            serde_json::from_str(r#"{"workspace":{"host_path":"/x"},"bogus":1}"#);
        assert!(r.is_err());
    }
}

// ---- Snapshots: checkpoint and restore of one sandbox ----

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    #[serde(default)]
    pub name: Option<String>,
    /// `false`: the disk alone (E2B's `mode="filesystem"`): the guest writes back its files
    /// first, and a restore or fork from it boots afresh on that disk (no processes). Default
    /// `true`: memory, processes and disk.
    #[serde(default = "keep")]
    pub keep_memory: bool,
}

impl Default for SnapshotRequest {
    fn default() -> Self {
        SnapshotRequest {
            name: None,
            keep_memory: true,
        }
    }
}

/// A checkpoint of a sandbox: memory, device state and disk at one instant.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    pub id: String,
    pub sandbox_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub created_at: String,
    /// Size of the memory + device state file (0 for a disk-only snapshot).
    pub state_bytes: u64,
    /// How long the sandbox was paused to take it.
    pub duration_ms: u64,
    /// Whether it holds memory and processes; `false`: the disk alone (a restore or fork from
    /// it boots afresh).
    #[serde(default = "keep")]
    pub memory: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
}

/// `POST /v1/sandboxes/{id}/fork`: `count` new sandboxes (default 1, at most 32) that start
/// from the current state of the sandbox (memory pages shared copy-on-write, disk through
/// backing files), or, with `snapshot`, from that snapshot of it (the sandbox itself may be
/// paused or retired then, and is left as it is).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    #[serde(default)]
    pub count: Option<u32>,
    /// A snapshot of the sandbox (id or name) to start the children from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// `POST /v1/sandboxes/{id}/pause` (body optional).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// `false`: keep the disk alone (E2B's `mode="filesystem"`): the guest writes back its
    /// files and powers off; the next start boots afresh on that disk (processes and memory
    /// are gone). Default `true`: memory and device state are kept too.
    #[serde(default = "keep")]
    pub keep_memory: bool,
}

impl Default for PauseRequest {
    fn default() -> Self {
        PauseRequest { keep_memory: true }
    }
}

fn keep() -> bool {
    true
}

/// `POST /v1/sandboxes/{id}/resume` (body optional).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// Boot afresh on the sandbox's disk, dropping its memory state (E2B's `memory: false` on
    /// connect): files as they were, processes gone. The way back for a pause whose state
    /// cannot be loaded any more (e.g. after a QEMU or image upgrade).
    #[serde(default)]
    pub reboot: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkResult {
    pub parent: String,
    pub sandboxes: Vec<Sandbox>,
    /// Why each child that could not be started failed (the others in `sandboxes` run).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<String>,
    /// From the request to every child answering.
    pub duration_ms: u64,
}

/// `POST /v1/sandboxes/{id}/restore`: `snapshot` is a snapshot id or name.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    pub snapshot: String,
    /// Boot afresh on the snapshot's disk instead of loading its memory: the way back from a
    /// snapshot whose state a newer QEMU or image set cannot load. Its files are those the
    /// guest had written back by the snapshot (a filesystem-only snapshot's are all of them).
    #[serde(default)]
    pub reboot: bool,
}

// ---- Workspace: sync, diff, apply, pull, undo ----

/// `POST /v1/sandboxes/{id}/sync` (also done before every exec): what went host -> VM.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SyncReport {
    pub files_sent: u64,
    pub bytes_sent: u64,
    pub deleted: u64,
    pub unchanged: u64,
    /// Paths left out by the secret rules (never synced unless allowed).
    #[serde(default)]
    pub secrets_skipped: Vec<String>,
    /// Files left out because they hold a stored secret's value (or an encoding of it);
    /// the VM keeps what it had there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_values_skipped: Vec<SecretValueSkipped>,
    /// Files changed both on the host and in the VM since the last sync: left as the VM has
    /// them (diff shows them; apply merges both sides).
    #[serde(default)]
    pub kept_vm_changes: Vec<String>,
    /// How the files went in.
    #[serde(default)]
    pub via: SyncVia,
    pub duration_ms: u64,
}

/// A synced file left out because it holds a stored secret's value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SecretValueSkipped {
    /// Relative to the workspace.
    pub path: String,
    /// The secret whose value it holds (its name; never the value).
    pub secret: String,
}

/// How a sync's files went into the VM.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SyncVia {
    /// Nothing to send (deletions, if any, went over the channel).
    #[default]
    Nothing,
    /// A tar archive over the agent channel.
    Channel,
    /// A tar archive written to the VM's transfer disk, unpacked by the agent.
    TransferDisk,
    /// An ext4 image built on the host on the VM's workspace base disk, mounted by the agent as
    /// the lower layer of an overlayfs on `/workspace` (first big sync only).
    BaseDisk,
}

/// Optional body of `POST /v1/sandboxes/{id}/sync`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncRequest {
    /// Paths (`sync.exclude` patterns) this sync leaves alone: not sent and not deleted in the
    /// VM (a later sync without them sends them).
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// How a path differs between the sync base and the VM.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
    Renamed,
    ModeChanged,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileChange {
    pub path: String,
    pub kind: ChangeKind,
    /// For `renamed`: where it came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_path: Option<String>,
    pub binary: bool,
    pub additions: u64,
    pub deletions: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_mode: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_mode: Option<u32>,
    /// Unified diff (text files, unless `stat` was asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
}

/// `GET /v1/sandboxes/{id}/diff[?stat=true][&path=P...]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DiffReport {
    pub files: Vec<FileChange>,
    /// VM files over `sync.max_file_mib`: not read, and apply/pull leave the host's copy as it
    /// is (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub too_big: Vec<TooBigFile>,
    /// Changes apply and pull never bring back, with the reason (`path: reason`): git metadata
    /// below the root or a bare-repository layout, devices, FIFOs and sockets, symlinks that
    /// would resolve outside the repo (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<String>,
}

/// A VM file over `sync.max_file_mib`: too big, not brought back (the host's copy, if any, is
/// left untouched).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TooBigFile {
    pub path: String,
    /// Its size in the VM, in bytes.
    pub size: u64,
}

/// `POST /v1/sandboxes/{id}/apply` (`paths` empty = everything) and
/// `POST /v1/sandboxes/{id}/pull` (`paths` required; `force` overrides the host-changed check).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub force: bool,
}

/// What an apply or pull did. `artifact_id` (`art_...`) undoes it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ApplyReport {
    pub artifact_id: Option<String>,
    pub applied: Vec<String>,
    /// Merged with conflict markers (host and VM both changed the file).
    pub conflicts: Vec<String>,
    /// Refused, with the reason (`path: reason`).
    pub refused: Vec<String>,
    /// VM files over `sync.max_file_mib`: not brought back; the host's copy is left untouched
    /// (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub too_big: Vec<TooBigFile>,
}

/// `POST /v1/artifacts/{art_id}/undo`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct UndoReport {
    pub artifact_id: String,
    pub restored: Vec<String>,
    pub removed: Vec<String>,
    /// Paths the host had changed after the apply, overwritten because `force` was set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overwritten: Vec<String>,
    /// Where their content before the undo was backed up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overwritten_backup: Option<String>,
}

/// Optional body of `POST /v1/artifacts/{art_id}/undo`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UndoRequest {
    /// Undo even though the host changed some of the paths after the apply (their current
    /// content is backed up first).
    #[serde(default)]
    pub force: bool,
    /// Host folders the caller may write to (absolute): the undo is refused (403) unless the
    /// apply's host folder resolves to one of them or below. The MCP server sends its allowed
    /// workspaces, so a model cannot undo an apply made into another folder. Empty: no limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub within: Vec<String>,
}

/// `GET /v1/sandboxes/{id}/files?path=/abs/path` and the body of `PUT` on the same route.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileContent {
    pub path: String,
    /// UTF-8 content, or `content_b64` for binary files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
}

// ---- Secrets ----

/// A secret's value as the API carries it: only in the body of `PUT /v1/secrets/{name}`,
/// zeroized on drop, never `Debug`-printed.
#[derive(Clone, Default)]
pub struct SecretText(pub zeroize::Zeroizing<String>);

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretText(<{} bytes redacted>)", self.0.len())
    }
}

impl Serialize for SecretText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for SecretText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|s| SecretText(zeroize::Zeroizing::new(s)))
    }
}

/// `PUT /v1/secrets/{name}`: add or replace a secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetSecretRequest {
    /// The value (1 to 16384 bytes of UTF-8). Appears in no response, log or event.
    pub value: SecretText,
    /// DNS names whose intercepted HTTPS requests get the value (1 to 16).
    pub hosts: Vec<String>,
    /// More header names that carry it, beyond `Authorization`, `Proxy-Authorization`,
    /// `X-Api-Key`, `Api-Key` and `X-Goog-Api-Key`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<String>,
    /// The value may also be swapped into request bodies.
    #[serde(default)]
    pub in_body: bool,
}

/// A stored secret as the API shows it (never its value).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<String>,
    #[serde(default)]
    pub headers: Vec<String>,
    #[serde(default)]
    pub in_body: bool,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// RFC 3339 UTC; `null` until it was first swapped into a request.
    #[serde(default)]
    pub last_used_at: Option<String>,
    /// Answer of a set only: sandboxes whose synced files (their sync base) already hold the
    /// value, synced before it was stored. Remove them, or remove the file and re-sync.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub already_synced_to: Vec<String>,
}

/// `GET /v1/secrets`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SecretList {
    pub secrets: Vec<SecretInfo>,
}

/// `POST /v1/sandboxes/{id}/secrets`: give a running sandbox one more stored secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddSandboxSecret {
    pub name: String,
}

/// One secret a sandbox holds, with the placeholder its execs see.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SandboxSecret {
    pub name: String,
    pub placeholder: String,
}

/// The secrets a sandbox holds (answer of `POST /v1/sandboxes/{id}/secrets`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxSecrets {
    pub sandbox_id: String,
    pub secrets: Vec<SandboxSecret>,
}

/// `POST /v1/sandboxes/{id}/git`: the sandbox's git may reach a repository over HTTPS with a
/// token (`tryboxi git allow`). Allowing a repository again replaces its grant.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitAllowRequest {
    /// `HOST/OWNER/REPO` (any case; an `https://` prefix, `.git` and a trailing `/` are fine).
    pub repo: String,
    /// Branch patterns a push may update (`agent/*`, `!main`; deny wins); none: no push.
    #[serde(default)]
    pub push: Vec<String>,
    /// The stored secret holding the token; the sandbox must hold it too.
    pub token_secret: String,
}

/// One repository grant of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GitGrantInfo {
    /// Lowercase `host/owner/repo`.
    pub repo: String,
    pub push: Vec<String>,
    pub token_secret: String,
}

/// A sandbox's repository grants (`GET`, `POST`, `DELETE /v1/sandboxes/{id}/git`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GitGrantList {
    pub sandbox_id: String,
    pub grants: Vec<GitGrantInfo>,
}

// ---- Templates and garbage collection ----

/// A root filesystem a sandbox can boot (`GET /v1/templates`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Template {
    pub name: String,
    /// File in the images directory (`rootfs.ext4` for base, `template-<name>.qcow2` else).
    pub file: String,
    pub size: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// `POST /v1/gc`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// List what would be deleted; delete nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// One thing gc deletes (or would delete).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GcItem {
    /// `orphan_vm_dir`, `snapshot`, `golden`, `backup`, `image_set`.
    pub kind: String,
    pub path: String,
    /// Allocated bytes on disk.
    pub bytes: u64,
    pub reason: String,
    /// Set when the deletion failed (then the item is still there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GcReport {
    pub dry_run: bool,
    pub items: Vec<GcItem>,
    /// Bytes deleted (or that would be, for a dry run).
    pub bytes: u64,
}
// ---- Network: egress policy and ask-to-allow (docs/NETWORK-POLICY.md) ----

/// The `network` of a create request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Preset names (`registries`, `github`, `none`) and `HOST|*.SUFFIX|CIDR[:PORTS]` allow
    /// rules.
    #[serde(default)]
    pub policy: Vec<String>,
}

/// `GET /v1/sandboxes/{id}/network`: the policy in force.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetworkPolicy {
    pub sandbox_id: String,
    pub presets: Vec<String>,
    /// `allow TARGET[:PORTS]` / `deny TARGET[:PORTS]`, in order.
    pub rules: Vec<String>,
    /// What a setup command runs with on top of the rules while it runs (empty otherwise).
    #[serde(default)]
    pub setup_widening: Vec<String>,
    /// Access requests waiting for the user.
    pub pending_requests: usize,
}

/// `POST /v1/sandboxes/{id}/network/rules`: add an allow or deny rule (replaces an opposite
/// rule for the same target and ports).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NetworkRuleChange {
    /// `allow` or `deny`.
    pub verdict: String,
    /// `HOST`, `*.SUFFIX`, `IP` or `CIDR`, optionally `:PORTS`.
    pub target: String,
}

/// `POST /v1/sandboxes/{id}/network/setup`: run a command with a wider policy, then narrow it
/// back (also when the command fails or the client goes away).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NetworkSetupRequest {
    /// Shell command line (`/bin/sh -c`), e.g. `npm ci`.
    pub cmd: String,
    /// Presets and allow rules added while it runs.
    pub policy: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NetworkSetupReport {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
    /// The last 8 KiB of each stream.
    pub stdout_tail: String,
    pub stderr_tail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /v1/sandboxes/{id}/network/requests` (the agent's "ask to allow").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AccessRequestCreate {
    /// `HOST`, `*.SUFFIX`, `IP` or `CIDR`, optionally `:PORTS`.
    pub host: String,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AccessRequestState {
    Pending,
    Approved,
    Rejected,
}

/// An access request and what became of it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AccessRequest {
    /// `req_...`.
    pub id: String,
    pub sandbox_id: String,
    /// The rule it would add (`allow TARGET[:PORTS]`).
    pub rule: String,
    pub host: String,
    #[serde(default)]
    pub reason: Option<String>,
    pub state: AccessRequestState,
    pub created_at: String,
    #[serde(default)]
    pub decided_at: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AccessRequestList {
    pub requests: Vec<AccessRequest>,
}

/// The header a client sets to say which face it is (`mcp` for the MCP server). The approve
/// and reject routes refuse `mcp`: an agent's tools never decide its own requests.
pub const CLIENT_FACE_HEADER: &str = "x-tryboxi-face";

/// The error code (403) a unix-socket client gets when its uid may not use the daemon (not
/// root, not the daemon's user, not in `[api] allowed_uids`). Its message names the uid and
/// the config file; clients show it as it is.
pub const UID_NOT_ALLOWED: &str = "uid_not_allowed";
