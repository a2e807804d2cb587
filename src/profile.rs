//! Opt-in stage timing for finding where a forward pass spends its time (`STATECUT_PROFILE=1`;
//! the command prints the table at exit). The parts of a model time themselves as wrappers do
//! (candle-transformers' `with_tracing`): a [`Span`] opened by a projection, a short conv, a
//! recurrence, a decoder layer's step or the observer covers that part's work, and a part's own
//! time excludes the spans opened inside it. Inside an op, [`mark`] charges the time since the
//! previous event to a named stage of that op; the time between the outermost spans that no mark
//! claims is "between spans", so the stages add up to the wall time. Every event waits for the
//! device, which costs some overlap, so profiled runs are a little slower; off, an event is one
//! atomic load.

use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

struct Open {
    stage: &'static str,
    start: Instant,
    /// Time of the spans and marks inside this span.
    inner: Duration,
}

#[derive(Default)]
struct Totals {
    last: Option<Instant>,
    /// The spans open now, innermost last.
    open: Vec<Open>,
    /// Per stage: total, calls, longest call (a first call that loads kernels stands out).
    stages: BTreeMap<&'static str, (Duration, u64, Duration)>,
}

/// The stage of the time between the outermost spans that no mark claims: host work between
/// the parts of a pass (the loop around the layers, setting up the next batch) and the device
/// work it queued.
const OUTSIDE: &str = "between spans";

pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("STATECUT_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

fn totals() -> &'static Mutex<Totals> {
    static T: OnceLock<Mutex<Totals>> = OnceLock::new();
    T.get_or_init(Default::default)
}

impl Totals {
    fn add(&mut self, stage: &'static str, own: Duration, whole: Duration) {
        let e = self.stages.entry(stage).or_default();
        e.0 += own;
        e.1 += 1;
        e.2 = e.2.max(whole);
    }
}

fn now_after(dev: &Device) -> (Instant, std::sync::MutexGuard<'static, Totals>) {
    let _ = dev.synchronize();
    (Instant::now(), totals().lock().unwrap_or_else(|e| e.into_inner()))
}

/// Charge the time since the previous event (after `dev` finishes its queued work) to `stage`.
pub fn mark(stage: &'static str, dev: &Device) {
    if !enabled() {
        return;
    }
    let (now, mut t) = now_after(dev);
    if let Some(last) = t.last {
        let d = now - last;
        t.add(stage, d, d);
        if let Some(o) = t.open.last_mut() {
            o.inner += d;
        }
    }
    t.last = Some(now);
}

/// Time spent in one part of a forward until the span is dropped; see [`span`].
#[must_use = "a span times the work until it is dropped"]
pub struct Span {
    dev: Option<Device>,
}

/// Open a span named `stage`: the work queued on `dev` from now until the span is dropped is
/// charged to `stage`, less the spans and marks inside it.
pub fn span(stage: &'static str, dev: &Device) -> Span {
    if !enabled() {
        return Span { dev: None };
    }
    let (now, mut t) = now_after(dev);
    // The time before the span is the enclosing part's own; with none open, it is charged to
    // OUTSIDE, so that the table's total is the wall time from the first event to the last.
    if let (None, Some(last)) = (t.open.last(), t.last) {
        let d = now - last;
        t.add(OUTSIDE, d, d);
    }
    t.open.push(Open { stage, start: now, inner: Duration::ZERO });
    t.last = Some(now);
    Span { dev: Some(dev.clone()) }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some(dev) = self.dev.take() else { return };
        let (now, mut t) = now_after(&dev);
        if let Some(o) = t.open.pop() {
            let whole = now - o.start;
            t.add(o.stage, whole.saturating_sub(o.inner), whole);
            if let Some(parent) = t.open.last_mut() {
                parent.inner += whole;
            }
        }
        t.last = Some(now);
    }
}

/// The table of stages by total time, or `None` when profiling is off or nothing was marked.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let t = totals().lock().unwrap_or_else(|e| e.into_inner());
    if t.stages.is_empty() {
        return None;
    }
    let all: f64 = t.stages.values().map(|(d, _, _)| d.as_secs_f64()).sum();
    let mut rows: Vec<_> = t.stages.iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .0));
    let mut out = format!("{:<24} {:>10} {:>7} {:>9} {:>11}\n", "stage", "seconds", "share", "calls", "longest ms");
    for (name, (d, n, m)) in rows {
        let s = d.as_secs_f64();
        let share = 100.0 * s / all.max(1e-12);
        out += &format!("{name:<24} {s:>10.3} {share:>6.1}% {n:>9} {:>11.2}\n", 1e3 * m.as_secs_f64());
    }
    out += &format!("{:<24} {all:>10.3}\n", "total");
    Some(out)
}
