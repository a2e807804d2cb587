//! Candle forward of fla DeltaNet / Gated DeltaNet causal LMs.

use super::stack::{FlaLayers, FlaStack, StackShape, TokenMixer};
use super::{Dims, FlaConfig, Kind};
use crate::arch::{projection, LayerCache, LoadOptions, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::norm::{l2_norm, NormWeight, RmsNorm};
use crate::ops::{repeat_heads, softplus};
use crate::profile::mark;
use anyhow::Result;
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::{linear_no_bias, Linear, VarBuilder};

/// One DeltaNet / Gated DeltaNet layer (fla `DeltaNet` / `GatedDeltaNet`, under `attn`).
pub struct Mixer {
    d: Dims,
    layer: usize,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    b_proj: Option<Linear>,
    a_proj: Option<Linear>,
    /// -exp(A_log), [HV]
    neg_a: Option<Tensor>,
    dt_bias: Option<Tensor>,
    convs: Option<[ShortConv; 3]>,
    g_proj: Option<Linear>,
    o_norm: RmsNorm,
    o_proj: Linear,
    allow_neg_eigval: bool,
}

impl Mixer {
    fn load(
        vb: VarBuilder,
        cfg: &FlaConfig,
        d: Dims,
        layer: usize,
        grad: bool,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let (hid, kd, vd) = (d.hidden, d.heads * d.dk, d.v_heads * d.dv);
        let gated = d.kind == Kind::GatedDeltaNet;
        let convs = if cfg.use_short_conv {
            let c = |name: &str, ch: usize| ShortConv::load(vb.pp(name), ch, cfg.conv_size, cfg.conv_bias);
            Some([c("q_conv1d", kd)?, c("k_conv1d", kd)?, c("v_conv1d", vd)?])
        } else {
            None
        };
        let use_beta = gated || cfg.use_beta;
        Ok(Self {
            d,
            layer,
            q_proj: projection(&vb, "q_proj", kd, hid, false, grad, vars)?,
            k_proj: projection(&vb, "k_proj", kd, hid, false, grad, vars)?,
            v_proj: linear_no_bias(hid, vd, vb.pp("v_proj"))?,
            b_proj: if use_beta { Some(linear_no_bias(hid, d.v_heads, vb.pp("b_proj"))?) } else { None },
            a_proj: if gated { Some(linear_no_bias(hid, d.v_heads, vb.pp("a_proj"))?) } else { None },
            neg_a: if gated { Some(vb.get(d.v_heads, "A_log")?.to_dtype(DType::F32)?.exp()?.neg()?) } else { None },
            dt_bias: if gated { Some(vb.get(d.v_heads, "dt_bias")?.to_dtype(DType::F32)?) } else { None },
            convs,
            g_proj: if d.use_gate { Some(linear_no_bias(hid, vd, vb.pp("g_proj"))?) } else { None },
            o_norm: RmsNorm::load(vb.pp("o_norm"), d.dv, cfg.norm_eps, NormWeight::Plain)?,
            o_proj: linear_no_bias(vd, hid, vb.pp("o_proj"))?,
            allow_neg_eigval: cfg.allow_neg_eigval,
        })
    }
}

impl TokenMixer for Mixer {
    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        obs.qk_input(self.layer, x)?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state }) => (Some(conv.clone()), Some(state.clone())),
            _ => (None, None),
        };
        let mut conv_states = Vec::new();
        let mut conv = |i: usize, y: Tensor| -> Result<Tensor> {
            Ok(match &self.convs {
                Some(c) => {
                    let (y, st) = c[i].forward_silu_cached(&y, prev_conv.as_ref().map(|p| &p[i]))?;
                    conv_states.push(st);
                    y
                }
                None => candle_nn::ops::silu(&y)?,
            })
        };
        let dev = x.device();
        mark("observer", dev);
        let (q, k, v) = (self.q_proj.forward(x)?, self.k_proj.forward(x)?, self.v_proj.forward(x)?);
        mark("qkv projections", dev);
        let q = conv(0, q)?.reshape((b, t, d.heads, d.dk))?;
        let k = conv(1, k)?.reshape((b, t, d.heads, d.dk))?;
        let v = conv(2, v)?.reshape((b, t, d.v_heads, d.dv))?;
        mark("short conv + silu", dev);
        obs.qk(self.layer, &q, &k)?;
        mark("observer", dev);
        let beta = match &self.b_proj {
            Some(p) => candle_nn::ops::sigmoid(&p.forward(x)?.to_dtype(DType::F32)?)?,
            None => Tensor::ones((b, t, d.v_heads), DType::F32, x.device())?,
        };
        let beta = if self.allow_neg_eigval { (beta * 2.0)? } else { beta };
        // g = -exp(A_log) * softplus(a + dt_bias)   (fla naive_gdn_gate), in float32 as fla's
        // kernels compute gates, β and the L2 norms: bf16 gates compound over the sequence.
        let g = match (&self.a_proj, &self.neg_a, &self.dt_bias) {
            (Some(a), Some(na), Some(dt)) => {
                Some(softplus(&a.forward(x)?.to_dtype(DType::F32)?.broadcast_add(dt)?)?.broadcast_mul(na)?)
            }
            _ => None,
        };
        let r = d.v_heads / d.heads;
        let q = repeat_heads(&l2_norm(&q.to_dtype(DType::F32)?, 1e-6)?, r)?;
        let k = repeat_heads(&l2_norm(&k.to_dtype(DType::F32)?, 1e-6)?, r)?;
        mark("gates + l2 norms", dev);
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: g.as_ref(),
            gk: None,
            scale: (d.dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial: prev_state.as_ref(),
        };
        let o = crate::arch::run_recurrence(&rec, self.layer, obs, cache, conv_states)?;
        mark("recurrence", dev);
        let o = match &self.g_proj {
            Some(gp) => self.o_norm.forward_gated(&o, &gp.forward(x)?.reshape((b, t, d.v_heads, d.dv))?)?,
            None => self.o_norm.forward(&o)?,
        };
        Ok(self.o_proj.forward(&o.reshape((b, t, d.v_heads * d.dv))?)?)
    }
}

/// A DeltaNet or Gated DeltaNet causal LM.
pub type FlaModel = FlaStack<Mixer>;

impl FlaStack<Mixer> {
    /// The stages of a DeltaNet / Gated DeltaNet model over `vb`.
    pub fn fla_layers(vb: VarBuilder<'static>, cfg: &FlaConfig, d: Dims, opts: &LoadOptions) -> FlaLayers<Mixer> {
        let shape = StackShape {
            vocab: cfg.vocab_size,
            hidden: d.hidden,
            intermediate: d.intermediate,
            layers: cfg.num_hidden_layers,
            norm_eps: cfg.norm_eps,
            tie_word_embeddings: cfg.tie_word_embeddings,
        };
        let (cfg, grad) = (cfg.clone(), opts.grad);
        FlaStack::layers(vb, shape, opts, move |vb, i, vars| Mixer::load(vb, &cfg, d, i, grad, vars))
    }
}
