//! The recovery report: JSON for tools, Markdown for people, the loss curves as SVG.

use super::state::StepLog;
use serde::Serialize;

/// Perplexity on the evaluation text: the teacher, the pruned model, the trained model in memory, and the written checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct RecoverPpl {
    pub data: String,
    pub windows: usize,
    pub seqlen: usize,
    pub teacher: f64,
    pub pruned: f64,
    /// The trained model in memory, before its tensors are rounded into their stored dtypes.
    pub trained: f64,
    /// The written checkpoint, reloaded.
    pub recovered: f64,
}

/// What was trained.
#[derive(Debug, Clone, Serialize)]
pub struct Trained {
    /// Checkpoint tensors with an adapter.
    pub adapted: Vec<String>,
    /// Checkpoint tensors trained whole.
    pub whole: Vec<String>,
    /// Trained scalars (adapter factors and whole tensors).
    pub params: usize,
}

/// The pruning before the recovery (`prune --recover`); prune's full report is
/// `statecut_report.json` beside this one.
#[derive(Debug, Clone, Serialize)]
pub struct Pruning {
    pub model: String,
    pub method: String,
    pub ratio: f64,
    pub dk_before: usize,
    pub dk_after: usize,
    pub state_elems_before: usize,
    pub state_elems_after: usize,
    pub params_before: usize,
    pub params_after: usize,
    pub seconds: f64,
}

impl Pruning {
    pub fn of(r: &crate::report::PruneReport) -> Self {
        Self {
            model: r.model.clone(),
            method: r.plan.method.name().to_string(),
            ratio: r.plan.ratio,
            dk_before: r.dk_before,
            dk_after: r.dk_after,
            state_elems_before: r.state_elems_before,
            state_elems_after: r.state_elems_after,
            params_before: r.params_before,
            params_after: r.params_after,
            seconds: r.seconds.get("total").copied().unwrap_or_default(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RecoverReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub student: String,
    pub teacher: String,
    pub output: String,
    pub family: String,
    /// Tensors held once for both models (stored identically in each).
    pub shared_tensors: usize,
    pub trained: Trained,
    pub recipe: super::Recipe,
    pub steps: usize,
    pub skipped_steps: usize,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub peak_memory_bytes: Option<u64>,
    pub ppl: Option<RecoverPpl>,
    /// Set when the run pruned the model first (`prune --recover`).
    pub pruning: Option<Pruning>,
    pub history: Vec<StepLog>,
}

impl RecoverReport {
    /// The one-line summary printed at the end.
    pub fn summary(&self) -> String {
        let last = self.history.iter().rev().find(|s| !s.skipped);
        let loss = last.map_or(String::from("-"), |s| format!("{:.4}", s.loss));
        let ppl = self.ppl.as_ref().map_or(String::new(), |p| {
            format!("; ppl teacher {:.3}, pruned {:.3}, recovered {:.3}", p.teacher, p.pruned, p.recovered)
        });
        format!(
            "recovered {} in {} steps ({} tokens, {:.0} tokens/s, {} skipped), final loss {loss}{ppl}",
            self.student, self.steps, self.tokens, self.tokens_per_second, self.skipped_steps
        )
    }

    pub fn markdown(&self) -> String {
        let r = &self.recipe;
        let mut md = format!(
            "# statecut recover\n\n- student: `{}`\n- teacher: `{}`\n- family: {}\n- steps: {} ({} skipped), {} tokens, {:.1} s, {:.0} tokens/s\n",
            self.student, self.teacher, self.family, self.steps, self.skipped_steps, self.tokens, self.seconds, self.tokens_per_second
        );
        if let Some(p) = &self.pruning {
            md += &format!(
                "- pruned from `{}` with {} at ratio {}: d_k {} -> {}, state {} -> {} elements per sequence, {} -> {} parameters ({:.1} s; details in statecut_report.md)\n",
                p.model, p.method, p.ratio, p.dk_before, p.dk_after, p.state_elems_before, p.state_elems_after, p.params_before, p.params_after, p.seconds
            );
        }
        md += &format!(
            "- adapters: rank {}, alpha {} on {} tensors; {} tensors trained whole; {} trained parameters\n",
            r.lora_rank,
            r.lora_alpha,
            self.trained.adapted.len(),
            self.trained.whole.len(),
            self.trained.params
        );
        md += &format!(
            "- loss: {}·CE + {}·T²·KL at T = {}; AdamW lr {} (warm-up {}, cosine to {}×), weight decay {}, clip {}\n- batch {} x {} tokens x {} micro-batches per step; seed {}\n- tensors held once for both models: {}\n",
            r.lm_weight, r.kd_weight, r.kd_temperature, r.lr, r.warmup, r.min_lr_ratio, r.weight_decay, r.clip, r.batch_size, r.seqlen, r.grad_accum, r.seed, self.shared_tensors
        );
        if let Some(p) = &self.ppl {
            md += &format!(
                "\n## Perplexity\n\n{} windows x {} tokens of `{}`\n\n| teacher | pruned | trained (in memory) | recovered (written, reloaded) |\n|---|---|---|---|\n| {:.3} | {:.3} | {:.3} | {:.3} |\n",
                p.windows, p.seqlen, p.data, p.teacher, p.pruned, p.trained, p.recovered
            );
        }
        md += "\n## Loss\n\n![loss](statecut_recover_loss.svg)\n";
        md
    }

    /// The loss and its parts per step.
    pub fn loss_svg(&self) -> String {
        let ok: Vec<&StepLog> = self.history.iter().filter(|s| !s.skipped).collect();
        let series =
            |name: &str, f: fn(&StepLog) -> f64| (name.to_string(), ok.iter().map(|s| (s.step as f64, f(s))).collect());
        let mut curves = vec![series("loss", |s| s.loss), series("cross-entropy", |s| s.ce)];
        if self.recipe.kd_weight > 0.0 {
            curves.push(series("T²·KL", |s| s.kd));
        }
        crate::plot::curves_svg("Recovery", "step", "per token", &curves, None)
    }
}
