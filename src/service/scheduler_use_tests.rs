//! Admission by use: the default vCPU overcommit, memory by measured use with a reserve, CPU
//! pressure, and background VMs never making a sandbox wait. Over a fake host reading.

use super::*;

/// The defaults of `[limits]` on a 2-CPU / 24 GiB host (128x vCPU overcommit, 10% reserve,
/// 64 MiB headroom, 256 MiB for a VM not measured yet, CPU saturated at PSI 90%), with
/// `available` MiB available and CPU PSI `psi`.
fn by_use(available: u64, psi: Option<f64>, timeout_ms: u64) -> (Arc<Ledger>, Arc<FakeHost>) {
    let host = Arc::new(FakeHost::default());
    host.set(|h| {
        *h = HostReading {
            total_mib: Some(24_105),
            available_mib: Some(available),
            cpu_some_avg60: psi,
        }
    });
    let policy = Policy {
        vcpus: 256,
        host_cpus: 2,
        memory_cap: None,
        mem: MemPolicy {
            reserve_mib: 2410,
            headroom_mib: 64,
            new_vm_mib: 256,
            cpu_psi_limit: 90.0,
        },
    };
    let l = Ledger::new(policy, host.clone(), Duration::from_millis(timeout_ms), 16);
    (l, host)
}

fn measured(pss: u64, pinned: u64) -> Usage {
    Usage::Measured(crate::service::usage::VmUse {
        pss_mib: pss,
        pinned_mib: pinned,
    })
}

/// The case: with the defaults, one sandbox, 12 forks of it and then more creates of
/// 2 vCPUs / 1 GiB are all granted at once (the old strict ledger allowed 8 vCPUs in all).
#[tokio::test]
async fn defaults_admit_a_sandbox_twelve_forks_and_more_creates_at_once() {
    let (l, _host) = by_use(20_000, Some(2.0), 10_000);
    let one = r(2, 1024);
    l.reserve("a", one).await.unwrap().keep();
    l.group_ever_fits(one, 12, &["a"]).unwrap();
    let t = Instant::now();
    for i in 0..12 {
        l.reserve(&format!("fork{i}"), one).await.unwrap().keep();
    }
    for id in ["b", "c", "d"] {
        l.reserve(id, one).await.unwrap().keep();
    }
    assert!(t.elapsed() < Duration::from_secs(1));
    let v = l.view();
    assert_eq!(v.waited, 0, "nobody waited");
    assert_eq!(v.used, r(32, 16 * 1024));
    // Not measured yet: each counts 256 MiB, not its 1 GiB.
    assert_eq!(v.mem.counted_mib, 16 * 256);
    assert_eq!(v.mem.room_mib, Some(20_000 - 2410 - 16 * 256));
}

#[tokio::test]
async fn memory_is_counted_by_measured_use_capped_at_each_vm_size() {
    let (l, _host) = by_use(10_000, None, 50);
    l.reserve("a", r(2, 1024)).await.unwrap().keep();
    l.reserve("b", r(2, 512)).await.unwrap().keep();
    l.reserve("gone", r(1, 256)).await.unwrap().keep();
    // `a`: 300 MiB PSS of which 60 pinned (QEMU's own); `b` claims more than its size.
    l.record_usage(&[
        ("a".into(), measured(300, 60)),
        ("b".into(), measured(900, 900)),
        ("nobody".into(), measured(1, 1)),
    ]);
    let v = l.view();
    let by_id = |id: &str| v.held.iter().find(|h| h.id == id).unwrap().clone();
    assert_eq!(
        (by_id("a").used_mib, by_id("a").counted_mib),
        (Some(300), 364)
    );
    assert_eq!(by_id("b").counted_mib, 512, "never more than its size");
    assert_eq!(by_id("gone").counted_mib, 256, "not measured: the estimate");
    assert_eq!(v.mem.used_mib, 1200);
    assert_eq!(v.mem.counted_mib, 364 + 512 + 256);
    // Room: available - reserve - what is not already out of MemAvailable:
    // a 364-60, b 512-900 -> 0, gone 256.
    assert_eq!(v.mem.room_mib, Some(10_000 - 2410 - 304 - 256));
}

#[tokio::test]
async fn a_full_host_waits_for_memory_and_is_served_when_the_host_has_room() {
    // 2410 reserve + 200 free: no room for a 256 MiB start.
    let (l, host) = by_use(2610, None, 5_000);
    let l2 = l.clone();
    let w = tokio::spawn(async move { l2.reserve("w", r(2, 1024)).await.map(|g| g.keep()) });
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    assert_eq!((l.view().waited, l.view().waited_cpu), (1, 0));
    // A background VM never starts while the host is short (nor while someone waits).
    assert!(l.try_reserve("p", r(1, 128), Holder::Pool).is_none());
    // Memory came back (another process ended): the next sample serves the queue.
    host.set(|h| h.available_mib = Some(4000));
    l.record_usage(&[]);
    w.await.unwrap().unwrap();
    assert!(l.holds("w"));

    // Never served: the error says how the memory stands.
    let (l, _) = by_use(2500, None, 100);
    let e = l.reserve("x", r(2, 1024)).await.err().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, SchedError::Timeout { .. }), "{msg}");
    assert!(
        msg.contains("stayed full")
            && msg.contains("90 MiB room = 2500 MiB available - 2410 MiB reserve")
            && msg.contains("256 MiB expected at start"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_vm_bigger_than_the_host_can_ever_give_is_refused_at_once() {
    let (l, _) = by_use(20_000, None, 10_000);
    let e = l.reserve("big", r(2, 30_000)).await.err().unwrap();
    assert!(matches!(e, SchedError::TooBig { .. }), "{e}");
    assert!(e.to_string().contains("21695 MiB"), "{e}");
    let e = l.reserve("cpus", r(300, 512)).await.err().unwrap();
    assert!(e.to_string().contains("256 vCPUs"), "{e}");
}

#[tokio::test]
async fn cpu_saturation_makes_requests_wait_then_admits_and_background_vms_skip() {
    let (l, host) = by_use(20_000, Some(95.0), 5_000);
    assert!(l.try_reserve("p", r(1, 512), Holder::Pool).is_none());
    let l2 = l.clone();
    let w = tokio::spawn(async move { l2.reserve("w", r(2, 1024)).await.map(|g| g.keep()) });
    while !l.has_waiters() {
        tokio::task::yield_now().await;
    }
    assert_eq!((l.view().waited, l.view().waited_cpu), (1, 1));
    host.set(|h| h.cpu_some_avg60 = Some(40.0));
    l.record_usage(&[]);
    w.await.unwrap().unwrap();
    // Without PSI (`None`) CPU pressure never holds anything back.
    host.set(|h| h.cpu_some_avg60 = None);
    l.reserve("x", r(2, 1024)).await.unwrap().keep();
    // Still saturated when the wait ends: admitted then (slow, not refused), counted as a
    // CPU wait; a memory shortage at the same time still refuses.
    let (l, _) = by_use(20_000, Some(99.0), 100);
    let t = Instant::now();
    l.reserve("y", r(1, 256)).await.unwrap().keep();
    assert!(t.elapsed() >= Duration::from_millis(100));
    assert_eq!((l.view().waited, l.view().waited_cpu), (1, 1));
    let (l, _) = by_use(2_500, Some(99.0), 100);
    let e = l.reserve("z", r(1, 256)).await.err().unwrap();
    assert!(e.to_string().contains("CPU saturated"), "{e}");
}

/// A golden build is never counted against a sandbox (it ends by itself); a pool VM is evicted
/// for one, and what it pins counts as free until it is stopped and released.
#[tokio::test]
async fn background_vms_never_make_a_sandbox_wait() {
    let (l, host) = by_use(3000, None, 100);
    let mut rx = l.evictions();
    // Room 590: a golden build (256 at start) and a pool VM (256) fit.
    l.try_reserve("golden-k", r(2, 1024), Holder::Golden)
        .unwrap()
        .keep();
    l.try_reserve("p", r(2, 1024), Holder::Pool).unwrap().keep();
    assert!(l.try_reserve("p2", r(2, 1024), Holder::Pool).is_none());
    // Measured: the golden VM pins 200, the pool VM 250 (both left MemAvailable already).
    host.set(|h| h.available_mib = Some(3000 - 450));
    l.record_usage(&[
        ("golden-k".into(), measured(250, 200)),
        ("p".into(), measured(300, 250)),
    ]);
    // Room for a sandbox: 2550 + 200 (golden, not counted) - 2410 - p's 364-250 = 226 < 256:
    // the pool VM is evicted instead of waiting (its 250 pinned credited until released).
    let t = Instant::now();
    l.reserve("s", r(2, 1024)).await.unwrap().keep();
    assert!(t.elapsed() < Duration::from_millis(50));
    assert_eq!(drain(&mut rx), ["p"]);
    assert_eq!(l.view().waited, 0);
    // The strict vCPU cap too: a golden build holding all vCPUs does not count for a sandbox.
    let strict = ledger(2, 8192, 100, 4);
    strict
        .try_reserve("golden-k", r(2, 512), Holder::Golden)
        .unwrap()
        .keep();
    strict.reserve("s", r(2, 512)).await.unwrap().keep();
    assert!(
        strict.try_reserve("p", r(1, 512), Holder::Pool).is_none(),
        "a background VM counts everything"
    );
}

#[tokio::test]
async fn under_pressure_pool_vms_and_pauses_free_their_measured_use() {
    let (l, _) = by_use(20_000, None, 100);
    let mut rx = l.evictions();
    l.try_reserve("p", r(2, 1024), Holder::Pool).unwrap().keep();
    l.reserve("s", r(2, 1024)).await.unwrap().keep();
    l.record_usage(&[
        ("p".into(), measured(200, 60)),
        ("s".into(), measured(400, 60)),
    ]);
    assert_eq!(l.evict_pool_memory(100), 200);
    assert_eq!(drain(&mut rx), ["p"]);
    let c = l.idle_candidates();
    assert_eq!((c[0].id.as_str(), c[0].memory_mib), ("s", 400));
}
