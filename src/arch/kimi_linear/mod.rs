//! Kimi Linear (`kimi_linear`, transformers `KimiLinearForCausalLM`): pre-norm layers of Kimi
//! Delta Attention or MLA (placed by the 1-based `linear_attn_config.kda_layers` /
//! `full_attn_layers`), then a SwiGLU MLP for the first `first_k_dense_replace` layers and a
//! sigmoid-routed MoE with shared experts after. Follows transformers `models/kimi_linear/`.
//!
//! Pruned checkpoints cannot be written: the config has one `linear_attn_config.head_dim` for
//! the key width, the value width, the gate ranks and the output norm, so transformers cannot
//! describe a key width below the value width. Everything else (forward, decoding, inspect,
//! calibrate, eval, selection with `prune --dry-run`) runs.

use super::keys::{bool_of, f64_of, usize_any, usize_of};
use super::layered::Layers;
use super::{Family, LayerState, LoadOptions, RowSlice, SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::linear_attention::{Decay, LinearAttention, LinearDims, OutputGate, Projections};
use crate::layers::mla::{Mla, MlaDims};
use crate::layers::mlp::Mlp;
use crate::layers::moe::{Moe, Router, Shared};
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::conv::ShortConv;
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::{linear_no_bias, VarBuilder};
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

/// Which layers are KDA, from the 1-based lists (or transformers 5's `layer_types`).
fn kda_layers(c: &Value, layers: usize) -> Result<Vec<bool>> {
    let lin = c.get("linear_attn_config").context("config.json has no linear_attn_config")?;
    let list = |key: &str| -> Result<Vec<usize>> {
        let a =
            lin.get(key).and_then(Value::as_array).with_context(|| format!("linear_attn_config has no {key} list"))?;
        a.iter()
            .map(|v| match v.as_u64() {
                Some(n) if (1..=layers as u64).contains(&n) => Ok(n as usize - 1),
                _ => bail!("linear_attn_config.{key} holds {v}; layers are numbered 1..={layers} (num_hidden_layers)"),
            })
            .collect()
    };
    let (kda, full) = (list("kda_layers")?, list("full_attn_layers")?);
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
    fn from_value(c: &Value) -> Result<Self> {
        let layers = usize_of(c, "num_hidden_layers", None)?;
        let hidden = usize_of(c, "hidden_size", None)?;
        let eps = f64_of(c, "rms_norm_eps", 1e-5)?;
        let lin = c.get("linear_attn_config").context("config.json has no linear_attn_config")?;
        let head = usize_of(lin, "head_dim", None)?;
        if c.get("q_lora_rank").is_some_and(|v| !v.is_null()) {
            bail!("MLA with a query low-rank projection (q_lora_rank) is not supported");
        }
        let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            bail!("hidden_act \"{act}\" is not supported (Kimi Linear uses silu)");
        }
        Ok(Self {
            kda: kda_layers(c, layers)?,
            vocab: usize_of(c, "vocab_size", None)?,
            hidden,
            eps,
            tie: bool_of(c, "tie_word_embeddings", false),
            kda_dims: {
                let heads = usize_of(lin, "num_heads", None)?;
                LinearDims { hidden, heads, v_heads: heads, dk: head, dv: head }
            },
            conv_kernel: usize_of(lin, "short_conv_kernel_size", Some(4))?,
            mla: MlaDims {
                hidden,
                heads: usize_of(c, "num_attention_heads", None)?,
                nope: usize_of(c, "qk_nope_head_dim", None)?,
                shared: usize_of(c, "qk_rope_head_dim", None)?,
                v_head: usize_of(c, "v_head_dim", None)?,
                kv_rank: usize_of(c, "kv_lora_rank", None)?,
                // transformers builds kv_a_layernorm with its default eps, not rms_norm_eps
                latent_eps: 1e-6,
            },
            dense_layers: usize_of(c, "first_k_dense_replace", Some(1))?,
            intermediate: usize_of(c, "intermediate_size", None)?,
            experts: usize_any(c, &["num_experts", "n_routed_experts"], None)?,
            top_k: usize_any(c, &["num_experts_per_token", "num_experts_per_tok"], None)?,
            moe_intermediate: usize_of(c, "moe_intermediate_size", None)?,
            shared_experts: usize_any(c, &["num_shared_experts", "n_shared_experts"], Some(0))?,
            groups: usize_any(c, &["num_expert_group", "n_group"], Some(1))?,
            topk_groups: usize_of(c, "topk_group", Some(1))?,
            renormalize: bool_of(c, "moe_renormalize", true),
            scale: f64_of(c, "routed_scaling_factor", 1.0)?,
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
                let lin = |name: &str, o: usize, i: usize| linear_no_bias(i, o, x.pp(name));
                Ok(Mlp::SwiGlu(SwiGlu::new(lin("w1", n, h)?, lin("w3", n, h)?, lin("w2", h, n)?)))
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = match self.shared_experts {
            0 => None,
            s => Some(Shared { mlp: Mlp::SwiGlu(SwiGlu::load(m.pp("shared_experts"), h, n * s)?), gate: None }),
        };
        Ok(Sublayer::Moe(Moe {
            gate: linear_no_bias(h, self.experts, m.pp("gate"))?,
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
fn kda(
    vb: VarBuilder,
    c: &KimiConfig,
    layer: usize,
    grad: bool,
    vars: &mut Vec<(String, candle_core::Var)>,
) -> Result<LinearAttention> {
    let d = c.kda_dims;
    let (hk, hv) = (d.heads * d.dk, d.v_heads * d.dv);
    let lin = |name: &str, i: usize, o: usize| linear_no_bias(i, o, vb.pp(name));
    let f32 = DType::F32;
    Ok(LinearAttention {
        dims: d,
        layer,
        proj: Projections::Separate {
            q: crate::arch::projection(&vb, "q_proj", hk, d.hidden, false, grad, vars)?,
            k: crate::arch::projection(&vb, "k_proj", hk, d.hidden, false, grad, vars)?,
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
            neg_a: vb.get((1, 1, d.v_heads, 1), "A_log")?.to_dtype(f32)?.reshape((d.v_heads, 1))?.exp()?.neg()?,
            dt_bias: vb.get_with_hints_dtype(hk, "dt_bias", Default::default(), f32)?,
        },
        gate: OutputGate::SigmoidLowRank { g_a: lin("g_a_proj", d.hidden, d.dv)?, g_b: lin("g_b_proj", d.dv, hv)? },
        beta_scale: 1.0,
        norm: RmsNorm::load(vb.pp("o_norm"), d.dv, c.eps, NormWeight::Plain)?,
        o_proj: lin("o_proj", hv, d.hidden)?,
    })
}

fn config(ckpt: &Checkpoint) -> Result<KimiConfig> {
    KimiConfig::from_value(&ckpt.config)
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
            lm_head: untied_head(ckpt, c.tie),
            embed_scale: 1.0,
            logit_scale: 1.0,
        };
        let grad = opts.grad;
        let build = move |l: VarBuilder, i: usize, vars: &mut Vec<(String, candle_core::Var)>| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let a = l.pp("self_attn");
            let mixer = if c.kda[i] {
                Sublayer::Linear(kda(a, &c, i, grad, vars)?)
            } else {
                Sublayer::Mla(Mla::load(a, c.mla)?)
            };
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
