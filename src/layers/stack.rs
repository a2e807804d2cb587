//! The stages of a decoder-only LM built from [`Layer`]s: an embedding (optionally scaled),
//! the layers, a final norm and an LM head (tied or not, optionally scaled). Hybrid families
//! describe their names and switches in a [`StackSpec`] and build each layer in a closure.

use super::block::Layer;
use crate::model::layered::{self, Head, Layers};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::Device;
use candle_nn::{Embedding, Linear, VarBuilder};

#[derive(Debug, Clone)]
pub struct StackSpec {
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub eps: f64,
    /// Checkpoint name of the embedding matrix.
    pub embed: String,
    /// Prefix of layer `i` is `{layer_prefix}.{i}`.
    pub layer_prefix: String,
    /// Prefix of the final norm (its `weight`).
    pub final_norm: String,
    /// The untied LM head's name; `None` when it is the embedding matrix.
    pub lm_head: Option<String>,
    pub embed_scale: f64,
    pub logit_scale: f64,
    /// The final norm's weight form ((1 + w) in Qwen3.5).
    pub final_norm_weight: NormWeight,
    /// transformers' Mamba-2 convention for `hidden_states`: no embedding entry, entry i is the
    /// residual after block i.
    pub states_after_blocks: bool,
}

/// The untied LM head `lm_head.weight`, unless the config ties it (`tie_word_embeddings`) or the
/// checkpoint does not store it (`has_tensor` says whether it stores a tensor).
pub fn untied_head(has_tensor: impl Fn(&str) -> bool, tied: bool) -> Option<String> {
    (!tied && has_tensor("lm_head.weight")).then(|| "lm_head.weight".into())
}

/// Builds layer `i` under its prefix (trained tensors as variables, for `Block::params`).
pub type LayerLoader = dyn Fn(VarBuilder, usize) -> Result<Layer> + Send + Sync;

pub struct Stack {
    vb: VarBuilder<'static>,
    spec: StackSpec,
    build: Box<LayerLoader>,
    device: Device,
}

impl Stack {
    pub fn new(vb: VarBuilder<'static>, spec: StackSpec, device: Device, build: Box<LayerLoader>) -> Self {
        Self { vb, spec, build, device }
    }
}

impl Layers for Stack {
    fn num_blocks(&self) -> usize {
        self.spec.layers
    }

    fn embed(&self) -> Result<Embedding> {
        Ok(Embedding::new(self.vb.get((self.spec.vocab, self.spec.hidden), &self.spec.embed)?, self.spec.hidden))
    }

    fn block(&self, i: usize) -> Result<Box<dyn layered::Block>> {
        Ok(Box::new((self.build)(self.vb.pp(format!("{}.{i}", self.spec.layer_prefix)), i)?))
    }

    fn head(&self, embed: Option<&Embedding>) -> Result<Head> {
        let s = &self.spec;
        let w = match (&s.lm_head, embed) {
            (Some(name), _) => self.vb.get((s.vocab, s.hidden), name)?,
            (None, Some(e)) => e.embeddings().clone(),
            (None, None) => self.embed()?.embeddings().clone(),
        };
        let norm = RmsNorm::load(self.vb.pp(&s.final_norm), s.hidden, s.eps, s.final_norm_weight)?;
        Ok(Head { norm, lm_head: Linear::new(w, None), scale: s.logit_scale })
    }

    fn block_prefix(&self, i: usize) -> String {
        format!("{}.{i}.", self.spec.layer_prefix)
    }

    fn embed_name(&self) -> String {
        self.spec.embed.clone()
    }

    fn hidden_after(&self, i: usize) -> Option<usize> {
        if self.spec.states_after_blocks {
            Some(i)
        } else {
            (i + 1 < self.spec.layers).then_some(i + 1)
        }
    }

    fn reports_embeddings(&self) -> bool {
        !self.spec.states_after_blocks
    }

    fn embed_scale(&self) -> f64 {
        self.spec.embed_scale
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
