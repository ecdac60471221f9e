//! Lifecycle torture: a real daemon and real (TCG) VMs take random create, exec, pause, resume,
//! snapshot, restore, fork, apply and rm calls from several threads at once over a few
//! sandboxes (idle pause is on too), then the books must balance: every QEMU belongs to a
//! `ready` sandbox and every `ready` sandbox has exactly one QEMU (paused ones none), the
//! scheduler's ledger holds exactly the running sandboxes, and every call was answered (a
//! response within its client-side deadline; no 500).
//!
//! Bounded: 60 s of calls by default. `TRYBOXI_TORTURE_SECS` and `TRYBOXI_TORTURE_SEED` change
//! the duration and the seed (printed on its own line, so a failure can be replayed; thread
//! timing still differs from run to run).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Daemon, Resp, raw_http, vm_daemon};

/// Small VMs, at most three running (the ledger queues the rest, briefly), idle pause on.
const CONFIG: &str = "default_memory_mib = 384\ndefault_vcpus = 1\nboot_timeout_s = 180\n\
                      idle_pause_secs = 6\n\
                      [limits]\nmax_vcpus = 3\nmax_memory_mib = 1152\nqueue_timeout_s = 10\n\
                      pressure_check_s = 0\n";
const WORKERS: usize = 3;
/// The client-side deadline of one call: past it the call counts as unanswered (a hang).
const CALL_DEADLINE: Duration = Duration::from_secs(300);

/// SplitMix64: a seeded, reproducible sequence of choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone)]
struct Sandbox {
    id: String,
    ws: PathBuf,
}

/// What the workers share: the sandboxes they know of and what every call got.
struct World {
    socket: PathBuf,
    sandboxes: Mutex<Vec<Sandbox>>,
    /// (op, status) -> count; status 0 = no answer within the deadline.
    outcomes: Mutex<BTreeMap<(String, u16), u32>>,
    /// Calls that break the contract: unanswered, 500, an exec stream without an end.
    problems: Mutex<Vec<String>>,
    /// Set when the daemon stopped answering at all (the run ends).
    dead: std::sync::atomic::AtomicBool,
    /// One error message per (op, status) seen, for the run's summary.
    samples: Mutex<BTreeMap<(String, u16), String>>,
    workspaces: tempfile::TempDir,
}

impl World {
    fn call(&self, op: &str, method: &str, path: &str, body: Option<&str>) -> Option<Resp> {
        let t0 = Instant::now();
        let r = UnixStream::connect(&self.socket).and_then(|mut s| {
            s.set_read_timeout(Some(CALL_DEADLINE))?;
            s.set_write_timeout(Some(CALL_DEADLINE))?;
            raw_http(&mut s, method, path, body, &[("Host", "localhost")])
        });
        let status = r.as_ref().map_or(0, |r| r.status);
        *self
            .outcomes
            .lock()
            .unwrap()
            .entry((op.to_owned(), status))
            .or_default() += 1;
        let ms = t0.elapsed().as_millis();
        match r {
            Err(e) => {
                self.problem(format!("{op} {path}: no answer after {ms} ms: {e}"));
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                ) {
                    // The daemon is gone: stop the run rather than spin.
                    self.dead.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                None
            }
            Ok(r) => {
                if r.status >= 400 {
                    self.samples
                        .lock()
                        .unwrap()
                        .entry((op.to_owned(), r.status))
                        .or_insert_with(|| r.text().chars().take(300).collect());
                }
                if r.status >= 500 && r.status != 503 {
                    self.problem(format!(
                        "{op} {path}: {} after {ms} ms: {}",
                        r.status,
                        r.text()
                    ));
                }
                Some(r)
            }
        }
    }

    fn problem(&self, p: String) {
        eprintln!("PROBLEM: {p}");
        self.problems.lock().unwrap().push(p);
    }

    fn pick(&self, rng: &mut Rng) -> Option<Sandbox> {
        let s = self.sandboxes.lock().unwrap();
        (!s.is_empty()).then(|| s[rng.below(s.len())].clone())
    }

    fn count(&self) -> usize {
        self.sandboxes.lock().unwrap().len()
    }

    fn add(&self, id: &str, ws: &Path) {
        self.sandboxes.lock().unwrap().push(Sandbox {
            id: id.to_owned(),
            ws: ws.to_owned(),
        });
    }

    fn forget(&self, id: &str) {
        self.sandboxes.lock().unwrap().retain(|s| s.id != id);
    }

    fn create(&self) {
        let ws = tempfile::tempdir_in(self.workspaces.path()).unwrap().keep();
        std::fs::write(ws.join("README"), "torture\n").unwrap();
        let body = serde_json::json!({"workspace": {"host_path": ws}}).to_string();
        if let Some(r) = self.call("create", "POST", "/v1/sandboxes", Some(&body))
            && r.status == 201
        {
            self.add(r.json()["id"].as_str().unwrap(), &ws);
        }
    }

    fn exec(&self, sb: &Sandbox, n: u64) {
        let body =
            serde_json::json!({"cmd": format!("echo {n} > /workspace/out-{}.txt; echo ok", n % 4)})
                .to_string();
        let path = format!("/v1/sandboxes/{}/exec", sb.id);
        if let Some(r) = self.call("exec", "POST", &path, Some(&body))
            && r.status == 200
        {
            // The stream ends with `exit` or `error`, never just stops.
            let last = r
                .text()
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .map(str::to_owned);
            let kind = last
                .as_deref()
                .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .and_then(|v| v["type"].as_str().map(str::to_owned));
            if !matches!(kind.as_deref(), Some("exit" | "error")) {
                self.problem(format!(
                    "exec in {}: the stream ended without exit/error: {last:?}",
                    sb.id
                ));
            }
        }
    }

    fn restore(&self, sb: &Sandbox, rng: &mut Rng) {
        let list = self.call(
            "snapshots",
            "GET",
            &format!("/v1/sandboxes/{}/snapshots", sb.id),
            None,
        );
        let snaps: Vec<String> = list
            .filter(|r| r.status == 200)
            .map(|r| {
                r.json()["snapshots"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if snaps.is_empty() {
            self.call(
                "snapshot",
                "POST",
                &format!("/v1/sandboxes/{}/snapshots", sb.id),
                Some("{}"),
            );
            return;
        }
        let body = serde_json::json!({"snapshot": snaps[rng.below(snaps.len())]}).to_string();
        self.call(
            "restore",
            "POST",
            &format!("/v1/sandboxes/{}/restore", sb.id),
            Some(&body),
        );
    }

    fn fork(&self, sb: &Sandbox) {
        let path = format!("/v1/sandboxes/{}/fork", sb.id);
        if let Some(r) = self.call("fork", "POST", &path, Some(r#"{"count":1}"#))
            && r.status == 201
        {
            for c in r.json()["sandboxes"].as_array().into_iter().flatten() {
                self.add(c["id"].as_str().unwrap(), &sb.ws);
            }
        }
    }

    fn remove(&self, sb: &Sandbox) {
        let path = format!("/v1/sandboxes/{}", sb.id);
        if let Some(r) = self.call("rm", "DELETE", &path, None)
            && matches!(r.status, 200 | 404)
        {
            self.forget(&sb.id);
        }
    }

    /// One random call.
    fn step(&self, rng: &mut Rng) {
        let roll = rng.below(100);
        let Some(sb) = self.pick(rng) else {
            return self.create();
        };
        let p = |op: &str| format!("/v1/sandboxes/{}/{op}", sb.id);
        match roll {
            0..=29 => self.exec(&sb, rng.next()),
            30..=39 => drop(self.call("pause", "POST", &p("pause"), None)),
            40..=47 => drop(self.call("resume", "POST", &p("resume"), None)),
            48..=57 => drop(self.call("snapshot", "POST", &p("snapshots"), Some("{}"))),
            58..=67 => self.restore(&sb, rng),
            68..=79 => drop(self.call("apply", "POST", &p("apply"), Some("{}"))),
            80..=84 if self.count() < 3 => self.fork(&sb),
            85..=91 if self.count() < 3 => self.create(),
            85..=99 if self.count() > 1 => self.remove(&sb),
            _ => drop(self.call("get", "GET", &format!("/v1/sandboxes/{}", sb.id), None)),
        }
    }
}

/// QEMU processes of this daemon's data root, by the sandbox directory their pidfile is in.
fn qemus_by_sandbox(root: &Path) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    let root = root.to_string_lossy().into_owned();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.first().is_some_and(|a| a.contains("qemu")) {
            continue;
        }
        let cwd = std::fs::read_link(e.path().join("cwd"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let pidfile = args
            .iter()
            .position(|a| a == "-pidfile")
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_default();
        let own = if pidfile.starts_with('/') {
            pidfile
        } else {
            format!("{cwd}/{pidfile}")
        };
        if !own.contains(&root) && !args.iter().any(|a| a.contains(&root)) {
            continue;
        }
        let id = own
            .split('/')
            .skip_while(|c| *c != "sandboxes")
            .nth(1)
            .unwrap_or("(not a sandbox)")
            .to_owned();
        out.entry(id).or_default().push(pid);
    }
    out
}

/// Every way the daemon's books and the host disagree; empty when they balance.
fn imbalances(d: &Daemon) -> Vec<String> {
    let mut bad = Vec::new();
    let before = d.request("GET", "/v1/sandboxes", None).json();
    let qemus = qemus_by_sandbox(&d.root().canonicalize().unwrap());
    let health = d.request("GET", "/v1/health", None).json();
    let after = d.request("GET", "/v1/sandboxes", None).json();
    if before != after {
        return vec!["the sandboxes changed while they were checked".into()];
    }
    let mut states = HashMap::new();
    let mut running: HashSet<String> = HashSet::new();
    for s in before["sandboxes"].as_array().into_iter().flatten() {
        let id = s["id"].as_str().unwrap().to_owned();
        let state = s["state"].as_str().unwrap().to_owned();
        let n = qemus.get(&id).map_or(0, Vec::len);
        match state.as_str() {
            "ready" if n == 1 => {
                running.insert(id.clone());
            }
            "ready" => bad.push(format!("{id} is ready with {n} QEMU processes")),
            "paused" if n == 0 => {}
            "paused" => bad.push(format!("{id} is paused but {n} QEMU processes run for it")),
            s => bad.push(format!(
                "{id} is {s} ({}) with {n} QEMU",
                s_err(s, &before, &id)
            )),
        }
        states.insert(id, state);
    }
    for (id, pids) in &qemus {
        if !states.contains_key(id) {
            bad.push(format!("QEMU {pids:?} runs for {id}, which has no record"));
        }
    }
    let cap = &health["capacity"];
    let held: HashSet<String> = cap["reservations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    if held != running {
        bad.push(format!(
            "the ledger holds {held:?} but these run: {running:?}"
        ));
    }
    let vcpus: u64 = cap["reservations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| r["vcpus"].as_u64().unwrap())
        .sum();
    if cap["reserved_vcpus"].as_u64() != Some(vcpus) || vcpus != running.len() as u64 {
        bad.push(format!(
            "the ledger's sums disagree: reserved_vcpus {} for {} running 1-vCPU sandboxes",
            cap["reserved_vcpus"],
            running.len()
        ));
    }
    bad
}

fn s_err(_state: &str, list: &serde_json::Value, id: &str) -> String {
    list["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["id"] == id)
        .map(|s| s["error"].to_string())
        .unwrap_or_default()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn random_lifecycle_calls_leave_the_books_balanced() {
    let Some(mut d) = vm_daemon(CONFIG) else {
        return;
    };
    let seed = env_u64("TRYBOXI_TORTURE_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let secs = env_u64("TRYBOXI_TORTURE_SECS").unwrap_or(60);
    println!("lifecycle torture: TRYBOXI_TORTURE_SEED={seed} TRYBOXI_TORTURE_SECS={secs}");
    let world = Arc::new(World {
        socket: d.socket(),
        sandboxes: Mutex::new(Vec::new()),
        outcomes: Mutex::new(BTreeMap::new()),
        problems: Mutex::new(Vec::new()),
        samples: Mutex::new(BTreeMap::new()),
        dead: Default::default(),
        workspaces: tempfile::tempdir().unwrap(),
    });
    // Two sandboxes to start from (not counted in the run's time).
    for _ in 0..2 {
        world.create();
    }
    assert!(
        world.count() > 0,
        "no sandbox could be created: {}",
        d.log_text()
    );
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(secs);
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let world = world.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(seed ^ (w as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
                let mut calls = 0u32;
                while Instant::now() < end && !world.dead.load(std::sync::atomic::Ordering::Relaxed)
                {
                    world.step(&mut rng);
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    let calls: u32 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let log = d.log.clone();
    if let Some(st) = d.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
        let keep = std::env::temp_dir().join(format!("torture-daemon-{seed}.log"));
        let _ = std::fs::copy(&log, &keep);
        panic!(
            "seed {seed}: the daemon exited ({st}) during the run; its log: {}",
            keep.display()
        );
    }
    println!(
        "{calls} steps in {} s; outcomes (op, status): {:?}",
        t0.elapsed().as_secs(),
        world.outcomes.lock().unwrap()
    );
    for ((op, status), msg) in world.samples.lock().unwrap().iter() {
        println!("  {op} {status}: {msg}");
    }

    // Let in-flight background work (a VM's exit after a pause, an idle pause) land, then the
    // books must balance; an idle pause between two reads is retried, never excused.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut bad = imbalances(&d);
    while !bad.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        bad = imbalances(&d);
    }
    let problems = world.problems.lock().unwrap().clone();
    if !bad.is_empty() || !problems.is_empty() {
        let keep = std::env::temp_dir().join(format!("torture-daemon-{seed}.log"));
        let _ = std::fs::copy(&log, &keep);
        eprintln!("the daemon's log: {}", keep.display());
    }
    assert!(
        bad.is_empty() && problems.is_empty(),
        "seed {seed}: imbalances {bad:#?}\nproblems {problems:#?}\n{}",
        d.log_text()
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Removing everything leaves no QEMU behind.
    for sb in world.sandboxes.lock().unwrap().clone().into_iter().rev() {
        let r = d.request("DELETE", &format!("/v1/sandboxes/{}", sb.id), None);
        assert!(
            matches!(r.status, 200 | 404),
            "rm {}: {} {}",
            sb.id,
            r.status,
            r.text()
        );
    }
    let left = d.request("GET", "/v1/sandboxes", None).json();
    for s in left["sandboxes"].as_array().into_iter().flatten() {
        let r = d.request(
            "DELETE",
            &format!("/v1/sandboxes/{}", s["id"].as_str().unwrap()),
            None,
        );
        assert!(matches!(r.status, 200 | 404), "{}", r.text());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !qemus_by_sandbox(&d.root().canonicalize().unwrap()).is_empty()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        qemus_by_sandbox(&d.root().canonicalize().unwrap()).is_empty(),
        "QEMU left after removing every sandbox"
    );
}
