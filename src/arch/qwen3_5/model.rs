//! Candle forward of Qwen3.5 / Qwen3-Next causal LMs: pre-norm decoder layers mixing Gated
//! DeltaNet and gated full attention, (1+w) RMSNorms, SwiGLU or MoE MLPs.

use super::attention::Attention;
use super::config::{tied, TextConfig, Variant};
use super::gdn::GatedDeltaNet;
use super::moe::SparseMoe;
use crate::arch::{CausalLm, DecodeCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::profile::mark;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Embedding, Linear};

enum Mixer {
    Linear(GatedDeltaNet),
    Full(Attention),
}

enum Mlp {
    Dense(SwiGlu),
    Moe(SparseMoe),
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    mlp: Mlp,
}

/// A Qwen3.5 (text or multimodal checkpoint) or Qwen3-Next causal LM.
pub struct Qwen35Model {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    vars: Vec<(String, Var)>,
    device: Device,
}

impl Qwen35Model {
    pub fn load(ckpt: &Checkpoint, variant: Variant, c: &TextConfig, opts: &LoadOptions) -> Result<Self> {
        let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
        let m = vb.pp(variant.prefix());
        let (hid, eps) = (c.hidden_size, c.rms_norm_eps);
        let embed_w = m.pp("embed_tokens").get((c.vocab_size, hid), "weight")?;
        let stored = match ckpt.info(&format!("{}.embed_tokens.weight", variant.prefix()))?.dtype {
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            _ => DType::F32,
        };
        let mut vars = Vec::new();
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            let mixer = if c.is_linear(i) {
                let gdn = GatedDeltaNet::load(l.pp("linear_attn"), c, variant.fused(), i, opts.grad, &mut vars);
                Mixer::Linear(gdn.with_context(|| format!("loading layer {i}"))?)
            } else {
                Mixer::Full(
                    Attention::load(l.pp("self_attn"), c, variant.inv_freq_dtype(stored))
                        .with_context(|| format!("loading layer {i}"))?,
                )
            };
            let mlp = match c.moe(variant, i) {
                Some(moe) => Mlp::Moe(SparseMoe::load(l.pp("mlp"), hid, moe)?),
                None => Mlp::Dense(SwiGlu::load(l.pp("mlp"), hid, c.intermediate_size)?),
            };
            layers.push(Layer {
                input_norm: RmsNorm::load(l.pp("input_layernorm"), hid, eps, NormWeight::OnePlus)?,
                mixer,
                post_norm: RmsNorm::load(l.pp("post_attention_layernorm"), hid, eps, NormWeight::OnePlus)?,
                mlp,
            });
        }
        let lm_head = if tied(variant, &ckpt.config, c) || !ckpt.tensors.contains_key("lm_head.weight") {
            Linear::new(embed_w.clone(), None)
        } else {
            Linear::new(vb.get((c.vocab_size, hid), "lm_head.weight")?, None)
        };
        Ok(Self {
            embed: Embedding::new(embed_w, hid),
            layers,
            norm: RmsNorm::load(m.pp("norm"), hid, eps, NormWeight::OnePlus)?,
            lm_head,
            vars,
            device: opts.device.clone(),
        })
    }
}

impl CausalLm for Qwen35Model {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        let mut h = self.embed.forward(ids)?;
        obs.hidden(0, &h)?;
        let n = self.layers.len();
        if let Some(c) = cache.as_deref_mut() {
            c.begin(n, ids.dim(1)?);
        }
        let dev = &self.device;
        mark("outside forward", dev);
        for (i, l) in self.layers.iter().enumerate() {
            let x = l.input_norm.forward(&h)?;
            mark("norm", dev);
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let y = match &l.mixer {
                Mixer::Linear(m) => m.forward(&x, obs, lc)?,
                Mixer::Full(a) => a.forward(&x, lc)?,
            };
            h = (&h + y)?;
            mark("mixer output", dev);
            let x = l.post_norm.forward(&h)?;
            mark("norm", dev);
            let y = match &l.mlp {
                Mlp::Dense(m) => m.forward(&x)?,
                Mlp::Moe(m) => m.forward(&x)?,
            };
            h = (&h + y)?;
            mark("mlp", dev);
            if i + 1 < n {
                obs.hidden(i + 1, &h)?;
                mark("observer", dev);
            }
        }
        crate::arch::head(&h, &self.norm, &self.lm_head, obs, n)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
