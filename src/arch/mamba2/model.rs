//! Candle forward of Mamba-2 causal LMs (transformers `Mamba2ForCausalLM`, mamba_ssm
//! `MambaLMHeadModel`): pre-norm residual blocks of one shared Mamba-2 mixer each.

use super::config::Mamba2Config;
use crate::arch::LoadOptions;
use crate::checkpoint::Checkpoint;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::mamba2::Mamba2Mixer;
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{Context, Result};
use candle_nn::VarBuilder;

/// The stages of a Mamba-2 causal LM.
pub fn mamba2_stack(
    ckpt: &Checkpoint,
    cfg: &Mamba2Config,
    opts: &LoadOptions,
    vb: VarBuilder<'static>,
) -> Result<Stack> {
    // mamba_ssm pads the vocabulary: the stored size.
    let vocab = *ckpt.info(cfg.format.embedding())?.shape.first().context("embedding has no shape")?;
    let spec = StackSpec {
        vocab,
        hidden: cfg.hidden,
        layers: cfg.layers,
        eps: cfg.eps,
        embed: cfg.format.embedding().into(),
        layer_prefix: "backbone.layers".into(),
        final_norm: "backbone.norm_f".into(),
        lm_head: untied_head(|t| ckpt.tensors.contains_key(t), cfg.tie),
        embed_scale: 1.0,
        logit_scale: 1.0,
        final_norm_weight: NormWeight::Plain,
        // transformers' Mamba2 `hidden_states` has no embedding entry: entry i is the residual
        // after block i (the last block's too), then the final norm's output.
        states_after_blocks: true,
    };
    let (ckpt, cfg, grad) = (ckpt.clone(), cfg.clone(), opts.grad);
    let build = move |l: VarBuilder, i: usize| -> Result<Layer> {
        let mixer = Mamba2Mixer::load(l.pp("mixer"), &cfg.dims(), i, &|n| Ok(ckpt.info(n)?.shape.clone()), grad)?;
        Ok(Layer {
            steps: vec![Step {
                norm: RmsNorm::load(l.pp("norm"), cfg.hidden, cfg.eps, NormWeight::Plain)?,
                sublayer: Sublayer::Mamba2(mixer),
                scale: 1.0,
            }],
        })
    };
    Ok(Stack::new(vb, spec, opts.device.clone(), Box::new(build)))
}
