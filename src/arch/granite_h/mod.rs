//! Granite 4.0-H (`granitemoehybrid`, transformers `GraniteMoeHybridForCausalLM`): pre-norm
//! layers of a Mamba-2 mixer or attention (RoPE or none), then a shared SwiGLU MLP plus, in the
//! MoE models, softmax-routed experts; muP multipliers on the embeddings, on each residual
//! branch, on attention scores and on the logits. Follows transformers `models/granitemoehybrid/`.
//!
//! The key width is `mamba_d_state`.

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
use crate::layers::moe::{Moe, Router, Shared};
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::VarBuilder;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone)]
struct GraniteConfig {
    /// true: Mamba-2, false: attention
    mamba: Vec<bool>,
    vocab: usize,
    hidden: usize,
    eps: f64,
    tie: bool,
    embed_scale: f64,
    residual_scale: f64,
    logit_scale: f64,
    dims: Mamba2Dims,
    attention: AttentionSpec,
    shared_intermediate: usize,
    /// (experts, top_k, intermediate) of the MoE models
    experts: Option<(usize, usize, usize)>,
}

/// The config.json keys of transformers' `GraniteMoeHybridConfig`, with its defaults.
#[derive(Debug, Deserialize)]
struct Keys {
    num_hidden_layers: usize,
    layer_types: Vec<String>,
    hidden_size: usize,
    vocab_size: usize,
    num_attention_heads: usize,
    shared_intermediate_size: usize,
    #[serde(default = "defaults::eps")]
    rms_norm_eps: f64,
    #[serde(default = "two")]
    mamba_expand: f64,
    #[serde(default = "defaults::d128")]
    mamba_n_heads: usize,
    #[serde(default)]
    mamba_d_head: AutoSize,
    #[serde(default = "defaults::one")]
    mamba_n_groups: usize,
    #[serde(default)]
    mamba_proj_bias: bool,
    #[serde(default = "defaults::d256")]
    mamba_d_state: usize,
    #[serde(default = "defaults::four")]
    mamba_d_conv: usize,
    #[serde(default = "defaults::yes")]
    mamba_conv_bias: bool,
    #[serde(default)]
    time_step_limit: Limit,
    #[serde(default)]
    position_embedding_type: Option<String>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "defaults::unit")]
    attention_multiplier: f64,
    #[serde(default)]
    num_local_experts: usize,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    intermediate_size: Option<usize>,
    #[serde(default = "defaults::silu")]
    hidden_act: String,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "defaults::unit")]
    embedding_multiplier: f64,
    #[serde(default = "defaults::unit")]
    residual_multiplier: f64,
    #[serde(default = "defaults::unit")]
    logits_scaling: f64,
}

fn two() -> f64 {
    2.0
}

impl GraniteConfig {
    fn from_keys(c: Keys) -> Result<Self> {
        let layers = c.num_hidden_layers;
        let mamba = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "mamba" | "linear_attention" => Ok(true),
                "attention" | "full_attention" => Ok(false),
                _ => bail!("layer_types[{i}] is \"{t}\"; expected \"mamba\" or \"attention\""),
            })
            .collect::<Result<Vec<_>>>()?;
        if mamba.len() != layers {
            bail!("layer_types names {} layers but num_hidden_layers is {layers}; make them agree", mamba.len());
        }
        let hidden = c.hidden_size;
        let eps = c.rms_norm_eps;
        let d_inner = (c.mamba_expand * hidden as f64) as usize;
        let heads = c.mamba_n_heads;
        let head_dim = c.mamba_d_head.0.unwrap_or(d_inner / heads.max(1));
        let groups = c.mamba_n_groups;
        let bias = c.mamba_proj_bias;
        let dims = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: c.mamba_d_state,
            groups,
            d_inner,
            conv_kernel: c.mamba_d_conv,
            conv_bias: c.mamba_conv_bias,
            in_bias: bias,
            out_bias: bias,
            eps,
            dt_limit: (c.time_step_limit.0, c.time_step_limit.1),
            norm: OutputNorm::Gated { groups, before_gate: false },
            in_scale: 1.0,
            segment_scales: [1.0; 5],
        };
        dims.check().context("the Mamba-2 sizes of config.json (mamba_n_heads, mamba_d_head, mamba_expand)")?;
        let heads_a = c.num_attention_heads;
        let hd = hidden / heads_a.max(1);
        let rope = match c.position_embedding_type.as_deref() {
            Some("rope") => Some(Rope {
                dim: hd,
                theta: rope_theta(c.rope_parameters.as_ref(), c.rope_theta, 10000.0),
                inv_freq_dtype: DType::F32,
                f32_rotation: false,
            }),
            None | Some("nope") => None,
            Some(other) => {
                bail!("position_embedding_type \"{other}\" is not supported (expected \"rope\" or \"nope\")")
            }
        };
        let attention = AttentionSpec {
            hidden,
            heads: heads_a,
            kv_heads: c.num_key_value_heads.unwrap_or(heads_a),
            head_dim: hd,
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            qk_norm: None,
            output_gate: false,
            rope,
            // muP: attention_multiplier replaces 1/sqrt(head_dim)
            scale: c.attention_multiplier,
            window: None,
        };
        let experts = match c.num_local_experts {
            0 => None,
            e => Some((
                e,
                c.num_experts_per_tok.context("config.json has no num_experts_per_tok")?,
                c.intermediate_size.context("config.json has no intermediate_size")?,
            )),
        };
        if c.hidden_act != "silu" {
            bail!("hidden_act \"{}\" is not supported (Granite 4.0-H uses silu)", c.hidden_act);
        }
        Ok(Self {
            mamba,
            vocab: c.vocab_size,
            hidden,
            eps,
            tie: c.tie_word_embeddings,
            embed_scale: c.embedding_multiplier,
            residual_scale: c.residual_multiplier,
            logit_scale: 1.0 / c.logits_scaling,
            dims,
            attention,
            shared_intermediate: c.shared_intermediate_size,
            experts,
        })
    }

    /// The feed-forward step under `vb` (`model.layers.{i}`): the shared MLP, plus the routed
    /// experts (`block_sparse_moe`, fused 3-D) in the MoE models.
    fn ffn(&self, vb: &VarBuilder) -> Result<Sublayer> {
        let h = self.hidden;
        let s = vb.pp("shared_mlp");
        let shared = Mlp::swiglu_stacked(
            &s.get((2 * self.shared_intermediate, h), "input_linear.weight")?,
            s.get((h, self.shared_intermediate), "output_linear.weight")?,
        )?;
        let Some((e, k, i)) = self.experts else { return Ok(Sublayer::Mlp(shared)) };
        let m = vb.pp("block_sparse_moe");
        let gate_up = m.get((e, 2 * i, h), "input_linear.weight")?;
        let down = m.get((e, h, i), "output_linear.weight")?;
        let experts = (0..e).map(|x| Mlp::swiglu_stacked(&gate_up.get(x)?, down.get(x)?)).collect::<Result<_>>()?;
        Ok(Sublayer::Moe(Moe {
            gate: Linear::load(m.pp("router.layer"), h, e, false)?,
            // softmax over the top-k logits = softmax over all, renormalised on the top k
            router: Router::Softmax { norm: true },
            top_k: k,
            experts,
            shared: Some(Shared { mlp: shared, gate: None }),
        }))
    }
}

fn config(ckpt: &Checkpoint) -> Result<GraniteConfig> {
    GraniteConfig::from_keys(parse_as(ckpt, &ckpt.config, "Granite 4.0-H")?)
        .with_context(|| format!("{}/config.json does not match the Granite 4.0-H format", ckpt.dir.display()))
}

pub struct GraniteHybridFamily;

impl Family for GraniteHybridFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["granitemoehybrid"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let c = config(ckpt)?;
        let mixers = (0..c.mamba.len()).filter(|&i| c.mamba[i]).map(|i| (i, format!("model.layers.{i}.mamba.")));
        Ok(crate::arch::mamba2::mixer_layout(&c.dims, "GraniteMoeHybrid", mixers, c.mamba.len(), |t| {
            ckpt.tensors.contains_key(t)
        }))
    }

    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        let c = config(ckpt)?;
        let spec = StackSpec {
            vocab: c.vocab,
            hidden: c.hidden,
            layers: c.mamba.len(),
            eps: c.eps,
            embed: "model.embed_tokens.weight".into(),
            layer_prefix: "model.layers".into(),
            final_norm: "model.norm".into(),
            lm_head: untied_head(|t| ckpt.tensors.contains_key(t), c.tie),
            embed_scale: c.embed_scale,
            logit_scale: c.logit_scale,
            final_norm_weight: crate::ops::norm::NormWeight::Plain,
            states_after_blocks: false,
        };
        let (ckpt, grad) = (ckpt.clone(), opts.grad);
        let build = move |l: VarBuilder, i: usize| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let mixer = if c.mamba[i] {
                Sublayer::Mamba2(Mamba2Mixer::load(
                    l.pp("mamba"),
                    &c.dims,
                    i,
                    &|n| Ok(ckpt.info(n)?.shape.clone()),
                    grad,
                )?)
            } else {
                Sublayer::Attention(Attention::load(l.pp("self_attn"), &c.attention)?)
            };
            Ok(Layer {
                steps: vec![
                    Step { norm: norm("input_layernorm")?, sublayer: mixer, scale: c.residual_scale },
                    Step { norm: norm("post_attention_layernorm")?, sublayer: c.ffn(&l)?, scale: c.residual_scale },
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
