//! The recovery loss over a chunk of token rows: `lm·CE + kd·T²·KL(p_teacher,T ‖ p_student,T)`,
//! summed over the rows and divided by the step's token count, so that chunks (and micro-batches)
//! add up to the mean over all tokens. The logits of one chunk are all that exist at a time: a
//! 248k vocabulary over a whole batch would outweigh the model.

use anyhow::Result;
use candle_core::Tensor;

/// The loss's weights and temperature.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct KdConfig {
    pub temperature: f64,
    pub kd_weight: f64,
    pub lm_weight: f64,
}

/// Sums over token rows, for reporting.
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts {
    /// Σ −log p_student(target).
    pub ce: f64,
    /// Σ KL(teacher ‖ student) at the temperature (without the T² factor).
    pub kl: f64,
    pub tokens: usize,
}

impl std::ops::AddAssign for Parts {
    fn add_assign(&mut self, o: Self) {
        self.ce += o.ce;
        self.kl += o.kl;
        self.tokens += o.tokens;
    }
}

impl Parts {
    /// The loss these sums give under `cfg`, per token.
    pub fn loss(&self, cfg: &KdConfig) -> f64 {
        let n = self.tokens.max(1) as f64;
        (cfg.lm_weight * self.ce + cfg.kd_weight * cfg.temperature * cfg.temperature * self.kl) / n
    }
}

/// The loss of `rows` token rows: student logits [R, V] (differentiable), teacher logits
/// [R, V] (ignored when the KD weight is 0) and targets [R] (u32), scaled by `scale` (one over
/// the step's tokens). Returns the scalar to differentiate and the unscaled sums.
pub fn chunk(
    student: &Tensor,
    teacher: &Tensor,
    targets: &Tensor,
    cfg: &KdConfig,
    scale: f64,
) -> Result<(Tensor, Parts)> {
    let kd = cfg.kd_weight > 0.0;
    // Per row (ce, kl) from one op over the logits, float32 inside.
    let rows = crate::ops::distill::kd_rows(student, kd.then_some(teacher), targets, cfg.temperature)?;
    let sums = rows.sum(0)?;
    let t2 = cfg.temperature * cfg.temperature;
    let weights = Tensor::new(&[cfg.lm_weight as f32, (cfg.kd_weight * t2) as f32], sums.device())?;
    let loss = ((&sums * &weights)?.sum_all()? * scale)?;
    let [ce, kl]: [f32; 2] = sums.to_vec1::<f32>()?.try_into().map_err(|_| anyhow::anyhow!("two sums"))?;
    Ok((loss, Parts { ce: ce as f64, kl: kl as f64, tokens: rows.dim(0)? }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The loss in float64 from plain arithmetic.
    fn reference(s: &[Vec<f64>], t: &[Vec<f64>], y: &[usize], cfg: &KdConfig) -> f64 {
        let lsm = |z: &[f64], temp: f64| -> Vec<f64> {
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max) / temp;
            let lse = z.iter().map(|v| (v / temp - m).exp()).sum::<f64>().ln() + m;
            z.iter().map(|v| v / temp - lse).collect()
        };
        let mut total = 0.0;
        for r in 0..s.len() {
            let ce = -lsm(&s[r], 1.0)[y[r]];
            let (lq, lp) = (lsm(&s[r], cfg.temperature), lsm(&t[r], cfg.temperature));
            let kl: f64 = lp.iter().zip(&lq).map(|(p, q)| p.exp() * (p - q)).sum();
            total += cfg.lm_weight * ce + cfg.kd_weight * cfg.temperature.powi(2) * kl;
        }
        total / s.len() as f64
    }

    /// The loss and its gradient with respect to the student's logits against float64 finite
    /// differences of the same loss written out by hand.
    #[test]
    fn loss_and_gradient_match_finite_differences() -> Result<()> {
        let dev = Device::Cpu;
        let (r, v) = (3, 7);
        let cfg = KdConfig { temperature: 2.0, kd_weight: 0.7, lm_weight: 1.3 };
        let s: Vec<Vec<f64>> =
            (0..r).map(|i| (0..v).map(|j| ((i * 7 + j * 3) % 11) as f64 * 0.3 - 1.2).collect()).collect();
        let t: Vec<Vec<f64>> =
            (0..r).map(|i| (0..v).map(|j| ((i * 5 + j * 2) % 9) as f64 * 0.4 - 1.0).collect()).collect();
        let y = [2usize, 0, 6];
        let flat = |m: &[Vec<f64>]| m.iter().flatten().map(|x| *x as f32).collect::<Vec<_>>();
        let sv = Var::from_tensor(&Tensor::from_vec(flat(&s), (r, v), &dev)?)?;
        let tt = Tensor::from_vec(flat(&t), (r, v), &dev)?;
        let yt = Tensor::new(&[2u32, 0, 6], &dev)?;
        let (loss, parts) = chunk(sv.as_tensor(), &tt, &yt, &cfg, 1.0 / r as f64)?;
        let want = reference(&s, &t, &y, &cfg);
        assert!((loss.to_scalar::<f32>()? as f64 - want).abs() < 1e-5);
        assert!((parts.loss(&cfg) - want).abs() < 1e-5);
        let grad = loss.backward()?.get(sv.as_tensor()).expect("gradient").to_vec2::<f32>()?;
        let h = 1e-6;
        for i in 0..r {
            for j in 0..v {
                let (mut up, mut down) = (s.clone(), s.clone());
                up[i][j] += h;
                down[i][j] -= h;
                let fd = (reference(&up, &t, &y, &cfg) - reference(&down, &t, &y, &cfg)) / (2.0 * h);
                assert!((grad[i][j] as f64 - fd).abs() < 1e-5, "({i},{j}): {} vs {fd}", grad[i][j]);
            }
        }
        Ok(())
    }
}
