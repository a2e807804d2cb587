//! Qwen3-Next / Qwen3.5-MoE sparse MoE MLP (transformers `Qwen3NextSparseMoeBlock`,
//! `Qwen3_5MoeSparseMoeBlock`) on the shared MoE block: softmax router, top-k experts
//! (renormalised when `norm_topk_prob`), plus a shared expert scaled by
//! sigmoid(shared_expert_gate(x)). This file holds the tensor names and storage layouts.

use super::config::Moe;
use crate::layers::linear::Linear;
use crate::layers::mlp::{Mlp, SwiGlu};
use crate::layers::moe::{self, Router, Shared};
use anyhow::{Context, Result};
use candle_nn::VarBuilder;

/// How a checkpoint stores the routed experts, told apart by the tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStorage {
    /// `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj`
    /// [E, H, I]: the bf16 Qwen3.5/3.6 releases.
    Fused,
    /// `experts.{e}.{gate,up,down}_proj.weight`: Qwen3-Next, transformers' `save_pretrained`,
    /// re-exports.
    PerExpert,
}

impl ExpertStorage {
    pub fn detect(vb: &VarBuilder) -> Self {
        if vb.contains_tensor("experts.gate_up_proj") {
            ExpertStorage::Fused
        } else {
            ExpertStorage::PerExpert
        }
    }

    /// One SwiGLU per expert. Fused experts become views into the two stored tensors (no copy),
    /// so that both layouts run the same forward.
    fn load(self, vb: &VarBuilder, hidden: usize, cfg: Moe) -> Result<Vec<Mlp>> {
        let (e, i) = (cfg.experts, cfg.intermediate);
        match self {
            ExpertStorage::Fused => {
                let gate_up = vb.get((e, 2 * i, hidden), "experts.gate_up_proj")?;
                let down = vb.get((e, hidden, i), "experts.down_proj")?;
                (0..e).map(|x| Mlp::swiglu_stacked(&gate_up.get(x)?, down.get(x)?)).collect()
            }
            ExpertStorage::PerExpert => {
                (0..e).map(|x| Ok(Mlp::SwiGlu(SwiGlu::load(vb.pp(format!("experts.{x}")), hidden, i)?))).collect()
            }
        }
    }
}

/// The MoE block under `vb` (`…mlp`).
pub fn load(vb: VarBuilder, hidden: usize, cfg: Moe) -> Result<moe::Moe> {
    let experts = ExpertStorage::detect(&vb).load(&vb, hidden, cfg).with_context(|| {
        format!(
            "{}: experts for num_experts {}, moe_intermediate_size {}, hidden_size {hidden} (config.json)",
            vb.prefix(),
            cfg.experts,
            cfg.intermediate
        )
    })?;
    Ok(moe::Moe {
        gate: Linear::load(vb.pp("gate"), hidden, cfg.experts, false)?,
        router: Router::Softmax { norm: cfg.norm_topk_prob },
        top_k: cfg.top_k,
        experts,
        shared: Some(Shared {
            mlp: Mlp::SwiGlu(SwiGlu::load(vb.pp("shared_expert"), hidden, cfg.shared_intermediate)?),
            gate: Some(Linear::load(vb.pp("shared_expert_gate"), hidden, 1, false)?),
        }),
    })
}
