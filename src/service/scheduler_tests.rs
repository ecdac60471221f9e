use super::*;
use crate::service::pressure::pick_to_free;

fn r(v: u32, m: u64) -> Resources {
    Resources::new(v, m)
}

/// A host whose readings the test sets.
#[derive(Default)]
struct FakeHost(Mutex<HostReading>);

impl HostProbe for FakeHost {
    fn read(&self) -> HostReading {
        *self.0.lock().unwrap()
    }
}

impl FakeHost {
    fn set(&self, f: impl FnOnce(&mut HostReading)) {
        f(&mut self.0.lock().unwrap());
    }
}

/// The old strict ledger, configured explicitly: exactly `v` vCPUs (`max_vcpus`) and `m` MiB
/// of configured memory (`max_memory_mib`); the host reading is unknown (no memory by use, no
/// CPU pressure).
fn ledger(v: u32, m: u64, timeout_ms: u64, max_queue: usize) -> Arc<Ledger> {
    let policy = Policy {
        vcpus: v,
        host_cpus: v,
        memory_cap: Some(m),
        mem: MemPolicy {
            reserve_mib: 0,
            headroom_mib: 0,
            new_vm_mib: u64::MAX,
            cpu_psi_limit: 0.0,
        },
    };
    Ledger::new(
        policy,
        Arc::new(FakeHost::default()),
        Duration::from_millis(timeout_ms),
        max_queue,
    )
}

/// Every reservation as (id, resources, holder), by id.
fn held(l: &Ledger) -> Vec<(String, Resources, Holder)> {
    l.view()
        .held
        .into_iter()
        .map(|h| (h.id, h.r, h.who))
        .collect()
}

#[tokio::test]
async fn grants_within_capacity_and_releases_on_drop() {
    let l = ledger(4, 2048, 50, 4);
    let a = l.reserve("a", r(2, 1024)).await.unwrap();
    let b = l.reserve("b", r(2, 1024)).await.unwrap();
    assert_eq!(l.view().used, r(4, 2048));
    drop(a);
    assert_eq!(l.view().used, r(2, 1024));
    b.keep();
    assert_eq!(l.view().used, r(2, 1024), "kept: still held");
    assert_eq!(l.release("b"), Some(r(2, 1024)));
    assert_eq!(l.view().used, r(0, 0));
    assert_eq!(l.release("b"), None);
}

#[tokio::test]
async fn too_big_is_refused_at_once_with_numbers() {
    let l = ledger(2, 2048, 10_000, 4);
    let t = Instant::now();
    let e = l.reserve("a", r(1, 4096)).await.err().unwrap();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(matches!(e, SchedError::TooBig { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("4096 MiB") && msg.contains("2048 MiB"),
        "{msg}"
    );
}

#[tokio::test]
async fn full_host_times_out_with_clear_error() {
    let l = ledger(2, 1024, 100, 4);
    l.reserve("a", r(2, 1024)).await.unwrap().keep();
    let e = l.reserve("b", r(1, 512)).await.err().unwrap();
    assert!(matches!(e, SchedError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("stayed full"), "{e}");
    assert_eq!(l.view().queued, 0, "a timed-out waiter leaves the queue");
    assert_eq!(l.view().used, r(2, 1024));
}

#[tokio::test]
async fn queue_full_refuses_at_once() {
    let l = ledger(1, 1024, 5_000, 1);
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    let l2 = l.clone();
    let waiting = tokio::spawn(async move { l2.reserve("b", r(1, 1024)).await.map(|g| g.keep()) });
    while l.view().queued == 0 {
        tokio::task::yield_now().await;
    }
    let e = l.reserve("c", r(1, 1024)).await.err().unwrap();
    assert!(matches!(e, SchedError::QueueFull { .. }), "{e}");
    l.release("a");
    waiting.await.unwrap().unwrap();
    assert_eq!(
        held(&l),
        vec![("b".to_string(), r(1, 1024), Holder::Sandbox)]
    );
}

#[tokio::test]
async fn waiters_are_served_in_fifo_order_and_small_ones_do_not_overtake() {
    let l = ledger(4, 4096, 5_000, 8);
    l.reserve("a", r(4, 4096)).await.unwrap().keep();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (id, need) in [("big", r(4, 4096)), ("small", r(1, 512))] {
        let (l2, o) = (l.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let g = l2.reserve(id, need).await.unwrap();
            o.lock().unwrap().push(id);
            g.keep();
        }));
        // Enqueue in a known order.
        let want = tasks.len();
        while l.view().queued < want {
            tokio::task::yield_now().await;
        }
    }
    // Freeing 1 vCPU would fit `small`, but `big` is first: nobody is granted.
    l.release("a");
    tasks.remove(0).await.unwrap();
    assert_eq!(*order.lock().unwrap(), vec!["big"]);
    assert_eq!(l.view().queued, 1, "small waits behind big");
    l.release("big");
    tasks.remove(0).await.unwrap();
    assert_eq!(*order.lock().unwrap(), vec!["big", "small"]);
}

#[tokio::test]
async fn duplicate_reservation_is_refused() {
    let l = ledger(4, 4096, 50, 4);
    l.reserve("a", r(1, 128)).await.unwrap().keep();
    assert!(matches!(
        l.reserve("a", r(1, 128)).await.err().unwrap(),
        SchedError::Duplicate(_)
    ));
}

#[test]
fn adopt_counts_recovered_sandboxes_even_past_the_limit() {
    let l = ledger(2, 1024, 50, 4);
    l.adopt("a", r(2, 1024));
    l.adopt("b", r(2, 1024));
    l.adopt("b", r(2, 1024));
    assert_eq!(l.view().used, r(4, 2048));
}

fn cand(id: &str, idle_s: u64, running: u32, mem: u64) -> Candidate {
    Candidate {
        id: id.into(),
        idle: Duration::from_secs(idle_s),
        running_execs: running,
        memory_mib: mem,
    }
}

#[test]
fn idle_ranking_skips_busy_and_orders_by_idleness_then_size() {
    let ranked = rank_idle(vec![
        cand("recent", 5, 0, 1024),
        cand("busy", 999, 1, 4096),
        cand("old-small", 600, 0, 512),
        cand("old-big", 600, 0, 2048),
        cand("oldest", 3600, 0, 256),
    ]);
    let ids: Vec<&str> = ranked.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["oldest", "old-big", "old-small", "recent"]);
}

#[test]
fn pick_to_free_stops_once_enough_and_respects_min_idle() {
    let ranked = rank_idle(vec![
        cand("a", 3600, 0, 512),
        cand("b", 600, 0, 1024),
        cand("c", 10, 0, 4096),
    ]);
    assert_eq!(
        pick_to_free(&ranked, 1000, Duration::from_secs(60)),
        ["a", "b"]
    );
    assert_eq!(pick_to_free(&ranked, 100, Duration::from_secs(60)), ["a"]);
    // `c` is too fresh to pause, even if more is wanted.
    assert_eq!(
        pick_to_free(&ranked, 100_000, Duration::from_secs(60)),
        ["a", "b"]
    );
}

#[tokio::test]
async fn activity_feeds_the_ranking() {
    let l = ledger(8, 8192, 50, 4);
    l.reserve("a", r(1, 512)).await.unwrap().keep();
    l.reserve("b", r(1, 512)).await.unwrap().keep();
    tokio::time::sleep(Duration::from_millis(20)).await;
    l.busy("a", 1);
    let ids: Vec<String> = l.idle_candidates().into_iter().map(|c| c.id).collect();
    assert_eq!(ids, ["b"], "a runs a command");
    l.busy("a", -1);
    let ids: Vec<String> = l.idle_candidates().into_iter().map(|c| c.id).collect();
    assert_eq!(ids, ["b", "a"], "b has been idle longer");
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue_and_holds_nothing() {
    let l = ledger(1, 1024, 10_000, 4);
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    let l2 = l.clone();
    let t = tokio::spawn(async move { l2.reserve("b", r(1, 1024)).await.map(|g| g.keep()) });
    while l.view().queued == 0 {
        tokio::task::yield_now().await;
    }
    t.abort();
    let _ = t.await;
    assert_eq!(l.view().queued, 0);
    l.release("a");
    assert_eq!(l.view().used, r(0, 0), "nobody holds anything");
}

#[tokio::test]
async fn a_group_that_never_fits_next_to_the_parent_is_refused_whole() {
    let l = ledger(8, 8192, 50, 4);
    l.reserve("parent", r(1, 512)).await.unwrap().keep();
    l.reserve("other", r(2, 1024)).await.unwrap().keep();
    // 7 more fit once `other` is gone (the parent stays): allowed, even if not right now.
    l.group_ever_fits(r(1, 512), 7, &["parent"]).unwrap();
    // 8 more never fit next to the parent.
    let e = l.group_ever_fits(r(1, 512), 8, &["parent"]).unwrap_err();
    assert!(matches!(e, SchedError::TooBig { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("needs 8 vCPUs (8 x 1 vCPUs) and 4096 MiB")
            && msg.contains("the host limit is 7 vCPUs and 7680 MiB"),
        "{msg}"
    );
    // Memory bound as well.
    assert!(l.group_ever_fits(r(1, 4096), 2, &["parent"]).is_err());
    assert_eq!(l.view().used, r(3, 1536), "a check reserves nothing");
}

#[tokio::test]
async fn a_pool_vm_reserves_only_when_it_fits_now_and_nobody_waits() {
    let l = ledger(2, 2048, 5_000, 4);
    let p = l.try_reserve("pool1", r(1, 512), Holder::Pool).unwrap();
    p.keep();
    assert_eq!(l.view().used, r(1, 512), "a pool VM is counted");
    assert_eq!(
        held(&l),
        vec![("pool1".to_string(), r(1, 512), Holder::Pool)]
    );
    // Does not fit right now: refused at once, never queued.
    assert!(l.try_reserve("pool2", r(2, 512), Holder::Pool).is_none());
    assert_eq!(l.view().queued, 0);
    // Someone waits: a pool VM does not overtake the queue even if it would fit.
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    let l2 = l.clone();
    let waiting =
        tokio::spawn(async move { l2.reserve("big", r(1, 1024)).await.map(|g| g.keep()) });
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    assert!(l.try_reserve("pool3", r(0, 1), Holder::Pool).is_none());
    // A dropped (not kept) background reservation gives back and wakes the queue.
    l.release("pool1");
    waiting.await.unwrap().unwrap();
    assert!(!l.has_waiters());
    let g = l.try_reserve("golden-x", r(0, 0), Holder::Golden).unwrap();
    assert!(l.holds("golden-x"));
    drop(g);
    assert!(!l.holds("golden-x"));
    assert_eq!(l.view().used, r(2, 2048));
}

#[tokio::test]
async fn claiming_a_pool_vm_moves_its_reservation_without_double_count() {
    let l = ledger(2, 1024, 50, 4);
    l.try_reserve("sbx_p", r(1, 512), Holder::Pool)
        .unwrap()
        .keep();
    l.reserve("other", r(1, 512)).await.unwrap().keep();
    assert_eq!(l.view().used, r(2, 1024), "host full: pool VM + other");
    // Taken by a create under its own id: same resources, now a sandbox's.
    assert_eq!(l.claim_pool("sbx_p", "sbx_p"), Some(r(1, 512)));
    assert_eq!(l.view().used, r(2, 1024), "no double count");
    assert_eq!(
        held(&l),
        vec![
            ("other".to_string(), r(1, 512), Holder::Sandbox),
            ("sbx_p".to_string(), r(1, 512), Holder::Sandbox),
        ]
    );
    // Only pool reservations can be claimed, and only once.
    assert_eq!(l.claim_pool("sbx_p", "sbx_p"), None);
    assert_eq!(l.claim_pool("other", "x"), None);
    // Under another id: moved, the old key is gone.
    l.release("other");
    l.try_reserve("sbx_q", r(1, 512), Holder::Pool)
        .unwrap()
        .keep();
    assert_eq!(l.claim_pool("sbx_q", "sbx_p"), None, "target holds already");
    assert_eq!(l.claim_pool("sbx_q", "sbx_new"), Some(r(1, 512)));
    assert!(!l.holds("sbx_q") && l.holds("sbx_new"));
    assert_eq!(l.view().used, r(2, 1024));
    // The sandbox now gives back like any other.
    l.release("sbx_new");
    l.release("sbx_p");
    assert_eq!(l.view().used, r(0, 0));
}

fn drain(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> Vec<String> {
    let mut v = Vec::new();
    while let Ok(id) = rx.try_recv() {
        v.push(id);
    }
    v
}

#[tokio::test]
async fn a_request_that_would_wait_evicts_just_enough_pool_vms() {
    let l = ledger(3, 3072, 100, 4);
    // Without a reader of evictions nothing is evicted: the request waits and times out.
    l.reserve("s", r(1, 1024)).await.unwrap().keep();
    l.try_reserve("p1", r(1, 1024), Holder::Pool)
        .unwrap()
        .keep();
    l.try_reserve("p2", r(1, 1024), Holder::Pool)
        .unwrap()
        .keep();
    assert!(matches!(
        l.reserve("x", r(1, 1024)).await.err().unwrap(),
        SchedError::Timeout { .. }
    ));
    let mut rx = l.evictions();
    // Nothing free: one pool VM (the newest of the two equal ones) makes room, and the
    // request is granted at once instead of waiting.
    let t = Instant::now();
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    assert!(t.elapsed() < Duration::from_millis(100));
    assert_eq!(drain(&mut rx), ["p2"]);
    assert_eq!(l.holder("p2"), None);
    assert_eq!(l.holder("p1"), Some(Holder::Pool));
    assert_eq!(l.view().used, r(3, 3072), "p2's room went to `a`");
    // A request that fits evicts nobody.
    l.release("a");
    l.reserve("b", r(1, 1024)).await.unwrap().keep();
    assert!(drain(&mut rx).is_empty());
    // Never enough (2 vCPUs needed, only p1's 1 can be freed): every pool VM goes, and the
    // request waits for a sandbox to leave.
    let l2 = l.clone();
    let waiting = tokio::spawn(async move {
        let l3 = l2.clone();
        let res = l2.reserve("big", r(2, 2048)).await;
        res.map(|g| {
            g.keep();
            l3.view().used
        })
    });
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    assert_eq!(drain(&mut rx), ["p1"]);
    assert_eq!(l.view().used, r(2, 2048), "s and b; p1's room is free");
    l.release("b");
    assert_eq!(waiting.await.unwrap().unwrap(), r(3, 3072));
    // A pool VM of a closed reader is not evicted either.
    drop(rx);
    l.release("big");
    l.try_reserve("p3", r(2, 2048), Holder::Pool)
        .unwrap()
        .keep();
    assert!(l.reserve("c", r(1, 1024)).await.is_err());
    assert_eq!(l.holder("p3"), Some(Holder::Pool));
}

#[tokio::test]
async fn eviction_serves_the_queue_first() {
    let l = ledger(2, 2048, 5_000, 4);
    l.reserve("s", r(1, 1024)).await.unwrap().keep();
    l.try_reserve("p", r(1, 1024), Holder::Pool).unwrap().keep();
    // No reader yet: `w` waits next to the pool VM.
    let l2 = l.clone();
    let w = tokio::spawn(async move { l2.reserve("w", r(1, 1024)).await.map(|g| g.keep()) });
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    // A pool VM cannot start while someone waits, even if it would fit.
    assert!(l.try_reserve("p2", r(0, 0), Holder::Pool).is_none());
    let mut rx = l.evictions();
    // `x` would wait: p is evicted, its room goes to `w` (queued first), `x` queues behind.
    let l3 = l.clone();
    let x = tokio::spawn(async move { l3.reserve("x", r(1, 1024)).await.map(|g| g.keep()) });
    w.await.unwrap().unwrap();
    assert_eq!(drain(&mut rx), ["p"]);
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    assert_eq!(l.view().used, r(2, 2048), "s and w");
    l.release("s");
    x.await.unwrap().unwrap();
    assert_eq!(
        held(&l),
        vec![
            ("w".to_string(), r(1, 1024), Holder::Sandbox),
            ("x".to_string(), r(1, 1024), Holder::Sandbox),
        ]
    );
}

#[tokio::test]
async fn background_vms_are_never_pause_candidates() {
    let l = ledger(4, 4096, 50, 4);
    l.reserve("a", r(1, 512)).await.unwrap().keep();
    l.try_reserve("p", r(1, 512), Holder::Pool).unwrap().keep();
    l.try_reserve("g", r(1, 512), Holder::Golden)
        .unwrap()
        .keep();
    let ids: Vec<String> = l.idle_candidates().into_iter().map(|c| c.id).collect();
    assert_eq!(ids, ["a"]);
    assert_eq!(l.view().used, r(3, 1536));
}

#[tokio::test]
async fn memory_pressure_evicts_pool_vms_first_and_only_as_many_as_needed() {
    let l = ledger(8, 8192, 50, 4);
    l.reserve("s", r(1, 1024)).await.unwrap().keep();
    l.try_reserve("p1", r(1, 512), Holder::Pool).unwrap().keep();
    l.try_reserve("p2", r(1, 512), Holder::Pool).unwrap().keep();
    l.try_reserve("g", r(1, 512), Holder::Golden)
        .unwrap()
        .keep();
    assert_eq!(l.evict_pool_memory(100), 0, "no reader: nothing evicted");
    let mut rx = l.evictions();
    assert_eq!(l.evict_pool_memory(100), 512);
    assert_eq!(drain(&mut rx), ["p2"], "the newest first");
    // More than the pool holds: all of it, never a sandbox or a golden build.
    assert_eq!(l.evict_pool_memory(4096), 512);
    assert_eq!(drain(&mut rx), ["p1"]);
    assert_eq!(l.evict_pool_memory(4096), 0);
    assert_eq!(l.view().used, r(2, 1536));
}

#[tokio::test]
async fn eviction_stops_as_few_pool_vms_as_it_can_the_newest_first() {
    let l = ledger(4, 4096, 50, 4);
    let mut rx = l.evictions();
    for (id, need) in [
        ("old2", r(2, 2048)),
        ("mid1", r(1, 1024)),
        ("new1", r(1, 1024)),
    ] {
        l.try_reserve(id, need, Holder::Pool).unwrap().keep();
    }
    // Each alone is enough: the smallest, and of the two small ones the newest.
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    assert_eq!(drain(&mut rx), ["new1"]);
    // Only the big one is enough alone: it goes, not the newer small one plus the big one.
    l.reserve("b", r(2, 2048)).await.unwrap().keep();
    assert_eq!(drain(&mut rx), ["old2"]);
    assert_eq!(l.holder("mid1"), Some(Holder::Pool));
    l.release("a");
    l.release("b");
    // None is enough alone: the newest first, then the one that is enough now.
    for (id, need) in [("p1", r(1, 1024)), ("p2", r(1, 1024))] {
        l.try_reserve(id, need, Holder::Pool).unwrap().keep();
    }
    l.reserve("s", r(1, 1024)).await.unwrap().keep();
    assert_eq!(l.view().used, r(4, 4096));
    l.reserve("big", r(2, 2048)).await.unwrap().keep();
    assert_eq!(drain(&mut rx), ["p2", "p1"]);
    assert_eq!(l.holder("mid1"), Some(Holder::Pool));
    // Memory pressure: the same order.
    l.release("big");
    l.try_reserve("p3", r(1, 1024), Holder::Pool)
        .unwrap()
        .keep();
    assert_eq!(l.evict_pool_memory(1), 1024);
    assert_eq!(drain(&mut rx), ["p3"]);
}

#[tokio::test]
async fn released_room_is_announced_once_evicted_room_is_not() {
    let l = ledger(2, 2048, 50, 4);
    let mut evicted = l.evictions();
    let mut freed = l.freed();
    l.reserve("a", r(1, 1024)).await.unwrap().keep();
    l.reserve("b", r(1, 1024)).await.unwrap().keep();
    assert!(freed.try_recv().is_err(), "nothing given back yet");
    // Two releases before the reader looks: one message (coalesced), then none.
    l.release("a");
    l.release("b");
    assert!(freed.try_recv().is_ok());
    assert!(freed.try_recv().is_err());
    // Unknown ids give nothing back.
    l.release("nobody");
    assert!(freed.try_recv().is_err());
    // A failed create (a dropped reservation) gives back too.
    drop(l.reserve("c", r(1, 1024)).await.unwrap());
    assert!(freed.try_recv().is_ok());
    // Evicting a pool VM hands its room to the request: no refill wake-up.
    l.try_reserve("p", r(2, 2048), Holder::Pool).unwrap().keep();
    l.reserve("d", r(1, 1024)).await.unwrap().keep();
    assert_eq!(drain(&mut evicted), ["p"]);
    // The service stops the evicted VM and releases it: nothing left to give back.
    assert_eq!(l.release("p"), None);
    assert!(freed.try_recv().is_err());
}

#[path = "scheduler_use_tests.rs"]
mod by_use;
