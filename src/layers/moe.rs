//! Sparse mixture-of-experts block: a router picks `top_k` experts per token, their outputs are
//! summed with the router's weights, and shared experts (optionally gated) see every token.
//!
//! Two routers cover the released families: softmax over all experts (Qwen3.5/3.6, Qwen3-Next;
//! Granite's softmax over the top-k logits is the renormalised case) and DeepSeek-V3-style
//! sigmoid scores with a selection-only correction bias, group-limited top-k and a routed
//! scaling factor (Nemotron 3, Kimi Linear).

use super::linear::Linear;
use super::mlp::Mlp;
use anyhow::Result;
use candle_core::{DType, Module, Tensor, D};
use candle_nn::VarBuilder;

pub enum Router {
    /// Softmax over every expert; the top-k weights are renormalised to sum to 1 when `norm`.
    Softmax { norm: bool },
    /// s = sigmoid(logits); experts are chosen by s + `bias` among the `topk_groups` best of
    /// `groups` groups (a group scores the sum of its two best), weighted by s (renormalised
    /// when `norm`) times `scale`.
    Sigmoid { bias: Vec<f32>, groups: usize, topk_groups: usize, norm: bool, scale: f64 },
}

/// Shared experts, added for every token, optionally scaled by sigmoid(gate(x)) (Qwen).
pub struct Shared {
    pub mlp: Mlp,
    pub gate: Option<Linear>,
}

pub struct Moe {
    /// The router's projection [E, H].
    pub gate: Linear,
    pub router: Router,
    pub top_k: usize,
    pub experts: Vec<Mlp>,
    pub shared: Option<Shared>,
}

impl Router {
    /// The sigmoid router whose correction bias is `e_score_correction_bias` under `gate` (the
    /// router's prefix, as DeepSeek-V3-style checkpoints store it, in float32).
    pub fn sigmoid(
        gate: &VarBuilder,
        experts: usize,
        groups: usize,
        topk_groups: usize,
        norm: bool,
        scale: f64,
    ) -> Result<Self> {
        let bias = gate.get_with_hints_dtype(experts, "e_score_correction_bias", Default::default(), DType::F32)?;
        Ok(Router::Sigmoid { bias: bias.to_vec1::<f32>()?, groups, topk_groups, norm, scale })
    }

    /// Scores [N, E] in float32 from router logits.
    fn scores(&self, logits: &Tensor) -> Result<Tensor> {
        let logits = logits.to_dtype(DType::F32)?;
        Ok(match self {
            Router::Softmax { .. } => crate::ops::softmax_last(&logits)?,
            Router::Sigmoid { .. } => candle_nn::ops::sigmoid(&logits)?,
        })
    }

    /// The experts of one token, from its scores.
    fn choose(&self, scores: &[f32], k: usize) -> Vec<usize> {
        let e = scores.len();
        let by_score = |key: &[f32], among: &mut Vec<usize>| {
            among.sort_by(|&a, &b| key[b].total_cmp(&key[a]).then(a.cmp(&b)));
        };
        match self {
            Router::Softmax { .. } => {
                let mut order: Vec<usize> = (0..e).collect();
                by_score(scores, &mut order);
                order.truncate(k.min(e));
                order
            }
            Router::Sigmoid { bias, groups, topk_groups, .. } => {
                let key: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
                let size = e / groups.max(&1);
                let group_score = |g: usize| {
                    let mut v: Vec<f32> = key[g * size..(g + 1) * size].to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    v.iter().take(2).sum::<f32>()
                };
                let mut gs: Vec<usize> = (0..*groups.max(&1)).collect();
                let totals: Vec<f32> = gs.iter().map(|&g| group_score(g)).collect();
                by_score(&totals, &mut gs);
                gs.truncate(*topk_groups.max(&1));
                let mut order: Vec<usize> = gs.iter().flat_map(|&g| g * size..(g + 1) * size).collect();
                by_score(&key, &mut order);
                order.truncate(k.min(order.len()));
                order
            }
        }
    }
}

impl Moe {
    /// The projections: the router, every expert, the shared experts and their gate.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.gate];
        out.extend(self.experts.iter().flat_map(|e| e.linears()));
        if let Some(s) = &self.shared {
            out.extend(s.mlp.linears());
            out.extend(s.gate.as_ref());
        }
        out
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let xs = x.reshape((b * t, h))?;
        let scores = self.router.scores(&self.gate.forward(&xs)?)?;
        let (n, e) = scores.dims2()?;
        // Routing is decided on the host; the weights stay tensors (the softmax a differentiable
        // one when a gradient flows) so gradients reach the router.
        let p = scores.to_vec2::<f32>()?;
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
        let mut picks: Vec<Vec<u32>> = vec![Vec::new(); e];
        for (tok, pt) in p.iter().enumerate() {
            for ex in self.router.choose(pt, self.top_k) {
                rows[ex].push(tok as u32);
                picks[ex].push((tok * e + ex) as u32);
            }
        }
        let (norm, eps, scale) = match &self.router {
            Router::Softmax { norm } => (*norm, 0.0, 1.0),
            Router::Sigmoid { norm, scale, .. } => (*norm, 1e-20, *scale),
        };
        let mut weights = scores.flatten_all()?;
        if norm {
            let mut mask = vec![0f32; n * e];
            picks.iter().flatten().for_each(|&i| mask[i as usize] = 1.0);
            let kept = (scores * Tensor::from_vec(mask, (n, e), x.device())?)?;
            let total = (kept.sum_keepdim(D::Minus1)? + eps)?;
            weights = kept.broadcast_div(&total)?.flatten_all()?;
        }
        if scale != 1.0 {
            weights = (weights * scale)?;
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
        if let Some(s) = &self.shared {
            let mut y = s.mlp.forward(&xs)?;
            if let Some(g) = &s.gate {
                y = y.broadcast_mul(&candle_nn::ops::sigmoid(&g.forward(&xs)?)?)?;
            }
            out = (out + y)?;
        }
        Ok(out.reshape((b, t, h))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::mlp::SwiGlu;
    use candle_core::Device;
    use candle_nn::VarMap;

    fn moe(vb: &VarBuilder, h: usize, e: usize, k: usize, router: Router, gated: bool) -> Moe {
        let mlp = |p: String| Mlp::SwiGlu(SwiGlu::load(vb.pp(p), h, 4).unwrap());
        Moe {
            gate: Linear::load(vb.pp("gate"), h, e, false).unwrap(),
            router,
            top_k: k,
            experts: (0..e).map(|x| mlp(format!("experts.{x}"))).collect(),
            shared: Some(Shared {
                mlp: mlp("shared".into()),
                gate: gated.then(|| Linear::load(vb.pp("shared_gate"), h, 1, false).unwrap()),
            }),
        }
    }

    /// Every expert on every token, masked to the chosen ones by hand.
    fn check(
        m: &Moe,
        x: &Tensor,
        want_experts: impl Fn(&[f32]) -> Vec<usize>,
        weight: impl Fn(&[f32], &[usize], usize) -> f32,
    ) {
        let h = x.dim(2).unwrap();
        let got = m.forward(x).unwrap().reshape(((), h)).unwrap().to_vec2::<f32>().unwrap();
        let xs = x.reshape(((), h)).unwrap();
        let scores = m.router.scores(&m.gate.forward(&xs).unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let all: Vec<Vec<Vec<f32>>> = m.experts.iter().map(|e| e.forward(&xs).unwrap().to_vec2().unwrap()).collect();
        let s = m.shared.as_ref().unwrap();
        let mut shared = s.mlp.forward(&xs).unwrap();
        if let Some(g) = &s.gate {
            shared = shared.broadcast_mul(&candle_nn::ops::sigmoid(&g.forward(&xs).unwrap()).unwrap()).unwrap();
        }
        let shared = shared.to_vec2::<f32>().unwrap();
        for (tok, sc) in scores.iter().enumerate() {
            let top = want_experts(sc);
            for c in 0..h {
                let want = shared[tok][c] + top.iter().map(|&i| weight(sc, &top, i) * all[i][tok][c]).sum::<f32>();
                assert!((got[tok][c] - want).abs() < 1e-5, "token {tok} channel {c}: {} vs {want}", got[tok][c]);
            }
        }
    }

    #[test]
    fn softmax_router_matches_dense_evaluation() {
        let dev = Device::Cpu;
        let (h, e, k) = (6, 5, 2);
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let x = Tensor::randn(0f32, 1.0, (2, 3, h), &dev).unwrap();
        for norm in [true, false] {
            let m = moe(&vb, h, e, k, Router::Softmax { norm }, true);
            let top = |sc: &[f32]| {
                let mut o: Vec<usize> = (0..e).collect();
                o.sort_by(|&a, &b| sc[b].total_cmp(&sc[a]));
                o[..k].to_vec()
            };
            check(&m, &x, top, |sc, top, i| {
                let z: f32 = if norm { top.iter().map(|&j| sc[j]).sum() } else { 1.0 };
                sc[i] / z
            });
        }
    }

    /// DeepSeek-V3 routing: the bias moves the choice, not the weights; only the best group's
    /// experts can be chosen when one group of two is kept.
    #[test]
    fn sigmoid_router_with_groups_and_bias() {
        let dev = Device::Cpu;
        let (h, e, k) = (6, 8, 2);
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let x = Tensor::randn(0f32, 1.0, (3, 5, h), &dev).unwrap();
        let bias = vec![0.3, -0.2, 0.0, 0.1, -0.4, 0.25, 0.05, -0.1];
        let b2 = bias.clone();
        let router = Router::Sigmoid { bias, groups: 2, topk_groups: 1, norm: true, scale: 2.5 };
        let m = moe(&vb, h, e, k, router, false);
        let top = move |sc: &[f32]| {
            let key: Vec<f32> = sc.iter().zip(&b2).map(|(s, b)| s + b).collect();
            let best2 = |g: usize| {
                let mut v = key[g * 4..g * 4 + 4].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[0] + v[1]
            };
            let g = if best2(0) >= best2(1) { 0 } else { 1 };
            let mut o: Vec<usize> = (g * 4..g * 4 + 4).collect();
            o.sort_by(|&a, &b| key[b].total_cmp(&key[a]));
            o[..k].to_vec()
        };
        check(&m, &x, top, |sc, top, i| 2.5 * sc[i] / (top.iter().map(|&j| sc[j]).sum::<f32>() + 1e-20));
    }
}
