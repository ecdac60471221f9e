//! An idle TCG guest does not tick (tickless idle with the TSC as clocksource, see
//! `src/vmm/tsc.rs`, and the local APIC timer as every CPU's tick device, see
//! `vmm::TCG_LAPIC_PARAMS`), sleeps for seconds between its few housekeeping wake-ups (the
//! kernel's fair deadline server is off, docs/VMM.md), and its clock keeps the host's time.

mod common;

use common::{SMALL_VMS, create, sh_out, vm_daemon};

#[test]
fn an_idle_guest_does_not_wake_every_tick_and_keeps_time() {
    // Two vCPUs: the secondary CPU sets its APIC timer up too.
    let cfg = format!("{SMALL_VMS}default_vcpus = 2\n[pool]\ngolden = false\nsize = 0\n")
        .replace("default_vcpus = 1\n", "");
    let Some(d) = vm_daemon(&cfg) else { return };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());
    // Timer interrupts (the PIT's line 0 and the local APIC timer) over 20 s of `sleep`, after
    // 3 s for the exec's own start to settle: a ticking guest takes CONFIG_HZ=250 a second
    // per CPU.
    let script = "t() { awk '$1==\"0:\"||$1==\"LOC:\" {n+=$2} END {print n}' /proc/interrupts; }; \
                  sleep 3; a=$(t); sleep 20; b=$(t); echo $((b-a)); \
                  cat /sys/devices/system/clocksource/clocksource0/current_clocksource; \
                  cat /sys/devices/system/clockevents/clockevent*/current_device | tr '\\n' ' '; echo; \
                  sleep 2; date +%s";
    let (code, out) = sh_out(&d, &id, script);
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let wakes: u64 = lines[0].parse().unwrap();
    println!(
        "timer interrupts in 20 s of idle: {wakes}; clocksource {}; tick devices {}",
        lines[1], lines[2]
    );
    assert_eq!(lines[1], "tsc", "the guest keeps time with {}", lines[1]);
    // Each CPU ticks with its local APIC timer. Without `lapic_timer_hz` a loaded host makes
    // the boot's APIC timer verification fail now and then, and the PIT (`pit`, with
    // `broadcast` on the other CPU) wakes the idle guest ~40 times a second.
    let devices: Vec<&str> = lines[2].split_whitespace().collect();
    assert!(
        devices.len() == 2 && devices.iter().all(|d| d.starts_with("lapic")),
        "tick devices per CPU: {devices:?}"
    );
    // Not ticking, and not woken every second per CPU either: with Linux 6.12's fair deadline
    // server on, the two CPUs took 346 in 60 s (~115 in 20 s); without it ~2.5 a second
    // (vmstat and other deferrable housekeeping riding the few real timers).
    assert!(
        wakes < 80,
        "{wakes} timer interrupts in 20 s of idle: the guest wakes more than ~4 times a second"
    );
    // 25 s on the guest's clock after its exec began: still the host's time (a wrong TSC rate drifts).
    let guest_now: u64 = lines[3].parse().unwrap();
    assert!(
        guest_now.abs_diff(host_now) <= 2,
        "guest clock {guest_now}, host {host_now}"
    );
}
