//! fla DeltaNet / Gated DeltaNet causal LMs: fla's tensor names and switches wired onto the
//! shared linear-attention mixer.

use super::stack::{FlaLayers, FlaStack, StackShape, TokenMixer};
use super::{Dims, FlaConfig, Kind};
use crate::arch::{projection, LayerCache, LoadOptions, Observer};
use crate::layers::linear_attention::{Decay, LinearAttention, LinearDims, OutputGate, Projections};
use crate::ops::conv::ShortConv;
use crate::ops::derived::Derived;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_nn::{linear_no_bias, VarBuilder};

/// One DeltaNet / Gated DeltaNet layer (fla `DeltaNet` / `GatedDeltaNet`, under `attn`) as the
/// shared linear-attention mixer.
pub type Mixer = LinearAttention;

fn load(
    vb: VarBuilder,
    cfg: &FlaConfig,
    d: Dims,
    layer: usize,
    grad: bool,
    vars: &mut Vec<(String, Var)>,
) -> Result<Mixer> {
    let (hid, kd, vd) = (d.hidden, d.heads * d.dk, d.v_heads * d.dv);
    let gated = d.kind == Kind::GatedDeltaNet;
    let conv = if cfg.use_short_conv {
        let parts = [("q_conv1d", kd), ("k_conv1d", kd), ("v_conv1d", vd)];
        Some(ShortConv::concat(&vb, &parts, cfg.conv_size, cfg.conv_bias)?)
    } else {
        None
    };
    let lin = |name: &str, out: usize| linear_no_bias(hid, out, vb.pp(name));
    let proj = Projections::Separate {
        q: projection(&vb, "q_proj", kd, hid, false, grad, vars)?,
        k: projection(&vb, "k_proj", kd, hid, false, grad, vars)?,
        v: lin("v_proj", vd)?,
        b: if gated || cfg.use_beta { Some(lin("b_proj", d.v_heads)?) } else { None },
        a: if gated { Some(lin("a_proj", d.v_heads)?) } else { None },
        z: if d.use_gate { Some(lin("g_proj", vd)?) } else { None },
    }
    .stacked()?;
    // g = -exp(A_log) * softplus(a + dt_bias)   (fla naive_gdn_gate)
    let decay = if gated {
        Decay::PerHead {
            neg_a: Derived::new(vb.get(d.v_heads, "A_log")?, |t| t.to_dtype(DType::F32)?.exp()?.neg())?,
            dt_bias: Derived::new(vb.get(d.v_heads, "dt_bias")?, |t| t.to_dtype(DType::F32))?,
        }
    } else {
        Decay::None
    };
    Ok(LinearAttention {
        dims: LinearDims { hidden: hid, heads: d.heads, v_heads: d.v_heads, dk: d.dk, dv: d.dv },
        layer,
        proj,
        conv,
        decay,
        gate: if d.use_gate { OutputGate::Silu } else { OutputGate::None },
        beta_scale: if cfg.allow_neg_eigval { 2.0 } else { 1.0 },
        norm: RmsNorm::load(vb.pp("o_norm"), d.dv, cfg.norm_eps, NormWeight::Plain)?,
        o_proj: linear_no_bias(vd, hid, vb.pp("o_proj"))?,
    })
}

impl TokenMixer for LinearAttention {
    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        LinearAttention::forward(self, x, obs, cache)
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
        FlaStack::layers(vb, shape, opts, move |vb, i, vars| load(vb, &cfg, d, i, grad, vars))
    }
}
