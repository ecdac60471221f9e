//! Per-phase traces: spans (`scheduler.reserve`, `vm.boot`, `guest.connect`,
//! `workspace.sync`, `exec.spawn`, `exec`, `output.flush`, ...) kept per sandbox id and per
//! exec id, in memory with a bound (the newest [`MAX_TRACES`] traces, or `[telemetry]`
//! `trace_max_count`, none older than `trace_max_age_s`, [`MAX_SPANS`] spans each, attribute
//! values cut to [`MAX_ATTR_BYTES`]).
//! A finished trace is also handed to the OTLP exporter when one is configured.
//!
//! Never: blocks on export (the exporter batches in the background) or keeps unbounded state.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub const MAX_TRACES: usize = 1024;
pub const MAX_SPANS: usize = 128;
/// Longest attribute value kept (longer ones are cut at a character boundary).
pub const MAX_ATTR_BYTES: usize = 1024;
/// Default age past which a trace is dropped (when a new one comes).
pub const MAX_AGE: Duration = Duration::from_secs(86_400);

/// One timed phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub name: String,
    /// Wall-clock start, nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attrs: BTreeMap<String, String>,
}

/// `GET /v1/traces/{id}`: the spans of a sandbox or an exec, by start time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Trace {
    pub id: String,
    /// True once the traced operation ended (create returned, exec exited).
    pub finished: bool,
    pub spans: Vec<Span>,
}

/// Receives finished traces (the OTLP exporter).
pub trait Exporter: Send + Sync {
    fn export(&self, trace: &Trace);
}

pub struct Traces {
    inner: Mutex<Inner>,
    exporter: Option<Box<dyn Exporter>>,
    max_traces: usize,
    /// `None`: traces are dropped by count only.
    max_age: Option<Duration>,
}

#[derive(Default)]
struct Inner {
    traces: HashMap<String, Kept>,
    /// Insertion order and time, oldest first, for eviction.
    order: VecDeque<(String, Instant)>,
}

/// A trace as the ring keeps it: [`Trace`] without its id (the map's key) and with
/// [`KeptSpan`]s. A [`Span`]'s attribute map allocates a whole B-tree node (about half a
/// KiB) for its first attribute; with 1,024 traces kept that was most of the ring's memory
/// (bench row (n)).
#[derive(Default)]
struct Kept {
    finished: bool,
    spans: Vec<KeptSpan>,
}

/// A [`Span`] as kept: its attributes a boxed slice sorted by key, one value per key (what
/// the map held).
struct KeptSpan {
    name: Box<str>,
    start_unix_ns: u64,
    duration_ns: u64,
    attrs: Box<[(Box<str>, Box<str>)]>,
}

impl KeptSpan {
    /// `attrs` in order, a later value of a key replacing an earlier one (as a map insert),
    /// each value cut to [`MAX_ATTR_BYTES`] before it is copied.
    fn new(name: &str, start_unix_ns: u64, duration_ns: u64, attrs: &[(&str, String)]) -> KeptSpan {
        let mut kept: Vec<(Box<str>, Box<str>)> = Vec::with_capacity(attrs.len());
        for (k, v) in attrs {
            let v: Box<str> = cap_attr(v).into();
            match kept.iter_mut().find(|(have, _)| **have == **k) {
                Some(slot) => slot.1 = v,
                None => kept.push(((*k).into(), v)),
            }
        }
        kept.sort_by(|a, b| a.0.cmp(&b.0));
        KeptSpan {
            name: name.into(),
            start_unix_ns,
            duration_ns,
            attrs: kept.into_boxed_slice(),
        }
    }

    fn to_span(&self) -> Span {
        Span {
            name: self.name.to_string(),
            start_unix_ns: self.start_unix_ns,
            duration_ns: self.duration_ns,
            attrs: self
                .attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }
}

impl Kept {
    /// The API's [`Trace`] of this one, its spans by start time.
    fn to_trace(&self, id: &str) -> Trace {
        let mut spans: Vec<Span> = self.spans.iter().map(KeptSpan::to_span).collect();
        spans.sort_by_key(|s| s.start_unix_ns);
        Trace {
            id: id.to_owned(),
            finished: self.finished,
            spans,
        }
    }
}

/// `v` cut to at most [`MAX_ATTR_BYTES`] at a character boundary.
fn cap_attr(v: &str) -> &str {
    if v.len() <= MAX_ATTR_BYTES {
        return v;
    }
    let mut end = MAX_ATTR_BYTES;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    &v[..end]
}

/// Seconds since the Unix epoch, now.
pub fn unix_secs_now() -> u64 {
    unix_ns(SystemTime::now()) / 1_000_000_000
}

pub fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The wall-clock time of a monotonic instant in the past.
fn instant_to_unix_ns(i: Instant) -> u64 {
    unix_ns(SystemTime::now()).saturating_sub(i.elapsed().as_nanos() as u64)
}

impl Traces {
    #[cfg(test)]
    pub fn new(exporter: Option<Box<dyn Exporter>>) -> Traces {
        Traces::with_retention(exporter, MAX_TRACES, Some(MAX_AGE))
    }

    /// Keep at most `max_traces` (at least 1), none older than `max_age` once a newer one comes.
    pub fn with_retention(
        exporter: Option<Box<dyn Exporter>>,
        max_traces: usize,
        max_age: Option<Duration>,
    ) -> Traces {
        Traces {
            inner: Mutex::new(Inner::default()),
            exporter,
            max_traces: max_traces.max(1),
            max_age,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a span of `trace_id` that started at `start` and ends now.
    pub fn record(&self, trace_id: &str, name: &str, start: Instant, attrs: &[(&str, String)]) {
        let span = KeptSpan::new(
            name,
            instant_to_unix_ns(start),
            (start.elapsed().as_nanos() as u64).max(1),
            attrs,
        );
        self.keep(trace_id, span);
    }

    /// A span that ends (and is recorded) when the guard is dropped.
    pub fn span<'a>(&'a self, trace_id: &str, name: &'static str) -> SpanGuard<'a> {
        SpanGuard {
            traces: self,
            trace_id: trace_id.to_owned(),
            name,
            start: Instant::now(),
            attrs: Vec::new(),
        }
    }

    fn keep(&self, trace_id: &str, span: KeptSpan) {
        let mut g = self.lock();
        if !g.traces.contains_key(trace_id) {
            let now = Instant::now();
            let expired = |t: Instant| self.max_age.is_some_and(|a| now.duration_since(t) > a);
            while g.traces.len() >= self.max_traces
                || g.order.front().is_some_and(|(_, t)| expired(*t))
            {
                let Some((old, _)) = g.order.pop_front() else {
                    break;
                };
                g.traces.remove(&old);
            }
            g.order.push_back((trace_id.to_owned(), now));
            g.traces.insert(trace_id.to_owned(), Kept::default());
        }
        if let Some(t) = g.traces.get_mut(trace_id)
            && t.spans.len() < MAX_SPANS
        {
            t.spans.push(span);
        }
    }

    /// Mark a trace finished and export it.
    pub fn finish(&self, trace_id: &str) {
        let done = {
            let mut g = self.lock();
            let Some(t) = g.traces.get_mut(trace_id) else {
                return;
            };
            t.finished = true;
            t.spans.shrink_to_fit();
            t.to_trace(trace_id)
        };
        if let Some(x) = &self.exporter {
            x.export(&done);
        }
    }

    /// The spans of a trace, by start time.
    pub fn get(&self, trace_id: &str) -> Option<Trace> {
        Some(self.lock().traces.get(trace_id)?.to_trace(trace_id))
    }
}

/// Records its span when dropped. Add attributes with [`SpanGuard::attr`].
pub struct SpanGuard<'a> {
    traces: &'a Traces,
    trace_id: String,
    name: &'static str,
    start: Instant,
    attrs: Vec<(&'static str, String)>,
}

impl SpanGuard<'_> {
    pub fn attr(&mut self, key: &'static str, value: impl ToString) {
        self.attrs.push((key, value.to_string()));
    }
}

impl Drop for SpanGuard<'_> {
    fn drop(&mut self) {
        self.traces
            .record(&self.trace_id, self.name, self.start, &self.attrs);
    }
}

/// A text waterfall: one line per span with its start offset, duration and a bar.
pub fn waterfall(t: &Trace, width: usize) -> String {
    let mut out = format!(
        "trace {}{}\n",
        t.id,
        if t.finished { "" } else { " (in progress)" }
    );
    let Some(t0) = t.spans.iter().map(|s| s.start_unix_ns).min() else {
        out.push_str("  (no spans)\n");
        return out;
    };
    let end = t
        .spans
        .iter()
        .map(|s| s.start_unix_ns + s.duration_ns)
        .max()
        .unwrap_or(t0);
    let total = (end - t0).max(1) as f64;
    let name_w = t
        .spans
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(4)
        .max(5);
    out.push_str(&format!(
        "  {:<name_w$} {:>10} {:>10}  0{}{}\n",
        "phase",
        "start",
        "duration",
        " ".repeat(width.saturating_sub(2)),
        fmt_ms(end - t0)
    ));
    for s in &t.spans {
        let off = s.start_unix_ns - t0;
        let a = ((off as f64 / total) * width as f64).floor() as usize;
        let len = ((s.duration_ns as f64 / total) * width as f64)
            .ceil()
            .max(1.0) as usize;
        let a = a.min(width.saturating_sub(1));
        let len = len.min(width - a);
        let bar = format!("{}{}", " ".repeat(a), "█".repeat(len));
        let attrs: Vec<String> = s.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!(
            "  {:<name_w$} {:>10} {:>10}  |{:<width$}| {}\n",
            s.name,
            fmt_ms(off),
            fmt_ms(s.duration_ns),
            bar,
            attrs.join(" ")
        ));
    }
    out
}

fn fmt_ms(ns: u64) -> String {
    let ms = ns as f64 / 1e6;
    if ms >= 1000.0 {
        format!("{:.2}s", ms / 1000.0)
    } else {
        format!("{ms:.2}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex as StdMutex};
    use std::time::Duration;

    #[test]
    fn spans_come_back_in_start_order_with_nonzero_durations() {
        let t = Traces::new(None);
        let a = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        {
            let mut g = t.span("exe_1", "exec");
            g.attr("exit_code", 0);
        }
        t.record("exe_1", "exec.spawn", a, &[]);
        let tr = t.get("exe_1").unwrap();
        let names: Vec<&str> = tr.spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["exec.spawn", "exec"]);
        assert!(tr.spans.iter().all(|s| s.duration_ns > 0));
        assert!(tr.spans[0].duration_ns >= 2_000_000);
        assert_eq!(tr.spans[1].attrs["exit_code"], "0");
        assert!(!tr.finished);
    }

    #[test]
    fn old_traces_are_evicted_past_the_bound() {
        let t = Traces::new(None);
        for i in 0..MAX_TRACES + 5 {
            t.record(&format!("exe_{i}"), "exec", Instant::now(), &[]);
        }
        assert!(t.get("exe_0").is_none());
        assert!(t.get("exe_4").is_none());
        assert!(t.get("exe_5").is_some());
        for _ in 0..MAX_SPANS + 3 {
            t.record("exe_5", "x", Instant::now(), &[]);
        }
        assert_eq!(t.get("exe_5").unwrap().spans.len(), MAX_SPANS);
    }

    #[test]
    fn traces_past_the_count_or_age_are_dropped_and_long_attributes_cut() {
        let t = Traces::with_retention(None, 3, Some(Duration::from_millis(50)));
        let long = "é".repeat(MAX_ATTR_BYTES);
        for i in 0..10 {
            t.record(
                &format!("exe_{i}"),
                "exec",
                Instant::now(),
                &[("error", long.clone())],
            );
        }
        assert!(t.get("exe_6").is_none());
        assert!(t.get("exe_7").is_some() && t.get("exe_9").is_some());
        let v = &t.get("exe_9").unwrap().spans[0].attrs["error"];
        assert!(
            v.len() <= MAX_ATTR_BYTES && v.len() >= MAX_ATTR_BYTES - 1,
            "{}",
            v.len()
        );
        std::thread::sleep(Duration::from_millis(80));
        t.record("exe_new", "exec", Instant::now(), &[]);
        assert!(t.get("exe_9").is_none(), "an old trace outlived its age");
        assert!(t.get("exe_new").is_some());
        assert_eq!(t.lock().traces.len(), 1);
    }

    #[test]
    fn attributes_come_back_as_a_map_the_last_value_of_a_key_winning() {
        let t = Traces::new(None);
        t.record(
            "exe_1",
            "exec",
            Instant::now(),
            &[("z", "1".into()), ("a", "2".into()), ("z", "3".into())],
        );
        let tr = t.get("exe_1").unwrap();
        let attrs: Vec<(&str, &str)> = tr.spans[0]
            .attrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(attrs, [("a", "2"), ("z", "3")]);
    }

    struct Collect(Arc<StdMutex<Vec<Trace>>>);
    impl Exporter for Collect {
        fn export(&self, trace: &Trace) {
            self.0.lock().unwrap().push(trace.clone());
        }
    }

    #[test]
    fn finishing_a_trace_exports_it() {
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let t = Traces::new(Some(Box::new(Collect(seen.clone()))));
        t.record("sbx_1", "vm.boot", Instant::now(), &[]);
        t.finish("sbx_1");
        t.finish("sbx_unknown");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert!(seen[0].finished && seen[0].spans[0].name == "vm.boot");
    }

    #[test]
    fn waterfall_shows_offsets_durations_and_bars() {
        let tr = Trace {
            id: "exe_1".into(),
            finished: true,
            spans: vec![
                Span {
                    name: "exec.spawn".into(),
                    start_unix_ns: 1_000_000_000,
                    duration_ns: 10_000_000,
                    attrs: BTreeMap::new(),
                },
                Span {
                    name: "exec".into(),
                    start_unix_ns: 1_010_000_000,
                    duration_ns: 30_000_000,
                    attrs: BTreeMap::new(),
                },
            ],
        };
        let w = waterfall(&tr, 40);
        let lines: Vec<&str> = w.lines().collect();
        assert!(
            lines[2].contains("exec.spawn")
                && lines[2].contains("0.00ms")
                && lines[2].contains("10.00ms"),
            "{w}"
        );
        assert!(
            lines[3].contains("10.00ms") && lines[3].contains("30.00ms"),
            "{w}"
        );
        // The second bar starts where the first ends: a quarter of the width.
        let bar = lines[3].split('|').nth(1).unwrap();
        assert_eq!(bar.chars().take_while(|c| *c == ' ').count(), 10, "{w}");
        assert_eq!(bar.chars().filter(|c| *c == '█').count(), 30, "{w}");
    }
}
