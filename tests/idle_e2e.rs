//! An idle TCG guest does not tick (tickless idle with the TSC as clocksource, see
//! `src/vmm/tsc.rs`, and the local APIC timer as every CPU's tick device, see
//! `vmm::TCG_LAPIC_PARAMS`), and its clock keeps the host's time.

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
    // Timer interrupts (the PIT's line 0 and the local APIC timer) over 5 s of `sleep`:
    // a ticking guest takes CONFIG_HZ=250 a second, 1,250 here.
    let script = "t() { awk '$1==\"0:\"||$1==\"LOC:\" {n+=$2} END {print n}' /proc/interrupts; }; \
                  a=$(t); sleep 5; b=$(t); echo $((b-a)); \
                  cat /sys/devices/system/clocksource/clocksource0/current_clocksource; \
                  cat /sys/devices/system/clockevents/clockevent*/current_device | tr '\\n' ' '; echo; \
                  sleep 20; date +%s";
    let (code, out) = sh_out(&d, &id, script);
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    let wakes: u64 = lines[0].parse().unwrap();
    println!(
        "timer interrupts in 5 s of idle: {wakes}; clocksource {}; tick devices {}",
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
    assert!(
        wakes < 250,
        "{wakes} timer interrupts in 5 s: the guest ticks"
    );
    // 25 s on the guest's clock after boot: still the host's time (a wrong TSC rate drifts).
    let guest_now: u64 = lines[3].parse().unwrap();
    assert!(
        guest_now.abs_diff(host_now) <= 2,
        "guest clock {guest_now}, host {host_now}"
    );
}
