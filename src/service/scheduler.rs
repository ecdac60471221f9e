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
//!   it, so nobody starves) for at most `queue_timeout`, then fails ([`SchedError::Timeout`]);
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
    fn fits_in(&self, free: Resources) -> bool {
        self.vcpus <= free.vcpus && self.memory_mib <= free.memory_mib
    }
    fn plus(self, o: Resources) -> Resources {
        Resources::new(
            self.vcpus.saturating_add(o.vcpus),
            self.memory_mib.saturating_add(o.memory_mib),
        )
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SchedError {
    #[error(
        "the host cannot ever fit this sandbox: it needs {need_vcpus} vCPUs and {need_mib} MiB, \
         the host limit is {cap_vcpus} vCPUs and {cap_mib} MiB (config [limits] max_vcpus / max_memory_mib)"
    )]
    TooBig {
        need_vcpus: u32,
        need_mib: u64,
        cap_vcpus: u32,
        cap_mib: u64,
    },
    #[error(
        "the host is full ({used_vcpus}/{cap_vcpus} vCPUs, {used_mib}/{cap_mib} MiB reserved) and \
         {queued} requests already wait (config [limits] max_queue); try again later"
    )]
    QueueFull {
        queued: usize,
        used_vcpus: u32,
        cap_vcpus: u32,
        used_mib: u64,
        cap_mib: u64,
    },
    #[error(
        "the host stayed full for {waited_s} s ({used_vcpus}/{cap_vcpus} vCPUs, {used_mib}/{cap_mib} MiB \
         reserved; this sandbox needs {need_vcpus} vCPUs and {need_mib} MiB): remove or pause a sandbox \
         (config [limits] queue_timeout_s)"
    )]
    Timeout {
        waited_s: u64,
        need_vcpus: u32,
        need_mib: u64,
        used_vcpus: u32,
        cap_vcpus: u32,
        used_mib: u64,
        cap_mib: u64,
    },
    #[error("sandbox `{0}` already holds a reservation")]
    Duplicate(String),
}

struct Waiter {
    ticket: u64,
    id: String,
    need: Resources,
    tx: oneshot::Sender<()>,
}

struct State {
    cap: Resources,
    used: Resources,
    /// Reservations by id: what, who, and when (a sequence number: larger is newer).
    held: HashMap<String, (Resources, Holder, u64)>,
    queue: VecDeque<Waiter>,
    next_ticket: u64,
    next_seq: u64,
}

impl State {
    fn free(&self) -> Resources {
        Resources {
            vcpus: self.cap.vcpus.saturating_sub(self.used.vcpus),
            memory_mib: self.cap.memory_mib.saturating_sub(self.used.memory_mib),
        }
    }
    fn take(&mut self, id: &str, r: Resources, who: Holder) {
        self.used.vcpus += r.vcpus;
        self.used.memory_mib += r.memory_mib;
        self.held.insert(id.to_owned(), (r, who, self.next_seq));
        self.next_seq += 1;
    }
    fn give_back(&mut self, id: &str) -> Option<Resources> {
        let (r, _, _) = self.held.remove(id)?;
        self.used.vcpus = self.used.vcpus.saturating_sub(r.vcpus);
        self.used.memory_mib = self.used.memory_mib.saturating_sub(r.memory_mib);
        Some(r)
    }
    /// The pool reservation to end next: the smallest one for which `enough` holds (its room
    /// alone does), the newest among equals; else the newest. `None`: no pool VM left.
    fn pool_victim(&self, enough: impl Fn(Resources) -> bool) -> Option<String> {
        let pool = || {
            self.held
                .iter()
                .filter(|(_, (_, who, _))| *who == Holder::Pool)
        };
        pool()
            .filter(|(_, (r, _, _))| enough(*r))
            .min_by_key(|(_, (r, _, seq))| (r.memory_mib, r.vcpus, std::cmp::Reverse(*seq)))
            .or_else(|| pool().max_by_key(|(_, (_, _, seq))| *seq))
            .map(|(id, _)| id.clone())
    }
    /// Pool reservations to end so that everything queued plus `need` fits (all of them when
    /// even that is not enough), in [`State::pool_victim`] order. Releases them.
    fn evict_pool_for(&mut self, need: Resources) -> Vec<String> {
        let want = self.queue.iter().fold(need, |a, w| a.plus(w.need));
        let mut out = Vec::new();
        while !want.fits_in(self.free()) {
            let free = self.free();
            let Some(id) = self.pool_victim(|r| want.fits_in(free.plus(r))) else {
                break;
            };
            self.give_back(&id);
            out.push(id);
        }
        out
    }
    /// Grant queued requests from the head while the head fits (strict FIFO).
    fn grant_waiters(&mut self) {
        while let Some(w) = self.queue.front() {
            if !w.need.fits_in(self.free()) {
                break;
            }
            let w = self.queue.pop_front().expect("front exists");
            self.take(&w.id, w.need, Holder::Sandbox);
            if w.tx.send(()).is_err() {
                // The waiter gave up between its timeout and now: undo.
                self.give_back(&w.id);
            }
        }
    }
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
        let mut s = self.ledger.lock();
        let before = s.queue.len();
        s.queue.retain(|w| w.ticket != self.ticket);
        if s.queue.len() == before {
            // Not queued any more: it was granted, but nobody will keep it.
            s.give_back(self.id);
        }
        s.grant_waiters();
    }
}

/// What [`Ledger::view`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerView {
    pub cap: Resources,
    pub used: Resources,
    pub queued: usize,
    /// Every reservation, by id.
    pub held: Vec<(String, Resources, Holder)>,
}

/// The host ledger. Cheap to share (`Arc`).
pub struct Ledger {
    state: Mutex<State>,
    queue_timeout: Duration,
    max_queue: usize,
    activity: Mutex<HashMap<String, Activity>>,
    /// Where evicted pool VM ids go (see [`Ledger::evictions`]).
    evict_tx: Mutex<Option<tokio::sync::mpsc::UnboundedSender<String>>>,
    /// Where "room was given back" goes (see [`Ledger::freed`]).
    freed_tx: Mutex<Option<tokio::sync::mpsc::Sender<()>>>,
}

impl Ledger {
    pub fn new(cap: Resources, queue_timeout: Duration, max_queue: usize) -> Arc<Ledger> {
        Arc::new(Ledger {
            state: Mutex::new(State {
                cap,
                used: Resources::default(),
                held: HashMap::new(),
                queue: VecDeque::new(),
                next_ticket: 0,
                next_seq: 0,
            }),
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
        let s = self.lock();
        let mut held: Vec<_> = s.held.iter().map(|(k, v)| (k.clone(), v.0, v.1)).collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        LedgerView {
            cap: s.cap,
            used: s.used,
            queued: s.queue.len(),
            held,
        }
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
        let s = self.lock();
        let kept = staying
            .iter()
            .filter_map(|id| s.held.get(*id))
            .fold(Resources::default(), |a, (r, ..)| a.plus(*r));
        let need = Resources::new(
            one.vcpus.saturating_mul(count),
            one.memory_mib.saturating_mul(u64::from(count)),
        );
        let room = Resources::new(
            s.cap.vcpus.saturating_sub(kept.vcpus),
            s.cap.memory_mib.saturating_sub(kept.memory_mib),
        );
        if need.fits_in(room) {
            Ok(())
        } else {
            Err(SchedError::TooBig {
                need_vcpus: need.vcpus,
                need_mib: need.memory_mib,
                cap_vcpus: room.vcpus,
                cap_mib: room.memory_mib,
            })
        }
    }

    /// Reserve `need` for sandbox `id`, waiting in the FIFO queue if the host is full.
    pub async fn reserve(
        self: &Arc<Self>,
        id: &str,
        need: Resources,
    ) -> Result<Reservation, SchedError> {
        let started = Instant::now();
        let rx = {
            let mut s = self.lock();
            if s.held.contains_key(id) {
                return Err(SchedError::Duplicate(id.to_owned()));
            }
            if !need.fits_in(s.cap) {
                return Err(SchedError::TooBig {
                    need_vcpus: need.vcpus,
                    need_mib: need.memory_mib,
                    cap_vcpus: s.cap.vcpus,
                    cap_mib: s.cap.memory_mib,
                });
            }
            if !(s.queue.is_empty() && need.fits_in(s.free())) {
                // It would wait: pool VMs make room first (they only hold room ahead of time).
                self.evict(&mut s, need);
            }
            if s.queue.is_empty() && need.fits_in(s.free()) {
                s.take(id, need, Holder::Sandbox);
                return Ok(self.guard(id));
            }
            if s.queue.len() >= self.max_queue {
                return Err(SchedError::QueueFull {
                    queued: s.queue.len(),
                    used_vcpus: s.used.vcpus,
                    cap_vcpus: s.cap.vcpus,
                    used_mib: s.used.memory_mib,
                    cap_mib: s.cap.memory_mib,
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
            tracing::info!(sandbox = %id, queued = s.queue.len(), vcpus = need.vcpus, memory_mib = need.memory_mib, "host full; waiting in the queue");
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
        let mut s = self.lock();
        // Granted just as the timer fired? Then take it.
        if rx.try_recv().is_ok() {
            drop(s);
            return Ok(self.guard(id));
        }
        s.queue.retain(|w| w.ticket != ticket);
        // Our leaving may unblock the ones behind us.
        s.grant_waiters();
        Err(SchedError::Timeout {
            waited_s: started.elapsed().as_secs(),
            need_vcpus: need.vcpus,
            need_mib: need.memory_mib,
            used_vcpus: s.used.vcpus,
            cap_vcpus: s.cap.vcpus,
            used_mib: s.used.memory_mib,
            cap_mib: s.cap.memory_mib,
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

    fn evict(&self, s: &mut State, need: Resources) {
        let tx = self.evict_tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref().filter(|t| !t.is_closed()) else {
            return;
        };
        let ids = s.evict_pool_for(need);
        if ids.is_empty() {
            return;
        }
        // Freed room goes to the queue first (FIFO), then to this request.
        s.grant_waiters();
        for id in ids {
            tracing::info!(pool_vm = %id, vcpus = need.vcpus, memory_mib = need.memory_mib, "evicting a warm-pool VM to make room");
            let _ = tx.send(id);
        }
    }

    /// Host memory pressure: evict pool VMs (in [`State::pool_victim`] order) until at least
    /// `want_mib` of their memory is freed or none is left; returns the MiB freed. They go
    /// before any sandbox is paused. Nothing without a reader of [`Ledger::evictions`].
    pub fn evict_pool_memory(&self, want_mib: u64) -> u64 {
        let mut s = self.lock();
        let tx = self.evict_tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref().filter(|t| !t.is_closed()) else {
            return 0;
        };
        let mut freed = 0;
        while freed < want_mib {
            let short = want_mib - freed;
            let Some(id) = s.pool_victim(|r| r.memory_mib >= short) else {
                break;
            };
            let mib = s.give_back(&id).map_or(0, |r| r.memory_mib);
            freed += mib;
            tracing::info!(pool_vm = %id, memory_mib = mib, "evicting a warm-pool VM: host memory pressure");
            let _ = tx.send(id);
        }
        s.grant_waiters();
        freed
    }

    /// Who holds `id`'s reservation, if anyone.
    pub fn holder(&self, id: &str) -> Option<Holder> {
        self.lock().held.get(id).map(|(_, who, _)| *who)
    }

    /// Reserve `need` for a background VM only if it fits right now and nobody waits in the
    /// queue; never queues. `None`: the host has no room to spare (the caller skips the VM).
    pub fn try_reserve(
        self: &Arc<Self>,
        id: &str,
        need: Resources,
        who: Holder,
    ) -> Option<Reservation> {
        let mut s = self.lock();
        if s.held.contains_key(id) || !s.queue.is_empty() || !need.fits_in(s.free()) {
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
            Some((_, Holder::Pool, _)) => {}
            _ => return None,
        }
        if pool_id != sandbox_id && s.held.contains_key(sandbox_id) {
            return None;
        }
        let (r, _, seq) = s.held.remove(pool_id)?;
        s.held
            .insert(sandbox_id.to_owned(), (r, Holder::Sandbox, seq));
        drop(s);
        self.touch(sandbox_id);
        Some(r)
    }

    /// Someone waits in the queue (a background VM that just started should give way).
    pub fn has_waiters(&self) -> bool {
        !self.lock().queue.is_empty()
    }

    /// Whether sandbox `id` holds a reservation.
    pub fn holds(&self, id: &str) -> bool {
        self.lock().held.contains_key(id)
    }

    /// Give back what `id` holds (rm, pause, failure), wake the queue and tell the reader of
    /// [`Ledger::freed`]. Unknown ids are fine.
    pub fn release(&self, id: &str) -> Option<Resources> {
        let r = {
            let mut s = self.lock();
            let r = s.give_back(id);
            s.grant_waiters();
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
        if s.used.vcpus > s.cap.vcpus || s.used.memory_mib > s.cap.memory_mib {
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

    /// Candidates for pausing under memory pressure, idlest first (see [`rank_idle`]).
    pub fn idle_candidates(&self) -> Vec<Candidate> {
        // Only sandboxes can be paused; background VMs are not the Pauser's to touch.
        let held: Vec<(String, Resources)> = self
            .lock()
            .held
            .iter()
            .filter(|(_, (_, who, _))| *who == Holder::Sandbox)
            .map(|(id, (r, ..))| (id.clone(), *r))
            .collect();
        let a = self.activity.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let c: Vec<Candidate> = held
            .into_iter()
            .map(|(id, r)| {
                let act = a.get(&id).cloned().unwrap_or_default();
                Candidate {
                    idle: act.last.map(|t| now - t).unwrap_or(Duration::MAX),
                    running_execs: act.running,
                    memory_mib: r.memory_mib,
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

/// A sandbox that memory pressure could pause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    pub idle: Duration,
    pub running_execs: u32,
    pub memory_mib: u64,
}

/// Idlest first: sandboxes running a command are never candidates; then the longest idle; on a
/// tie the bigger one (pausing it frees more); then by id so the order is stable.
pub fn rank_idle(mut c: Vec<Candidate>) -> Vec<Candidate> {
    c.retain(|c| c.running_execs == 0);
    c.sort_by(|a, b| {
        b.idle
            .cmp(&a.idle)
            .then(b.memory_mib.cmp(&a.memory_mib))
            .then(a.id.cmp(&b.id))
    });
    c
}

/// Which candidates to pause to free at least `want_mib`, idlest first.
pub fn pick_to_free(ranked: &[Candidate], want_mib: u64, min_idle: Duration) -> Vec<String> {
    let mut freed = 0;
    let mut out = Vec::new();
    for c in ranked {
        if freed >= want_mib {
            break;
        }
        if c.idle < min_idle {
            continue;
        }
        freed += c.memory_mib;
        out.push(c.id.clone());
    }
    out
}

/// Pauses a sandbox to free host memory (`service::ServicePauser`: pause to disk).
#[async_trait::async_trait]
pub trait Pauser: Send + Sync {
    /// Pause `id`; on success its reservation must have been released.
    async fn pause(&self, id: &str) -> Result<(), String>;
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
