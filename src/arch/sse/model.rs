//! SSE causal LMs: fla's block stack ([`fla_stack`]) around the SSE layers and, in hybrids,
//! softmax attention.

use super::config::{Implementation, SseConfig};
use crate::arch::fla::{fla_stack, StackShape};
use crate::arch::LoadOptions;
use crate::checkpoint::Checkpoint;
use crate::layers::attention::Attention;
use crate::layers::block::Sublayer;
use crate::layers::sse::SseMixer;
use crate::layers::stack::Stack;
use crate::model::layered::Resident;
use anyhow::Result;
use candle_nn::VarBuilder;

/// The stages over `vb`; `implementation` overrides the config's `sse_implementation`.
pub fn sse_stack(
    ckpt: &Checkpoint,
    opts: &LoadOptions,
    vb: VarBuilder<'static>,
    implementation: Option<Implementation>,
) -> Result<Stack> {
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
    Ok(fla_stack(vb, shape, opts, move |vb, i| {
        Ok(match attn.as_ref().filter(|a| a.layers.contains(&i)) {
            Some(a) => Sublayer::Attention(Attention::load(vb, &a.spec(d.hidden, cfg.norm_eps))?),
            None => Sublayer::Sse(Box::new(SseMixer::load(vb, d, i, grad)?), imp),
        })
    }))
}

/// Load an SSE checkpoint, every stage resident; `implementation` overrides the config's
/// `sse_implementation`.
pub fn open(ckpt: &Checkpoint, opts: &LoadOptions, implementation: Option<Implementation>) -> Result<Resident> {
    let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
    Resident::load(Box::new(sse_stack(ckpt, opts, vb, implementation)?))
}
