//! Nemotron-H and Nemotron 3 (`nemotron_h`, transformers `NemotronHForCausalLM`): every layer is
//! one pre-norm residual block, a Mamba-2 mixer, NoPE attention, a squared-ReLU MLP or a
//! sigmoid-routed MoE, under `backbone.*`. Follows transformers `models/nemotron_h/`.
//!
//! Only the Mamba-2 layers have a state; their key width is `ssm_state_size`. MTP tensors
//! (`mtp.*`), which transformers does not load, are carried through untouched.

mod config;

use super::layered::Layers;
use super::{Family, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::attention::Attention;
use crate::layers::block::{Layer, Step, Sublayer};
use crate::layers::linear::Linear;
use crate::layers::mamba2::Mamba2Mixer;
use crate::layers::mlp::Mlp;
use crate::layers::moe::{Moe, Router, Shared};
use crate::layers::stack::{untied_head, Stack, StackSpec};
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::{Context, Result};
use candle_nn::VarBuilder;
use serde_json::Value;

pub use config::{BlockKind, NemotronHConfig};

fn config(ckpt: &Checkpoint) -> Result<NemotronHConfig> {
    NemotronHConfig::from_value(&ckpt.config)
        .with_context(|| format!("{}/config.json does not match the Nemotron-H format", ckpt.dir.display()))
}

/// An `E` block under `vb` (`…mixer`): experts one tensor per expert or fused 3-D.
fn moe(vb: &VarBuilder, c: &NemotronHConfig) -> Result<Moe> {
    let m = c.moe.as_ref().context("an MoE layer without MoE sizes")?;
    let (h, i) = (c.hidden, m.intermediate);
    let experts = if vb.contains_tensor("experts.up_proj") {
        let up = vb.get((m.experts, i, h), "experts.up_proj")?;
        let down = vb.get((m.experts, h, i), "experts.down_proj")?;
        (0..m.experts)
            .map(|e| Ok(Mlp::Relu2 { up: Linear::new(up.get(e)?, None), down: Linear::new(down.get(e)?, None) }))
            .collect::<Result<Vec<_>>>()?
    } else {
        (0..m.experts).map(|e| Mlp::relu2(vb.pp(format!("experts.{e}")), h, i, false)).collect::<Result<Vec<_>>>()?
    };
    Ok(Moe {
        gate: Linear::load(vb.pp("gate"), h, m.experts, false)?,
        router: Router::sigmoid(&vb.pp("gate"), m.experts, m.groups, m.topk_groups, m.norm, m.scale)?,
        top_k: m.top_k,
        experts,
        shared: Some(Shared { mlp: Mlp::relu2(vb.pp("shared_experts"), h, m.shared_intermediate, false)?, gate: None }),
    })
}

pub struct NemotronHFamily;

impl Family for NemotronHFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["nemotron_h"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let c = config(ckpt)?;
        let mixers = (0..c.blocks.len())
            .filter(|&i| c.blocks[i] == BlockKind::Mamba)
            .map(|i| (i, format!("backbone.layers.{i}.mixer.")));
        Ok(crate::arch::mamba2::mixer_layout(&c.mamba, "NemotronH", mixers, c.blocks.len(), |t| {
            ckpt.tensors.contains_key(t)
        }))
    }

    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        let c = config(ckpt)?;
        let spec = StackSpec {
            vocab: c.vocab,
            hidden: c.hidden,
            layers: c.blocks.len(),
            eps: c.eps,
            embed: "backbone.embeddings.weight".into(),
            layer_prefix: "backbone.layers".into(),
            final_norm: "backbone.norm_f".into(),
            lm_head: untied_head(|t| ckpt.tensors.contains_key(t), c.tie),
            embed_scale: 1.0,
            logit_scale: 1.0,
            final_norm_weight: crate::ops::norm::NormWeight::Plain,
            states_after_blocks: false,
        };
        let (ckpt, grad) = (ckpt.clone(), opts.grad);
        let build = move |l: VarBuilder, i: usize| {
            let m = l.pp("mixer");
            let sublayer = match c.blocks[i] {
                BlockKind::Mamba => {
                    Sublayer::Mamba2(Mamba2Mixer::load(m, &c.mamba, i, &|n| Ok(ckpt.info(n)?.shape.clone()), grad)?)
                }
                BlockKind::Attention => Sublayer::Attention(Attention::load(m, &c.attention)?),
                BlockKind::Mlp => Sublayer::Mlp(Mlp::relu2(m, c.hidden, c.mlp_intermediate, c.mlp_bias)?),
                BlockKind::Moe => Sublayer::Moe(moe(&m, &c)?),
            };
            let norm = RmsNorm::load(l.pp("norm"), c.hidden, c.eps, NormWeight::Plain)?;
            Ok(Layer { steps: vec![Step { norm, sublayer, scale: 1.0 }] })
        };
        Ok(Box::new(Stack::new(vb, spec, opts.device.clone(), Box::new(build))))
    }

    fn set_key_width(&self, config: &mut Value, _layout: &StateLayout, dk: usize) -> Result<()> {
        config["ssm_state_size"] = Value::from(dk);
        Ok(())
    }
}
