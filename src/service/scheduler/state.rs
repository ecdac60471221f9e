//! The ledger's state and its rules: what the reservations hold, whether a request fits now
//! (vCPUs, the strict memory cap, memory by use, CPU pressure), which pool VM to evict, and
//! how the host is described in errors. Pure: the host reading comes in as an argument.

use std::collections::{HashMap, VecDeque};

use tokio::sync::oneshot;

use super::{Holder, Policy, Resources};
use crate::service::usage::{HostReading, Usage};

/// Why a request does not fit right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Short {
    Vcpus,
    MemoryCap,
    Memory,
    Cpu,
}

pub(super) struct Waiter {
    pub(super) ticket: u64,
    pub(super) id: String,
    pub(super) need: Resources,
    pub(super) tx: oneshot::Sender<()>,
}

/// One reservation.
pub(super) struct Held {
    pub(super) r: Resources,
    pub(super) who: Holder,
    /// Sequence number: larger is newer.
    pub(super) seq: u64,
    pub(super) usage: Usage,
}

pub(super) struct State {
    pub(super) policy: Policy,
    /// Configured vCPUs and memory of every reservation together.
    pub(super) used: Resources,
    pub(super) held: HashMap<String, Held>,
    /// Evicted pool VMs not stopped yet: the memory they pin, freed once they are gone
    /// (their [`super::Ledger::release`]).
    pub(super) freeing: HashMap<String, u64>,
    pub(super) queue: VecDeque<Waiter>,
    pub(super) next_ticket: u64,
    pub(super) next_seq: u64,
    /// Requests that waited in the queue since the daemon started.
    pub(super) waited: u64,
    /// Of those, the ones that had vCPUs and memory but met a CPU-saturated host.
    pub(super) waited_cpu: u64,
}

/// What the memory rules make of the ledger and one host reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemView {
    /// Sum of the measured VMs' PSS.
    pub used_mib: u64,
    /// Sum of what every VM counts for (PSS + headroom, at most its size; estimates).
    pub counted_mib: u64,
    /// Room for new VMs now (`None`: MemAvailable unknown, memory is not checked by use).
    pub room_mib: Option<u64>,
}

impl State {
    /// Whether `who`'s request counts reservation `h`: a sandbox never waits for a background
    /// VM (a pool VM is evicted instead; a golden build is not counted against it).
    pub(super) fn counts(h: &Held, who: Holder) -> bool {
        !(who == Holder::Sandbox && h.who == Holder::Golden)
    }

    /// Room for new VMs of `who` with the reservations in `gone` treated as stopped.
    pub(super) fn room(&self, host: &HostReading, who: Holder, gone: &[&str]) -> Option<u64> {
        let avail = host.available_mib?;
        let p = &self.policy.mem;
        let (mut outstanding, mut credit) = (0u64, self.freeing.values().sum::<u64>());
        for (id, h) in &self.held {
            if gone.contains(&id.as_str()) || !Self::counts(h, who) {
                // It goes (or does not count): what it pins comes back.
                credit += match h.usage {
                    Usage::Measured(m) => m.pinned_mib,
                    _ => 0,
                };
                continue;
            }
            outstanding += p.outstanding(h.r.memory_mib, h.usage);
        }
        Some(p.room(avail, outstanding, credit))
    }

    /// Whether `needs` (new VMs of `who`) all fit now, with the reservations in `gone` treated
    /// as stopped; else the first reason they do not.
    pub(super) fn check(
        &self,
        host: &HostReading,
        needs: &[Resources],
        who: Holder,
        gone: &[&str],
    ) -> Result<(), Short> {
        let want = needs.iter().fold(Resources::default(), |a, n| a.plus(*n));
        let held = self
            .held
            .iter()
            .filter(|(id, h)| !gone.contains(&id.as_str()) && Self::counts(h, who))
            .fold(Resources::default(), |a, (_, h)| a.plus(h.r));
        if held.vcpus.saturating_add(want.vcpus) > self.policy.vcpus {
            return Err(Short::Vcpus);
        }
        if let Some(cap) = self.policy.memory_cap
            && held.memory_mib.saturating_add(want.memory_mib) > cap
        {
            return Err(Short::MemoryCap);
        }
        if let Some(room) = self.room(host, who, gone) {
            let expected: u64 = needs
                .iter()
                .map(|n| self.policy.mem.expected(n.memory_mib))
                .sum();
            if expected > room {
                return Err(Short::Memory);
            }
        }
        if self.policy.mem.cpu_saturated(host.cpu_some_avg60) {
            return Err(Short::Cpu);
        }
        Ok(())
    }

    pub(super) fn mem_view(&self, host: &HostReading) -> MemView {
        let p = &self.policy.mem;
        MemView {
            used_mib: self.held.values().filter_map(|h| h.usage.pss_mib()).sum(),
            counted_mib: self
                .held
                .values()
                .map(|h| p.counted(h.r.memory_mib, h.usage))
                .sum(),
            room_mib: self.room(host, Holder::Sandbox, &[]),
        }
    }

    /// The host in words, for error messages: the vCPUs, the memory and, when saturated, the
    /// CPU pressure.
    pub(super) fn describe(&self, host: &HostReading) -> String {
        let p = &self.policy;
        let mut out = format!("{}/{} vCPUs", self.used.vcpus, p.vcpus);
        if p.host_cpus > 0 && p.vcpus > p.host_cpus {
            out.push_str(&format!(
                " ({:.0}x the {} host CPUs)",
                f64::from(p.vcpus) / f64::from(p.host_cpus),
                p.host_cpus
            ));
        }
        match p.memory_cap {
            Some(cap) => out.push_str(&format!(", {}/{cap} MiB reserved", self.used.memory_mib)),
            None => out.push_str(&format!(", {} MiB configured", self.used.memory_mib)),
        }
        let m = self.mem_view(host);
        if let (Some(room), Some(avail)) = (m.room_mib, host.available_mib) {
            out.push_str(&format!(
                "; memory: {room} MiB room = {avail} MiB available - {} MiB reserve - what running \
                 VMs may still grow into ({} MiB used, {} MiB counted)",
                p.mem.reserve_mib, m.used_mib, m.counted_mib
            ));
        }
        if p.mem.cpu_saturated(host.cpu_some_avg60) {
            out.push_str(&format!(
                "; CPU saturated: PSI some avg60 {:.0}% >= {:.0}%",
                host.cpu_some_avg60.unwrap_or(0.0),
                p.mem.cpu_psi_limit
            ));
        }
        out
    }

    /// `need` in words: its vCPUs, its size and what it is expected to use at first.
    pub(super) fn describe_need(&self, need: Resources, count: u32) -> String {
        let each = if count > 1 {
            format!(" ({count} x {} vCPUs)", need.vcpus / count.max(1))
        } else {
            String::new()
        };
        let mut out = format!("{} vCPUs{each} and {} MiB", need.vcpus, need.memory_mib);
        if self.policy.memory_cap.is_none() {
            let expected = self
                .policy
                .mem
                .expected(need.memory_mib / u64::from(count.max(1)))
                * u64::from(count.max(1));
            out.push_str(&format!(" ({expected} MiB expected at start)"));
        }
        out
    }

    pub(super) fn take(&mut self, id: &str, r: Resources, who: Holder) {
        self.used = self.used.plus(r);
        self.freeing.remove(id);
        self.held.insert(
            id.to_owned(),
            Held {
                r,
                who,
                seq: self.next_seq,
                usage: Usage::Pending,
            },
        );
        self.next_seq += 1;
    }
    pub(super) fn give_back(&mut self, id: &str) -> Option<Held> {
        let h = self.held.remove(id)?;
        self.used.vcpus = self.used.vcpus.saturating_sub(h.r.vcpus);
        self.used.memory_mib = self.used.memory_mib.saturating_sub(h.r.memory_mib);
        Some(h)
    }
    /// What freeing `h` frees at most, in MiB: its measured use, else its size.
    pub(super) fn frees_mib(h: &Held) -> u64 {
        h.usage
            .pss_mib()
            .unwrap_or(h.r.memory_mib)
            .min(h.r.memory_mib)
    }
    /// The pool reservation to end next: the smallest one for which `enough` holds (its room
    /// alone does), the newest among equals; else the newest. `None`: no pool VM left.
    pub(super) fn pool_victim(&self, enough: impl Fn(&str, &Held) -> bool) -> Option<String> {
        let pool = || self.held.iter().filter(|(_, h)| h.who == Holder::Pool);
        pool()
            .filter(|(id, h)| enough(id, h))
            .min_by_key(|(_, h)| (h.r.memory_mib, h.r.vcpus, std::cmp::Reverse(h.seq)))
            .or_else(|| pool().max_by_key(|(_, h)| h.seq))
            .map(|(id, _)| id.clone())
    }
    /// End a pool reservation now; the VM still runs until the service stops it, so what it
    /// pins is credited ([`State::freeing`]) until its release.
    pub(super) fn evict_one(&mut self, id: &str) -> Option<Held> {
        let h = self.give_back(id)?;
        if let Usage::Measured(m) = h.usage {
            self.freeing.insert(id.to_owned(), m.pinned_mib);
        }
        Some(h)
    }
    /// Pool reservations to end so that everything queued plus `need` fits (all of them when
    /// even that is not enough), in [`State::pool_victim`] order. Not for CPU pressure (an
    /// idle pool VM uses no CPU). Releases them.
    pub(super) fn evict_pool_for(&mut self, host: &HostReading, need: Resources) -> Vec<String> {
        let mut want: Vec<Resources> = self.queue.iter().map(|w| w.need).collect();
        want.push(need);
        let mut out = Vec::new();
        while let Err(short) = self.check(host, &want, Holder::Sandbox, &[]) {
            if short == Short::Cpu {
                break;
            }
            // Enough: it fits without this one, or would but for CPU pressure.
            let Some(id) = self.pool_victim(|id, _| {
                matches!(
                    self.check(host, &want, Holder::Sandbox, &[id]),
                    Ok(()) | Err(Short::Cpu)
                )
            }) else {
                break;
            };
            self.evict_one(&id);
            out.push(id);
        }
        out
    }
    /// Grant queued requests from the head while the head fits (strict FIFO).
    pub(super) fn grant_waiters(&mut self, host: &HostReading) {
        while let Some(w) = self.queue.front() {
            if self.check(host, &[w.need], Holder::Sandbox, &[]).is_err() {
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
