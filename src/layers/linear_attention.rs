//! The linear-attention (delta-rule) mixer, shared by fla DeltaNet / Gated DeltaNet, Qwen3.5 /
//! Qwen3-Next Gated DeltaNet and Kimi Delta Attention: projections → one short conv + SiLU over
//! [q | k | v] → observer → β and decay → L2-normed q and k → the delta-rule recurrence → a
//! (gated) per-head RMSNorm → o_proj. The families differ only in the projection layout
//! ([`Projections`]), the decay ([`Decay`]) and the output gate ([`OutputGate`]).

use crate::arch::{LayerCache, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::norm::{l2_norm, RmsNorm};
use crate::ops::{repeat_heads, softplus};
use crate::profile::mark;
use anyhow::Result;
use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;

/// Head counts and widths: `heads` key heads of width `dk`, `v_heads` value heads (a multiple
/// of `heads`; value head j reads key head j / (v_heads / heads)) of width `dv`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearDims {
    pub hidden: usize,
    pub heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

impl LinearDims {
    fn r(&self) -> usize {
        self.v_heads / self.heads
    }
}

/// Where q, k, v and the per-value-head inputs (z for the output gate, b for β, a for the decay)
/// come from.
pub enum Projections {
    /// One projection each (fla, Kimi): `b`, `a`, `z` where the layer has them.
    Separate { q: Linear, k: Linear, v: Linear, b: Option<Linear>, a: Option<Linear>, z: Option<Linear> },
    /// Qwen3.5: flat [q | k | v], and z, b, a per value head.
    QwenSplit { qkv: Linear, z: Linear, b: Linear, a: Linear },
    /// Qwen3-Next: per key-head group [q_g | k_g | v_g | z_g] and [b_g | a_g].
    QwenFused { qkvz: Linear, ba: Linear },
}

struct Projected {
    /// pre-conv [q all | k all | v all]
    qkv: Tensor,
    /// [B, T, Hv, dv]
    z: Option<Tensor>,
    /// [B, T, Hv]
    b: Option<Tensor>,
    a: Option<Tensor>,
}

impl Projections {
    fn project(&self, x: &Tensor, d: LinearDims) -> Result<Projected> {
        let (bs, t, _) = x.dims3()?;
        let heads = |y: Tensor| y.reshape((bs, t, d.v_heads, d.dv));
        Ok(match self {
            Projections::Separate { q, k, v, b, a, z } => {
                let opt = |p: &Option<Linear>| p.as_ref().map(|p| p.forward(x)).transpose();
                Projected {
                    qkv: Tensor::cat(&[q.forward(x)?, k.forward(x)?, v.forward(x)?], 2)?,
                    z: opt(z)?.map(heads).transpose()?,
                    b: opt(b)?,
                    a: opt(a)?,
                }
            }
            Projections::QwenSplit { qkv, z, b, a } => Projected {
                qkv: qkv.forward(x)?,
                z: Some(heads(z.forward(x)?)?),
                b: Some(b.forward(x)?),
                a: Some(a.forward(x)?),
            },
            Projections::QwenFused { qkvz, ba } => {
                // transformers `fix_query_key_value_ordering`
                let (r, hk) = (d.r(), d.heads);
                let rdv = r * d.dv;
                let m = qkvz.forward(x)?.reshape((bs, t, hk, 2 * d.dk + 2 * rdv))?;
                let part = |off: usize, len: usize| m.narrow(3, off, len)?.reshape((bs, t, hk * len));
                let qkv = Tensor::cat(&[part(0, d.dk)?, part(d.dk, d.dk)?, part(2 * d.dk, rdv)?], 2)?;
                let z = m.narrow(3, 2 * d.dk + rdv, rdv)?.reshape((bs, t, d.v_heads, d.dv))?;
                let ba = ba.forward(x)?.reshape((bs, t, hk, 2 * r))?;
                let b = ba.narrow(3, 0, r)?.reshape((bs, t, d.v_heads))?;
                let a = ba.narrow(3, r, r)?.reshape((bs, t, d.v_heads))?;
                Projected { qkv, z: Some(z), b: Some(b), a: Some(a) }
            }
        })
    }
}

/// How the state decays per step.
pub enum Decay {
    /// DeltaNet
    None,
    /// g = -exp(A_log) · softplus(a + dt_bias) per value head (Gated DeltaNet); `a` comes from
    /// the projections. Float32 [Hv].
    PerHead { neg_a: Tensor, dt_bias: Tensor },
    /// g = -exp(A_log) · softplus(f_b(f_a(x)) + dt_bias) per value head and key channel (KDA).
    /// `neg_a` [Hv, 1] and `dt_bias` [Hv·dk], float32.
    PerChannel { f_a: Linear, f_b: Linear, neg_a: Tensor, dt_bias: Tensor },
}

/// What multiplies the normed output.
pub enum OutputGate {
    None,
    /// silu(z) (fla `FusedRMSNormGated`, Qwen3.5); z comes from the projections.
    Silu,
    /// sigmoid(g_b(g_a(x))) (Kimi Delta Attention).
    SigmoidLowRank {
        g_a: Linear,
        g_b: Linear,
    },
}

pub struct LinearAttention {
    pub dims: LinearDims,
    pub layer: usize,
    pub proj: Projections,
    /// one depthwise conv over [q | k | v]; without one, SiLU alone (fla `use_short_conv = False`)
    pub conv: Option<ShortConv>,
    pub decay: Decay,
    pub gate: OutputGate,
    /// β = scale · sigmoid(b) (2 for fla's `allow_neg_eigval`); β = 1 without b.
    pub beta_scale: f64,
    /// per-head norm over dv
    pub norm: RmsNorm,
    pub o_proj: Linear,
}

impl LinearAttention {
    /// `cache`: conv history and recurrent state carried between decoding calls.
    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let d = self.dims;
        let (b, t, _) = x.dims3()?;
        obs.qk_input(self.layer, x)?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state }) => (conv.clone(), Some(state.clone())),
            _ => (None, None),
        };
        let dev = x.device();
        mark("observer", dev);
        let p = self.proj.project(x, d)?;
        mark("qkv projections", dev);
        let (mixed, conv_state) = match &self.conv {
            Some(c) => {
                let (y, st) = c.forward_silu_cached(&p.qkv, prev_conv.as_ref())?;
                (y, Some(st))
            }
            None => (candle_nn::ops::silu(&p.qkv)?, None),
        };
        mark("short conv + silu", dev);
        let kd = d.heads * d.dk;
        let q = mixed.narrow(2, 0, kd)?.reshape((b, t, d.heads, d.dk))?;
        let k = mixed.narrow(2, kd, kd)?.reshape((b, t, d.heads, d.dk))?;
        let v = mixed.narrow(2, 2 * kd, d.v_heads * d.dv)?.reshape((b, t, d.v_heads, d.dv))?;
        obs.qk(self.layer, &q, &k)?;
        mark("observer", dev);
        // Gates, β and the L2 norms in float32, as the upstream kernels compute them: bf16 gates
        // compound over the sequence.
        let f32 = DType::F32;
        let beta = match &p.b {
            Some(bb) => (candle_nn::ops::sigmoid(&bb.to_dtype(f32)?)? * self.beta_scale)?,
            None => Tensor::ones((b, t, d.v_heads), f32, dev)?,
        };
        let (g, gk) = match &self.decay {
            Decay::None => (None, None),
            Decay::PerHead { neg_a, dt_bias } => {
                let a = p.a.as_ref().ok_or_else(|| anyhow::anyhow!("a per-head decay needs the a projection"))?;
                (Some(softplus(&a.to_dtype(f32)?.broadcast_add(dt_bias)?)?.broadcast_mul(neg_a)?), None)
            }
            Decay::PerChannel { f_a, f_b, neg_a, dt_bias } => {
                let f = f_b.forward(&f_a.forward(x)?)?.to_dtype(f32)?.broadcast_add(dt_bias)?;
                (None, Some(softplus(&f.reshape((b, t, d.v_heads, d.dk))?)?.broadcast_mul(neg_a)?))
            }
        };
        let q = repeat_heads(&l2_norm(&q.to_dtype(f32)?, 1e-6)?, d.r())?;
        let k = repeat_heads(&l2_norm(&k.to_dtype(f32)?, 1e-6)?, d.r())?;
        mark("gates + l2 norms", dev);
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: g.as_ref(),
            gk: gk.as_ref(),
            scale: (d.dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial: prev_state.as_ref(),
        };
        let o = crate::arch::run_recurrence(&rec, self.layer, obs, cache, conv_state)?;
        mark("recurrence", dev);
        let o = match &self.gate {
            OutputGate::None => self.norm.forward(&o)?,
            OutputGate::Silu => {
                let z = p.z.as_ref().ok_or_else(|| anyhow::anyhow!("a silu output gate needs the z projection"))?;
                self.norm.forward_gated(&o, z)?
            }
            OutputGate::SigmoidLowRank { g_a, g_b } => {
                let gate = g_b.forward(&g_a.forward(x)?)?.reshape((b, t, d.v_heads, d.dv))?;
                let o = self.norm.forward(&o)?.to_dtype(f32)?;
                (o * candle_nn::ops::sigmoid(&gate.to_dtype(f32)?)?)?.to_dtype(x.dtype())?
            }
        };
        Ok(self.o_proj.forward(&o.reshape((b, t, d.v_heads * d.dv))?)?)
    }
}
