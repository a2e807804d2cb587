//! Nemotron-H / Nemotron 3 configs (transformers `NemotronHConfig`): one block per layer, named
//! by `hybrid_override_pattern` (or an explicit `layers_block_type` list).

use crate::arch::keys::{bool_of, f64_of, usize_any, usize_of};
use crate::layers::attention::AttentionSpec;
use crate::layers::mamba2::{Mamba2Dims, OutputNorm};
use anyhow::{bail, Context, Result};
use serde_json::Value;

/// What one layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// `M`
    Mamba,
    /// `*`
    Attention,
    /// `-`: squared-ReLU MLP
    Mlp,
    /// `E`: mixture of experts
    Moe,
}

impl BlockKind {
    fn from_letter(c: char) -> Option<Self> {
        Some(match c {
            'M' => BlockKind::Mamba,
            '*' => BlockKind::Attention,
            '-' => BlockKind::Mlp,
            'E' => BlockKind::Moe,
            _ => return None,
        })
    }

    fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "mamba" | "linear_attention" | "M" => BlockKind::Mamba,
            "attention" | "full_attention" | "*" => BlockKind::Attention,
            "mlp" | "-" => BlockKind::Mlp,
            "moe" | "E" => BlockKind::Moe,
            _ => return None,
        })
    }
}

/// The routed experts of `E` layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub shared_intermediate: usize,
    pub groups: usize,
    pub topk_groups: usize,
    pub norm: bool,
    pub scale: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NemotronHConfig {
    pub blocks: Vec<BlockKind>,
    pub vocab: usize,
    pub hidden: usize,
    pub eps: f64,
    pub tie: bool,
    pub mamba: Mamba2Dims,
    pub attention: AttentionSpec,
    pub mlp_intermediate: usize,
    pub mlp_bias: bool,
    pub moe: Option<MoeConfig>,
}

/// The block kinds: `layers_block_type` when given (transformers prefers it), else the pattern,
/// checked against `num_hidden_layers` when the config states it.
pub fn block_kinds(c: &Value) -> Result<Vec<BlockKind>> {
    let blocks = match (c.get("layers_block_type").and_then(Value::as_array), c.get("hybrid_override_pattern")) {
        (Some(list), _) => list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().and_then(BlockKind::from_name).with_context(|| {
                    format!("layers_block_type[{i}] is {v}; expected \"mamba\", \"attention\", \"mlp\" or \"moe\"")
                })
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Some(Value::String(p))) => p
            .chars()
            .enumerate()
            .map(|(i, ch)| {
                BlockKind::from_letter(ch).with_context(|| {
                    format!(
                        "hybrid_override_pattern \"{p}\" has '{ch}' at position {i}; the block letters are M (Mamba-2), * (attention), - (MLP) and E (MoE)"
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Some(v)) => bail!("hybrid_override_pattern is {v}, expected a string such as \"M-M*-\""),
        (None, None) => bail!("config.json has neither hybrid_override_pattern nor layers_block_type"),
    };
    if blocks.is_empty() {
        bail!("the layer pattern of config.json is empty");
    }
    if let Some(n) = c.get("num_hidden_layers").and_then(Value::as_u64) {
        if n as usize != blocks.len() {
            bail!(
                "the layer pattern of config.json names {} layers but num_hidden_layers is {n}; make them agree",
                blocks.len()
            );
        }
    }
    Ok(blocks)
}

impl NemotronHConfig {
    pub fn from_value(c: &Value) -> Result<Self> {
        let blocks = block_kinds(c)?;
        let hidden = usize_of(c, "hidden_size", None)?;
        let eps = f64_of(c, "layer_norm_epsilon", 1e-5)?;
        let (heads, head_dim) = (usize_of(c, "mamba_num_heads", Some(128))?, usize_of(c, "mamba_head_dim", Some(64))?);
        let groups = usize_any(c, &["n_groups", "mamba_n_groups"], Some(8))?;
        let bias = bool_of(c, "use_bias", false);
        let mamba = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: usize_of(c, "ssm_state_size", Some(128))?,
            groups,
            // the inner width is heads × head_dim; `expand` is not used by the mixer
            d_inner: heads * head_dim,
            conv_kernel: usize_any(c, &["conv_kernel", "mamba_d_conv"], Some(4))?,
            conv_bias: bool_of(c, "use_conv_bias", true),
            in_bias: bias,
            out_bias: bias,
            eps,
            // transformers clamps Δt from below at time_step_min in the full forward
            dt_limit: (f64_of(c, "time_step_min", 0.001)?, f64::INFINITY),
            norm: OutputNorm::Gated { groups, before_gate: false },
            in_scale: 1.0,
            segment_scales: [1.0; 5],
        };
        mamba.check().context("the Mamba-2 sizes of config.json (mamba_num_heads, mamba_head_dim, n_groups)")?;
        let attn_heads = usize_of(c, "num_attention_heads", None)?;
        let attn_head_dim = usize_any(c, &["head_dim", "attention_head_dim"], Some(hidden / attn_heads.max(1)))?;
        let attention = AttentionSpec {
            hidden,
            heads: attn_heads,
            kv_heads: usize_of(c, "num_key_value_heads", Some(attn_heads))?,
            head_dim: attn_head_dim,
            // transformers' NemotronHAttention has no biases whatever attention_bias says
            qkv_bias: false,
            o_bias: false,
            qk_norm: None,
            output_gate: false,
            rope: None,
            scale: (attn_head_dim as f64).powf(-0.5),
            window: None,
        };
        let act = c.get("mlp_hidden_act").and_then(Value::as_str).unwrap_or("relu2");
        if act != "relu2" {
            bail!("mlp_hidden_act \"{act}\" is not supported (Nemotron-H MLPs use relu2)");
        }
        let moe = if blocks.contains(&BlockKind::Moe) {
            if c.get("moe_latent_size").is_some_and(|v| !v.is_null()) {
                bail!("Nemotron-H MoE layers with a latent projection (moe_latent_size) are not supported");
            }
            Some(MoeConfig {
                experts: usize_any(c, &["n_routed_experts", "num_local_experts"], None)?,
                top_k: usize_of(c, "num_experts_per_tok", None)?,
                intermediate: usize_of(c, "moe_intermediate_size", None)?,
                shared_intermediate: usize_of(c, "moe_shared_expert_intermediate_size", None)?,
                groups: usize_of(c, "n_group", Some(1))?,
                topk_groups: usize_of(c, "topk_group", Some(1))?,
                norm: bool_of(c, "norm_topk_prob", true),
                scale: f64_of(c, "routed_scaling_factor", 1.0)?,
            })
        } else {
            None
        };
        if let Some(m) = &moe {
            if m.groups == 0 || !m.experts.is_multiple_of(m.groups) || m.topk_groups > m.groups || m.top_k > m.experts {
                bail!(
                    "MoE routing of config.json: {} experts in n_group {} (topk_group {}), num_experts_per_tok {}: expected groups dividing the experts",
                    m.experts,
                    m.groups,
                    m.topk_groups,
                    m.top_k
                );
            }
        }
        Ok(Self {
            blocks,
            vocab: usize_of(c, "vocab_size", None)?,
            hidden,
            eps,
            tie: bool_of(c, "tie_word_embeddings", false),
            mamba,
            attention,
            mlp_intermediate: usize_of(c, "intermediate_size", None)?,
            mlp_bias: bool_of(c, "mlp_bias", false),
            moe,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pattern_letters_and_lengths() {
        let kinds = block_kinds(&json!({"hybrid_override_pattern": "M-*E", "num_hidden_layers": 4})).unwrap();
        assert_eq!(kinds, [BlockKind::Mamba, BlockKind::Mlp, BlockKind::Attention, BlockKind::Moe]);
        let e = block_kinds(&json!({"hybrid_override_pattern": "M-*", "num_hidden_layers": 4})).unwrap_err();
        assert!(e.to_string().contains("names 3 layers but num_hidden_layers is 4"), "{e}");
        let e = block_kinds(&json!({"hybrid_override_pattern": "M-X"})).unwrap_err();
        assert!(e.to_string().contains("'X' at position 2"), "{e}");
        // an explicit list wins over the pattern
        let kinds =
            block_kinds(&json!({"hybrid_override_pattern": "MMMM", "layers_block_type": ["mamba", "attention"]}));
        assert_eq!(kinds.unwrap(), [BlockKind::Mamba, BlockKind::Attention]);
        let e = block_kinds(&json!({"layers_block_type": ["mamba", "conv"]})).unwrap_err();
        assert!(e.to_string().contains("layers_block_type[1]"), "{e}");
    }
}
