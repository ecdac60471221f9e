//! The host's TSC frequency, given to TCG guests so that their kernel can keep time with the
//! TSC and stop ticking when idle.
//!
//! Under TCG a guest's `rdtsc` reads the host's TSC, but the guest kernel cannot work out its
//! rate: early calibration against the (emulated) PIT fails, there is no HPET or ACPI PM timer
//! on microvm to refine it, so the kernel marks the TSC unstable and keeps time with jiffies.
//! Jiffies need the periodic tick: an idle guest then took 250 PIT interrupts a second
//! (`CONFIG_HZ=250`; its local APIC timer also fails verification under TCG), each one a wake-up
//! of its QEMU — measured ~3 % of a host core per idle VM. With `tsc_early_khz=<host rate>
//! tsc=reliable` the guest uses the TSC as clocksource, high-resolution timers and
//! `NO_HZ_IDLE` work (the PIT in one-shot mode), and an idle guest sleeps.
//!
//! Owns: measuring the rate (once per process, against `CLOCK_MONOTONIC_RAW`) and the kernel
//! parameters. Never used under KVM (the guest has kvm-clock there).

use std::sync::OnceLock;
use std::time::Duration;

/// How long the measurement runs: its error is about the clock-read jitter over this window
/// (~1e-5 here), the guest clock's drift rate until its next sync.
const WINDOW: Duration = Duration::from_millis(100);

/// Plausible TSC rates: anything else (a host without a constant TSC, a preempted
/// measurement) gives no parameter and the guest calibrates as it did before.
const MIN_KHZ: u64 = 100_000;
const MAX_KHZ: u64 = 10_000_000;

fn raw_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_RAW, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(target_arch = "x86_64")]
fn rdtsc() -> u64 {
    // SAFETY: `rdtsc` has no memory effects; every x86_64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// One (TSC, ns) pair read as close together as the clock allows: the pair with the
/// shortest gap of a few tries.
#[cfg(target_arch = "x86_64")]
fn pair() -> (u64, u64) {
    let mut best = (0, 0, u64::MAX);
    for _ in 0..5 {
        let a = raw_ns();
        let t = rdtsc();
        let b = raw_ns();
        if b - a < best.2 {
            best = (t, a + (b - a) / 2, b - a);
        }
    }
    (best.0, best.1)
}

/// Measure the host's TSC rate in kHz (takes [`WINDOW`]); `None` when implausible.
#[cfg(target_arch = "x86_64")]
pub fn measure_khz() -> Option<u64> {
    let (t0, n0) = pair();
    std::thread::sleep(WINDOW);
    let (t1, n1) = pair();
    let ns = n1.checked_sub(n0)?;
    let khz = (t1.checked_sub(t0)? as u128 * 1_000_000 / ns.max(1) as u128) as u64;
    (MIN_KHZ..=MAX_KHZ).contains(&khz).then_some(khz)
}

#[cfg(not(target_arch = "x86_64"))]
pub fn measure_khz() -> Option<u64> {
    None
}

/// The host's TSC rate, measured on first use and then kept.
pub fn host_khz() -> Option<u64> {
    static KHZ: OnceLock<Option<u64>> = OnceLock::new();
    *KHZ.get_or_init(|| {
        let khz = measure_khz();
        tracing::debug!(tsc_khz = ?khz, "host TSC rate for TCG guests");
        khz
    })
}

/// Kernel parameters for a TCG guest with a host TSC of `khz` (see the module doc).
pub fn kernel_params(khz: u64) -> String {
    format!("tsc_early_khz={khz} tsc=reliable")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_tsc_rate_is_measured_and_stable() {
        let Some(a) = measure_khz() else {
            println!("no plausible TSC rate on this host (not x86_64, or no constant TSC)");
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI hosts are x86_64 with a constant TSC"
            );
            return;
        };
        let b = measure_khz().unwrap();
        // Two measurements agree to 0.5 % even on a loaded machine.
        assert!(a.abs_diff(b) * 200 < a, "{a} vs {b} kHz");
        assert_eq!(host_khz().map(|k| k.abs_diff(a) * 200 < a), Some(true));
        assert_eq!(
            kernel_params(2_600_000),
            "tsc_early_khz=2600000 tsc=reliable"
        );
    }
}
