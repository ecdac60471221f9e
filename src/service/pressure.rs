//! Host memory pressure: a background task that reads PSI (`/proc/pressure/memory`) and
//! `MemAvailable`, and before the host swaps evicts warm-pool VMs (through the ledger), then
//! asks the [`Pauser`] to pause the idlest sandboxes for the rest.
//!
//! Owns: parsing the two proc files, the decision "under pressure?" and how much to free.
//! Never: pauses anything itself (the `Pauser` does), or acts on sandboxes running a command.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Service;
#[cfg(test)]
use super::scheduler::{Ledger, Resources};
use crate::config::LimitsConfig;

/// `some avg10` of `/proc/pressure/memory` (percent of time some task stalled on memory).
pub fn parse_psi_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))
        .and_then(|v| v.parse().ok())
}

/// A `/proc/meminfo` field in MiB (e.g. `MemAvailable`, `MemTotal`).
pub fn parse_meminfo_mib(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.split(':').next() == Some(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb / 1024)
}

/// One reading of the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub psi_some_avg10: Option<f64>,
    pub available_mib: Option<u64>,
}

impl Reading {
    pub fn now() -> Reading {
        Reading {
            psi_some_avg10: std::fs::read_to_string("/proc/pressure/memory")
                .ok()
                .and_then(|t| parse_psi_some_avg10(&t)),
            available_mib: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|t| parse_meminfo_mib(&t, "MemAvailable")),
        }
    }
}

/// How many MiB to free, or `None` when the host is fine. Pressure means PSI above its
/// threshold or `MemAvailable` below its floor; then free enough to get back above the floor
/// (at least one sandbox's worth, `min_free_mib`).
pub fn want_to_free(r: Reading, l: &LimitsConfig) -> Option<u64> {
    let psi = r
        .psi_some_avg10
        .is_some_and(|p| l.pressure_psi_avg10 > 0.0 && p >= l.pressure_psi_avg10);
    let low = r
        .available_mib
        .is_some_and(|a| a < l.pressure_min_available_mib);
    if !(psi || low) {
        return None;
    }
    let short = r
        .available_mib
        .map(|a| l.pressure_min_available_mib.saturating_sub(a))
        .unwrap_or(0);
    Some(short.max(1))
}

/// Ask the pauser to pause each of `ids`, in order; returns each outcome.
pub async fn pause_all(pauser: &dyn Pauser, ids: &[String]) -> Vec<(String, Result<(), String>)> {
    let mut out = Vec::new();
    for id in ids {
        out.push((id.clone(), pauser.pause(id).await));
    }
    out
}

/// How often a lasting pressure is reported again.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// Start the watcher; it ends when the service is dropped.
pub fn spawn(svc: &Arc<Service>, pauser: Arc<dyn Pauser>) {
    let limits = svc.config.limits.clone();
    if limits.pressure_check_s == 0 {
        return;
    }
    let weak: Weak<Service> = Arc::downgrade(svc);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(limits.pressure_check_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // While pressure lasts, report (event + pause attempts) at most once a minute.
        let mut last_report: Option<std::time::Instant> = None;
        loop {
            tick.tick().await;
            let Some(svc) = weak.upgrade() else { return };
            let reading = Reading::now();
            let Some(want) = want_to_free(reading, &limits) else {
                last_report = None;
                continue;
            };
            if last_report.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
                continue;
            }
            last_report = Some(std::time::Instant::now());
            // Warm-pool VMs only hold memory ahead of time: they go before any sandbox.
            let from_pool = svc.ledger.evict_pool_memory(want);
            let pick = pick_to_free(
                &svc.ledger.idle_candidates(),
                want.saturating_sub(from_pool),
                Duration::from_secs(limits.pressure_min_idle_s),
            );
            tracing::warn!(psi = ?reading.psi_some_avg10, available_mib = ?reading.available_mib, want_mib = want, pool_evicted_mib = from_pool, pausing = ?pick, "host memory pressure");
            svc.telemetry.events.publish(
                "host.memory_pressure",
                "",
                None,
                serde_json::json!({
                    "psi_some_avg10": reading.psi_some_avg10,
                    "available_mib": reading.available_mib,
                    "want_free_mib": want,
                    "pool_evicted_mib": from_pool,
                    "pausing": pick,
                }),
            );
            for (id, res) in pause_all(pauser.as_ref(), &pick).await {
                match res {
                    Ok(()) => {
                        svc.telemetry.events.publish(
                            "sandbox.paused",
                            &id,
                            None,
                            serde_json::json!({"reason": "memory_pressure"}),
                        );
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "cannot pause under memory pressure")
                    }
                }
            }
        }
    });
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
mod tests {
    use super::*;

    const PSI: &str = "some avg10=12.50 avg60=3.00 avg300=0.50 total=123\n\
                       full avg10=1.00 avg60=0.00 avg300=0.00 total=4\n";

    #[test]
    fn parses_psi_and_meminfo() {
        assert_eq!(parse_psi_some_avg10(PSI), Some(12.5));
        assert_eq!(parse_psi_some_avg10("garbage"), None);
        let mi = "MemTotal:       24683584 kB\nMemFree: 1 kB\nMemAvailable:    2097152 kB\n";
        assert_eq!(parse_meminfo_mib(mi, "MemAvailable"), Some(2048));
        assert_eq!(parse_meminfo_mib(mi, "MemTotal"), Some(24105));
        assert_eq!(parse_meminfo_mib(mi, "Nope"), None);
    }

    /// Pauses like the real feature would: gives the sandbox's resources back.
    struct FakePauser {
        ledger: Arc<Ledger>,
        paused: std::sync::Mutex<Vec<String>>,
    }

    #[async_trait::async_trait]
    impl Pauser for FakePauser {
        async fn pause(&self, id: &str) -> Result<(), String> {
            self.paused.lock().unwrap().push(id.to_owned());
            self.ledger.release(id).map(|_| ()).ok_or("unknown".into())
        }
    }

    #[tokio::test]
    async fn pressure_pauses_the_idlest_until_enough_is_freed() {
        let ledger = Ledger::strict_for_tests(Resources::new(16, 16384), Duration::from_secs(1), 4);
        for (id, mem) in [("old", 1024), ("mid", 2048), ("new", 4096)] {
            ledger
                .reserve(id, Resources::new(1, mem))
                .await
                .unwrap()
                .keep();
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        ledger.busy("mid", 1); // running a command: never paused
        let pauser = FakePauser {
            ledger: ledger.clone(),
            paused: Default::default(),
        };
        let pick = pick_to_free(&ledger.idle_candidates(), 3000, Duration::ZERO);
        assert_eq!(pick, ["old", "new"]);
        let res = pause_all(&pauser, &pick).await;
        assert!(res.iter().all(|(_, r)| r.is_ok()), "{res:?}");
        assert_eq!(*pauser.paused.lock().unwrap(), ["old", "new"]);
        assert_eq!(ledger.view().used, Resources::new(1, 2048));
    }

    #[test]
    fn pressure_decision() {
        let l = LimitsConfig {
            pressure_psi_avg10: 10.0,
            pressure_min_available_mib: 1024,
            ..LimitsConfig::default()
        };
        let calm = Reading {
            psi_some_avg10: Some(0.5),
            available_mib: Some(8000),
        };
        assert_eq!(want_to_free(calm, &l), None);
        let low = Reading {
            psi_some_avg10: Some(0.0),
            available_mib: Some(600),
        };
        assert_eq!(want_to_free(low, &l), Some(424));
        let stall = Reading {
            psi_some_avg10: Some(25.0),
            available_mib: Some(8000),
        };
        assert_eq!(want_to_free(stall, &l), Some(1));
        let unknown = Reading {
            psi_some_avg10: None,
            available_mib: None,
        };
        assert_eq!(want_to_free(unknown, &l), None);
    }
}
