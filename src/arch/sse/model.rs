//! Candle forward of SSE causal LMs: fla's block stack around the SSE layers of `mixer`.

use super::attention::Attention;
use super::config::{Implementation, SseConfig};
use super::mixer::Mixer;
use crate::arch::{CausalLm, DecodeCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{linear_no_bias, Embedding, Linear};

/// A block's token mixer: an SSE layer, or softmax attention in hybrids.
enum Layer {
    Sse(Box<Mixer>),
    Attention(Attention),
}

struct Block {
    attn_norm: RmsNorm,
    attn: Layer,
    mlp_norm: RmsNorm,
    mlp: SwiGlu,
}

/// An SSE causal LM (GLA or Gated DeltaNet transition).
pub struct SseModel {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    vars: Vec<(String, Var)>,
    device: Device,
    implementation: Implementation,
}

impl SseModel {
    /// Load a checkpoint; `implementation` overrides the config's `sse_implementation`.
    pub fn open(ckpt: &Checkpoint, opts: &LoadOptions, implementation: Option<Implementation>) -> Result<Self> {
        let cfg: SseConfig = crate::arch::parse(ckpt, &ckpt.config)?;
        let d = cfg.dims()?;
        let attn = cfg.attn_config()?;
        let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
        let m = vb.pp("model");
        let embed_w = m.pp("embeddings").get((cfg.vocab_size, d.hidden), "weight")?;
        let mut vars = Vec::new();
        let mut blocks = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            blocks.push(Block {
                attn_norm: RmsNorm::load(l.pp("attn_norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
                attn: match attn.as_ref().filter(|a| a.layers.contains(&i)) {
                    Some(a) => Layer::Attention(Attention::load(l.pp("attn"), a, d.hidden, cfg.norm_eps)?),
                    None => Layer::Sse(Box::new(Mixer::load(l.pp("attn"), &cfg, d, i, opts.grad, &mut vars)?)),
                },
                mlp_norm: RmsNorm::load(l.pp("mlp_norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
                mlp: SwiGlu::load(l.pp("mlp"), d.hidden, d.intermediate)?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_w.clone(), None)
        } else {
            linear_no_bias(d.hidden, cfg.vocab_size, vb.pp("lm_head"))?
        };
        Ok(Self {
            embed: Embedding::new(embed_w, d.hidden),
            blocks,
            norm: RmsNorm::load(m.pp("norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
            lm_head,
            vars,
            device: opts.device.clone(),
            implementation: implementation.unwrap_or(d.implementation),
        })
    }
}

impl CausalLm for SseModel {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        let mut h = self.embed.forward(ids)?;
        obs.hidden(0, &h)?;
        let n = self.blocks.len();
        if let Some(c) = cache.as_deref_mut() {
            c.begin(n, ids.dim(1)?);
        }
        for (i, blk) in self.blocks.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let x = blk.attn_norm.forward(&h)?;
            let a = match &blk.attn {
                Layer::Sse(m) => m.forward(&x, obs, self.implementation, lc)?,
                Layer::Attention(at) => at.forward(&x, lc).with_context(|| format!("attention layer {i}"))?,
            };
            h = (&h + a)?;
            h = (&h + blk.mlp.forward(&blk.mlp_norm.forward(&h)?)?)?;
            if i + 1 < n {
                obs.hidden(i + 1, &h)?;
            }
        }
        let h = self.norm.forward(&h)?;
        obs.hidden(n, &h)?;
        Ok(self.lm_head.forward(&h)?)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
