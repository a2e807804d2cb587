//! Falcon-H1 (`falcon_h1`, transformers `FalconH1ForCausalLM`): every layer runs a Mamba-2
//! mixer and attention side by side on the same normed input, then a SwiGLU MLP, with muP
//! multipliers on the embeddings, on each branch's input and output, on the in_proj segments
//! [z, x, B, C, dt], on the keys, the MLP and the logits. Follows transformers `models/falcon_h1/`.
//!
//! The key width is `mamba_d_state`; the in_proj segment multipliers are recomputed from the
//! config by transformers, so they follow a new width.

use super::config::{rope_theta, AutoSize, Limit, RopeParameters};
use super::defaults;
use super::layered::Layers;
use super::{parse_as, Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::{Attention, AttentionSpec, Rope};
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::linear::Linear;
use crate::layers::mamba2::{Mamba2Dims, Mamba2Mixer, OutputNorm};
use crate::layers::mlp::Mlp;
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::VarBuilder;
use serde::Deserialize;
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

/// The config.json keys of transformers' `FalconH1Config`, with its defaults.
#[derive(Debug, Deserialize)]
struct Keys {
    hidden_size: usize,
    num_hidden_layers: usize,
    vocab_size: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    #[serde(default = "defaults::eps5")]
    rms_norm_eps: f64,
    #[serde(default)]
    mamba_d_ssm: Option<usize>,
    #[serde(default = "two")]
    mamba_expand: f64,
    #[serde(default = "defaults::d128")]
    mamba_n_heads: usize,
    #[serde(default)]
    mamba_d_head: AutoSize,
    #[serde(default = "defaults::one")]
    mamba_n_groups: usize,
    #[serde(default = "defaults::d256")]
    mamba_d_state: usize,
    #[serde(default = "defaults::four")]
    mamba_d_conv: usize,
    #[serde(default = "defaults::yes")]
    mamba_conv_bias: bool,
    #[serde(default)]
    mamba_proj_bias: bool,
    #[serde(default)]
    projectors_bias: bool,
    #[serde(default)]
    time_step_limit: Limit,
    #[serde(default)]
    mamba_rms_norm: bool,
    #[serde(default = "defaults::yes")]
    mamba_norm_before_gate: bool,
    #[serde(default = "defaults::unit")]
    ssm_in_multiplier: f64,
    #[serde(default = "defaults::units")]
    ssm_multipliers: [f64; 5],
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default = "defaults::unit")]
    key_multiplier: f64,
    #[serde(default = "defaults::silu")]
    hidden_act: String,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "defaults::unit")]
    embedding_multiplier: f64,
    #[serde(default = "defaults::unit")]
    lm_head_multiplier: f64,
    #[serde(default = "defaults::unit")]
    ssm_out_multiplier: f64,
    #[serde(default = "defaults::unit")]
    attention_in_multiplier: f64,
    #[serde(default = "defaults::unit")]
    attention_out_multiplier: f64,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "defaults::units")]
    mlp_multipliers: [f64; 2],
}

fn two() -> f64 {
    2.0
}

impl FalconH1Config {
    fn from_keys(c: Keys) -> Result<Self> {
        let hidden = c.hidden_size;
        let eps = c.rms_norm_eps;
        let d_inner = c.mamba_d_ssm.unwrap_or((c.mamba_expand * hidden as f64) as usize);
        let heads = c.mamba_n_heads;
        let head_dim = c.mamba_d_head.0.unwrap_or(d_inner / heads.max(1));
        let groups = c.mamba_n_groups;
        let dims = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: c.mamba_d_state,
            groups,
            d_inner,
            conv_kernel: c.mamba_d_conv,
            conv_bias: c.mamba_conv_bias,
            in_bias: c.mamba_proj_bias,
            out_bias: c.projectors_bias,
            eps,
            dt_limit: (c.time_step_limit.0, c.time_step_limit.1),
            norm: if c.mamba_rms_norm {
                OutputNorm::Gated { groups, before_gate: c.mamba_norm_before_gate }
            } else {
                OutputNorm::None
            },
            in_scale: c.ssm_in_multiplier,
            segment_scales: c.ssm_multipliers,
        };
        dims.check().context("the Mamba-2 sizes of config.json (mamba_n_heads, mamba_d_head, mamba_d_ssm)")?;
        let heads_a = c.num_attention_heads;
        let hd = c.head_dim.unwrap_or(hidden / heads_a.max(1));
        let bias = c.attention_bias;
        let attention = AttentionSpec {
            hidden,
            heads: heads_a,
            kv_heads: c.num_key_value_heads.unwrap_or(heads_a),
            head_dim: hd,
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: None,
            output_gate: false,
            rope: Some(Rope {
                dim: hd,
                theta: rope_theta(c.rope_parameters.as_ref(), c.rope_theta, 10000.0),
                inv_freq_dtype: DType::F32,
                f32_rotation: false,
            }),
            // the keys' muP multiplier scales every score (RoPE and the cache are linear in k)
            scale: (hd as f64).powf(-0.5) * c.key_multiplier,
            window: None,
        };
        if c.hidden_act != "silu" {
            bail!("hidden_act \"{}\" is not supported (Falcon-H1 uses silu)", c.hidden_act);
        }
        Ok(Self {
            layers: c.num_hidden_layers,
            vocab: c.vocab_size,
            hidden,
            eps,
            tie: c.tie_word_embeddings,
            embed_scale: c.embedding_multiplier,
            logit_scale: c.lm_head_multiplier,
            dims,
            ssm_out: c.ssm_out_multiplier,
            attention,
            attn_in: c.attention_in_multiplier,
            attn_out: c.attention_out_multiplier,
            intermediate: c.intermediate_size,
            mlp_bias: c.mlp_bias,
            mlp_scales: c.mlp_multipliers,
        })
    }
}

fn config(ckpt: &Checkpoint) -> Result<FalconH1Config> {
    FalconH1Config::from_keys(parse_as(ckpt, &ckpt.config, "Falcon-H1")?)
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
        Ok(crate::arch::mamba2::mixer_layout(&c.dims, "FalconH1", mixers, c.layers, |t| ckpt.tensors.contains_key(t)))
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
            lm_head: untied_head(|t| ckpt.tensors.contains_key(t), c.tie),
            embed_scale: c.embed_scale,
            logit_scale: c.logit_scale,
            final_norm_weight: crate::ops::norm::NormWeight::Plain,
            states_after_blocks: false,
        };
        let (ckpt, grad) = (ckpt.clone(), opts.grad);
        let build = move |l: VarBuilder, i: usize| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let mamba = Mamba2Mixer::load(l.pp("mamba"), &c.dims, i, &|n| Ok(ckpt.info(n)?.shape.clone()), grad)?;
            let attn = Attention::load(l.pp("self_attn"), &c.attention)?;
            let mixers = Sublayer::Parallel(vec![
                (Sublayer::Mamba2(mamba), 1.0, c.ssm_out),
                (Sublayer::Attention(attn), c.attn_in, c.attn_out),
            ]);
            let f = l.pp("feed_forward");
            let (h, n, b) = (c.hidden, c.intermediate, c.mlp_bias);
            let mlp = Mlp::ScaledSwiGlu {
                gate: Linear::load(f.pp("gate_proj"), h, n, b)?,
                up: Linear::load(f.pp("up_proj"), h, n, b)?,
                down: Linear::load(f.pp("down_proj"), n, h, b)?,
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
