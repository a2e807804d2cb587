//! Qwen3.5 (`qwen3_5_text`, and the multimodal `qwen3_5` checkpoints), Qwen3.5/3.6-MoE
//! (`qwen3_5_moe_text`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`): hybrids of Gated DeltaNet
//! and gated full attention.
//!
//! Follows transformers `modular_qwen3_5.py`, `modular_qwen3_5_moe.py` and
//! `modular_qwen3_next.py`. Only the linear-attention layers have a recurrent state;
//! full-attention layers, experts, `model.visual.*` and `mtp.*` are left alone.

mod config;
mod gdn;
mod model;
mod moe;

use super::{Family, LayerState, LoadOptions, RowSlice, SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use anyhow::{Context, Result};
use serde_json::Value;

pub use config::{TextConfig, Variant};
pub use model::qwen3_5_stack;

fn config(ckpt: &Checkpoint) -> Result<(Variant, TextConfig)> {
    let variant = Variant::of(&ckpt.model_type()?)?;
    let cfg = TextConfig::from_value(variant, &ckpt.config).with_context(|| {
        format!(
            "{}/config.json does not match the {} format",
            ckpt.dir.display(),
            ckpt.model_type().unwrap_or_default()
        )
    })?;
    Ok((variant, cfg))
}

/// Where the q and k channels of each linear-attention layer live (FORMATS.md §3).
pub fn layout_of(variant: Variant, c: &TextConfig) -> StateLayout {
    let d = gdn::Dims::new(c);
    let layers = (0..c.num_hidden_layers)
        .filter(|&i| c.is_linear(i))
        .map(|i| {
            let p = format!("{}.layers.{i}.linear_attn.", variant.prefix());
            let slice = |t: &str, offset, head_stride, role| RowSlice {
                tensor: format!("{p}{t}.weight"),
                offset,
                head_stride,
                role,
            };
            let kd = d.hk * d.dk;
            let mut slices = if variant.fused() {
                // one [q_g | k_g | v_g | z_g] block per key head
                let blk = d.fused_block();
                vec![
                    slice("in_proj_qkvz", 0, blk, SliceRole::QueryProj),
                    slice("in_proj_qkvz", d.dk, blk, SliceRole::KeyProj),
                ]
            } else {
                vec![
                    slice("in_proj_qkv", 0, d.dk, SliceRole::QueryProj),
                    slice("in_proj_qkv", kd, d.dk, SliceRole::KeyProj),
                ]
            };
            slices.push(slice("conv1d", 0, d.dk, SliceRole::Conv));
            slices.push(slice("conv1d", kd, d.dk, SliceRole::Conv));
            LayerState { layer: i, key_heads: d.hk, value_heads: d.hv, dv: d.dv, slices }
        })
        .collect();
    let family = match variant {
        Variant::Next => "Qwen3Next",
        Variant::MoeText | Variant::MoeMultimodal => "Qwen3_5Moe",
        Variant::Text | Variant::Multimodal => "Qwen3_5",
    };
    StateLayout { family: family.into(), dk: d.dk, layers, num_layers: c.num_hidden_layers }
}

pub struct Qwen35Family;

impl Family for Qwen35Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let (variant, cfg) = config(ckpt)?;
        Ok(layout_of(variant, &cfg))
    }

    fn layers(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        vb: candle_nn::VarBuilder<'static>,
    ) -> Result<Box<dyn super::layered::Layers>> {
        let (variant, cfg) = config(ckpt)?;
        Ok(Box::new(qwen3_5_stack(ckpt, variant, &cfg, opts, vb)?))
    }

    fn set_key_width(&self, config: &mut Value, _layout: &StateLayout, dk: usize) -> Result<()> {
        // linear_key_head_dim is independent of linear_value_head_dim: nothing else changes
        let variant = Variant::of(&crate::checkpoint::model_type(config)?)?;
        variant.text_mut(config)?["linear_key_head_dim"] = Value::from(dk);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text() -> Value {
        json!({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "linear_key_head_dim": 16, "linear_value_head_dim": 8,
               "linear_num_key_heads": 2, "linear_num_value_heads": 6})
    }

    fn rows(l: &StateLayout, layer: usize) -> Vec<(String, usize, usize, SliceRole)> {
        let s = l.layer(layer).unwrap();
        s.slices.iter().map(|r| (r.tensor.clone(), r.offset, r.head_stride, r.role)).collect()
    }

    #[test]
    fn text_layout_lists_linear_layers() {
        let c = TextConfig::from_value(Variant::Text, &text()).unwrap();
        let l = layout_of(Variant::Text, &c);
        assert_eq!(l.layers.iter().map(|s| s.layer).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!((l.dk, l.layers[0].key_heads, l.layers[0].value_heads, l.layers[0].dv), (16, 2, 6, 8));
        let p = "model.layers.1.linear_attn.";
        assert_eq!(
            rows(&l, 1),
            [
                (format!("{p}in_proj_qkv.weight"), 0, 16, SliceRole::QueryProj),
                (format!("{p}in_proj_qkv.weight"), 32, 16, SliceRole::KeyProj),
                (format!("{p}conv1d.weight"), 0, 16, SliceRole::Conv),
                (format!("{p}conv1d.weight"), 32, 16, SliceRole::Conv),
            ]
        );
    }

    #[test]
    fn multimodal_and_next_layouts() {
        let mm = json!({"model_type": "qwen3_5", "text_config": text()});
        let c = TextConfig::from_value(Variant::Multimodal, &mm).unwrap();
        let l = layout_of(Variant::Multimodal, &c);
        assert_eq!(rows(&l, 0)[1].0, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight");

        let c = TextConfig::from_value(Variant::Next, &text()).unwrap();
        let l = layout_of(Variant::Next, &c);
        // block = 2·dk + 2·r·dv = 32 + 48; q at 0, k at dk within each block
        let p = "model.layers.2.linear_attn.";
        assert_eq!(
            rows(&l, 2),
            [
                (format!("{p}in_proj_qkvz.weight"), 0, 80, SliceRole::QueryProj),
                (format!("{p}in_proj_qkvz.weight"), 16, 80, SliceRole::KeyProj),
                (format!("{p}conv1d.weight"), 0, 16, SliceRole::Conv),
                (format!("{p}conv1d.weight"), 32, 16, SliceRole::Conv),
            ]
        );
    }

    #[test]
    fn moe_layouts() {
        let mut t = text();
        t["model_type"] = json!("qwen3_5_moe_text");
        let mm = json!({"model_type": "qwen3_5_moe", "text_config": t});
        let c = TextConfig::from_value(Variant::MoeMultimodal, &mm).unwrap();
        let l = layout_of(Variant::MoeMultimodal, &c);
        assert_eq!((l.family.as_str(), l.layers.len()), ("Qwen3_5Moe", 3));
        assert_eq!(rows(&l, 2)[0].0, "model.language_model.layers.2.linear_attn.in_proj_qkv.weight");
        let l = layout_of(Variant::MoeText, &TextConfig::from_value(Variant::MoeText, &mm["text_config"]).unwrap());
        assert_eq!(rows(&l, 0)[3], ("model.layers.0.linear_attn.conv1d.weight".into(), 32, 16, SliceRole::Conv));

        let mut cfg = mm.clone();
        Qwen35Family.set_key_width(&mut cfg, &l, 8).unwrap();
        assert_eq!(cfg["text_config"]["linear_key_head_dim"], 8);
    }

    #[test]
    fn set_key_width_edits_the_text_config() {
        let mut c = text();
        let layout = layout_of(Variant::Text, &TextConfig::from_value(Variant::Text, &c).unwrap());
        Qwen35Family.set_key_width(&mut c, &layout, 12).unwrap();
        assert_eq!((c["linear_key_head_dim"].clone(), c["linear_value_head_dim"].clone()), (json!(12), json!(8)));

        let mut mm = json!({"model_type": "qwen3_5", "text_config": text()});
        Qwen35Family.set_key_width(&mut mm, &layout, 10).unwrap();
        assert_eq!(mm["text_config"]["linear_key_head_dim"], 10);
        assert!(mm.get("linear_key_head_dim").is_none());
        assert_eq!(TextConfig::from_value(Variant::Multimodal, &mm).unwrap().linear_key_head_dim, 10);
    }
}
