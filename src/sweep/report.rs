//! `sweep.json`, `sweep.md` and the curves: the grid's numbers, the recommendation and the
//! per-layer view.

use super::{Cell, Settings};
use crate::arch::StateLayout;
use crate::plot::{curves_svg, Series};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// The cell to recommend and why.
#[derive(Debug, Clone, Serialize)]
pub struct Recommendation {
    pub method: String,
    pub ratio: f64,
    pub dk: usize,
    /// State size relative to the unpruned model.
    pub state_fraction: f64,
    /// Relative perplexity increase per evaluation text.
    pub ppl_increase: Vec<f64>,
    /// Relative recall accuracy drop per task.
    pub recall_drop: Vec<f64>,
    /// The `statecut prune` command that writes this model.
    pub command: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub settings: Settings,
    pub family: String,
    pub dk: usize,
    pub layers_pruned: usize,
    pub budget: f64,
    pub unpruned: Cell,
    pub cells: Vec<Cell>,
    /// None when no cell stays within the budget.
    pub recommendation: Option<Recommendation>,
    /// Wall-clock seconds per stage of this run (cells reused from an earlier run cost nothing).
    pub seconds: BTreeMap<String, f64>,
    /// Models evaluated by this run (the rest were reused).
    pub cells_evaluated: usize,
}

/// Relative perplexity increase per text and relative recall drop per task of `c` against `base`
/// (a task the unpruned model fails entirely cannot drop).
fn losses(base: &Cell, c: &Cell) -> (Vec<f64>, Vec<f64>) {
    let ppl = c.ppl.iter().zip(&base.ppl).map(|(p, b)| p / b - 1.0).collect();
    let recall = c
        .recall
        .iter()
        .zip(&base.recall)
        .map(|(r, b)| if b.accuracy > 0.0 { (b.accuracy - r.accuracy) / b.accuracy } else { 0.0 })
        .collect();
    (ppl, recall)
}

/// The largest ratio with a cell whose every loss is within `budget`; among its cells, the one
/// with the smallest mean perplexity increase.
pub fn recommend<'a>(base: &Cell, cells: &'a [Cell], budget: f64) -> Option<&'a Cell> {
    let within = |c: &&Cell| {
        let (p, r) = losses(base, c);
        p.iter().chain(&r).all(|l| *l <= budget + 1e-12)
    };
    let mean = |c: &Cell| {
        let (p, _) = losses(base, c);
        p.iter().sum::<f64>() / p.len().max(1) as f64
    };
    cells.iter().filter(within).max_by(|a, b| a.ratio.total_cmp(&b.ratio).then(mean(b).total_cmp(&mean(a))))
}

/// A shell word, quoted when it needs to be.
fn sh(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,%@+".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The `statecut prune` command that makes the same selection as the cell `c`.
fn prune_command(s: &Settings, c: &Cell) -> String {
    let stem = std::path::Path::new(&s.model).file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let mut w: Vec<String> = vec!["statecut".into(), "prune".into(), "-m".into(), sh(&s.model)];
    let mut flag = |name: &str, v: String| {
        w.push(format!("--{name}"));
        w.push(sh(&v));
    };
    if s.revision != "main" {
        flag("revision", s.revision.clone());
    }
    if let Some(t) = &s.tokenizer {
        flag("tokenizer", t.clone());
    }
    if s.dtype != "auto" {
        flag("dtype", s.dtype.clone());
    }
    if s.device != "cpu" {
        flag("device", s.device.clone());
    }
    flag("method", c.method.clone());
    flag("ratio", c.ratio.to_string());
    if s.round_to > 1 {
        flag("round-to", s.round_to.to_string());
    }
    if c.method == "drrqr" {
        if s.rrqr_f != 1.5 {
            flag("rrqr-f", s.rrqr_f.to_string());
        }
        if s.score_on != "qk" {
            flag("score-on", s.score_on.clone());
        }
    }
    if let Some(src) = &s.calib {
        flag("calib", src.clone());
    }
    if s.text_column != "text" {
        flag("text-column", s.text_column.clone());
    }
    flag("nsamples", s.nsamples.to_string());
    flag("seqlen", s.seqlen.to_string());
    flag("seed", s.seed.to_string());
    flag("rows", s.rows.to_string());
    flag("output", format!("{stem}-{}-{}", c.method, c.ratio));
    w.join(" ")
}

fn pct(x: f64) -> String {
    format!("{:+.2}%", 100.0 * x)
}

/// Short name of an evaluation text (file stem).
fn text_name(s: &str) -> String {
    std::path::Path::new(s).file_stem().map_or(s.to_string(), |n| n.to_string_lossy().into_owned())
}

impl SweepReport {
    pub fn new(
        settings: &Settings,
        layout: &StateLayout,
        budget: f64,
        unpruned: Cell,
        cells: Vec<Cell>,
        seconds: BTreeMap<String, f64>,
        cells_evaluated: usize,
    ) -> Self {
        let recommendation = recommend(&unpruned, &cells, budget).map(|c| {
            let (ppl_increase, recall_drop) = losses(&unpruned, c);
            Recommendation {
                method: c.method.clone(),
                ratio: c.ratio,
                dk: c.dk,
                state_fraction: c.state_elems as f64 / unpruned.state_elems.max(1) as f64,
                ppl_increase,
                recall_drop,
                command: prune_command(settings, c),
            }
        });
        Self {
            tool: "statecut",
            version: env!("CARGO_PKG_VERSION"),
            settings: settings.clone(),
            family: layout.family.clone(),
            dk: layout.dk,
            layers_pruned: layout.layers.len(),
            budget,
            unpruned,
            cells,
            recommendation,
            seconds,
            cells_evaluated,
        }
    }

    fn methods(&self) -> Vec<String> {
        let mut m: Vec<String> = Vec::new();
        for c in &self.cells {
            if !m.contains(&c.method) {
                m.push(c.method.clone());
            }
        }
        m
    }

    fn fraction(&self, c: &Cell) -> f64 {
        c.state_elems as f64 / self.unpruned.state_elems.max(1) as f64
    }

    /// The recommendation in one line (printed at the end of a run).
    pub fn summary(&self) -> String {
        let base: Vec<String> = self.unpruned.ppl.iter().map(|p| format!("{p:.3}")).collect();
        let mut s = format!(
            "{} cells ({} evaluated now), unpruned ppl {}; ",
            self.cells.len() + 1,
            self.cells_evaluated,
            base.join(" / ")
        );
        match &self.recommendation {
            Some(r) => {
                let _ = write!(
                    s,
                    "recommended within {}: {} ratio {} (d_k {} -> {}, state {:.1}%): {}",
                    pct(self.budget).trim_start_matches('+'),
                    r.method,
                    r.ratio,
                    self.dk,
                    r.dk,
                    100.0 * r.state_fraction,
                    r.command
                );
            }
            None => {
                let _ =
                    write!(s, "recommended: none (no ratio stays within {})", pct(self.budget).trim_start_matches('+'));
            }
        }
        s
    }

    pub fn markdown(&self) -> String {
        let st = &self.settings;
        let mut s = "# statecut sweep\n\n".to_string();
        let _ = writeln!(s, "| setting | value |\n|---|---|");
        let _ = writeln!(
            s,
            "| model | `{}` ({}, d_k {}, {} layers pruned) |",
            st.model, self.family, self.dk, self.layers_pruned
        );
        let _ = writeln!(
            s,
            "| calibration | {} ({} x {} tokens, {} rows/layer, seed {}) |",
            st.calib.as_deref().unwrap_or("builtin"),
            st.nsamples,
            st.seqlen,
            st.rows,
            st.seed
        );
        let _ = writeln!(
            s,
            "| evaluation | {} ({} windows x {} tokens) |",
            st.eval.join(", "),
            st.eval_windows,
            st.eval_seqlen
        );
        if !st.recall.is_empty() {
            let names: Vec<&str> = st.recall.iter().map(|t| t.name()).collect();
            let _ = writeln!(s, "| recall | {} |", names.join(", "));
        }
        let _ = writeln!(s, "| budget | {} |\n", pct(self.budget).trim_start_matches('+'));

        s += "## Recommendation\n\n";
        match &self.recommendation {
            Some(r) => {
                let incr: Vec<String> = r.ppl_increase.iter().map(|x| pct(*x)).collect();
                let _ = write!(
                    s,
                    "**{} at ratio {}** (d_k {} -> {}, state {:.1}% of the unpruned), the largest ratio within the budget: perplexity {}",
                    r.method,
                    r.ratio,
                    self.dk,
                    r.dk,
                    100.0 * r.state_fraction,
                    incr.join(", ")
                );
                if !r.recall_drop.is_empty() {
                    // + 0.0: a drop of zero prints as 0.00%, not -0.00%
                    let d: Vec<String> = r.recall_drop.iter().map(|x| pct(-*x + 0.0)).collect();
                    let _ = write!(s, "; recall {}", d.join(", "));
                }
                let _ = writeln!(s, "\n\n```\n{}\n```\n", r.command);
            }
            None => {
                let _ = writeln!(
                    s,
                    "**none**: no ratio keeps every perplexity increase{} within {}.\n",
                    if st.recall.is_empty() { "" } else { " and recall drop" },
                    pct(self.budget).trim_start_matches('+')
                );
            }
        }

        s += "## Grid\n\n| method | ratio | d_k | state |";
        for e in &st.eval {
            let _ = write!(s, " ppl {} |", text_name(e));
        }
        for t in &st.recall {
            let _ = write!(s, " {} |", t.name());
        }
        s += "\n|---|---|---|---|";
        s += &"---|".repeat(st.eval.len() + st.recall.len());
        s += "\n";
        let row = |s: &mut String, c: &Cell, base: Option<&Cell>| {
            let _ = write!(
                s,
                "| {} | {} | {} | {:.1}% |",
                if c.method == "none" { "unpruned" } else { &c.method },
                c.ratio,
                c.dk,
                100.0 * self.fraction(c)
            );
            for (i, p) in c.ppl.iter().enumerate() {
                match base {
                    Some(b) => {
                        let _ = write!(s, " {p:.3} ({}) |", pct(p / b.ppl[i] - 1.0));
                    }
                    None => {
                        let _ = write!(s, " {p:.3} |");
                    }
                }
            }
            for r in &c.recall {
                let _ = write!(s, " {:.3} |", r.accuracy);
            }
            s.push('\n');
        };
        row(&mut s, &self.unpruned, None);
        for c in &self.cells {
            row(&mut s, c, Some(&self.unpruned));
        }

        for (ti, t) in st.recall.iter().enumerate() {
            if *t != crate::recall::Task::Passkey {
                continue;
            }
            let names: Vec<String> = self.unpruned.recall[ti].buckets.iter().map(|b| b.name.clone()).collect();
            let _ = write!(s, "\n### {} accuracy by length and depth\n\n| method | ratio |", t.name());
            for n in &names {
                let _ = write!(s, " {n} |");
            }
            s += "\n|---|---|";
            s += &"---|".repeat(names.len());
            s += "\n";
            for c in std::iter::once(&self.unpruned).chain(&self.cells) {
                let _ = write!(s, "| {} | {} |", if c.method == "none" { "unpruned" } else { &c.method }, c.ratio);
                for b in &c.recall[ti].buckets {
                    let _ = write!(s, " {:.2} |", b.accuracy);
                }
                s.push('\n');
            }
        }

        s += "\n## Per layer\n\nShare of each layer's calibration key/query activations that the kept channels cannot express, ‖M − Π_S M‖_F / ‖M‖_F (mean over heads; 0 = nothing lost).\n\n| layer |";
        let cols: Vec<&Cell> = self.cells.iter().filter(|c| !c.layers.is_empty()).collect();
        for c in &cols {
            let _ = write!(s, " {} {} |", c.method, c.ratio);
        }
        s += "\n|---|";
        s += &"---|".repeat(cols.len());
        s += "\n";
        if let Some(first) = cols.first() {
            for (i, l) in first.layers.iter().enumerate() {
                let _ = write!(s, "| {} |", l.layer);
                for c in &cols {
                    let _ = write!(s, " {:.3} |", c.layers.get(i).map_or(f64::NAN, |x| x.mean));
                }
                s.push('\n');
            }
        }
        s += "\nLayers that lose the most at each method's largest ratio:\n\n";
        for m in self.methods() {
            if let Some(c) = cols.iter().filter(|c| c.method == m).max_by(|a, b| a.ratio.total_cmp(&b.ratio)) {
                let mut ls = c.layers.clone();
                ls.sort_by(|a, b| b.mean.total_cmp(&a.mean));
                let top: Vec<String> = ls
                    .iter()
                    .take(3)
                    .map(|l| format!("layer {} ({:.3}, worst head {} {:.3})", l.layer, l.mean, l.worst_head, l.worst))
                    .collect();
                let _ = writeln!(s, "- {m} {}: {}", c.ratio, top.join(", "));
            }
        }

        s += "\n## Cost\n\n| stage | seconds |\n|---|---|\n";
        for (k, v) in &self.seconds {
            let _ = writeln!(s, "| {k} | {v:.2} |");
        }
        let _ = writeln!(s, "\n{} models evaluated by this run; statecut {}.", self.cells_evaluated, self.version);
        s
    }

    /// (file name, SVG) of every curve.
    pub fn plots(&self) -> Vec<(String, String)> {
        let methods = self.methods();
        let series = |y: &dyn Fn(&Cell) -> f64| -> Vec<Series> {
            methods
                .iter()
                .map(|m| {
                    let mut pts: Vec<(f64, f64)> =
                        self.cells.iter().filter(|c| &c.method == m).map(|c| (self.fraction(c), y(c))).collect();
                    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                    (m.clone(), pts)
                })
                .collect()
        };
        let x_label = "state size (fraction of the unpruned)";
        let mut out = Vec::new();
        for (i, e) in self.settings.eval.iter().enumerate() {
            let name = text_name(e);
            let svg = curves_svg(
                &format!("perplexity on {name} against state size"),
                x_label,
                "perplexity",
                &series(&|c| c.ppl[i]),
                Some(("unpruned", 1.0, self.unpruned.ppl[i])),
            );
            out.push((format!("ppl_{i}_{name}.svg"), svg));
        }
        for (i, t) in self.settings.recall.iter().enumerate() {
            let svg = curves_svg(
                &format!("{} accuracy against state size", t.name()),
                x_label,
                "accuracy",
                &series(&|c| c.recall[i].accuracy),
                Some(("unpruned", 1.0, self.unpruned.recall[i].accuracy)),
            );
            out.push((format!("recall_{}.svg", t.name()), svg));
        }
        // Per layer at each method's largest ratio.
        let per_layer: Vec<Series> = methods
            .iter()
            .filter_map(|m| {
                let c = self
                    .cells
                    .iter()
                    .filter(|c| &c.method == m && !c.layers.is_empty())
                    .max_by(|a, b| a.ratio.total_cmp(&b.ratio))?;
                Some((format!("{m} {}", c.ratio), c.layers.iter().map(|l| (l.layer as f64, l.mean)).collect()))
            })
            .collect();
        if !per_layer.is_empty() {
            out.push((
                "layers.svg".into(),
                curves_svg("activation share lost per layer", "layer", "||M - P_S M|| / ||M||", &per_layer, None),
            ));
        }
        out
    }
}
