//! The host's vCPU and memory ledger: who holds how much, a fair FIFO queue when the host is
//! full, and a clear refusal when a request can never be served.
//!
//! Owns: reservations (by sandbox id), the wait queue, the idle ranking used under memory
//! pressure ([`rank_idle`]) and the [`Pauser`] seam through which a pause feature frees memory.
//! Never: boots, pauses or kills VMs itself, or reads the store (the service feeds it).
//!
//! Rules:
//! - a request bigger than the host limit is refused at once ([`SchedError::TooBig`]);
//! - a request that fits now and has nobody queued before it is granted at once;
//! - otherwise it waits in FIFO order (a small request never overtakes a big one queued before
//!   it, so nobody starves) for at most `queue_timeout`, then fails ([`SchedError::Timeout`]),
//!   unless the only shortage left is CPU saturation: then it is admitted (slow, not refused);
//! - a full queue refuses at once ([`SchedError::QueueFull`]).
//!
//! A [`Reservation`] is an RAII guard: dropped without [`Reservation::keep`] it gives the
//! resources back (a failed create, restore or fork). Kept, they belong to the sandbox until
//! [`Ledger::release`] (rm, pause).
//!
//! Background VMs (a warm-pool VM, a golden snapshot being built) are in the ledger too, as
//! [`Holder::Pool`] / [`Holder::Golden`], but they never wait: [`Ledger::try_reserve`] grants
//! only when the request fits right now and nobody is queued, so a background VM can neither
//! wait in nor overtake the queue. A create that takes a pool VM moves its reservation to the
//! sandbox ([`Ledger::claim_pool`]: one step under the lock, no double count, no gap). A
//! request that would have to wait first evicts pool VMs (in the same step, under the lock):
//! just enough for everything queued plus itself, or all of them when even that is not
//! enough; their reservations end at once and their ids go to [`Ledger::evictions`], whose
//! reader (the service) stops those VMs. Without a reader nothing is evicted.
//!
//! Which pool VM goes first ([`State::pool_victim`]): one whose room alone is enough, the
//! smallest such (bigger ones stay for the shapes that need them), so as few as possible are
//! stopped; else the newest. Among equals the newest goes first: it may still be starting
//! (nothing ready to offer yet), while an older one is ready for the next create now; and the
//! order is stable (ids are random). The same rule serves memory pressure
//! ([`Ledger::evict_pool_memory`]).
//!
//! Room given back by [`Ledger::release`] (rm, pause, a VM's end, a failed create) is
//! announced on [`Ledger::freed`], so the service can refill the warm pool; room freed by
//! evicting pool VMs is not (it went to whoever needed it).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::usage::{HostProbe, HostReading, MemPolicy, Usage};
pub use crate::service::pressure::{Candidate, Pauser, rank_idle};
pub use state::MemView;
use state::{Held, Short, State, Waiter};

mod state;

/// Who holds a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Holder {
    /// A sandbox (creating, ready; a fork child, a restore, a resume).
    #[default]
    Sandbox,
    /// A warm-pool VM waiting to be taken by a create; may be evicted to make room.
    Pool,
    /// A VM booted to build a golden snapshot (gone once the snapshot is written).
    Golden,
}

impl Holder {
    pub fn as_str(self) -> &'static str {
        match self {
            Holder::Sandbox => "sandbox",
            Holder::Pool => "pool",
            Holder::Golden => "golden",
        }
    }
}

/// vCPUs and MiB of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resources {
    pub vcpus: u32,
    pub memory_mib: u64,
}

impl Resources {
    pub fn new(vcpus: u32, memory_mib: u64) -> Resources {
        Resources { vcpus, memory_mib }
    }
    fn plus(self, o: Resources) -> Resources {
        Resources::new(
            self.vcpus.saturating_add(o.vcpus),
            self.memory_mib.saturating_add(o.memory_mib),
        )
    }
}

/// The host's limits: the vCPU cap, the strict memory cap (if any) and the memory/CPU rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// vCPUs all VMs may hold together (`vcpu_overcommit` x CPUs, or `max_vcpus`).
    pub vcpus: u32,
    /// The host's CPU count (reported beside the ratio).
    pub host_cpus: u32,
    /// `[limits] max_memory_mib`: a cap on the configured memory of all VMs together.
    pub memory_cap: Option<u64>,
    pub mem: MemPolicy,
}

impl Policy {
    pub fn from_limits(l: &crate::config::LimitsConfig) -> Policy {
        let cpus = crate::config::host_cpus();
        Policy {
            vcpus: l.vcpu_cap(cpus),
            host_cpus: cpus,
            memory_cap: l.max_memory_mib,
            mem: MemPolicy::from_limits(l),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SchedError {
    #[error(
        "the host cannot ever fit this sandbox: it needs {need}, the host limit is {limit} \
         (config [limits] vcpu_overcommit / max_vcpus, memory_reserve_mib / max_memory_mib)"
    )]
    TooBig { need: String, limit: String },
    #[error(
        "the host is full ({host}) and {queued} requests already wait (config [limits] \
         max_queue); try again later"
    )]
    QueueFull { queued: usize, host: String },
    #[error(
        "the host stayed full for {waited_s} s ({host}; this sandbox needs {need}): remove or \
         pause a sandbox (config [limits] queue_timeout_s)"
    )]
    Timeout {
        waited_s: u64,
        need: String,
        host: String,
    },
    #[error("sandbox `{0}` already holds a reservation")]
    Duplicate(String),
}

/// A place in the queue; see [`Ledger::reserve`].
struct Queued<'a> {
    ledger: &'a Ledger,
    ticket: u64,
    id: &'a str,
    done: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let host = self.ledger.probe.read();
        let mut s = self.ledger.lock();
        let before = s.queue.len();
        s.queue.retain(|w| w.ticket != self.ticket);
        if s.queue.len() == before {
            // Not queued any more: it was granted, but nobody will keep it.
            s.give_back(self.id);
        }
        s.grant_waiters(&host);
    }
}

/// One reservation as [`Ledger::view`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldView {
    pub id: String,
    pub r: Resources,
    pub who: Holder,
    /// Measured PSS, MiB (`None`: not measured yet, or unreadable).
    pub used_mib: Option<u64>,
    /// What it counts for now (see `usage.rs`).
    pub counted_mib: u64,
}

/// What [`Ledger::view`] reports.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerView {
    pub policy: Policy,
    /// Configured vCPUs and memory of every reservation together.
    pub used: Resources,
    pub queued: usize,
    /// Requests that waited in the queue since the daemon started.
    pub waited: u64,
    /// Of those, the ones that had vCPUs and memory but met a CPU-saturated host.
    pub waited_cpu: u64,
    pub host: HostReading,
    pub mem: MemView,
    /// Every reservation, by id.
    pub held: Vec<HeldView>,
}

/// The host ledger. Cheap to share (`Arc`).
pub struct Ledger {
    state: Mutex<State>,
    /// Where the host's memory and CPU pressure are read (the real `/proc`, or a fake).
    probe: Arc<dyn HostProbe>,
    queue_timeout: Duration,
    max_queue: usize,
    activity: Mutex<HashMap<String, Activity>>,
    /// Where evicted pool VM ids go (see [`Ledger::evictions`]).
    evict_tx: Mutex<Option<tokio::sync::mpsc::UnboundedSender<String>>>,
    /// Where "room was given back" goes (see [`Ledger::freed`]).
    freed_tx: Mutex<Option<tokio::sync::mpsc::Sender<()>>>,
}

impl Ledger {
    pub fn new(
        policy: Policy,
        probe: Arc<dyn HostProbe>,
        queue_timeout: Duration,
        max_queue: usize,
    ) -> Arc<Ledger> {
        Arc::new(Ledger {
            state: Mutex::new(State {
                policy,
                used: Resources::default(),
                held: HashMap::new(),
                freeing: HashMap::new(),
                queue: VecDeque::new(),
                next_ticket: 0,
                next_seq: 0,
                waited: 0,
                waited_cpu: 0,
            }),
            probe,
            queue_timeout,
            max_queue,
            activity: Mutex::new(HashMap::new()),
            evict_tx: Mutex::new(None),
            freed_tx: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn view(&self) -> LedgerView {
        let host = self.probe.read();
        let s = self.lock();
        let p = s.policy.mem;
        let mut held: Vec<HeldView> = s
            .held
            .iter()
            .map(|(id, h)| HeldView {
                id: id.clone(),
                r: h.r,
                who: h.who,
                used_mib: h.usage.pss_mib(),
                counted_mib: p.counted(h.r.memory_mib, h.usage),
            })
            .collect();
        held.sort_by(|a, b| a.id.cmp(&b.id));
        LedgerView {
            policy: s.policy,
            used: s.used,
            queued: s.queue.len(),
            waited: s.waited,
            waited_cpu: s.waited_cpu,
            host,
            mem: s.mem_view(&host),
            held,
        }
    }

    /// Whether one VM of `one` could ever fit: its vCPUs within the vCPU cap, its memory
    /// within the strict cap (if set) and within what the host could ever give VMs (MemTotal
    /// minus the reserve).
    fn ever_fits_one(s: &State, host: &HostReading, one: Resources) -> Result<(), SchedError> {
        let p = &s.policy;
        let mem_limit = p
            .memory_cap
            .or_else(|| host.total_mib.map(|t| p.mem.usable(t)));
        if one.vcpus > p.vcpus || mem_limit.is_some_and(|m| one.memory_mib > m) {
            return Err(SchedError::TooBig {
                need: format!("{} vCPUs and {} MiB", one.vcpus, one.memory_mib),
                limit: format!(
                    "{} vCPUs and {} MiB",
                    p.vcpus,
                    mem_limit.map_or("unknown".into(), |m| m.to_string())
                ),
            });
        }
        Ok(())
    }

    /// `count` sandboxes of shape `one` could fit together once every sandbox but the ones in
    /// `staying` (which keep their reservations) is gone; else [`SchedError::TooBig`] for the
    /// whole group. Lets a fork of N refuse at once instead of queueing children that never fit.
    pub fn group_ever_fits(
        &self,
        one: Resources,
        count: u32,
        staying: &[&str],
    ) -> Result<(), SchedError> {
        let host = self.probe.read();
        let s = self.lock();
        Self::ever_fits_one(&s, &host, one)?;
        let p = &s.policy;
        let kept: Vec<&Held> = staying.iter().filter_map(|id| s.held.get(*id)).collect();
        let kept_r = kept.iter().fold(Resources::default(), |a, h| a.plus(h.r));
        let need = Resources::new(
            one.vcpus.saturating_mul(count),
            one.memory_mib.saturating_mul(u64::from(count)),
        );
        let vcpu_room = p.vcpus.saturating_sub(kept_r.vcpus);
        let cap_room = p.memory_cap.map(|c| c.saturating_sub(kept_r.memory_mib));
        let use_room = host.total_mib.map(|t| {
            let counted: u64 = kept
                .iter()
                .map(|h| p.mem.counted(h.r.memory_mib, h.usage))
                .sum();
            p.mem.usable(t).saturating_sub(counted)
        });
        let expected = p
            .mem
            .expected(one.memory_mib)
            .saturating_mul(u64::from(count));
        if need.vcpus <= vcpu_room
            && cap_room.is_none_or(|c| need.memory_mib <= c)
            && use_room.is_none_or(|u| expected <= u)
        {
            return Ok(());
        }
        let limit = match (cap_room, use_room) {
            (Some(c), _) => format!("{vcpu_room} vCPUs and {c} MiB"),
            (None, Some(u)) => format!("{vcpu_room} vCPUs and {u} MiB of expected use"),
            (None, None) => format!("{vcpu_room} vCPUs"),
        };
        Err(SchedError::TooBig {
            need: s.describe_need(need, count),
            limit,
        })
    }

    /// Reserve `need` for sandbox `id`, waiting in the FIFO queue if the host is full.
    pub async fn reserve(
        self: &Arc<Self>,
        id: &str,
        need: Resources,
    ) -> Result<Reservation, SchedError> {
        let started = Instant::now();
        let host = self.probe.read();
        let rx = {
            let mut s = self.lock();
            if s.held.contains_key(id) {
                return Err(SchedError::Duplicate(id.to_owned()));
            }
            Self::ever_fits_one(&s, &host, need)?;
            let fits = |s: &State| {
                s.queue.is_empty() && s.check(&host, &[need], Holder::Sandbox, &[]).is_ok()
            };
            if !fits(&s) {
                // It would wait: pool VMs make room first (they only hold room ahead of time).
                self.evict(&mut s, &host, need);
            }
            if fits(&s) {
                s.take(id, need, Holder::Sandbox);
                return Ok(self.guard(id));
            }
            if s.queue.len() >= self.max_queue {
                return Err(SchedError::QueueFull {
                    queued: s.queue.len(),
                    host: s.describe(&host),
                });
            }
            let (tx, rx) = oneshot::channel();
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            s.queue.push_back(Waiter {
                ticket,
                id: id.to_owned(),
                need,
                tx,
            });
            s.waited += 1;
            let short = s.check(&host, &[need], Holder::Sandbox, &[]).err();
            if short == Some(Short::Cpu) {
                s.waited_cpu += 1;
            }
            tracing::info!(sandbox = %id, queued = s.queue.len(), vcpus = need.vcpus, memory_mib = need.memory_mib, short = ?short, host = %s.describe(&host), "host full; waiting in the queue");
            (ticket, rx)
        };
        let (ticket, mut rx) = rx;
        // If this future is dropped while queued (the client went away), leave the queue, or
        // give back a grant that arrived in between.
        let mut queued = Queued {
            ledger: self,
            ticket,
            id,
            done: false,
        };
        let granted = matches!(
            tokio::time::timeout(self.queue_timeout, &mut rx).await,
            Ok(Ok(()))
        );
        queued.done = true;
        if granted {
            return Ok(self.guard(id));
        }
        let host = self.probe.read();
        let mut s = self.lock();
        // Granted just as the timer fired? Then take it.
        if rx.try_recv().is_ok() {
            drop(s);
            return Ok(self.guard(id));
        }
        s.queue.retain(|w| w.ticket != ticket);
        // A host that is only CPU saturated admits at the end of the wait: a busy CPU makes a
        // sandbox slow, not the host fail (memory and vCPU shortages still refuse).
        if s.check(&host, &[need], Holder::Sandbox, &[]) == Err(Short::Cpu) {
            s.take(id, need, Holder::Sandbox);
            tracing::warn!(sandbox = %id, waited_s = started.elapsed().as_secs(), host = %s.describe(&host),
                "CPU still saturated after the queue wait; admitting anyway");
            drop(s);
            return Ok(self.guard(id));
        }
        // Our leaving may unblock the ones behind us.
        s.grant_waiters(&host);
        Err(SchedError::Timeout {
            waited_s: started.elapsed().as_secs(),
            need: s.describe_need(need, 1),
            host: s.describe(&host),
        })
    }

    fn guard(self: &Arc<Self>, id: &str) -> Reservation {
        self.touch(id);
        Reservation {
            ledger: self.clone(),
            id: id.to_owned(),
            kept: false,
        }
    }

    /// Evicted pool VM ids, from now on (one reader: a second call replaces the first). The
    /// reader must stop each VM; its reservation has already ended.
    pub fn evictions(&self) -> tokio::sync::mpsc::UnboundedReceiver<String> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        *self.evict_tx.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        rx
    }

    /// A message (coalesced: at most one pending) each time [`Ledger::release`] gives room
    /// back, from now on (one reader: a second call replaces the first). The service refills
    /// the warm pool on it.
    pub fn freed(&self) -> tokio::sync::mpsc::Receiver<()> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        *self.freed_tx.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        rx
    }

    fn evict(&self, s: &mut State, host: &HostReading, need: Resources) {
        let tx = self.evict_tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref().filter(|t| !t.is_closed()) else {
            return;
        };
        let ids = s.evict_pool_for(host, need);
        if ids.is_empty() {
            return;
        }
        // Freed room goes to the queue first (FIFO), then to this request.
        s.grant_waiters(host);
        for id in ids {
            tracing::info!(pool_vm = %id, vcpus = need.vcpus, memory_mib = need.memory_mib, "evicting a warm-pool VM to make room");
            let _ = tx.send(id);
        }
    }

    /// Host memory pressure: evict pool VMs (in [`State::pool_victim`] order) until at least
    /// `want_mib` of their memory (measured use, else size) is freed or none is left; returns
    /// the MiB freed. They go before any sandbox is paused. Nothing without a reader of
    /// [`Ledger::evictions`].
    pub fn evict_pool_memory(&self, want_mib: u64) -> u64 {
        let host = self.probe.read();
        let mut s = self.lock();
        let tx = self.evict_tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref().filter(|t| !t.is_closed()) else {
            return 0;
        };
        let mut freed = 0;
        while freed < want_mib {
            let short = want_mib - freed;
            let Some(id) = s.pool_victim(|_, h| State::frees_mib(h) >= short) else {
                break;
            };
            let mib = s.evict_one(&id).map_or(0, |h| State::frees_mib(&h));
            freed += mib;
            tracing::info!(pool_vm = %id, memory_mib = mib, "evicting a warm-pool VM: host memory pressure");
            let _ = tx.send(id);
        }
        s.grant_waiters(&host);
        freed
    }

    /// Who holds `id`'s reservation, if anyone.
    pub fn holder(&self, id: &str) -> Option<Holder> {
        self.lock().held.get(id).map(|h| h.who)
    }

    /// Reserve `need` for a background VM only if it fits right now (counting every VM, and
    /// not while the host is CPU saturated) and nobody waits in the queue; never queues.
    /// `None`: the host has no room to spare (the caller skips the VM).
    pub fn try_reserve(
        self: &Arc<Self>,
        id: &str,
        need: Resources,
        who: Holder,
    ) -> Option<Reservation> {
        let host = self.probe.read();
        let mut s = self.lock();
        if s.held.contains_key(id)
            || !s.queue.is_empty()
            || s.check(&host, &[need], who, &[]).is_err()
        {
            return None;
        }
        s.take(id, need, who);
        drop(s);
        Some(Reservation {
            ledger: self.clone(),
            id: id.to_owned(),
            kept: false,
        })
    }

    /// A create takes pool VM `pool_id` as sandbox `sandbox_id` (the same id when the sandbox
    /// keeps the pool VM's id): its reservation moves over in one step (no double count, no
    /// moment where the VM is not counted). `None` (nothing changed) if `pool_id` holds no pool
    /// reservation or `sandbox_id` already holds one of its own.
    pub fn claim_pool(&self, pool_id: &str, sandbox_id: &str) -> Option<Resources> {
        let mut s = self.lock();
        match s.held.get(pool_id) {
            Some(h) if h.who == Holder::Pool => {}
            _ => return None,
        }
        if pool_id != sandbox_id && s.held.contains_key(sandbox_id) {
            return None;
        }
        let mut h = s.held.remove(pool_id)?;
        h.who = Holder::Sandbox;
        let r = h.r;
        s.held.insert(sandbox_id.to_owned(), h);
        drop(s);
        self.touch(sandbox_id);
        Some(r)
    }

    /// Record each VM's measured use (the sampler, `usage.rs`); ids that hold nothing are
    /// ignored. Then serve the queue: the host may have room now.
    pub fn record_usage(&self, samples: &[(String, Usage)]) {
        let host = self.probe.read();
        let mut s = self.lock();
        for (id, u) in samples {
            if let Some(h) = s.held.get_mut(id) {
                h.usage = *u;
            }
        }
        s.grant_waiters(&host);
    }

    /// Someone waits in the queue (a background VM that just started should give way).
    pub fn has_waiters(&self) -> bool {
        !self.lock().queue.is_empty()
    }

    /// Whether sandbox `id` holds a reservation.
    pub fn holds(&self, id: &str) -> bool {
        self.lock().held.contains_key(id)
    }

    /// Give back what `id` holds (rm, pause, failure, an evicted pool VM now stopped), wake
    /// the queue and tell the reader of [`Ledger::freed`]. Unknown ids are fine.
    pub fn release(&self, id: &str) -> Option<Resources> {
        // The VM is gone by now (callers stop it first): the reading shows what it freed.
        let host = self.probe.read();
        let r = {
            let mut s = self.lock();
            let r = s.give_back(id).map(|h| h.r);
            s.freeing.remove(id);
            s.grant_waiters(&host);
            r
        };
        if r.is_some() {
            self.activity
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
            if let Some(tx) = &*self.freed_tx.lock().unwrap_or_else(|p| p.into_inner()) {
                // Full: a message is pending already, and one is as good as two.
                let _ = tx.try_send(());
            }
        }
        r
    }

    /// Record what a sandbox found after a daemon restart holds, even past the limit (it runs
    /// already; the limit then only holds back new sandboxes).
    pub fn adopt(&self, id: &str, r: Resources) {
        let mut s = self.lock();
        if s.held.contains_key(id) {
            return;
        }
        s.take(id, r, Holder::Sandbox);
        if s.used.vcpus > s.policy.vcpus
            || s.policy.memory_cap.is_some_and(|c| s.used.memory_mib > c)
        {
            tracing::warn!(sandbox = %id, used_vcpus = s.used.vcpus, used_mib = s.used.memory_mib, "recovered sandboxes hold more than the host limit");
        }
        drop(s);
        self.touch(id);
    }

    /// The sandbox did something (exec started or finished): it is not idle.
    pub fn touch(&self, id: &str) {
        let mut a = self.activity.lock().unwrap_or_else(|p| p.into_inner());
        a.entry(id.to_owned()).or_default().last = Some(Instant::now());
    }

    /// An exec started (`+1`) or finished (`-1`) in the sandbox.
    pub fn busy(&self, id: &str, delta: i32) {
        let mut a = self.activity.lock().unwrap_or_else(|p| p.into_inner());
        let e = a.entry(id.to_owned()).or_default();
        e.running = (e.running as i64 + delta as i64).max(0) as u32;
        e.last = Some(Instant::now());
    }

    /// Candidates for pausing under memory pressure, idlest first (see [`rank_idle`]); each
    /// with what pausing it frees (its measured use, else its size).
    pub fn idle_candidates(&self) -> Vec<Candidate> {
        // Only sandboxes can be paused; background VMs are not the Pauser's to touch.
        let held: Vec<(String, u64)> = self
            .lock()
            .held
            .iter()
            .filter(|(_, h)| h.who == Holder::Sandbox)
            .map(|(id, h)| (id.clone(), State::frees_mib(h)))
            .collect();
        let a = self.activity.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let c: Vec<Candidate> = held
            .into_iter()
            .map(|(id, memory_mib)| {
                let act = a.get(&id).cloned().unwrap_or_default();
                Candidate {
                    idle: act.last.map(|t| now - t).unwrap_or(Duration::MAX),
                    running_execs: act.running,
                    memory_mib,
                    id,
                }
            })
            .collect();
        rank_idle(c)
    }
}

#[derive(Debug, Clone, Default)]
struct Activity {
    last: Option<Instant>,
    running: u32,
}

/// RAII reservation: released on drop unless [`Reservation::keep`] hands it to the sandbox.
#[must_use = "a reservation is released when dropped"]
pub struct Reservation {
    ledger: Arc<Ledger>,
    id: String,
    kept: bool,
}

impl Reservation {
    /// The sandbox now owns the resources until [`Ledger::release`].
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.kept {
            self.ledger.release(&self.id);
        }
    }
}

/// A host whose memory and CPU pressure are unknown (nothing is checked by use).
#[cfg(test)]
struct UnknownHost;

#[cfg(test)]
impl HostProbe for UnknownHost {
    fn read(&self) -> HostReading {
        HostReading::default()
    }
}

#[cfg(test)]
impl Ledger {
    /// The old strict ledger, for other modules' tests: exactly `cap` (vCPUs and configured
    /// memory), the host unknown.
    pub fn strict_for_tests(
        cap: Resources,
        queue_timeout: Duration,
        max_queue: usize,
    ) -> Arc<Ledger> {
        let policy = Policy {
            vcpus: cap.vcpus,
            host_cpus: cap.vcpus,
            memory_cap: Some(cap.memory_mib),
            mem: MemPolicy {
                reserve_mib: 0,
                headroom_mib: 0,
                new_vm_mib: u64::MAX,
                cpu_psi_limit: 0.0,
            },
        };
        Ledger::new(policy, Arc::new(UnknownHost), queue_timeout, max_queue)
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
