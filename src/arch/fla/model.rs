//! fla causal LMs: the block stack every model built from fla blocks shares (DeltaNet, Gated
//! DeltaNet, SSE: embeddings, per layer `x + mixer(attn_norm(x))` and `x + mlp(mlp_norm(x))`,
//! a final norm and the LM head), and fla's DeltaNet / Gated DeltaNet tensor names and switches
//! wired onto the shared linear-attention mixer.

use super::{Dims, FlaConfig, Kind};
use crate::arch::LoadOptions;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::linear::Linear;
use crate::layers::linear_attention::{Decay, LinearAttention, LinearDims, OutputGate, Projections};
use crate::layers::mlp::{Mlp, SwiGlu};
use crate::layers::stack::{Stack, StackSpec};
use crate::ops::conv::ShortConv;
use crate::ops::derived::Derived;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::DType;
use candle_nn::VarBuilder;

/// The sizes of an fla block stack.
pub struct StackShape {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub norm_eps: f64,
    pub tie_word_embeddings: bool,
}

/// The stages of an fla causal LM; `mixer(vb, i)` builds layer `i`'s token mixer from its
/// `attn` prefix.
pub fn fla_stack(
    vb: VarBuilder<'static>,
    s: StackShape,
    opts: &LoadOptions,
    mixer: impl Fn(VarBuilder, usize) -> Result<Sublayer> + Send + Sync + 'static,
) -> Stack {
    let spec = StackSpec {
        vocab: s.vocab,
        hidden: s.hidden,
        layers: s.layers,
        eps: s.norm_eps,
        embed: "model.embeddings.weight".into(),
        layer_prefix: "model.layers".into(),
        final_norm: "model.norm".into(),
        lm_head: (!s.tie_word_embeddings).then(|| "lm_head.weight".into()),
        embed_scale: 1.0,
        logit_scale: 1.0,
        final_norm_weight: NormWeight::Plain,
        states_after_blocks: false,
    };
    let (hidden, intermediate, eps) = (s.hidden, s.intermediate, s.norm_eps);
    let build = move |l: VarBuilder, i: usize| -> Result<Layer> {
        let norm = |name: &str| RmsNorm::load(l.pp(name), hidden, eps, NormWeight::Plain);
        Ok(Layer {
            steps: vec![
                Step { norm: norm("attn_norm")?, sublayer: mixer(l.pp("attn"), i)?, scale: 1.0 },
                Step {
                    norm: norm("mlp_norm")?,
                    sublayer: Sublayer::Mlp(Mlp::SwiGlu(SwiGlu::load(l.pp("mlp"), hidden, intermediate)?)),
                    scale: 1.0,
                },
            ],
        })
    };
    Stack::new(vb, spec, opts.device.clone(), Box::new(build))
}

/// One DeltaNet / Gated DeltaNet layer (fla `DeltaNet` / `GatedDeltaNet`, under `attn`) as the
/// shared linear-attention mixer.
fn load(vb: VarBuilder, cfg: &FlaConfig, d: Dims, layer: usize, grad: bool) -> Result<LinearAttention> {
    let (hid, kd, vd) = (d.hidden, d.heads * d.dk, d.v_heads * d.dv);
    let gated = d.kind == Kind::GatedDeltaNet;
    let conv = if cfg.use_short_conv {
        let parts = [("q_conv1d", kd), ("k_conv1d", kd), ("v_conv1d", vd)];
        Some(ShortConv::concat(&vb, &parts, cfg.conv_size, cfg.conv_bias)?)
    } else {
        None
    };
    let lin = |name: &str, out: usize| Linear::load(vb.pp(name), hid, out, false);
    let proj = Projections::Separate {
        q: Linear::load_trainable(&vb, "q_proj", hid, kd, false, grad)?,
        k: Linear::load_trainable(&vb, "k_proj", hid, kd, false, grad)?,
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
        o_proj: Linear::load(vb.pp("o_proj"), vd, hid, false)?,
    })
}

/// The stages of a DeltaNet / Gated DeltaNet model over `vb`.
pub fn delta_net_stack(vb: VarBuilder<'static>, cfg: &FlaConfig, d: Dims, opts: &LoadOptions) -> Stack {
    let shape = StackShape {
        vocab: cfg.vocab_size,
        hidden: d.hidden,
        intermediate: d.intermediate,
        layers: cfg.num_hidden_layers,
        norm_eps: cfg.norm_eps,
        tie_word_embeddings: cfg.tie_word_embeddings,
    };
    let (cfg, grad) = (cfg.clone(), opts.grad);
    fla_stack(vb, shape, opts, move |vb, i| Ok(Sublayer::Linear(load(vb, &cfg, d, i, grad)?)))
}
