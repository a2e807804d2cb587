//! Kimi Linear (`kimi_linear`, transformers `KimiLinearForCausalLM`): pre-norm layers of Kimi
//! Delta Attention or MLA (placed by the 1-based `linear_attn_config.kda_layers` /
//! `full_attn_layers`), then a SwiGLU MLP for the first `first_k_dense_replace` layers and a
//! sigmoid-routed MoE with shared experts after. Follows transformers `models/kimi_linear/`.
//!
//! Pruned checkpoints cannot be written: the config has one `linear_attn_config.head_dim` for
//! the key width, the value width, the gate ranks and the output norm, so transformers cannot
//! describe a key width below the value width. Everything else (forward, decoding, inspect,
//! calibrate, eval, selection with `prune --dry-run`) runs.

use super::defaults;
use super::layered::Layers;
use super::{parse_as, Family, LayerState, LoadOptions, RowSlice, SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::linear::Linear;
use crate::layers::linear_attention::{Decay, LinearAttention, LinearDims, OutputGate, Projections};
use crate::layers::mla::{Mla, MlaDims};
use crate::layers::mlp::{Mlp, SwiGlu};
use crate::layers::moe::{Moe, Router, Shared};
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::conv::ShortConv;
use crate::ops::derived::Derived;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::VarBuilder;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone)]
struct KimiConfig {
    /// true: KDA, false: MLA
    kda: Vec<bool>,
    vocab: usize,
    hidden: usize,
    eps: f64,
    tie: bool,
    kda_dims: LinearDims,
    conv_kernel: usize,
    mla: MlaDims,
    dense_layers: usize,
    intermediate: usize,
    experts: usize,
    top_k: usize,
    moe_intermediate: usize,
    shared_experts: usize,
    groups: usize,
    topk_groups: usize,
    renormalize: bool,
    scale: f64,
}

/// The config.json keys of transformers' `KimiLinearConfig`. Where the release and
/// transformers spell a key two ways, both are read and the first spelling wins.
#[derive(Debug, Deserialize)]
struct Keys {
    num_hidden_layers: usize,
    hidden_size: usize,
    vocab_size: usize,
    intermediate_size: usize,
    num_attention_heads: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    kv_lora_rank: usize,
    moe_intermediate_size: usize,
    linear_attn_config: LinearAttnConfig,
    #[serde(default = "defaults::eps5")]
    rms_norm_eps: f64,
    #[serde(default)]
    q_lora_rank: Option<usize>,
    #[serde(default = "defaults::silu")]
    hidden_act: String,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "defaults::one")]
    first_k_dense_replace: usize,
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    n_routed_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_token: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    num_shared_experts: Option<usize>,
    #[serde(default)]
    n_shared_experts: Option<usize>,
    #[serde(default)]
    num_expert_group: Option<usize>,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default = "defaults::one")]
    topk_group: usize,
    #[serde(default = "defaults::yes")]
    moe_renormalize: bool,
    #[serde(default = "defaults::unit")]
    routed_scaling_factor: f64,
}

/// `linear_attn_config`: the KDA layers' sizes and where they sit (1-based layer numbers).
#[derive(Debug, Deserialize)]
struct LinearAttnConfig {
    head_dim: usize,
    num_heads: usize,
    #[serde(default = "defaults::four")]
    short_conv_kernel_size: usize,
    kda_layers: Vec<usize>,
    full_attn_layers: Vec<usize>,
}

/// Which layers are KDA, from the 1-based lists.
fn kda_layers(lin: &LinearAttnConfig, layers: usize) -> Result<Vec<bool>> {
    let list = |key: &str, a: &[usize]| -> Result<Vec<usize>> {
        a.iter()
            .map(|&n| match n {
                n if (1..=layers).contains(&n) => Ok(n - 1),
                _ => bail!("linear_attn_config.{key} holds {n}; layers are numbered 1..={layers} (num_hidden_layers)"),
            })
            .collect()
    };
    let (kda, full) = (list("kda_layers", &lin.kda_layers)?, list("full_attn_layers", &lin.full_attn_layers)?);
    let mut out = vec![None; layers];
    for (l, is_kda) in kda.iter().map(|&l| (l, true)).chain(full.iter().map(|&l| (l, false))) {
        if out[l].replace(is_kda).is_some() {
            bail!("layer {} is listed twice in linear_attn_config.kda_layers / full_attn_layers", l + 1);
        }
    }
    out.iter()
        .enumerate()
        .map(|(i, t)| t.with_context(|| format!("layer {} is in neither kda_layers nor full_attn_layers", i + 1)))
        .collect()
}

impl KimiConfig {
    fn from_keys(c: Keys) -> Result<Self> {
        let layers = c.num_hidden_layers;
        let hidden = c.hidden_size;
        let eps = c.rms_norm_eps;
        let lin = &c.linear_attn_config;
        let head = lin.head_dim;
        if c.q_lora_rank.is_some() {
            bail!("MLA with a query low-rank projection (q_lora_rank) is not supported");
        }
        if c.hidden_act != "silu" {
            bail!("hidden_act \"{}\" is not supported (Kimi Linear uses silu)", c.hidden_act);
        }
        Ok(Self {
            kda: kda_layers(lin, layers)?,
            vocab: c.vocab_size,
            hidden,
            eps,
            tie: c.tie_word_embeddings,
            kda_dims: LinearDims { hidden, heads: lin.num_heads, v_heads: lin.num_heads, dk: head, dv: head },
            conv_kernel: lin.short_conv_kernel_size,
            mla: MlaDims {
                hidden,
                heads: c.num_attention_heads,
                nope: c.qk_nope_head_dim,
                shared: c.qk_rope_head_dim,
                v_head: c.v_head_dim,
                kv_rank: c.kv_lora_rank,
                // transformers builds kv_a_layernorm with its default eps, not rms_norm_eps
                latent_eps: 1e-6,
            },
            dense_layers: c.first_k_dense_replace,
            intermediate: c.intermediate_size,
            experts: c
                .num_experts
                .or(c.n_routed_experts)
                .context("config.json has no num_experts or n_routed_experts")?,
            top_k: c
                .num_experts_per_token
                .or(c.num_experts_per_tok)
                .context("config.json has no num_experts_per_token or num_experts_per_tok")?,
            moe_intermediate: c.moe_intermediate_size,
            shared_experts: c.num_shared_experts.or(c.n_shared_experts).unwrap_or(0),
            groups: c.num_expert_group.or(c.n_group).unwrap_or(1),
            topk_groups: c.topk_group,
            renormalize: c.moe_renormalize,
            scale: c.routed_scaling_factor,
        })
    }

    /// The feed-forward step of layer `i` under `l` (`model.layers.{i}`).
    fn ffn(&self, l: &VarBuilder, i: usize) -> Result<Sublayer> {
        let h = self.hidden;
        let m = l.pp("block_sparse_moe");
        if i < self.dense_layers {
            // releases name the dense MLP `mlp`, transformers' save_pretrained `block_sparse_moe`
            let vb = if l.contains_tensor("mlp.gate_proj.weight") { l.pp("mlp") } else { m };
            return Ok(Sublayer::Mlp(Mlp::SwiGlu(SwiGlu::load(vb, h, self.intermediate)?)));
        }
        let n = self.moe_intermediate;
        let experts = (0..self.experts)
            .map(|e| {
                let x = m.pp(format!("experts.{e}"));
                let lin = |name: &str, o: usize, i: usize| Linear::load(x.pp(name), i, o, false);
                Ok(Mlp::SwiGlu(SwiGlu::new(lin("w1", n, h)?, lin("w3", n, h)?, lin("w2", h, n)?)))
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = match self.shared_experts {
            0 => None,
            s => Some(Shared { mlp: Mlp::SwiGlu(SwiGlu::load(m.pp("shared_experts"), h, n * s)?), gate: None }),
        };
        Ok(Sublayer::Moe(Moe {
            gate: Linear::load(m.pp("gate"), h, self.experts, false)?,
            router: Router::sigmoid(
                &m.pp("gate"),
                self.experts,
                self.groups,
                self.topk_groups,
                self.renormalize,
                self.scale,
            )?,
            top_k: self.top_k,
            experts,
            shared,
        }))
    }
}

/// A Kimi Delta Attention layer under `vb` (`…self_attn`): the delta rule with a per-key-channel
/// decay from a low-rank projection and a sigmoid low-rank output gate.
fn kda(vb: VarBuilder, c: &KimiConfig, layer: usize, grad: bool) -> Result<LinearAttention> {
    let d = c.kda_dims;
    let (hk, hv) = (d.heads * d.dk, d.v_heads * d.dv);
    let lin = |name: &str, i: usize, o: usize| Linear::load(vb.pp(name), i, o, false);
    let f32 = DType::F32;
    Ok(LinearAttention {
        dims: d,
        layer,
        proj: Projections::Separate {
            q: Linear::load_trainable(&vb, "q_proj", d.hidden, hk, false, grad)?,
            k: Linear::load_trainable(&vb, "k_proj", d.hidden, hk, false, grad)?,
            v: lin("v_proj", d.hidden, hv)?,
            b: Some(lin("b_proj", d.hidden, d.v_heads)?),
            a: None,
            z: None,
        },
        conv: Some(ShortConv::concat(
            &vb,
            &[("q_conv1d", hk), ("k_conv1d", hk), ("v_conv1d", hv)],
            c.conv_kernel,
            false,
        )?),
        decay: Decay::PerChannel {
            f_a: lin("f_a_proj", d.hidden, d.dv)?,
            f_b: lin("f_b_proj", d.dv, hk)?,
            neg_a: {
                let hv = d.v_heads;
                Derived::new(vb.get((1, 1, hv, 1), "A_log")?, move |t| t.to_dtype(f32)?.reshape((hv, 1))?.exp()?.neg())?
            },
            dt_bias: Derived::new(vb.get_with_hints_dtype(hk, "dt_bias", Default::default(), f32)?, |t| Ok(t.clone()))?,
        },
        gate: OutputGate::SigmoidLowRank { g_a: lin("g_a_proj", d.hidden, d.dv)?, g_b: lin("g_b_proj", d.dv, hv)? },
        beta_scale: 1.0,
        norm: RmsNorm::load(vb.pp("o_norm"), d.dv, c.eps, NormWeight::Plain)?,
        o_proj: lin("o_proj", hv, d.hidden)?,
    })
}

fn config(ckpt: &Checkpoint) -> Result<KimiConfig> {
    KimiConfig::from_keys(parse_as(ckpt, &ckpt.config, "Kimi Linear")?)
        .with_context(|| format!("{}/config.json does not match the Kimi Linear format", ckpt.dir.display()))
}

pub struct KimiLinearFamily;

impl Family for KimiLinearFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["kimi_linear"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let c = config(ckpt)?;
        let d = c.kda_dims;
        let layers = (0..c.kda.len())
            .filter(|&i| c.kda[i])
            .map(|i| {
                let p = format!("model.layers.{i}.self_attn.");
                let slice = |t: &str, role| RowSlice { tensor: format!("{p}{t}"), offset: 0, head_stride: d.dk, role };
                let slices = vec![
                    slice("q_proj.weight", SliceRole::QueryProj),
                    slice("k_proj.weight", SliceRole::KeyProj),
                    slice("q_conv1d.weight", SliceRole::Conv),
                    slice("k_conv1d.weight", SliceRole::Conv),
                    // the per-key-channel decay: its projection's rows and bias entries
                    slice("f_b_proj.weight", SliceRole::Channel),
                    slice("dt_bias", SliceRole::Channel),
                ];
                LayerState { layer: i, key_heads: d.heads, value_heads: d.heads, dv: d.dv, slices }
            })
            .collect();
        Ok(StateLayout { family: "KimiLinear".into(), dk: d.dk, layers, num_layers: c.kda.len() })
    }

    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        let c = config(ckpt)?;
        let spec = StackSpec {
            vocab: c.vocab,
            hidden: c.hidden,
            layers: c.kda.len(),
            eps: c.eps,
            embed: "model.embed_tokens.weight".into(),
            layer_prefix: "model.layers".into(),
            final_norm: "model.norm".into(),
            lm_head: untied_head(|t| ckpt.tensors.contains_key(t), c.tie),
            embed_scale: 1.0,
            logit_scale: 1.0,
            final_norm_weight: crate::ops::norm::NormWeight::Plain,
            states_after_blocks: false,
        };
        let grad = opts.grad;
        let build = move |l: VarBuilder, i: usize| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let a = l.pp("self_attn");
            let mixer =
                if c.kda[i] { Sublayer::Linear(kda(a, &c, i, grad)?) } else { Sublayer::Mla(Mla::load(a, c.mla)?) };
            Ok(Layer {
                steps: vec![
                    Step { norm: norm("input_layernorm")?, sublayer: mixer, scale: 1.0 },
                    Step { norm: norm("post_attention_layernorm")?, sublayer: c.ffn(&l, i)?, scale: 1.0 },
                ],
            })
        };
        Ok(Box::new(Stack::new(vb, spec, opts.device.clone(), Box::new(build))))
    }

    fn set_key_width(&self, _config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()> {
        bail!(
            "kimi_linear checkpoints cannot be pruned: transformers' KimiLinear config has one linear_attn_config.head_dim \
             ({}) for the key width, the value width, the gate ranks and o_norm, so a key width of {dk} below the value \
             width cannot be written in a form it loads (inspect, calibrate, eval and prune --dry-run work)",
            layout.dk
        )
    }
}
