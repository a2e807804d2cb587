//! The training state between runs: parameters, AdamW moments, the step reached and the loss
//! history, in one safetensors file beside the output. A run resumed from it takes the same
//! steps on the same data as one that never stopped.

use super::optim::AdamW;
use super::params::ParamSet;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One optimizer step, as reported.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepLog {
    pub step: usize,
    /// The loss per token (with its weights), and its parts per token.
    pub loss: f64,
    pub ce: f64,
    pub kd: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// The step was skipped: its loss or gradient was not finite.
    pub skipped: bool,
    /// Wall time of the step.
    #[serde(default)]
    pub seconds: f64,
}

/// What a state file records besides the tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Progress {
    /// Steps done (the next step's index).
    pub step: usize,
    pub adam_t: u64,
    pub history: Vec<StepLog>,
    /// The settings the run was started with; a resume must match them.
    pub settings: String,
}

const META: &str = "statecut_recover";

/// Where the state of a run writing `output` is kept.
pub fn path_for(output: &Path) -> PathBuf {
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    output.with_file_name(format!("{name}.recover-state.safetensors"))
}

/// Write the state atomically.
pub fn save(path: &Path, params: &ParamSet, opt: &AdamW, progress: &Progress) -> Result<()> {
    let cpu = Device::Cpu;
    let mut tensors = Vec::new();
    for (i, name) in params.names.iter().enumerate() {
        tensors.push((format!("value.{name}"), params.values[i].to_device(&cpu)?));
        tensors.push((format!("m.{name}"), opt.m[i].to_device(&cpu)?));
        tensors.push((format!("v.{name}"), opt.v[i].to_device(&cpu)?));
    }
    let meta = HashMap::from([(META.to_string(), serde_json::to_string(progress)?)]);
    crate::surgery::write_tensors_atomic(path, &tensors, meta).with_context(|| format!("saving {}", path.display()))
}

/// Read a state into `params` and `opt`, checking that it was made with `settings`.
pub fn load(path: &Path, params: &mut ParamSet, opt: &mut AdamW, settings: &str) -> Result<Progress> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a training state ({e})", path.display()))?;
    let text = meta.metadata().as_ref().and_then(|m| m.get(META)).cloned();
    let progress: Progress =
        serde_json::from_str(&text.with_context(|| format!("{}: not a training state", path.display()))?)?;
    if progress.settings != settings {
        bail!(
            "{} was saved by a run with other settings; resume with the same flags, or remove it to start over",
            path.display()
        );
    }
    let dev = params.values.first().map(|v| v.device().clone()).unwrap_or(Device::Cpu);
    let stored = candle_core::safetensors::load_buffer(&bytes, &dev)?;
    let get = |key: String, like: &Tensor| -> Result<Tensor> {
        let t = stored.get(&key).with_context(|| format!("{}: {key} is missing", path.display()))?;
        if t.shape() != like.shape() {
            bail!("{}: {key} has shape {:?}, expected {:?}", path.display(), t.shape(), like.shape());
        }
        Ok(t.clone())
    };
    for (i, name) in params.names.iter().enumerate() {
        params.values[i] = get(format!("value.{name}"), &params.values[i])?;
        opt.m[i] = get(format!("m.{name}"), &opt.m[i])?;
        opt.v[i] = get(format!("v.{name}"), &opt.v[i])?;
    }
    opt.t = progress.adam_t;
    Ok(progress)
}
