//! Candle forward of Mamba-2 causal LMs (transformers `Mamba2ForCausalLM`, mamba_ssm
//! `MambaLMHeadModel`): pre-norm residual blocks of one shared Mamba-2 mixer each.

use super::config::Mamba2Config;
use crate::arch::layered::{self, Head, Layers};
use crate::arch::LoadOptions;
use crate::checkpoint::Checkpoint;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::mamba2::Mamba2Mixer;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{Context, Result};
use candle_core::{Device, Var};
use candle_nn::{Embedding, Linear, VarBuilder};

/// The stages of a Mamba-2 causal LM.
pub struct Mamba2Layers {
    vb: VarBuilder<'static>,
    ckpt: Checkpoint,
    cfg: Mamba2Config,
    /// mamba_ssm pads the vocabulary: the stored size.
    vocab: usize,
    grad: bool,
    device: Device,
}

impl Mamba2Layers {
    pub fn new(ckpt: &Checkpoint, cfg: &Mamba2Config, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Self> {
        let vocab = *ckpt.info(cfg.format.embedding())?.shape.first().context("embedding has no shape")?;
        Ok(Self { vb, ckpt: ckpt.clone(), cfg: cfg.clone(), vocab, grad: opts.grad, device: opts.device.clone() })
    }
}

impl Layers for Mamba2Layers {
    fn num_blocks(&self) -> usize {
        self.cfg.layers
    }

    fn embed(&self) -> Result<Embedding> {
        Ok(Embedding::new(self.vb.get((self.vocab, self.cfg.hidden), self.cfg.format.embedding())?, self.cfg.hidden))
    }

    fn block(&self, i: usize, vars: &mut Vec<(String, Var)>) -> Result<Box<dyn layered::Block>> {
        let (cfg, l) = (&self.cfg, self.vb.pp(format!("backbone.layers.{i}")));
        Ok(Box::new(Layer {
            steps: vec![Step {
                norm: RmsNorm::load(l.pp("norm"), cfg.hidden, cfg.eps, NormWeight::Plain)?,
                sublayer: Sublayer::Mamba2(Mamba2Mixer::load(
                    l.pp("mixer"),
                    &cfg.dims(),
                    i,
                    &|n| Ok(self.ckpt.info(n)?.shape.clone()),
                    self.grad,
                    vars,
                )?),
                scale: 1.0,
            }],
        }))
    }

    fn head(&self, embed: Option<&Embedding>) -> Result<Head> {
        let cfg = &self.cfg;
        let lm_head = if cfg.tie || !self.ckpt.tensors.contains_key("lm_head.weight") {
            match embed {
                Some(e) => e.embeddings().clone(),
                None => self.embed()?.embeddings().clone(),
            }
        } else {
            self.vb.get((self.vocab, cfg.hidden), "lm_head.weight")?
        };
        let norm = RmsNorm::load(self.vb.pp("backbone.norm_f"), cfg.hidden, cfg.eps, NormWeight::Plain)?;
        Ok(Head::new(norm, Linear::new(lm_head, None)))
    }

    fn block_prefix(&self, i: usize) -> String {
        format!("backbone.layers.{i}.")
    }

    fn embed_name(&self) -> String {
        self.cfg.format.embedding().into()
    }

    // transformers' Mamba2 `hidden_states` has no embedding entry: entry i is the residual
    // after block i (the last block's too), then the final norm's output.
    fn hidden_after(&self, i: usize) -> Option<usize> {
        Some(i)
    }

    fn reports_embeddings(&self) -> bool {
        false
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
