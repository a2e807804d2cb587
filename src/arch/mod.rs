//! Architecture adapters: one folder per model family, all behind [`Family`].
//!
//! A family knows how to read its config, build a candle forward, describe where its recurrent
//! state's key/query channels live in the checkpoint ([`StateLayout`]), and edit its config so a
//! pruned checkpoint reloads in the family's own library. Everything else (calibration,
//! selectors, surgery, reports) is written once against these descriptions.

pub mod config;
mod defaults;
pub mod falcon_h1;
pub mod fla;
pub mod granite_h;
pub mod kimi_linear;
pub mod mamba2;
pub mod nemotron_h;
pub mod qwen3_5;
pub mod sse;

mod layout;

pub use crate::model::run_recurrence;
pub use crate::model::{
    layered, trainable, CausalLm, DecodeCache, LayerCache, LoadOptions, NoObserver, Observer, RowSlice, SliceRole,
};
pub use layout::{LayerState, StateLayout};

use crate::checkpoint::Checkpoint;
use anyhow::{bail, Result};
use candle_nn::VarBuilder;
use serde_json::Value;

/// A model family.
pub trait Family: Sync {
    /// The `model_type` values this family reads.
    fn model_types(&self) -> &'static [&'static str];
    /// The layout as the config describes it; use [`Family::layout`], which checks it.
    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout>;
    /// The layout, checked against the stored tensors ([`StateLayout::check`]).
    fn layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let layout = self.describe_layout(ckpt)?;
        layout.check(ckpt)?;
        Ok(layout)
    }
    /// The model's stages over `weights` (a view of `ckpt`'s tensors in `opts`' dtype and device).
    fn layers(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        weights: VarBuilder<'static>,
    ) -> Result<Box<dyn layered::Layers>>;
    /// The model with every stage loaded from the memory-mapped weights.
    fn load(&self, ckpt: &Checkpoint, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
        let weights = ckpt.var_builder(opts.dtype, &opts.device)?;
        Ok(Box::new(layered::Resident::load(self.layers(ckpt, opts, weights)?)?))
    }
    /// The model with the tensors `select` accepts (by checkpoint name) loaded as variables,
    /// returned with them: a loss over its logits can be differentiated with respect to each.
    fn load_trainable(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        select: trainable::Selector,
    ) -> Result<(Box<dyn CausalLm>, trainable::Trainable)> {
        let set = trainable::Trainable::default();
        let weights = set.wrap(ckpt.var_builder(opts.dtype, &opts.device)?, select);
        Ok((Box::new(layered::Resident::load(self.layers(ckpt, opts, weights)?)?), set))
    }
    /// Edit config.json so that the family's library rebuilds the model with key width `dk`.
    fn set_key_width(&self, config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()>;
    /// Models with routed state partitions: keep partitions `keep[layer]` (ascending, the same
    /// count in every layer) and edit config.json to match; returns the rows to keep of the
    /// tensors that change (sliced along dim 0).
    fn keep_partitions(
        &self,
        _config: &mut Value,
        _keep: &std::collections::BTreeMap<usize, Vec<usize>>,
    ) -> Result<Vec<(String, Vec<usize>)>> {
        bail!("this model family has no routed state partitions (--prune-partitions is for SSE models)")
    }
}

static FAMILIES: &[&dyn Family] = &[
    &fla::DeltaNetFamily,
    &fla::GatedDeltaNetFamily,
    &mamba2::Mamba2Family,
    &qwen3_5::Qwen35Family,
    &sse::SseFamily,
    &nemotron_h::NemotronHFamily,
    &granite_h::GraniteHybridFamily,
    &falcon_h1::FalconH1Family,
    &kimi_linear::KimiLinearFamily,
];

/// The family adapter for a checkpoint.
pub fn family_for(ckpt: &Checkpoint) -> Result<&'static dyn Family> {
    let mt = ckpt.model_type()?;
    for f in FAMILIES {
        if f.model_types().contains(&mt.as_str()) {
            return Ok(*f);
        }
    }
    let known: Vec<&str> = FAMILIES.iter().flat_map(|f| f.model_types().iter().copied()).collect();
    bail!(
        "unsupported model_type \"{mt}\" in {}/config.json; statecut supports: {}",
        ckpt.dir.display(),
        known.join(", ")
    )
}

/// Read a typed config from JSON with one line naming the file and the key.
pub fn parse<T: serde::de::DeserializeOwned>(ckpt: &Checkpoint, value: &Value) -> Result<T> {
    let family = ckpt.model_type().unwrap_or_default();
    parse_as(ckpt, value, &family)
}

/// [`parse`] for a family named `family` in the message.
pub fn parse_as<T: serde::de::DeserializeOwned>(ckpt: &Checkpoint, value: &Value, family: &str) -> Result<T> {
    config::from_value(value)
        .map_err(|e| anyhow::anyhow!("{}/config.json does not match the {family} format: {e}", ckpt.dir.display()))
}
