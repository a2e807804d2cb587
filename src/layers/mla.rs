//! Multi-head latent attention as Kimi Linear runs it (transformers `KimiLinearMLA`): queries
//! from one projection, keys and values expanded from a shared, RMS-normed latent, a shared
//! key part, causal softmax, and no positional embedding. Decoding caches the expanded keys
//! and values.

use super::linear::Linear;
use crate::model::LayerCache;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaDims {
    pub hidden: usize,
    pub heads: usize,
    /// per-head key part expanded from the latent
    pub nope: usize,
    /// key part shared by every head (`qk_rope_head_dim`)
    pub shared: usize,
    pub v_head: usize,
    pub kv_rank: usize,
    /// eps of `kv_a_layernorm`
    pub latent_eps: f64,
}

pub struct Mla {
    d: MlaDims,
    q_proj: Linear,
    kv_a: Linear,
    kv_norm: RmsNorm,
    kv_b: Linear,
    o_proj: Linear,
}

impl Mla {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.q_proj, &self.kv_a, &self.kv_b, &self.o_proj]
    }

    pub fn load(vb: VarBuilder, d: MlaDims) -> Result<Self> {
        let qk = d.nope + d.shared;
        Ok(Self {
            d,
            q_proj: Linear::load(vb.pp("q_proj"), d.hidden, d.heads * qk, false)?,
            kv_a: Linear::load(vb.pp("kv_a_proj_with_mqa"), d.hidden, d.kv_rank + d.shared, false)?,
            kv_norm: RmsNorm::load(vb.pp("kv_a_layernorm"), d.kv_rank, d.latent_eps, NormWeight::Plain)?,
            kv_b: Linear::load(vb.pp("kv_b_proj"), d.kv_rank, d.heads * (d.nope + d.v_head), false)?,
            o_proj: Linear::load(vb.pp("o_proj"), d.heads * d.v_head, d.hidden, false)?,
        })
    }

    pub fn forward(&self, x: &Tensor, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        let qk = d.nope + d.shared;
        let q = self.q_proj.forward(x)?.reshape((b, t, d.heads, qk))?.transpose(1, 2)?.contiguous()?;
        let ckv = self.kv_a.forward(x)?;
        let latent = self.kv_norm.forward(&ckv.narrow(2, 0, d.kv_rank)?)?;
        let shared = ckv.narrow(2, d.kv_rank, d.shared)?.unsqueeze(2)?;
        let kv = self.kv_b.forward(&latent)?.reshape((b, t, d.heads, d.nope + d.v_head))?;
        let shared = shared.broadcast_as((b, t, d.heads, d.shared))?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, d.nope)?, &shared.contiguous()?], 3)?.transpose(1, 2)?;
        let v = kv.narrow(3, d.nope, d.v_head)?.transpose(1, 2)?;
        let (mut k, mut v) = (k.contiguous()?, v.contiguous()?);
        let past = match cache.as_deref() {
            Some(LayerCache::Attention { k, .. }) => k.dim(2)?,
            _ => 0,
        };
        if let Some(c) = cache {
            if let LayerCache::Attention { k: pk, v: pv } = &*c {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *c = LayerCache::Attention { k: k.clone(), v: v.clone() };
        }
        let mask = super::attention::causal_mask(past, t, None, x.device())?;
        let o = crate::ops::attention::attention(&q, &k, &v, &mask, (qk as f64).powf(-0.5))?;
        let o = o.transpose(1, 2)?.reshape((b, t, d.heads * d.v_head))?;
        Ok(self.o_proj.forward(&o)?)
    }
}
