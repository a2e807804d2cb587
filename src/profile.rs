//! Opt-in stage timing for finding where a forward pass spends its time: `STATECUT_PROFILE=1`
//! makes every [`mark`] wait for the device and charge the time since the previous mark to the
//! named stage; the command prints the table at exit. Off, a mark is one atomic load.
//! Synchronising after every stage costs some overlap, so profiled runs are a little slower.

use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Totals {
    last: Option<Instant>,
    /// Per stage: total, calls, longest call (a first call that loads kernels stands out).
    stages: BTreeMap<&'static str, (Duration, u64, Duration)>,
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("STATECUT_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

fn totals() -> &'static Mutex<Totals> {
    static T: OnceLock<Mutex<Totals>> = OnceLock::new();
    T.get_or_init(Default::default)
}

/// Charge the time since the previous mark (after `dev` finishes its queued work) to `stage`.
pub fn mark(stage: &'static str, dev: &Device) {
    if !enabled() {
        return;
    }
    let _ = dev.synchronize();
    let now = Instant::now();
    let mut t = totals().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(last) = t.last {
        let e = t.stages.entry(stage).or_default();
        e.0 += now - last;
        e.1 += 1;
        e.2 = e.2.max(now - last);
    }
    t.last = Some(now);
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
