use super::*;

const ROLLUP: &str = "55d4c8a00000-7ffc4d3f1000 ---p 00000000 00:00 0        [rollup]\n\
Rss:              412340 kB\n\
Pss:              207172 kB\n\
Pss_Dirty:         61012 kB\n\
Pss_Anon:          55300 kB\n\
Pss_File:         151872 kB\n\
Pss_Shmem:             0 kB\n\
Shared_Clean:     390000 kB\n\
Private_Dirty:     20000 kB\n";

#[test]
fn smaps_rollup_gives_pss_and_its_pinned_part() {
    assert_eq!(
        parse_smaps_rollup(ROLLUP),
        Some(VmUse {
            pss_mib: 203,
            pinned_mib: 55
        })
    );
    // An old kernel without Pss_Anon: all of PSS is pinned (the cautious side).
    assert_eq!(
        parse_smaps_rollup("Rss: 2048 kB\nPss: 1024 kB\n"),
        Some(VmUse {
            pss_mib: 1,
            pinned_mib: 1
        })
    );
    // Shmem (a RAM file on tmpfs) is pinned too.
    assert_eq!(
        parse_smaps_rollup("Pss: 4096 kB\nPss_Anon: 1024 kB\nPss_Shmem: 2048 kB\n"),
        Some(VmUse {
            pss_mib: 4,
            pinned_mib: 3
        })
    );
    assert_eq!(parse_smaps_rollup("garbage"), None);
    assert_eq!(read_vm_use(u32::MAX), Usage::Unreadable);
    // This process can be read (the sampler reads QEMUs of the same user).
    assert!(matches!(
        read_vm_use(std::process::id()),
        Usage::Measured(u) if u.pss_mib > 0
    ));
}

#[test]
fn psi_lines_and_fields() {
    let cpu = "some avg10=95.10 avg60=42.00 avg300=3.50 total=1\n\
               full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
    assert_eq!(parse_psi(cpu, "some", "avg60"), Some(42.0));
    assert_eq!(parse_psi(cpu, "some", "avg10"), Some(95.1));
    assert_eq!(parse_psi(cpu, "full", "avg60"), Some(0.0));
    assert_eq!(parse_psi(cpu, "none", "avg60"), None);
    assert_eq!(parse_psi("", "some", "avg60"), None);
}

fn policy() -> MemPolicy {
    MemPolicy {
        reserve_mib: 1000,
        headroom_mib: 64,
        new_vm_mib: 256,
        cpu_psi_limit: 90.0,
    }
}

#[test]
fn a_vm_counts_its_use_plus_headroom_never_more_than_its_size() {
    let p = policy();
    let m = |pss, pinned| {
        Usage::Measured(VmUse {
            pss_mib: pss,
            pinned_mib: pinned,
        })
    };
    assert_eq!(p.counted(1024, Usage::Pending), 256);
    assert_eq!(p.counted(128, Usage::Pending), 128);
    assert_eq!(p.counted(1024, Usage::Unreadable), 1024);
    assert_eq!(p.counted(1024, m(100, 40)), 164);
    assert_eq!(p.counted(1024, m(1000, 40)), 1024);
    // Twelve forks sharing one RAM file: PSS splits the shared pages, so each counts little.
    let fork = m(600 / 13 + 5, 5);
    assert_eq!(p.counted(1024, fork), 46 + 5 + 64);
    // Outstanding: what MemAvailable does not already miss.
    assert_eq!(p.outstanding(1024, m(100, 40)), 124);
    assert_eq!(p.outstanding(1024, m(2000, 1500)), 0);
    assert_eq!(p.outstanding(1024, Usage::Pending), 256);
}

#[test]
fn room_is_available_minus_reserve_minus_growth() {
    let p = policy();
    assert_eq!(p.room(5000, 1200, 0), 2800);
    assert_eq!(p.room(5000, 1200, 300), 3100);
    assert_eq!(p.room(1500, 1200, 0), 0, "never negative");
    assert_eq!(p.expected(4096), 256);
    assert_eq!(p.usable(24_000), 23_000);
}

#[test]
fn cpu_is_saturated_only_with_psi_at_or_over_the_limit() {
    let p = policy();
    assert!(!p.cpu_saturated(None), "no PSI: the ratio alone");
    assert!(!p.cpu_saturated(Some(89.9)));
    assert!(p.cpu_saturated(Some(90.0)));
    let off = MemPolicy {
        cpu_psi_limit: 0.0,
        ..p
    };
    assert!(!off.cpu_saturated(Some(100.0)));
}

#[test]
fn the_sampler_reads_pss_only_when_a_vm_changed_or_a_minute_passed() {
    use std::cell::Cell;
    let reads = Cell::new(0u32);
    let rss = Cell::new(100_000u64);
    let pss = |_pid: u32| {
        reads.set(reads.get() + 1);
        Usage::Measured(VmUse {
            pss_mib: 50,
            pinned_mib: 20,
        })
    };
    let mut s = Sampler::default();
    let t0 = Instant::now();
    let vms = vec![("a".to_string(), 10), ("b".to_string(), 11)];
    let out = s.sample(&vms, t0, |_| Some(rss.get()), pss);
    assert_eq!(reads.get(), 2, "new VMs are read");
    assert_eq!(out[0].1.pss_mib(), Some(50));
    // Idle: the same resident size, no PSS read.
    let out = s.sample(&vms, t0 + Duration::from_secs(2), |_| Some(rss.get()), pss);
    assert_eq!(reads.get(), 2);
    assert_eq!(out.len(), 2);
    assert_eq!(out[1].1.pss_mib(), Some(50), "the cached use");
    // `a` grew by 16 MiB: only it is read.
    let grown = |pid: u32| Some(if pid == 10 { 100_000 + 16_384 } else { 100_000 });
    s.sample(&vms, t0 + Duration::from_secs(4), grown, pss);
    assert_eq!(reads.get(), 3);
    // A minute on: both again.
    s.sample(&vms, t0 + Duration::from_secs(70), grown, pss);
    assert_eq!(reads.get(), 5);
    // A new process under the same id (restore, resume), and a VM gone: forgotten.
    let out = s.sample(
        &[("a".to_string(), 99)],
        t0 + Duration::from_secs(72),
        grown,
        pss,
    );
    assert_eq!((reads.get(), out.len()), (6, 1));
    // Unreadable resident size: read PSS (which says unreadable too).
    s.sample(
        &[("a".to_string(), 99)],
        t0 + Duration::from_secs(74),
        |_| None,
        |_| Usage::Unreadable,
    );
    assert!(read_rss_kib(std::process::id()).is_some_and(|k| k > 0));
    assert_eq!(read_rss_kib(u32::MAX), None);
}
