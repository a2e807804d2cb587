//! The interface of a loaded causal language model.

use super::{layered, DecodeCache, NoObserver, Observer};
use anyhow::Result;
use candle_core::{Device, Tensor, Var};

/// A loaded causal language model.
pub trait CausalLm {
    /// Logits [B, T, V] for token ids [B, T], continuing from and updating `cache` when given.
    /// Families without step-by-step decoding reject a cache.
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, cache: Option<&mut DecodeCache>) -> Result<Tensor>;
    /// Logits [B, T, V] for token ids [B, T].
    fn forward(&self, ids: &Tensor, obs: &mut dyn Observer) -> Result<Tensor> {
        self.run(ids, obs, None)
    }
    /// Logits [B, T, V] for ids [B, T] continuing from `cache` (a prefill when it is new),
    /// updating it: the recurrent path used for generation and decode benchmarks.
    fn forward_cached(&self, ids: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        self.run(ids, &mut NoObserver, Some(cache))
    }
    /// Projection weights loaded as variables (with `LoadOptions::grad`), by checkpoint name.
    fn grad_vars(&self) -> &[(String, Var)];
    fn device(&self) -> &Device;
    /// Decoder layers: what a backward pass keeps activations for.
    fn num_blocks(&self) -> usize;
    /// The stages of a layer-streamed model, which calibration, evaluation and inspection run
    /// layer-major (`crate::stream`) instead of calling [`CausalLm::forward`] per batch.
    fn layers(&self) -> Option<&dyn layered::Layers> {
        None
    }
}
