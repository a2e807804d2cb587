//! Qwen3-Next / Qwen3.5-MoE sparse MoE MLP (transformers `Qwen3NextSparseMoeBlock`,
//! `Qwen3_5MoeSparseMoeBlock`): softmax router, top-k experts (renormalised when
//! `norm_topk_prob`), plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

use super::config::Moe;
use crate::ops::mlp::SwiGlu;
use anyhow::{Context, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::{linear_no_bias, Linear, VarBuilder};

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
    fn load(self, vb: &VarBuilder, hidden: usize, cfg: Moe) -> candle_core::Result<Vec<SwiGlu>> {
        let (e, i) = (cfg.experts, cfg.intermediate);
        match self {
            ExpertStorage::Fused => {
                let gate_up = vb.get((e, 2 * i, hidden), "experts.gate_up_proj")?;
                let down = vb.get((e, hidden, i), "experts.down_proj")?;
                (0..e)
                    .map(|x| {
                        let gu = gate_up.get(x)?;
                        let lin = |t: Tensor| Linear::new(t, None);
                        Ok(SwiGlu::new(lin(gu.narrow(0, 0, i)?), lin(gu.narrow(0, i, i)?), lin(down.get(x)?)))
                    })
                    .collect()
            }
            ExpertStorage::PerExpert => {
                (0..e).map(|x| SwiGlu::load(vb.pp(format!("experts.{x}")), hidden, i)).collect()
            }
        }
    }
}

pub struct SparseMoe {
    cfg: Moe,
    router: Linear,
    experts: Vec<SwiGlu>,
    shared: SwiGlu,
    shared_gate: Linear,
}

impl SparseMoe {
    pub fn load(vb: VarBuilder, hidden: usize, cfg: Moe) -> Result<Self> {
        let experts = ExpertStorage::detect(&vb).load(&vb, hidden, cfg).with_context(|| {
            format!(
                "{}: experts for num_experts {}, moe_intermediate_size {}, hidden_size {hidden} (config.json)",
                vb.prefix(),
                cfg.experts,
                cfg.intermediate
            )
        })?;
        Ok(Self {
            cfg,
            router: linear_no_bias(hidden, cfg.experts, vb.pp("gate"))?,
            experts,
            shared: SwiGlu::load(vb.pp("shared_expert"), hidden, cfg.shared_intermediate)?,
            shared_gate: linear_no_bias(hidden, 1, vb.pp("shared_expert_gate"))?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let xs = x.reshape((b * t, h))?;
        let probs = candle_nn::ops::softmax_last_dim(&self.router.forward(&xs)?.to_dtype(DType::F32)?)?;
        let (n, e) = probs.dims2()?;
        // Routing is decided on the host; the weights stay tensors so gradients reach the router.
        let p = probs.to_vec2::<f32>()?;
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
        let mut picks: Vec<Vec<u32>> = vec![Vec::new(); e];
        for (tok, pt) in p.iter().enumerate() {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| pt[b].total_cmp(&pt[a]).then(a.cmp(&b)));
            for &ex in &order[..self.cfg.top_k.min(e)] {
                rows[ex].push(tok as u32);
                picks[ex].push((tok * e + ex) as u32);
            }
        }
        let mut weights = probs.flatten_all()?;
        if self.cfg.norm_topk_prob {
            let mut mask = vec![0f32; n * e];
            picks.iter().flatten().for_each(|&i| mask[i as usize] = 1.0);
            let kept = (probs * Tensor::from_vec(mask, (n, e), x.device())?)?;
            weights = kept.broadcast_div(&kept.sum_keepdim(D::Minus1)?)?.flatten_all()?;
        }
        let mut out = xs.zeros_like()?;
        for (ex, expert) in self.experts.iter().enumerate() {
            if rows[ex].is_empty() {
                continue;
            }
            let idx = Tensor::new(rows[ex].as_slice(), x.device())?;
            let w = weights.index_select(&Tensor::new(picks[ex].as_slice(), x.device())?, 0)?;
            let y = expert.forward(&xs.index_select(&idx, 0)?)?;
            let y = y.broadcast_mul(&w.to_dtype(y.dtype())?.unsqueeze(1)?)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        let shared =
            self.shared.forward(&xs)?.broadcast_mul(&candle_nn::ops::sigmoid(&self.shared_gate.forward(&xs)?)?)?;
        Ok((out + shared)?.reshape((b, t, h))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::VarMap;

    /// Every expert on every token, masked to the top-k by hand.
    #[test]
    fn matches_dense_evaluation() {
        let dev = Device::Cpu;
        let (h, e, k) = (6, 5, 2);
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        for norm in [true, false] {
            let cfg = Moe { experts: e, top_k: k, intermediate: 4, shared_intermediate: 3, norm_topk_prob: norm };
            let moe = SparseMoe::load(vb.clone(), h, cfg).unwrap();
            let x = Tensor::randn(0f32, 1.0, (2, 3, h), &dev).unwrap();
            let got = moe.forward(&x).unwrap().reshape((6, h)).unwrap().to_vec2::<f32>().unwrap();
            let xs = x.reshape((6, h)).unwrap();
            let probs = candle_nn::ops::softmax_last_dim(&moe.router.forward(&xs).unwrap()).unwrap();
            let probs = probs.to_vec2::<f32>().unwrap();
            let all: Vec<Vec<Vec<f32>>> =
                moe.experts.iter().map(|m| m.forward(&xs).unwrap().to_vec2().unwrap()).collect();
            let sg = candle_nn::ops::sigmoid(&moe.shared_gate.forward(&xs).unwrap()).unwrap();
            let shared = moe.shared.forward(&xs).unwrap().broadcast_mul(&sg).unwrap().to_vec2::<f32>().unwrap();
            for tok in 0..6 {
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| probs[tok][b].total_cmp(&probs[tok][a]));
                let top = &order[..k];
                let z: f32 = if norm { top.iter().map(|&i| probs[tok][i]).sum() } else { 1.0 };
                for c in 0..h {
                    let want = shared[tok][c] + top.iter().map(|&i| probs[tok][i] / z * all[i][tok][c]).sum::<f32>();
                    assert!((got[tok][c] - want).abs() < 1e-5, "token {tok} channel {c}: {} vs {want}", got[tok][c]);
                }
            }
        }
    }
}
