//! `statecut_report.json` and `statecut_report.md`: what a prune run did, head by head.

use crate::select::HeadChoice;
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct HeadReport {
    pub head: usize,
    #[serde(flatten)]
    pub choice: HeadChoice,
    /// σ_max, σ_min, κ of the head's joint key/query calibration activations [K; Q]:
    /// all channels, and the kept channels.
    pub before: Option<crate::select::ColumnStats>,
    pub after: Option<crate::select::ColumnStats>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    pub layer: usize,
    pub heads: Vec<HeadReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub data: String,
    pub windows: usize,
    pub seqlen: usize,
    pub before: f64,
    pub after: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CalibrationInfo {
    pub source: String,
    pub sequences: usize,
    pub seqlen: usize,
    pub tokens: usize,
    pub rows_per_layer: usize,
}

/// How the run held the model, and the most memory it used.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryInfo {
    /// Whether a model ran layer-streamed (one layer's weights on the device at a time).
    pub streamed: bool,
    /// Peak device memory in bytes (the CPU: the process's peak resident set).
    pub peak_bytes: Option<u64>,
    /// How `peak_bytes` was measured.
    pub measured: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct PruneReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub model: String,
    pub model_type: String,
    pub family: String,
    pub output: String,
    /// The effective settings (recipe with defaults applied).
    pub plan: crate::recipe::Plan,
    pub dk_before: usize,
    pub dk_after: usize,
    pub layers_pruned: usize,
    pub key_heads_per_layer: usize,
    pub state_elems_before: usize,
    pub state_elems_after: usize,
    pub params_before: usize,
    pub params_after: usize,
    pub calibration: Option<CalibrationInfo>,
    pub ppl: Option<Perplexity>,
    /// Where the output runs and the engine limits its key width hits.
    pub serving: crate::serving::Serving,
    /// Wall-clock seconds per stage (load, tokenize, calibrate, select, evaluate_before, write,
    /// reload_evaluate) and in total, from the planning step on.
    pub seconds: std::collections::BTreeMap<String, f64>,
    /// Heads whose strong-RRQR bounds hold / heads checked (DRRQR only).
    pub rrqr_bounds_hold: Option<(usize, usize)>,
    pub memory: MemoryInfo,
    pub layers: Vec<LayerReport>,
}

fn pct(before: usize, after: usize) -> f64 {
    100.0 * (after as f64 - before as f64) / before.max(1) as f64
}

impl PruneReport {
    /// The one-line summary printed at the end of a run.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} layers, {} heads: d_k {} -> {}, state {:+.1}%, params {:+.2}%",
            self.layers_pruned,
            self.key_heads_per_layer,
            self.dk_before,
            self.dk_after,
            pct(self.state_elems_before, self.state_elems_after),
            pct(self.params_before, self.params_after)
        );
        if let Some(p) = &self.ppl {
            s += &format!(", ppl {:.2} -> {:.2}", p.before, p.after);
        }
        s
    }

    pub fn markdown(&self) -> String {
        let mut s = format!("# statecut prune report\n\n{}\n\n", self.summary());
        s += "| setting | value |\n|---|---|\n";
        s += &format!("| model | `{}` ({}) |\n", self.model, self.model_type);
        s += &format!("| method | {} |\n| ratio | {} |\n", self.plan.method.name(), self.plan.ratio);
        s += &format!("| d_k | {} -> {} |\n", self.dk_before, self.dk_after);
        s += &format!("| state elements | {} -> {} |\n", self.state_elems_before, self.state_elems_after);
        s += &format!("| parameters | {} -> {} |\n", self.params_before, self.params_after);
        if let Some(c) = &self.calibration {
            s += &format!(
                "| calibration | {} ({} sequences of {} tokens, {} tokens, {} rows/layer) |\n",
                c.source, c.sequences, c.seqlen, c.tokens, c.rows_per_layer
            );
        }
        if let Some(a) = &self.plan.activations {
            s += &format!(
                "| activations | `{}` (sha256 `{}`) |\n",
                a.path.display(),
                a.sha256.as_deref().unwrap_or("-")
            );
        }
        if let Some(p) = &self.ppl {
            s += &format!(
                "| perplexity ({}, {} x {}) | {:.3} -> {:.3} |\n",
                p.data, p.windows, p.seqlen, p.before, p.after
            );
        }
        if let Some((ok, n)) = self.rrqr_bounds_hold {
            s += &format!("| strong-RRQR bounds hold | {ok} / {n} heads |\n");
        }
        let m = &self.memory;
        s += &format!("| layer-streamed | {} |\n", if m.streamed { "yes" } else { "no" });
        if let Some(b) = m.peak_bytes {
            s += &format!("| peak memory | {} ({}) |\n", crate::stream::human(b), m.measured);
        }
        s += &format!("| statecut | {} |\n\n", self.version);
        s += &self.serving.markdown();
        s += "## Per head\n\n| layer | head | kappa before | kappa after | kept channels |\n|---|---|---|---|---|\n";
        let f = |x: Option<crate::select::ColumnStats>| x.map_or("-".to_string(), |v| format!("{:.1}", v.kappa));
        for l in &self.layers {
            for h in &l.heads {
                let mut kept = h.choice.kept.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
                if let Some(r) = &h.choice.rrqr {
                    kept += &format!(" (swaps {}, bounds {})", r.swaps, if r.bounds_hold { "hold" } else { "FAIL" });
                }
                s += &format!("| {} | {} | {} | {} | {} |\n", l.layer, h.head, f(h.before), f(h.after), kept);
            }
        }
        s
    }
}
