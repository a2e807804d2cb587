//! A causal LM as stages: the embedding, one block per decoder layer, and the head (final norm
//! and LM head). A resident model ([`Resident`]) is every stage loaded once; a layer-streamed
//! run (`crate::stream`) loads one stage at a time through the same loaders, so both run the
//! same code on the same weights.

use super::observer::Timed;
use super::{CausalLm, DecodeCache, LayerCache, Observer};
use crate::ops::norm::RmsNorm;
use crate::profile::mark;
use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Embedding, Linear};

/// One decoder layer: the residual stream in, the residual stream out.
pub trait Block: Send + Sync {
    fn forward(&self, h: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor>;
    /// Appends the block's trained tensors to `out`, by checkpoint name.
    fn params(&self, _out: &mut Vec<(String, Var)>) {}
}

/// The end of a causal LM: the final norm and the LM head, whose logits are multiplied by
/// `scale` (muP: Granite's 1/logits_scaling, Falcon-H1's lm_head_multiplier; 1 elsewhere).
pub struct Head {
    pub norm: RmsNorm,
    /// candle's own layer, not `layers::linear::Linear`: the model core sits below the layer
    /// library, and the head is neither adapted nor sliced (pruning leaves it whole).
    pub lm_head: Linear,
    pub scale: f64,
}

impl Head {
    pub fn new(norm: RmsNorm, lm_head: Linear) -> Self {
        Self { norm, lm_head, scale: 1.0 }
    }

    /// Logits, or the normed hidden state (hidden state `index`) when the observer needs none.
    pub fn forward(&self, h: &Tensor, obs: &mut dyn Observer, index: usize) -> Result<Tensor> {
        let out = head(h, &self.norm, &self.lm_head, obs, index)?;
        Ok(if self.scale != 1.0 && obs.needs_logits() { (out * self.scale)? } else { out })
    }
}

/// The end of every causal LM: the final norm, whose output is hidden state `index` for the
/// observer, then the LM head's logits, or that normed hidden state itself when the observer
/// needs no logits.
fn head(
    h: &Tensor,
    norm: &crate::ops::norm::RmsNorm,
    lm_head: &Linear,
    obs: &mut dyn Observer,
    index: usize,
) -> Result<Tensor> {
    let _s = crate::profile::span("head", h.device());
    let h = norm.forward(h)?;
    obs.hidden(index, &h)?;
    if !obs.needs_logits() {
        return Ok(h);
    }
    // With a gradient flowing into h through a frozen head (recovery's loss), one product each
    // way: candle's matmul backward would also make the [vocab, hidden] weight's gradient, a
    // product as large as the logits', and throw it away.
    let w = lm_head.weight();
    let frozen = lm_head.bias().is_none() && crate::ops::projection::takes_frozen(&h, w);
    Ok(if frozen { crate::ops::projection::frozen_linear(&h, w)? } else { candle_core::Module::forward(lm_head, &h)? })
}

/// A causal LM's stages, each loaded on demand from the weights it was opened on.
pub trait Layers: Send + Sync {
    fn num_blocks(&self) -> usize;
    fn embed(&self) -> Result<Embedding>;
    /// Load block `i` (its trained tensors as variables with `LoadOptions::grad`).
    fn block(&self, i: usize) -> Result<Box<dyn Block>>;
    /// Load the head; a head tied to the embeddings reuses `embed`'s weight when given.
    fn head(&self, embed: Option<&Embedding>) -> Result<Head>;
    /// Checkpoint name prefix of block `i`'s tensors (`model.layers.{i}.`), to size it.
    fn block_prefix(&self, i: usize) -> String;
    /// Checkpoint name of the embedding matrix (the head's size too).
    fn embed_name(&self) -> String;
    /// Observer index of the hidden state after block `i`: the embeddings are index 0 and the
    /// final norm's output the last, so by default block i reports i + 1 except the last.
    fn hidden_after(&self, i: usize) -> Option<usize> {
        (i + 1 < self.num_blocks()).then_some(i + 1)
    }
    /// Whether the embeddings are reported as hidden state 0 (Mamba-2's list starts after block 0).
    fn reports_embeddings(&self) -> bool {
        true
    }
    /// The factor on the embeddings (muP `embedding_multiplier`; 1 elsewhere).
    fn embed_scale(&self) -> f64 {
        1.0
    }
    fn device(&self) -> &Device;
}

/// Load block `i` with the layer named in any error.
pub fn load_block(layers: &dyn Layers, i: usize) -> Result<Box<dyn Block>> {
    layers.block(i).with_context(|| format!("loading layer {i}"))
}

/// The embeddings of `ids`, reported to the observer as hidden state 0 where the family does.
pub fn embed(layers: &dyn Layers, embed: &Embedding, ids: &Tensor, obs: &mut dyn Observer) -> Result<Tensor> {
    let _s = crate::profile::span("embed", ids.device());
    let mut h = embed.forward(ids)?;
    if layers.embed_scale() != 1.0 {
        h = (h * layers.embed_scale())?;
    }
    if layers.reports_embeddings() {
        obs.hidden(0, &h)?;
    }
    Ok(h)
}

/// Run block `i` and report its output.
pub fn run_block(
    layers: &dyn Layers,
    i: usize,
    blk: &dyn Block,
    h: &Tensor,
    obs: &mut dyn Observer,
    cache: Option<&mut LayerCache>,
) -> Result<Tensor> {
    // Profiled, the observer's hooks time themselves.
    let mut timed;
    let obs: &mut dyn Observer = if crate::profile::enabled() {
        timed = Timed(obs);
        &mut timed
    } else {
        obs
    };
    let h = blk.forward(h, obs, cache).with_context(|| format!("layer {i}"))?;
    if let Some(index) = layers.hidden_after(i) {
        obs.hidden(index, &h)?;
    }
    Ok(h)
}

/// Every stage loaded: the model of a run whose weights fit on the device. Training
/// (`crate::recover::stages`) drives its stages one at a time.
pub struct Resident {
    pub(crate) layers: Box<dyn Layers>,
    pub(crate) embed: Embedding,
    pub(crate) blocks: Vec<Box<dyn Block>>,
    pub(crate) head: Head,
    vars: Vec<(String, Var)>,
}

impl Resident {
    pub fn load(layers: Box<dyn Layers>) -> Result<Self> {
        let embed = layers.embed()?;
        let blocks: Vec<Box<dyn Block>> =
            (0..layers.num_blocks()).map(|i| load_block(&*layers, i)).collect::<Result<_>>()?;
        // The named set of trained tensors: one walk over the loaded layers.
        let mut vars = Vec::new();
        for b in &blocks {
            b.params(&mut vars);
        }
        let head = layers.head(Some(&embed))?;
        Ok(Self { layers, embed, blocks, head, vars })
    }
}

impl CausalLm for Resident {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        mark("outside forward", self.device());
        let l = &*self.layers;
        let mut h = embed(l, &self.embed, ids, obs)?;
        let n = self.blocks.len();
        if let Some(c) = cache.as_deref_mut() {
            c.begin(n, ids.dim(1)?);
        }
        for (i, blk) in self.blocks.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            h = run_block(l, i, blk.as_ref(), &h, obs, lc)?;
        }
        self.head.forward(&h, obs, n)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn device(&self) -> &Device {
        self.layers.device()
    }
}

/// No stage loaded until a forward needs it: every call loads each stage, uses it and drops
/// it. Calibration, evaluation and inspection run such a model layer-major instead
/// ([`CausalLm::layers`]), loading each stage once per run.
pub struct Streamed {
    layers: Box<dyn Layers>,
}

impl Streamed {
    pub fn new(layers: Box<dyn Layers>) -> Self {
        Self { layers }
    }
}

impl CausalLm for Streamed {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        let l = &*self.layers;
        let mut h = embed(l, &l.embed()?, ids, obs)?;
        let n = l.num_blocks();
        if let Some(c) = cache.as_deref_mut() {
            c.begin(n, ids.dim(1)?);
        }
        for i in 0..n {
            let blk = load_block(l, i)?;
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            h = run_block(l, i, blk.as_ref(), &h, obs, lc)?;
        }
        l.head(None)?.forward(&h, obs, n)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &[]
    }

    fn num_blocks(&self) -> usize {
        self.layers.num_blocks()
    }

    fn device(&self) -> &Device {
        self.layers.device()
    }

    fn layers(&self) -> Option<&dyn Layers> {
        Some(&*self.layers)
    }
}
