//! Granite 4.0-H (`granitemoehybrid`, transformers `GraniteMoeHybridForCausalLM`): pre-norm
//! layers of a Mamba-2 mixer or attention (RoPE or none), then a shared SwiGLU MLP plus, in the
//! MoE models, softmax-routed experts; muP multipliers on the embeddings, on each residual
//! branch, on attention scores and on the logits. Follows transformers `models/granitemoehybrid/`.
//!
//! The key width is `mamba_d_state`.

use super::keys::{bool_of, f64_of, rope_theta, usize_of};
use super::layered::Layers;
use super::{Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::{Attention, AttentionSpec, Rope};
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::mamba2::{Mamba2Dims, Mamba2Mixer, OutputNorm};
use crate::layers::mlp::Mlp;
use crate::layers::moe::{Moe, Router, Shared};
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_nn::{linear_no_bias, VarBuilder};
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

impl GraniteConfig {
    fn from_value(c: &Value) -> Result<Self> {
        let layers = usize_of(c, "num_hidden_layers", None)?;
        let types = c.get("layer_types").and_then(Value::as_array).context("config.json has no layer_types list")?;
        let mamba = types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("mamba" | "linear_attention") => Ok(true),
                Some("attention" | "full_attention") => Ok(false),
                _ => bail!("layer_types[{i}] is {t}; expected \"mamba\" or \"attention\""),
            })
            .collect::<Result<Vec<_>>>()?;
        if mamba.len() != layers {
            bail!("layer_types names {} layers but num_hidden_layers is {layers}; make them agree", mamba.len());
        }
        let hidden = usize_of(c, "hidden_size", None)?;
        let eps = f64_of(c, "rms_norm_eps", 1e-6)?;
        let d_inner = (f64_of(c, "mamba_expand", 2.0)? * hidden as f64) as usize;
        let heads = usize_of(c, "mamba_n_heads", Some(128))?;
        let head_dim = match c.get("mamba_d_head") {
            None | Some(Value::String(_)) => d_inner / heads.max(1), // "auto"
            Some(_) => usize_of(c, "mamba_d_head", None)?,
        };
        let groups = usize_of(c, "mamba_n_groups", Some(1))?;
        let bias = bool_of(c, "mamba_proj_bias", false);
        let dims = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: usize_of(c, "mamba_d_state", Some(256))?,
            groups,
            d_inner,
            conv_kernel: usize_of(c, "mamba_d_conv", Some(4))?,
            conv_bias: bool_of(c, "mamba_conv_bias", true),
            in_bias: bias,
            out_bias: bias,
            eps,
            dt_limit: super::mamba2::limit(c.get("time_step_limit"))?,
            norm: OutputNorm::Gated { groups, before_gate: false },
            in_scale: 1.0,
            segment_scales: [1.0; 5],
        };
        dims.check().context("the Mamba-2 sizes of config.json (mamba_n_heads, mamba_d_head, mamba_expand)")?;
        let heads_a = usize_of(c, "num_attention_heads", None)?;
        let hd = hidden / heads_a.max(1);
        let rope = match c.get("position_embedding_type").and_then(Value::as_str) {
            Some("rope") => {
                Some(Rope { dim: hd, theta: rope_theta(c, 10000.0), inv_freq_dtype: DType::F32, f32_rotation: false })
            }
            None | Some("nope") => None,
            Some(other) => {
                bail!("position_embedding_type \"{other}\" is not supported (expected \"rope\" or \"nope\")")
            }
        };
        let attention = AttentionSpec {
            hidden,
            heads: heads_a,
            kv_heads: usize_of(c, "num_key_value_heads", Some(heads_a))?,
            head_dim: hd,
            qkv_bias: bool_of(c, "attention_bias", false),
            o_bias: bool_of(c, "attention_bias", false),
            qk_norm: None,
            output_gate: false,
            rope,
            // muP: attention_multiplier replaces 1/sqrt(head_dim)
            scale: f64_of(c, "attention_multiplier", 1.0)?,
            window: None,
        };
        let experts = match usize_of(c, "num_local_experts", Some(0))? {
            0 => None,
            e => Some((e, usize_of(c, "num_experts_per_tok", None)?, usize_of(c, "intermediate_size", None)?)),
        };
        let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            bail!("hidden_act \"{act}\" is not supported (Granite 4.0-H uses silu)");
        }
        Ok(Self {
            mamba,
            vocab: usize_of(c, "vocab_size", None)?,
            hidden,
            eps,
            tie: bool_of(c, "tie_word_embeddings", false),
            embed_scale: f64_of(c, "embedding_multiplier", 1.0)?,
            residual_scale: f64_of(c, "residual_multiplier", 1.0)?,
            logit_scale: 1.0 / f64_of(c, "logits_scaling", 1.0)?,
            dims,
            attention,
            shared_intermediate: usize_of(c, "shared_intermediate_size", None)?,
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
            gate: linear_no_bias(h, e, m.pp("router.layer"))?,
            // softmax over the top-k logits = softmax over all, renormalised on the top k
            router: Router::Softmax { norm: true },
            top_k: k,
            experts,
            shared: Some(Shared { mlp: shared, gate: None }),
        }))
    }
}

fn config(ckpt: &Checkpoint) -> Result<GraniteConfig> {
    GraniteConfig::from_value(&ckpt.config)
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
        Ok(c.dims.layout("GraniteMoeHybrid", mixers, c.mamba.len(), |t| ckpt.tensors.contains_key(t)))
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
            lm_head: untied_head(ckpt, c.tie),
            embed_scale: c.embed_scale,
            logit_scale: c.logit_scale,
        };
        let (ckpt, grad) = (ckpt.clone(), opts.grad);
        let build = move |l: VarBuilder, i: usize, vars: &mut Vec<(String, candle_core::Var)>| {
            let norm = |name: &str| RmsNorm::load(l.pp(name), c.hidden, c.eps, NormWeight::Plain);
            let mixer = if c.mamba[i] {
                Sublayer::Mamba2(Mamba2Mixer::load(l.pp("mamba"), &c.dims, i, &ckpt, grad, vars)?)
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
