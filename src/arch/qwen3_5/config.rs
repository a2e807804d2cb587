//! Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text configs (transformers `configuration_qwen3_5.py`,
//! `configuration_qwen3_5_moe.py`, `configuration_qwen3_next.py`), and where a checkpoint keeps
//! its text model.

use crate::arch::config::RopeParameters;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

/// The on-disk layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// `qwen3_5_text`: `model.layers.*`, separate `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`.
    Text,
    /// `qwen3_5`: the text config under `text_config`, weights under `model.language_model.*`
    /// next to `model.visual.*` and `mtp.*` (which the text forward ignores).
    Multimodal,
    /// `qwen3_5_moe_text` (`Qwen3_5MoeForCausalLM`): the `Text` layout with a sparse MoE MLP in
    /// every layer.
    MoeText,
    /// `qwen3_5_moe` (the released Qwen3.5/3.6 MoE checkpoints): the `Multimodal` layout with a
    /// sparse MoE MLP in every layer; `mtp.*` stores its experts one tensor per expert.
    MoeMultimodal,
    /// `qwen3_next`: fused `in_proj_qkvz` / `in_proj_ba`, interleaved per key-head group; MoE MLPs.
    Next,
}

impl Variant {
    pub fn of(model_type: &str) -> Result<Self> {
        Ok(match model_type {
            "qwen3_5_text" => Variant::Text,
            "qwen3_5" => Variant::Multimodal,
            "qwen3_5_moe_text" => Variant::MoeText,
            "qwen3_5_moe" => Variant::MoeMultimodal,
            "qwen3_next" => Variant::Next,
            t => bail!("not a Qwen3.5 / Qwen3-Next model_type: {t}"),
        })
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Variant::Text => "qwen3_5_text",
            Variant::Multimodal => "qwen3_5",
            Variant::MoeText => "qwen3_5_moe_text",
            Variant::MoeMultimodal => "qwen3_5_moe",
            Variant::Next => "qwen3_next",
        }
    }

    /// A multimodal wrapper: text fields under `text_config`, text weights under `model.language_model`.
    pub fn wrapper(self) -> bool {
        matches!(self, Variant::Multimodal | Variant::MoeMultimodal)
    }

    /// Qwen3.5-MoE: every decoder layer's MLP is the sparse MoE block.
    pub fn moe(self) -> bool {
        matches!(self, Variant::MoeText | Variant::MoeMultimodal)
    }

    /// The dtype the rotary `inv_freq` is rounded to for checkpoints stored in `stored`: the
    /// dense goldens come from transformers 5.17, which held it in the weights' dtype;
    /// transformers 5.24, the Qwen3.5-MoE reference, keeps it in float32.
    pub fn inv_freq_dtype(self, stored: candle_core::DType) -> candle_core::DType {
        if self.moe() {
            candle_core::DType::F32
        } else {
            stored
        }
    }

    /// Prefix of the text decoder's tensors (`embed_tokens`, `layers`, `norm`).
    pub fn prefix(self) -> &'static str {
        if self.wrapper() {
            "model.language_model"
        } else {
            "model"
        }
    }

    pub fn fused(self) -> bool {
        self == Variant::Next
    }

    /// The JSON object holding the text fields.
    pub fn text(self, config: &Value) -> Result<&Value> {
        if !self.wrapper() {
            return Ok(config);
        }
        config.get("text_config").filter(|t| t.is_object()).with_context(|| self.no_text_config())
    }

    pub fn text_mut(self, config: &mut Value) -> Result<&mut Value> {
        if !self.wrapper() {
            return Ok(config);
        }
        let why = self.no_text_config();
        config.get_mut("text_config").filter(|t| t.is_object()).context(why)
    }

    fn no_text_config(self) -> String {
        format!(
            "{} config.json has no text_config object: a {} checkpoint keeps its language-model fields there \
             (a text-only export has model_type {}_text and the fields at the top level)",
            self.model_type(),
            self.model_type(),
            self.model_type()
        )
    }
}

fn one() -> usize {
    1
}

/// The text-model fields statecut reads.
#[derive(Debug, Clone, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense MLPs (absent from Qwen3.5-MoE, which has none).
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "crate::arch::defaults::eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "crate::arch::defaults::yes")]
    pub attn_output_gate: bool,
    #[serde(default = "crate::arch::defaults::four")]
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default = "crate::arch::defaults::four")]
    pub full_attention_interval: usize,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    // Qwen3-Next MoE (absent from dense Qwen3.5)
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default = "crate::arch::defaults::yes")]
    pub norm_topk_prob: bool,
    /// Activation of the linear-attention output gate (Qwen3.8 configs say "swish").
    #[serde(default)]
    pub output_gate_type: Option<String>,
}

/// Sizes of a routed-expert MLP.
#[derive(Debug, Clone, Copy)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub shared_intermediate: usize,
    pub norm_topk_prob: bool,
}

impl TextConfig {
    pub fn from_value(variant: Variant, config: &Value) -> Result<Self> {
        let at = if variant.wrapper() { "text_config" } else { "" };
        let cfg: Self = crate::arch::config::from_value_at(variant.text(config)?, at)?;
        if variant.wrapper() {
            // the wrapper's own flag decides the head (`tied`): refuse one of the wrong type here
            crate::arch::config::from_value::<Top>(config)?;
        }
        let (hk, hv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        if hk == 0 || !hv.is_multiple_of(hk) {
            bail!("linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}");
        }
        if !cfg.num_attention_heads.is_multiple_of(cfg.num_key_value_heads.max(1)) {
            bail!("num_attention_heads must be a multiple of num_key_value_heads");
        }
        for t in cfg.layer_types() {
            if t != "linear_attention" && t != "full_attention" {
                bail!("layer type \"{t}\" is not supported");
            }
        }
        if let Some(want) = variant.wrapper().then(|| format!("{}_text", variant.model_type())) {
            let got = variant.text(config)?.get("model_type").and_then(Value::as_str);
            if got.is_some_and(|t| t != want) {
                bail!(
                    "text_config has model_type {:?}; a {} checkpoint's is \"{want}\"",
                    got.unwrap(),
                    variant.model_type()
                );
            }
        }
        // transformers' Qwen3.5 gated norm computes silu (= swish) whatever the key says.
        if let Some(g) = cfg.output_gate_type.as_deref().filter(|g| !matches!(*g, "silu" | "swish")) {
            bail!("output_gate_type \"{g}\" is not supported: the Qwen3.5 linear-attention output gate is silu (\"swish\")");
        }
        // mrope_section / mrope_interleaved only matter for image and video positions: with the
        // three position streams of text equal, interleaved mRoPE is the plain rotary embedding.
        let rope_type = cfg.rope_parameters.as_ref().and_then(|r| r.rope_type.as_deref());
        if let Some(t) = rope_type.filter(|t| *t != "default") {
            bail!("rope_type \"{t}\" is not supported (only the default rotary embedding, with or without mrope)");
        }
        for i in 0..cfg.num_hidden_layers {
            match cfg.moe(variant, i) {
                Some(m) if m.experts == 0 || m.top_k == 0 || m.top_k > m.experts => {
                    bail!("num_experts_per_tok {} must be between 1 and num_experts {}", m.top_k, m.experts)
                }
                None if cfg.intermediate_size == 0 => {
                    bail!("config.json has no intermediate_size (layer {i} is a dense MLP)")
                }
                _ => {}
            }
        }
        Ok(cfg)
    }

    /// `layer_types`, or transformers' default: full attention every `full_attention_interval`-th layer.
    pub fn layer_types(&self) -> Vec<String> {
        match &self.layer_types {
            Some(t) => t.clone(),
            None => (0..self.num_hidden_layers)
                .map(|i| {
                    let full = (i + 1).is_multiple_of(self.full_attention_interval.max(1));
                    if full { "full_attention" } else { "linear_attention" }.to_string()
                })
                .collect(),
        }
    }

    pub fn is_linear(&self, layer: usize) -> bool {
        self.layer_types().get(layer).is_some_and(|t| t == "linear_attention")
    }

    /// The gated full-attention layers as the shared attention layer: per-head [q | gate]
    /// rows, (1+w) q/k norms, partial rotary in the activations' dtype with `inv_freq` rounded
    /// to `inv_freq_dtype`.
    pub fn attention_spec(&self, inv_freq_dtype: candle_core::DType) -> crate::layers::attention::AttentionSpec {
        let hd = self.head_dim();
        crate::layers::attention::AttentionSpec {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: hd,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            qk_norm: Some((crate::ops::norm::NormWeight::OnePlus, self.rms_norm_eps)),
            output_gate: self.attn_output_gate,
            rope: Some(crate::layers::attention::Rope {
                dim: self.rotary_dim(),
                theta: self.rope_theta(),
                inv_freq_dtype,
                f32_rotation: false,
            }),
            scale: (hd as f64).powf(-0.5),
            window: None,
        }
    }

    pub fn head_dim(&self) -> usize {
        // transformers default for both Qwen3.5 and Qwen3-Next
        self.head_dim.unwrap_or(256)
    }

    pub fn rope_theta(&self) -> f64 {
        crate::arch::config::rope_theta(self.rope_parameters.as_ref(), self.rope_theta, 10000.0)
    }

    /// Rotary dims of each attention head: int(head_dim · partial_rotary_factor).
    pub fn rotary_dim(&self) -> usize {
        let from_params = self.rope_parameters.as_ref().and_then(|r| r.partial_rotary_factor);
        let f = from_params.or(self.partial_rotary_factor).unwrap_or(0.25);
        (self.head_dim() as f64 * f) as usize
    }

    /// The MoE block of `layer`, or None for a dense SwiGLU. Qwen3-Next: layers not in
    /// `mlp_only_layers`, every `decoder_sparse_step`-th. Qwen3.5-MoE: every layer, top-k weights
    /// always renormalised (transformers' `Qwen3_5MoeTextConfig` drops `mlp_only_layers`,
    /// `decoder_sparse_step` and `norm_topk_prob`, and its router divides by the top-k sum).
    pub fn moe(&self, variant: Variant, layer: usize) -> Option<Moe> {
        // transformers defaults of each config class
        let (experts, top_k, norm_topk_prob) = match variant {
            Variant::Next => {
                let experts = self.num_experts.unwrap_or(512);
                let sparse = experts > 0
                    && !self.mlp_only_layers.contains(&layer)
                    && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1));
                if !sparse {
                    return None;
                }
                (experts, self.num_experts_per_tok.unwrap_or(10), self.norm_topk_prob)
            }
            Variant::MoeText | Variant::MoeMultimodal => {
                (self.num_experts.unwrap_or(256), self.num_experts_per_tok.unwrap_or(8), true)
            }
            Variant::Text | Variant::Multimodal => return None,
        };
        Some(Moe {
            experts,
            top_k,
            intermediate: self.moe_intermediate_size.unwrap_or(512),
            shared_intermediate: self.shared_expert_intermediate_size.unwrap_or(512),
            norm_topk_prob,
        })
    }
}

/// The wrapper's top-level `tie_word_embeddings` (checked by `TextConfig::from_value`).
#[derive(Deserialize)]
struct Top {
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
}

/// Whether the LM head shares the embedding (the top level of a multimodal config decides).
pub fn tied(variant: Variant, config: &Value, text: &TextConfig) -> bool {
    // TextConfig::from_value refused a flag of the wrong type, so this read cannot fail
    let top = variant.wrapper().then(|| crate::arch::config::from_value::<Top>(config).ok()).flatten();
    let top = top.and_then(|t| t.tie_word_embeddings);
    top.or(text.tie_word_embeddings).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text() -> Value {
        json!({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "linear_key_head_dim": 16, "linear_value_head_dim": 8,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}})
    }

    #[test]
    fn derives_layer_types_and_rope() {
        let c = TextConfig::from_value(Variant::Text, &text()).unwrap();
        let full: Vec<usize> = (0..8).filter(|&i| !c.is_linear(i)).collect();
        assert_eq!(full, [3, 7]);
        assert_eq!((c.rotary_dim(), c.rope_theta()), (16, 1e7));
        assert!(c.moe(Variant::Text, 0).is_none());
        // Qwen3-Next defaults to 512 experts on every layer
        assert_eq!(c.moe(Variant::Next, 5).unwrap().experts, 512);
    }

    /// The text_config of Qwen3.6-35B-A3B (REAL-CHECKPOINTS.md §2.2), shortened to 4 layers.
    fn moe_text() -> Value {
        json!({"attention_bias": false, "attn_output_gate": true, "bos_token_id": 248044, "dtype": "bfloat16",
               "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
               "hidden_size": 2048, "layer_types": ["linear_attention", "linear_attention", "linear_attention",
               "full_attention"], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
               "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
               "mamba_ssm_dtype": "float32", "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
               "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false, "num_attention_heads": 16,
               "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 4, "num_key_value_heads": 2,
               "output_router_logits": false, "pad_token_id": null, "partial_rotary_factor": 0.25,
               "rms_norm_eps": 1e-06, "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
               "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
               "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
               "vocab_size": 248320})
    }

    #[test]
    fn released_moe_config() {
        let cfg = json!({"model_type": "qwen3_5_moe", "tie_word_embeddings": false, "text_config": moe_text()});
        let c = TextConfig::from_value(Variant::MoeMultimodal, &cfg).unwrap();
        assert_eq!((c.rotary_dim(), c.rope_theta(), c.is_linear(3)), (64, 1e7, false));
        for i in 0..4 {
            let m = c.moe(Variant::MoeMultimodal, i).unwrap();
            assert_eq!((m.experts, m.top_k, m.intermediate, m.shared_intermediate), (256, 8, 512, 512));
            assert!(m.norm_topk_prob);
        }
        assert!(!tied(Variant::MoeMultimodal, &cfg, &c));
        // Qwen3.5-MoE ignores the Qwen3-Next keys, as transformers does
        let mut t = moe_text();
        t["mlp_only_layers"] = json!([1]);
        t["norm_topk_prob"] = json!(false);
        let c = TextConfig::from_value(Variant::MoeText, &t).unwrap();
        assert!(c.moe(Variant::MoeText, 1).unwrap().norm_topk_prob);
        // partial_rotary_factor at the top level only; transformers' defaults without the MoE keys
        let mut t = moe_text();
        t.as_object_mut().unwrap().retain(|k, _| !k.starts_with("rope_") && !k.contains("expert"));
        t["partial_rotary_factor"] = json!(0.5);
        let c = TextConfig::from_value(Variant::MoeText, &t).unwrap();
        assert_eq!((c.rotary_dim(), c.moe(Variant::MoeText, 0).unwrap().experts), (128, 256));
    }

    #[test]
    fn rejects_what_qwen3_5_does_not_compute() {
        let err = |v: Variant, c: Value| format!("{:#}", TextConfig::from_value(v, &c).unwrap_err());
        let wrapper = json!({"model_type": "qwen3_5_moe", "vision_config": {}});
        assert!(err(Variant::MoeMultimodal, wrapper).contains("qwen3_5_moe config.json has no text_config"));
        let wrong = json!({"model_type": "qwen3_5_moe", "text_config": text()});
        let mut wrong = wrong;
        wrong["text_config"]["model_type"] = json!("qwen3_5_text");
        assert!(err(Variant::MoeMultimodal, wrong).contains("a qwen3_5_moe checkpoint's is \"qwen3_5_moe_text\""));
        let mut t = moe_text();
        t["output_gate_type"] = json!("sigmoid");
        assert!(err(Variant::MoeText, t.clone()).contains("output_gate_type \"sigmoid\""));
        t["output_gate_type"] = json!("swish");
        assert!(TextConfig::from_value(Variant::MoeText, &t).is_ok());
        t["rope_parameters"]["rope_type"] = json!("yarn");
        assert!(err(Variant::MoeText, t).contains("rope_type \"yarn\""));
        let mut t = moe_text();
        t["num_experts_per_tok"] = json!(300);
        assert!(err(Variant::MoeText, t).contains("between 1 and num_experts 256"));
        let mut t = text();
        t.as_object_mut().unwrap().remove("intermediate_size");
        assert!(err(Variant::Text, t).contains("no intermediate_size"));
    }

    /// A value of the wrong type is refused with its key, never read as the default.
    #[test]
    fn wrong_types_name_the_key() {
        let err = |v: Variant, c: Value| format!("{:#}", TextConfig::from_value(v, &c).unwrap_err());
        let mut t = text();
        t["rope_parameters"]["rope_theta"] = json!("1e4");
        assert!(err(Variant::Text, t).contains("config key rope_parameters.rope_theta: invalid type: string"));
        let mut t = text();
        t.as_object_mut().unwrap().remove("rope_parameters");
        t["rope_theta"] = json!("1e4");
        assert!(err(Variant::Text, t).contains("config key rope_theta: invalid type: string \"1e4\""));
        let mut t = text();
        t["attn_output_gate"] = json!("yes");
        assert!(err(Variant::Text, t).contains("config key attn_output_gate: "));
        let mut t = text();
        t["linear_num_key_heads"] = json!(2.5);
        let cfg = json!({"model_type": "qwen3_5", "text_config": t});
        assert!(err(Variant::Multimodal, cfg).contains("config key text_config.linear_num_key_heads: invalid type"));
        let cfg = json!({"model_type": "qwen3_5", "tie_word_embeddings": "true", "text_config": text()});
        assert!(err(Variant::Multimodal, cfg).contains("config key tie_word_embeddings: "));
    }

    #[test]
    fn multimodal_reads_text_config() {
        let cfg = json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": text()});
        let c = TextConfig::from_value(Variant::Multimodal, &cfg).unwrap();
        assert_eq!(c.linear_key_head_dim, 16);
        assert!(tied(Variant::Multimodal, &cfg, &c));
        assert!(TextConfig::from_value(Variant::Multimodal, &text()).is_err());
    }
}
