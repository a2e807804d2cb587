//! Kimi Delta Attention (Kimi Linear's linear layers): the gated delta rule with a decay per key
//! channel from a low-rank projection, q/k/v short convolutions, L2-normed q and k, a sigmoid
//! β per head and a sigmoid-gated per-head RMSNorm on the output. Follows transformers
//! `KimiLinearDeltaAttention` and fla `KimiDeltaAttention`.
//!
//! Key channel j of head h is row h·K + j of q_proj, k_proj, their convs, f_b_proj and dt_bias.

use crate::arch::{projection, LayerCache, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::norm::{l2_norm, NormWeight, RmsNorm};
use crate::ops::softplus;
use crate::profile::mark;
use anyhow::Result;
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::{linear_no_bias, Linear, VarBuilder};

/// The sizes of one KDA layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdaDims {
    pub hidden: usize,
    pub heads: usize,
    /// key width K (pruned)
    pub dk: usize,
    /// value width V, also the rank of the low-rank gate projections
    pub dv: usize,
    pub conv_kernel: usize,
    pub eps: f64,
}

pub struct Kda {
    d: KdaDims,
    layer: usize,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    /// the three depthwise convs as one over [q | k | v]
    conv: ShortConv,
    f_a: Linear,
    f_b: Linear,
    /// [H·K] float32
    dt_bias: Tensor,
    /// -exp(A_log) [H, 1] float32
    neg_a: Tensor,
    b_proj: Linear,
    g_a: Linear,
    g_b: Linear,
    o_norm: RmsNorm,
    o_proj: Linear,
}

impl Kda {
    /// The layer under `vb` (`…self_attn`); with `grad` q_proj and k_proj are variables.
    pub fn load(vb: VarBuilder, d: KdaDims, layer: usize, grad: bool, vars: &mut Vec<(String, Var)>) -> Result<Self> {
        let (hk, hv) = (d.heads * d.dk, d.heads * d.dv);
        let conv = |name: &str, c: usize| vb.get((c, 1, d.conv_kernel), &format!("{name}.weight"));
        let weight = Tensor::cat(&[conv("q_conv1d", hk)?, conv("k_conv1d", hk)?, conv("v_conv1d", hv)?], 0)?;
        let f32 = DType::F32;
        Ok(Self {
            d,
            layer,
            q_proj: projection(&vb, "q_proj", hk, d.hidden, false, grad, vars)?,
            k_proj: projection(&vb, "k_proj", hk, d.hidden, false, grad, vars)?,
            v_proj: linear_no_bias(d.hidden, hv, vb.pp("v_proj"))?,
            conv: ShortConv::new(weight, None)?,
            f_a: linear_no_bias(d.hidden, d.dv, vb.pp("f_a_proj"))?,
            f_b: linear_no_bias(d.dv, hk, vb.pp("f_b_proj"))?,
            dt_bias: vb.get_with_hints_dtype(hk, "dt_bias", Default::default(), f32)?,
            neg_a: vb.get((1, 1, d.heads, 1), "A_log")?.to_dtype(f32)?.reshape((d.heads, 1))?.exp()?.neg()?,
            b_proj: linear_no_bias(d.hidden, d.heads, vb.pp("b_proj"))?,
            g_a: linear_no_bias(d.hidden, d.dv, vb.pp("g_a_proj"))?,
            g_b: linear_no_bias(d.dv, hv, vb.pp("g_b_proj"))?,
            o_norm: RmsNorm::load(vb.pp("o_norm"), d.dv, d.eps, NormWeight::Plain)?,
            o_proj: linear_no_bias(hv, d.hidden, vb.pp("o_proj"))?,
        })
    }

    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        let (hk, hv) = (d.heads * d.dk, d.heads * d.dv);
        obs.qk_input(self.layer, x)?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state }) => (conv.first().cloned(), Some(state.clone())),
            _ => (None, None),
        };
        let dev = x.device();
        mark("observer", dev);
        let qkv = Tensor::cat(&[self.q_proj.forward(x)?, self.k_proj.forward(x)?, self.v_proj.forward(x)?], 2)?;
        mark("qkv projections", dev);
        let (mixed, conv_state) = self.conv.forward_silu_cached(&qkv, prev_conv.as_ref())?;
        mark("short conv + silu", dev);
        let q = mixed.narrow(2, 0, hk)?.reshape((b, t, d.heads, d.dk))?;
        let k = mixed.narrow(2, hk, hk)?.reshape((b, t, d.heads, d.dk))?;
        let v = mixed.narrow(2, 2 * hk, hv)?.reshape((b, t, d.heads, d.dv))?;
        obs.qk(self.layer, &q, &k)?;
        mark("observer", dev);
        // Gates, β and the L2 norms in float32, as the upstream kernels compute them.
        let f32 = DType::F32;
        let f = self.f_b.forward(&self.f_a.forward(x)?)?.to_dtype(f32)?.broadcast_add(&self.dt_bias)?;
        let gk = softplus(&f.reshape((b, t, d.heads, d.dk))?)?.broadcast_mul(&self.neg_a)?;
        let beta = candle_nn::ops::sigmoid(&self.b_proj.forward(x)?.to_dtype(f32)?)?;
        let q = l2_norm(&q.to_dtype(f32)?, 1e-6)?;
        let k = l2_norm(&k.to_dtype(f32)?, 1e-6)?;
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: None,
            gk: Some(&gk),
            scale: (d.dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial: prev_state.as_ref(),
        };
        mark("gates + l2 norms", dev);
        let o = crate::arch::run_recurrence(&rec, self.layer, obs, cache, vec![conv_state])?;
        mark("recurrence", dev);
        // norm(o)·w·sigmoid(gate), per head over V
        let gate = self.g_b.forward(&self.g_a.forward(x)?)?.reshape((b, t, d.heads, d.dv))?;
        let o = self.o_norm.forward(&o)?.to_dtype(f32)?;
        let o = (o * candle_nn::ops::sigmoid(&gate.to_dtype(f32)?)?)?.to_dtype(x.dtype())?;
        Ok(self.o_proj.forward(&o.reshape((b, t, hv))?)?)
    }
}
