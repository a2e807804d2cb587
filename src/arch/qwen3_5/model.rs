//! Candle forward of Qwen3.5 / Qwen3-Next causal LMs: pre-norm decoder layers mixing Gated
//! DeltaNet and gated full attention, (1+w) RMSNorms, SwiGLU or MoE MLPs.

use super::config::{tied, TextConfig, Variant};
use crate::arch::layered::{self, Head, Layers};
use crate::arch::{LayerCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::Attention;
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::profile::mark;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Embedding, Linear, VarBuilder};

enum Mixer {
    Linear(crate::layers::linear_attention::LinearAttention),
    Full(Attention),
}

enum Mlp {
    Dense(SwiGlu),
    Moe(crate::layers::moe::Moe),
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    mlp: Mlp,
}

impl layered::Block for Layer {
    fn forward(&self, h: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let dev = h.device();
        let x = self.input_norm.forward(h)?;
        mark("norm", dev);
        let y = match &self.mixer {
            Mixer::Linear(m) => m.forward(&x, obs, cache)?,
            Mixer::Full(a) => a.forward(&x, cache)?,
        };
        let h = (h + y)?;
        mark("mixer output", dev);
        let x = self.post_norm.forward(&h)?;
        mark("norm", dev);
        let y = match &self.mlp {
            Mlp::Dense(m) => m.forward(&x)?,
            Mlp::Moe(m) => m.forward(&x)?,
        };
        let h = (&h + y)?;
        mark("mlp", dev);
        Ok(h)
    }
}

/// The stages of a Qwen3.5 (text or multimodal checkpoint) or Qwen3-Next causal LM.
pub struct Qwen35Layers {
    vb: VarBuilder<'static>,
    variant: Variant,
    c: TextConfig,
    /// The embedding's stored dtype (attention computes in it).
    stored: DType,
    tied: bool,
    grad: bool,
    device: Device,
}

impl Qwen35Layers {
    pub fn new(
        ckpt: &Checkpoint,
        variant: Variant,
        c: &TextConfig,
        opts: &LoadOptions,
        vb: VarBuilder<'static>,
    ) -> Result<Self> {
        let stored = match ckpt.info(&format!("{}.embed_tokens.weight", variant.prefix()))?.dtype {
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            _ => DType::F32,
        };
        let tied = tied(variant, &ckpt.config, c) || !ckpt.tensors.contains_key("lm_head.weight");
        Ok(Self { vb, variant, c: c.clone(), stored, tied, grad: opts.grad, device: opts.device.clone() })
    }
}

impl Layers for Qwen35Layers {
    fn num_blocks(&self) -> usize {
        self.c.num_hidden_layers
    }

    fn embed(&self) -> Result<Embedding> {
        let m = self.vb.pp(self.variant.prefix());
        Ok(Embedding::new(
            m.pp("embed_tokens").get((self.c.vocab_size, self.c.hidden_size), "weight")?,
            self.c.hidden_size,
        ))
    }

    fn block(&self, i: usize, vars: &mut Vec<(String, Var)>) -> Result<Box<dyn layered::Block>> {
        let (c, variant) = (&self.c, self.variant);
        let (hid, eps) = (c.hidden_size, c.rms_norm_eps);
        let l = self.vb.pp(self.variant.prefix()).pp(format!("layers.{i}"));
        let mixer = if c.is_linear(i) {
            Mixer::Linear(super::gdn::load(l.pp("linear_attn"), c, variant.fused(), i, self.grad, vars)?)
        } else {
            Mixer::Full(Attention::load(
                l.pp("self_attn"),
                &c.attention_spec(self.variant.inv_freq_dtype(self.stored)),
            )?)
        };
        let mlp = match c.moe(variant, i) {
            Some(moe) => Mlp::Moe(super::moe::load(l.pp("mlp"), hid, moe)?),
            None => Mlp::Dense(SwiGlu::load(l.pp("mlp"), hid, c.intermediate_size)?),
        };
        Ok(Box::new(Layer {
            input_norm: RmsNorm::load(l.pp("input_layernorm"), hid, eps, NormWeight::OnePlus)?,
            mixer,
            post_norm: RmsNorm::load(l.pp("post_attention_layernorm"), hid, eps, NormWeight::OnePlus)?,
            mlp,
        }))
    }

    fn head(&self, embed: Option<&Embedding>) -> Result<Head> {
        let (c, m) = (&self.c, self.vb.pp(self.variant.prefix()));
        let lm_head = match embed {
            _ if !self.tied => self.vb.get((c.vocab_size, c.hidden_size), "lm_head.weight")?,
            Some(e) => e.embeddings().clone(),
            None => self.embed()?.embeddings().clone(),
        };
        let norm = RmsNorm::load(m.pp("norm"), c.hidden_size, c.rms_norm_eps, NormWeight::OnePlus)?;
        Ok(Head::new(norm, Linear::new(lm_head, None)))
    }

    fn block_prefix(&self, i: usize) -> String {
        format!("{}.layers.{i}.", self.variant.prefix())
    }

    fn embed_name(&self) -> String {
        format!("{}.embed_tokens.weight", self.variant.prefix())
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
