//! Qwen3.5 / Qwen3-Next Gated DeltaNet layer (transformers `Qwen3_5GatedDeltaNet`,
//! `Qwen3NextGatedDeltaNet`).

use super::config::TextConfig;
use crate::arch::{projection, LayerCache, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::norm::{l2_norm, NormWeight, RmsNorm};
use crate::ops::{repeat_heads, softplus};
use crate::profile::mark;
use anyhow::Result;
use candle_core::{Module, Tensor, Var};
use candle_nn::{linear_no_bias, Linear, VarBuilder};

/// Linear-attention sizes.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Dims {
    pub fn new(c: &TextConfig) -> Self {
        Self {
            hidden: c.hidden_size,
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
        }
    }

    /// Value heads per key head.
    pub fn r(&self) -> usize {
        self.hv / self.hk
    }

    /// Conv channels [q all | k all | v all].
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    /// Rows of one key-head group of Qwen3-Next's `in_proj_qkvz`: [q_g | k_g | v_g | z_g].
    pub fn fused_block(&self) -> usize {
        2 * self.dk + 2 * self.r() * self.dv
    }
}

enum InProj {
    /// Qwen3.5: flat [q | k | v], and z, b, a per value head.
    Split { qkv: Linear, z: Linear, b: Linear, a: Linear },
    /// Qwen3-Next: per key-head group [q_g | k_g | v_g | z_g] and [b_g | a_g].
    Fused { qkvz: Linear, ba: Linear },
}

pub struct GatedDeltaNet {
    d: Dims,
    layer: usize,
    in_proj: InProj,
    conv: ShortConv,
    dt_bias: Tensor,
    /// -exp(A_log), [Hv]
    neg_a: Tensor,
    norm: RmsNorm,
    out_proj: Linear,
}

impl GatedDeltaNet {
    pub fn load(
        vb: VarBuilder,
        c: &TextConfig,
        fused: bool,
        layer: usize,
        grad: bool,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let d = Dims::new(c);
        let in_proj = if fused {
            InProj::Fused {
                qkvz: projection(&vb, "in_proj_qkvz", d.hk * d.fused_block(), d.hidden, false, grad, vars)?,
                ba: linear_no_bias(d.hidden, 2 * d.hv, vb.pp("in_proj_ba"))?,
            }
        } else {
            InProj::Split {
                qkv: projection(&vb, "in_proj_qkv", d.conv_dim(), d.hidden, false, grad, vars)?,
                z: linear_no_bias(d.hidden, d.hv * d.dv, vb.pp("in_proj_z"))?,
                b: linear_no_bias(d.hidden, d.hv, vb.pp("in_proj_b"))?,
                a: linear_no_bias(d.hidden, d.hv, vb.pp("in_proj_a"))?,
            }
        };
        Ok(Self {
            d,
            layer,
            in_proj,
            conv: ShortConv::load(vb.pp("conv1d"), d.conv_dim(), c.linear_conv_kernel_dim, false)?,
            dt_bias: vb.get(d.hv, "dt_bias")?.to_dtype(candle_core::DType::F32)?,
            neg_a: vb.get(d.hv, "A_log")?.to_dtype(candle_core::DType::F32)?.exp()?.neg()?,
            // norm before gate with a plain weight (Qwen3NextRMSNormGated)
            norm: RmsNorm::load(vb.pp("norm"), d.dv, c.rms_norm_eps, NormWeight::Plain)?,
            out_proj: linear_no_bias(d.hv * d.dv, d.hidden, vb.pp("out_proj"))?,
        })
    }

    /// Pre-conv [q | k | v] [B,T,C], gate z [B,T,Hv,dv], b and a [B,T,Hv].
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        Ok(match &self.in_proj {
            InProj::Split { qkv, z, b: bp, a } => {
                (qkv.forward(x)?, z.forward(x)?.reshape((b, t, d.hv, d.dv))?, bp.forward(x)?, a.forward(x)?)
            }
            InProj::Fused { qkvz, ba } => {
                // transformers `fix_query_key_value_ordering`
                let rdv = d.r() * d.dv;
                let m = qkvz.forward(x)?.reshape((b, t, d.hk, d.fused_block()))?;
                let part = |off: usize, len: usize| m.narrow(3, off, len)?.reshape((b, t, d.hk * len));
                let qkv = Tensor::cat(&[part(0, d.dk)?, part(d.dk, d.dk)?, part(2 * d.dk, rdv)?], 2)?;
                let z = m.narrow(3, 2 * d.dk + rdv, rdv)?.reshape((b, t, d.hv, d.dv))?;
                let ba = ba.forward(x)?.reshape((b, t, d.hk, 2 * d.r()))?;
                let bb = ba.narrow(3, 0, d.r())?.reshape((b, t, d.hv))?;
                let a = ba.narrow(3, d.r(), d.r())?.reshape((b, t, d.hv))?;
                (qkv, z, bb, a)
            }
        })
    }

    /// `cache`: conv history and recurrent state carried between decoding calls.
    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        obs.qk_input(self.layer, x)?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state }) => (conv.first().cloned(), Some(state.clone())),
            _ => (None, None),
        };
        let dev = x.device();
        mark("observer", dev);
        let (qkv, z, beta, a) = self.project(x)?;
        mark("qkv projections", dev);
        let (mixed, conv_state) = self.conv.forward_silu_cached(&qkv, prev_conv.as_ref())?;
        mark("short conv + silu", dev);
        let kd = d.hk * d.dk;
        let q = mixed.narrow(2, 0, kd)?.reshape((b, t, d.hk, d.dk))?;
        let k = mixed.narrow(2, kd, kd)?.reshape((b, t, d.hk, d.dk))?;
        let v = mixed.narrow(2, 2 * kd, d.hv * d.dv)?.reshape((b, t, d.hv, d.dv))?;
        obs.qk(self.layer, &q, &k)?;
        mark("observer", dev);
        // Gates, β and the L2 norms in float32, as the upstream kernels compute them.
        let f32 = candle_core::DType::F32;
        let beta = candle_nn::ops::sigmoid(&beta.to_dtype(f32)?)?;
        let g = softplus(&a.to_dtype(f32)?.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;
        // value head j reads key head j / r (repeat_interleave)
        let q = repeat_heads(&l2_norm(&q.to_dtype(f32)?, 1e-6)?, d.r())?;
        let k = repeat_heads(&l2_norm(&k.to_dtype(f32)?, 1e-6)?, d.r())?;
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: Some(&g),
            gk: None,
            scale: (d.dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial: prev_state.as_ref(),
        };
        mark("gates + l2 norms", dev);
        let o = crate::arch::run_recurrence(&rec, self.layer, obs, cache, vec![conv_state])?;
        mark("recurrence", dev);
        let o = self.norm.forward_gated(&o, &z)?;
        Ok(self.out_proj.forward(&o.reshape((b, t, d.hv * d.dv))?)?)
    }
}
