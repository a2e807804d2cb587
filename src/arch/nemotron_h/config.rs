//! Nemotron-H / Nemotron 3 configs (transformers `NemotronHConfig`): one block per layer, named
//! by `hybrid_override_pattern` (or an explicit `layers_block_type` list).

use crate::arch::defaults;
use crate::layers::attention::AttentionSpec;
use crate::layers::mamba2::{Mamba2Dims, OutputNorm};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
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

/// The keys that name the layers.
#[derive(Debug, Deserialize)]
struct Pattern {
    #[serde(default)]
    layers_block_type: Option<Vec<String>>,
    #[serde(default)]
    hybrid_override_pattern: Option<String>,
    #[serde(default)]
    num_hidden_layers: Option<usize>,
}

/// The block kinds: `layers_block_type` when given (transformers prefers it), else the pattern,
/// checked against `num_hidden_layers` when the config states it.
pub fn block_kinds(c: &Value) -> Result<Vec<BlockKind>> {
    let p: Pattern = crate::arch::config::from_value(c)?;
    let blocks = match (p.layers_block_type, p.hybrid_override_pattern) {
        (Some(list), _) => list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                BlockKind::from_name(v).with_context(|| {
                    format!("layers_block_type[{i}] is \"{v}\"; expected \"mamba\", \"attention\", \"mlp\" or \"moe\"")
                })
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Some(p)) => p
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
        (None, None) => bail!("config.json has neither hybrid_override_pattern nor layers_block_type"),
    };
    if blocks.is_empty() {
        bail!("the layer pattern of config.json is empty");
    }
    if let Some(n) = p.num_hidden_layers {
        if n != blocks.len() {
            bail!(
                "the layer pattern of config.json names {} layers but num_hidden_layers is {n}; make them agree",
                blocks.len()
            );
        }
    }
    Ok(blocks)
}

/// The config.json keys of transformers' `NemotronHConfig`, with its defaults. Where released
/// configs spell a key two ways, both are read and the first spelling wins.
#[derive(Debug, Deserialize)]
struct Keys {
    hidden_size: usize,
    vocab_size: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    #[serde(default = "defaults::eps5")]
    layer_norm_epsilon: f64,
    #[serde(default = "defaults::d128")]
    mamba_num_heads: usize,
    #[serde(default = "d64")]
    mamba_head_dim: usize,
    #[serde(default)]
    n_groups: Option<usize>,
    #[serde(default)]
    mamba_n_groups: Option<usize>,
    #[serde(default)]
    use_bias: bool,
    #[serde(default = "defaults::d128")]
    ssm_state_size: usize,
    #[serde(default)]
    conv_kernel: Option<usize>,
    #[serde(default)]
    mamba_d_conv: Option<usize>,
    #[serde(default = "defaults::yes")]
    use_conv_bias: bool,
    #[serde(default = "time_step_min")]
    time_step_min: f64,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    attention_head_dim: Option<usize>,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default = "relu2")]
    mlp_hidden_act: String,
    #[serde(default)]
    moe_latent_size: Option<Value>,
    #[serde(default)]
    n_routed_experts: Option<usize>,
    #[serde(default)]
    num_local_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    moe_shared_expert_intermediate_size: Option<usize>,
    #[serde(default = "defaults::one")]
    n_group: usize,
    #[serde(default = "defaults::one")]
    topk_group: usize,
    #[serde(default = "defaults::yes")]
    norm_topk_prob: bool,
    #[serde(default = "defaults::unit")]
    routed_scaling_factor: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    mlp_bias: bool,
}

fn d64() -> usize {
    64
}
fn time_step_min() -> f64 {
    0.001
}
fn relu2() -> String {
    "relu2".into()
}

impl NemotronHConfig {
    pub fn from_value(value: &Value) -> Result<Self> {
        let blocks = block_kinds(value)?;
        let c: Keys = crate::arch::config::from_value(value)?;
        let hidden = c.hidden_size;
        let eps = c.layer_norm_epsilon;
        let (heads, head_dim) = (c.mamba_num_heads, c.mamba_head_dim);
        let groups = c.n_groups.or(c.mamba_n_groups).unwrap_or(8);
        let bias = c.use_bias;
        let mamba = Mamba2Dims {
            hidden,
            heads,
            head_dim,
            state: c.ssm_state_size,
            groups,
            // the inner width is heads × head_dim; `expand` is not used by the mixer
            d_inner: heads * head_dim,
            conv_kernel: c.conv_kernel.or(c.mamba_d_conv).unwrap_or(4),
            conv_bias: c.use_conv_bias,
            in_bias: bias,
            out_bias: bias,
            eps,
            // transformers clamps Δt from below at time_step_min in the full forward
            dt_limit: (c.time_step_min, f64::INFINITY),
            norm: OutputNorm::Gated { groups, before_gate: false },
            in_scale: 1.0,
            segment_scales: [1.0; 5],
        };
        mamba.check().context("the Mamba-2 sizes of config.json (mamba_num_heads, mamba_head_dim, n_groups)")?;
        let attn_heads = c.num_attention_heads;
        let attn_head_dim = c.head_dim.or(c.attention_head_dim).unwrap_or(hidden / attn_heads.max(1));
        let attention = AttentionSpec {
            hidden,
            heads: attn_heads,
            kv_heads: c.num_key_value_heads.unwrap_or(attn_heads),
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
        if c.mlp_hidden_act != "relu2" {
            bail!("mlp_hidden_act \"{}\" is not supported (Nemotron-H MLPs use relu2)", c.mlp_hidden_act);
        }
        let moe = if blocks.contains(&BlockKind::Moe) {
            if c.moe_latent_size.is_some() {
                bail!("Nemotron-H MoE layers with a latent projection (moe_latent_size) are not supported");
            }
            let need = |v: Option<usize>, key: &str| v.with_context(|| format!("config.json has no {key}"));
            Some(MoeConfig {
                experts: need(c.n_routed_experts.or(c.num_local_experts), "n_routed_experts or num_local_experts")?,
                top_k: need(c.num_experts_per_tok, "num_experts_per_tok")?,
                intermediate: need(c.moe_intermediate_size, "moe_intermediate_size")?,
                shared_intermediate: need(
                    c.moe_shared_expert_intermediate_size,
                    "moe_shared_expert_intermediate_size",
                )?,
                groups: c.n_group,
                topk_groups: c.topk_group,
                norm: c.norm_topk_prob,
                scale: c.routed_scaling_factor,
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
            vocab: c.vocab_size,
            hidden,
            eps,
            tie: c.tie_word_embeddings,
            mamba,
            attention,
            mlp_intermediate: c.intermediate_size,
            mlp_bias: c.mlp_bias,
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
