//! SSE causal LMs: fla's block stack (`fla::stack`) around the SSE layers of `mixer` and, in
//! hybrids, softmax attention.

use super::config::{Implementation, SseConfig};
use super::mixer::Mixer;
use crate::arch::fla::stack::{FlaLayers, FlaStack, StackShape, TokenMixer};
use crate::arch::{LayerCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::Attention;
use anyhow::Result;
use candle_core::Tensor;
use candle_nn::VarBuilder;

/// A block's token mixer: an SSE layer, or softmax attention in hybrids.
pub enum Layer {
    Sse(Box<Mixer>, Implementation),
    Attention(Box<Attention>),
}

impl TokenMixer for Layer {
    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        match self {
            Layer::Sse(m, imp) => m.forward(x, obs, *imp, cache),
            Layer::Attention(at) => at.forward(x, cache),
        }
    }
}

/// An SSE causal LM (GLA or Gated DeltaNet transition, optionally with attention layers).
pub type SseModel = FlaStack<Layer>;

impl FlaStack<Layer> {
    /// The stages over `vb`; `implementation` overrides the config's `sse_implementation`.
    pub fn sse_layers(
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        vb: VarBuilder<'static>,
        implementation: Option<Implementation>,
    ) -> Result<FlaLayers<Layer>> {
        let cfg: SseConfig = crate::arch::parse(ckpt, &ckpt.config)?;
        let d = cfg.dims()?;
        let attn = cfg.attn_config()?;
        let imp = implementation.unwrap_or(d.implementation);
        let shape = StackShape {
            vocab: cfg.vocab_size,
            hidden: d.hidden,
            intermediate: d.intermediate,
            layers: cfg.num_hidden_layers,
            norm_eps: cfg.norm_eps,
            tie_word_embeddings: cfg.tie_word_embeddings,
        };
        let grad = opts.grad;
        Ok(FlaStack::layers(vb, shape, opts, move |vb, i, vars| {
            Ok(match attn.as_ref().filter(|a| a.layers.contains(&i)) {
                Some(a) => Layer::Attention(Box::new(Attention::load(vb, &a.spec(d.hidden, cfg.norm_eps))?)),
                None => Layer::Sse(Box::new(Mixer::load(vb, &cfg, d, i, grad, vars)?), imp),
            })
        }))
    }

    /// Load a checkpoint; `implementation` overrides the config's `sse_implementation`.
    pub fn open(ckpt: &Checkpoint, opts: &LoadOptions, implementation: Option<Implementation>) -> Result<Self> {
        let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
        Self::from_layers(Self::sse_layers(ckpt, opts, vb, implementation)?)
    }
}
