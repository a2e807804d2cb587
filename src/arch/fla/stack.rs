//! fla's causal-LM skeleton, shared by every model built from fla blocks (DeltaNet, Gated
//! DeltaNet, SSE): embeddings, then per layer `x + mixer(attn_norm(x))` and
//! `x + mlp(mlp_norm(x))`, a final norm and the LM head (tied to the embeddings or not).

use crate::arch::{CausalLm, DecodeCache, LayerCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::profile::mark;
use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{linear_no_bias, Embedding, Linear, VarBuilder};

/// A block's token mixer (the part under `model.layers.{i}.attn`).
pub trait TokenMixer: Send + Sync {
    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor>;
}

/// The block-stack shape of a checkpoint.
pub struct StackShape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub norm_eps: f64,
    pub tie_word_embeddings: bool,
}

struct Block<M> {
    attn_norm: RmsNorm,
    attn: M,
    mlp_norm: RmsNorm,
    mlp: SwiGlu,
}

/// An fla causal LM whose token mixers are `M`.
pub struct FlaStack<M> {
    embed: Embedding,
    blocks: Vec<Block<M>>,
    norm: RmsNorm,
    lm_head: Linear,
    vars: Vec<(String, Var)>,
    device: Device,
}

impl<M: TokenMixer> FlaStack<M> {
    /// Load the stack; `mixer(vb, layer, vars)` loads layer `layer`'s mixer from `vb` (its
    /// `attn` prefix) and registers any gradient variables in `vars`.
    pub fn load(
        ckpt: &Checkpoint,
        s: &StackShape,
        opts: &LoadOptions,
        mut mixer: impl FnMut(VarBuilder, usize, &mut Vec<(String, Var)>) -> Result<M>,
    ) -> Result<Self> {
        let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
        let m = vb.pp("model");
        let embed_w = m.pp("embeddings").get((s.vocab, s.hidden), "weight")?;
        let norm = |vb: VarBuilder| RmsNorm::load(vb, s.hidden, s.norm_eps, NormWeight::Plain);
        let mut vars = Vec::new();
        let mut blocks = Vec::new();
        for i in 0..s.layers {
            let l = m.pp(format!("layers.{i}"));
            blocks.push(Block {
                attn_norm: norm(l.pp("attn_norm"))?,
                attn: mixer(l.pp("attn"), i, &mut vars).with_context(|| format!("loading layer {i}"))?,
                mlp_norm: norm(l.pp("mlp_norm"))?,
                mlp: SwiGlu::load(l.pp("mlp"), s.hidden, s.intermediate)?,
            });
        }
        let lm_head = if s.tie_word_embeddings {
            Linear::new(embed_w.clone(), None)
        } else {
            linear_no_bias(s.hidden, s.vocab, vb.pp("lm_head"))?
        };
        Ok(Self {
            embed: Embedding::new(embed_w, s.hidden),
            blocks,
            norm: norm(m.pp("norm"))?,
            lm_head,
            vars,
            device: opts.device.clone(),
        })
    }
}

impl<M: TokenMixer> CausalLm for FlaStack<M> {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        let dev = &self.device;
        mark("outside forward", dev);
        let mut h = self.embed.forward(ids)?;
        obs.hidden(0, &h)?;
        mark("embed", dev);
        let n = self.blocks.len();
        if let Some(c) = cache.as_deref_mut() {
            c.begin(n, ids.dim(1)?);
        }
        for (i, blk) in self.blocks.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let x = blk.attn_norm.forward(&h)?;
            mark("norm", dev);
            h = (&h + blk.attn.forward(&x, obs, lc).with_context(|| format!("layer {i}"))?)?;
            mark("mixer output", dev);
            let x = blk.mlp_norm.forward(&h)?;
            mark("norm", dev);
            h = (&h + blk.mlp.forward(&x)?)?;
            mark("mlp", dev);
            if i + 1 < n {
                obs.hidden(i + 1, &h)?;
                mark("observer", dev);
            }
        }
        crate::arch::head(&h, &self.norm, &self.lm_head, obs, n)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
