//! Falcon-H1 (`falcon_h1`, transformers `FalconH1ForCausalLM`): every layer runs a Mamba-2
//! mixer and attention side by side on the same normed input, then a SwiGLU MLP, with muP
//! multipliers on the embeddings, on each branch's input and output, on the in_proj segments
//! [z, x, B, C, dt], on the keys, the MLP and the logits. Follows transformers `models/falcon_h1/`.
//!
//! The key width is `mamba_d_state`; the in_proj segment multipliers are recomputed from the
//! config by transformers, so they follow a new width.

use super::keys::{bool_of, f64_of, f64s_of, rope_theta, usize_of};
use super::layered::Layers;
use super::{Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::{Attention, AttentionSpec, Rope};
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::mamba2::{Mamba2Dims, Mamba2Mixer, OutputNorm};
use crate::layers::mlp::Mlp;
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::{linear_b, VarBuilder};
use serde_json::Value;

#[derive(Debug, Clone)]
struct FalconH1Config {
    layers: usize,
    vocab: usize,
    hidden: usize,
    eps: f64,
    tie: bool,
    embed_scale: f64,
    logit_scale: f64,
    dims: Mamba2Dims,
    ssm_out: f64,
    attention: AttentionSpec,
    attn_in: f64,
    attn_out: f64,
    intermediate: usize,
    mlp_bias: bool,
    mlp_scales: [f64; 2],
}

impl FalconH1Config {
    fn from_value(c: &Value) -> Result<Self> {
        let hidden = usize_of(c, "hidden_size", None)?;
        let eps = f64_of(c, "rms_norm_eps", 1e-5)?;
        let d_inner = match c.get("mamba_d_ssm") {
            None | Some(Value::Null) => (f64_of(c, "mamba_expand", 2.0)? * hidden as f64) as usize,
            Some(_) => usize_of(c, "mamba_d_ssm", None)?,
        };
        let heads = usize_of(c, "mamba_n_heads", Some(128))?;
        let head_dim = match c.get("mamba_d_head") {
            None | Some(Value::String(_)) => d_inner / heads.max(1), // "auto"
            Some(_) => usize_of(c, "mamba_d_head", None)?,
        };
        let groups = usize_of(c, "mamba_n_groups", Some(1))?;
        let dims = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: usize_of(c, "mamba_d_state", Some(256))?,
            groups,
            d_inner,
            conv_kernel: usize_of(c, "mamba_d_conv", Some(4))?,
            conv_bias: bool_of(c, "mamba_conv_bias", true),
            in_bias: bool_of(c, "mamba_proj_bias", false),
            out_bias: bool_of(c, "projectors_bias", false),
            eps,
            dt_limit: super::mamba2::limit(c.get("time_step_limit"))?,
            norm: if bool_of(c, "mamba_rms_norm", false) {
                OutputNorm::Gated { groups, before_gate: bool_of(c, "mamba_norm_before_gate", true) }
            } else {
                OutputNorm::None
            },
            in_scale: f64_of(c, "ssm_in_multiplier", 1.0)?,
            segment_scales: f64s_of(c, "ssm_multipliers", [1.0; 5])?,
        };
        dims.check().context("the Mamba-2 sizes of config.json (mamba_n_heads, mamba_d_head, mamba_d_ssm)")?;
        let heads_a = usize_of(c, "num_attention_heads", None)?;
        let hd = usize_of(c, "head_dim", Some(hidden / heads_a.max(1)))?;
        let bias = bool_of(c, "attention_bias", false);
        let attention = AttentionSpec {
            hidden,
            heads: heads_a,
            kv_heads: usize_of(c, "num_key_value_heads", Some(heads_a))?,
            head_dim: hd,
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: None,
            output_gate: false,
            rope: Some(Rope {
                dim: hd,
                theta: rope_theta(c, 10000.0),
                inv_freq_dtype: DType::F32,
                f32_rotation: false,
            }),
            // the keys' muP multiplier scales every score (RoPE and the cache are linear in k)
            scale: (hd as f64).powf(-0.5) * f64_of(c, "key_multiplier", 1.0)?,
            window: None,
        };
        let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            bail!("hidden_act \"{act}\" is not supported (Falcon-H1 uses silu)");
        }
        Ok(Self {
            layers: usize_of(c, "num_hidden_layers", None)?,
            vocab: usize_of(c, "vocab_size", None)?,
            hidden,
            eps,
            tie: bool_of(c, "tie_word_embeddings", false),
            embed_scale: f64_of(c, "embedding_multiplier", 1.0)?,
            logit_scale: f64_of(c, "lm_head_multiplier", 1.0)?,
            dims,
            ssm_out: f64_of(c, "ssm_out_multiplier", 1.0)?,
            attention,
            attn_in: f64_of(c, "attention_in_multiplier", 1.0)?,
            attn_out: f64_of(c, "attention_out_multiplier", 1.0)?,
            intermediate: usize_of(c, "intermediate_size", None)?,
            mlp_bias: bool_of(c, "mlp_bias", false),
            mlp_scales: f64s_of(c, "mlp_multipliers", [1.0; 2])?,
        })
    }
}

fn config(ckpt: &Checkpoint) -> Result<FalconH1Config> {
    FalconH1Config::from_value(&ckpt.config)
        .with_context(|| format!("{}/config.json does not match the Falcon-H1 format", ckpt.dir.display()))
}

pub struct FalconH1Family;

impl Family for FalconH1Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["falcon_h1"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let c = config(ckpt)?;
        let mixers = (0..c.layers).map(|i| (i, format!("model.layers.{i}.mamba.")));
        Ok(c.dims.layout("FalconH1", mixers, c.layers, |t| ckpt.tensors.contains_key(t)))
    }

    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        let c = config(ckpt)?;
        let spec = StackSpec {
            vocab: c.vocab,
            hidden: c.hidden,
            layers: c.layers,
            eps: c.eps,
            embed: "model.embed_tokens.weight".into(),
            layer_prefix: "model.layers".into(),
            final_norm: "model.final_layernorm".into(),
            lm_head: untied_head(ckpt, c.tie),
            embed_scale: c.embed_scale,
            logit_scale: c.logit_scale,
        };
        let (ckpt, grad) = (ckpt.clone(), opts.grad);
        let build = move |l: VarBuilder, i: usize, vars: &mut Vec<(String, candle_core::Var)>| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let mamba = Mamba2Mixer::load(l.pp("mamba"), &c.dims, i, &ckpt, grad, vars)?;
            let attn = Attention::load(l.pp("self_attn"), &c.attention)?;
            let mixers = Sublayer::Parallel(vec![
                (Sublayer::Mamba2(mamba), 1.0, c.ssm_out),
                (Sublayer::Attention(attn), c.attn_in, c.attn_out),
            ]);
            let f = l.pp("feed_forward");
            let (h, n, b) = (c.hidden, c.intermediate, c.mlp_bias);
            let mlp = Mlp::ScaledSwiGlu {
                gate: linear_b(h, n, b, f.pp("gate_proj"))?,
                up: linear_b(h, n, b, f.pp("up_proj"))?,
                down: linear_b(n, h, b, f.pp("down_proj"))?,
                gate_scale: c.mlp_scales[0],
                down_scale: c.mlp_scales[1],
            };
            Ok(Layer {
                steps: vec![
                    Step { norm: norm("input_layernorm")?, sublayer: mixers, scale: 1.0 },
                    Step { norm: norm("pre_ff_layernorm")?, sublayer: Sublayer::Mlp(mlp), scale: 1.0 },
                ],
            })
        };
        Ok(Box::new(Stack::new(vb, spec, opts.device.clone(), Box::new(build))))
    }

    fn set_key_width(&self, config: &mut Value, _layout: &StateLayout, dk: usize) -> Result<()> {
        config["mamba_d_state"] = Value::from(dk);
        Ok(())
    }
}
