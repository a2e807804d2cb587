//! Candle forward of Qwen3.5 / Qwen3-Next causal LMs: pre-norm decoder layers mixing Gated
//! DeltaNet and gated full attention, (1+w) RMSNorms, SwiGLU or MoE MLPs.

use super::config::{tied, TextConfig, Variant};
use crate::arch::LoadOptions;
use crate::checkpoint::Checkpoint;
use crate::layers::attention::Attention;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::mlp::{Mlp, SwiGlu};
use crate::layers::stack::{Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::DType;
use candle_nn::VarBuilder;

/// The stages of a Qwen3.5 (text or multimodal checkpoint) or Qwen3-Next causal LM.
pub fn qwen3_5_stack(
    ckpt: &Checkpoint,
    variant: Variant,
    c: &TextConfig,
    opts: &LoadOptions,
    vb: VarBuilder<'static>,
) -> Result<Stack> {
    let prefix = variant.prefix();
    // Attention computes in the embedding's stored dtype.
    let stored = match ckpt.info(&format!("{prefix}.embed_tokens.weight"))?.dtype {
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        _ => DType::F32,
    };
    let tied = tied(variant, &ckpt.config, c) || !ckpt.tensors.contains_key("lm_head.weight");
    let spec = StackSpec {
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        layers: c.num_hidden_layers,
        eps: c.rms_norm_eps,
        embed: format!("{prefix}.embed_tokens.weight"),
        layer_prefix: format!("{prefix}.layers"),
        final_norm: format!("{prefix}.norm"),
        lm_head: (!tied).then(|| "lm_head.weight".into()),
        embed_scale: 1.0,
        logit_scale: 1.0,
        final_norm_weight: NormWeight::OnePlus,
        states_after_blocks: false,
    };
    let (c, grad) = (c.clone(), opts.grad);
    let build = move |l: VarBuilder, i: usize| -> Result<Layer> {
        let (hid, eps) = (c.hidden_size, c.rms_norm_eps);
        let mixer = if c.is_linear(i) {
            Sublayer::Linear(super::gdn::load(l.pp("linear_attn"), &c, variant.fused(), i, grad)?)
        } else {
            Sublayer::Attention(Attention::load(l.pp("self_attn"), &c.attention_spec(variant.inv_freq_dtype(stored)))?)
        };
        let mlp = match c.moe(variant, i) {
            Some(moe) => Sublayer::Moe(super::moe::load(l.pp("mlp"), hid, moe)?),
            None => Sublayer::Mlp(Mlp::SwiGlu(SwiGlu::load(l.pp("mlp"), hid, c.intermediate_size)?)),
        };
        let norm = |name: &str| RmsNorm::load(l.pp(name), hid, eps, NormWeight::OnePlus);
        Ok(Layer {
            steps: vec![
                Step { norm: norm("input_layernorm")?, sublayer: mixer, scale: 1.0 },
                Step { norm: norm("post_attention_layernorm")?, sublayer: mlp, scale: 1.0 },
            ],
        })
    };
    Ok(Stack::new(vb, spec, opts.device.clone(), Box::new(build)))
}
