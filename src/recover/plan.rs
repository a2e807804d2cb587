//! Which tensors train during recovery, and how. The default is the recipe of *On State
//! Reduction in Linear Attention*: low-rank adapters on the query/key/value projections of the
//! pruned mixers, and their short convs, norms and biases trained whole. Attention layers,
//! MLPs, embeddings and the head stay frozen.

use crate::arch::{SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// How one tensor trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum How {
    /// A low-rank adapter beside the frozen weight (W + (α/r)·B·A).
    Lora,
    /// Every element.
    Full,
}

/// The trained tensors by checkpoint name.
pub type Plan = BTreeMap<String, How>;

/// The default selection, by name (the default of `--train`).
pub const DEFAULT: &str = crate::cli::RECOVER_TRAIN;

/// Substrings of the tensors of a pruned mixer that train whole (the recipe's `conv1d`, `norm`
/// and `bias`).
const WHOLE: [&str; 3] = ["conv1d", "norm", "bias"];

/// The module a projection weight belongs to: `model.layers.0.attn.q_proj.weight` is under
/// `model.layers.0.attn`.
fn mixer_of(tensor: &str) -> Option<&str> {
    let module = tensor.strip_suffix(".weight")?;
    module.rsplit_once('.').map(|(m, _)| m)
}

/// The pruned mixers' tensors by the recipe.
fn mixers(ckpt: &Checkpoint, layout: &StateLayout, plan: &mut Plan) {
    for l in &layout.layers {
        let projections: Vec<&str> = l
            .slices
            .iter()
            .filter(|s| matches!(s.role, SliceRole::QueryProj | SliceRole::KeyProj))
            .map(|s| s.tensor.as_str())
            .collect();
        let Some(mixer) = projections.first().and_then(|p| mixer_of(p)) else { continue };
        for p in &projections {
            plan.insert(p.to_string(), How::Lora);
        }
        let v = format!("{mixer}.v_proj.weight");
        if ckpt.tensors.contains_key(&v) {
            plan.insert(v, How::Lora);
        }
        let prefix = format!("{mixer}.");
        for name in ckpt.tensors.keys() {
            let Some(rest) = name.strip_prefix(&prefix) else { continue };
            if !plan.contains_key(name) && WHOLE.iter().any(|w| rest.contains(w)) {
                plan.insert(name.clone(), How::Full);
            }
        }
    }
}

/// The plan for a `--train` list: `mixers` (the recipe), `lora:PATTERN` (adapters on every
/// two-dimensional tensor whose name contains PATTERN) and `full:PATTERN` (those tensors whole),
/// comma-separated and applied in order, later entries overriding earlier ones.
pub fn plan(ckpt: &Checkpoint, layout: &StateLayout, spec: &str) -> Result<Plan> {
    let mut plan = Plan::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (how, pattern) = match item.split_once(':') {
            None if item == DEFAULT => {
                mixers(ckpt, layout, &mut plan);
                continue;
            }
            Some(("lora", p)) if !p.is_empty() => (How::Lora, p),
            Some(("full", p)) if !p.is_empty() => (How::Full, p),
            _ => bail!("--train {item:?}: expected mixers, lora:PATTERN or full:PATTERN (comma-separated)"),
        };
        let mut matched = 0;
        for (name, info) in &ckpt.tensors {
            if !name.contains(pattern) {
                continue;
            }
            if how == How::Lora && info.shape.len() != 2 {
                continue;
            }
            plan.insert(name.clone(), how);
            matched += 1;
        }
        if matched == 0 {
            let what = if how == How::Lora { "two-dimensional tensor" } else { "tensor" };
            bail!("--train {item}: no {what} of {} has {pattern:?} in its name", ckpt.dir.display());
        }
    }
    if plan.is_empty() {
        bail!("--train {spec:?} selects nothing to train");
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::mixer_of;

    #[test]
    fn mixers_are_the_projections_parent_module() {
        assert_eq!(mixer_of("model.layers.3.attn.q_proj.weight"), Some("model.layers.3.attn"));
        assert_eq!(mixer_of("backbone.layers.0.mixer.in_proj.weight"), Some("backbone.layers.0.mixer"));
        assert_eq!(mixer_of("model.layers.0.linear_attn.in_proj_qkv.weight"), Some("model.layers.0.linear_attn"));
        assert_eq!(mixer_of("norm.bias"), None);
    }
}
