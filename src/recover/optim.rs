//! AdamW with decoupled weight decay, global-norm clipping and the learning-rate schedule of
//! the recovery recipe (linear warm-up, then cosine decay to a floor). The moments are float32
//! whatever the model's dtype.

use anyhow::Result;
use candle_core::Tensor;

/// AdamW's settings. The betas are torchtitan's (the recipe's trainer), not PyTorch's defaults.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

/// The optimizer state: first and second moments per parameter, and the update count.
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Updates taken (skipped steps do not count).
    pub t: u64,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &[Tensor]) -> Result<Self> {
        let zeros = || params.iter().map(|p| p.zeros_like().map_err(Into::into)).collect::<Result<Vec<_>>>();
        Ok(Self { cfg, m: zeros()?, v: zeros()?, t: 0 })
    }

    /// One update of `params` with `grads` at learning rate `lr`.
    pub fn step(&mut self, params: &mut [Tensor], grads: &[Tensor], lr: f64) -> Result<()> {
        self.t += 1;
        let c = self.cfg;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t as i32), 1.0 - c.beta2.powi(self.t as i32));
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            self.m[i] = ((&self.m[i] * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            self.v[i] = ((&self.v[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let m_hat = (&self.m[i] / bc1)?;
            let denom = ((&self.v[i] / bc2)?.sqrt()? + c.eps)?;
            let decayed = (&*p * (1.0 - lr * c.weight_decay))?;
            *p = (decayed - (m_hat / denom)? * lr)?;
        }
        Ok(())
    }
}

/// The L2 norm of all gradients together (float64 sum of float32 squares).
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut sum = 0f64;
    for g in grads {
        sum += crate::ops::sum_all(&g.sqr()?)?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
    }
    Ok(sum.sqrt())
}

/// Scale `grads` so that their global norm is at most `max` (no change when `max` is 0).
pub fn clip(grads: &mut [Tensor], norm: f64, max: f64) -> Result<()> {
    if max > 0.0 && norm > max {
        let s = max / (norm + 1e-6);
        for g in grads.iter_mut() {
            *g = (&*g * s)?;
        }
    }
    Ok(())
}

/// The learning rate of step `step` (from 0) of `total`: linear warm-up over `warmup` steps to
/// `lr`, then cosine decay to `lr · min_ratio` at the last step.
pub fn learning_rate(step: usize, total: usize, warmup: usize, lr: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / (warmup + 1) as f64;
    }
    let span = total.saturating_sub(warmup).saturating_sub(1).max(1);
    let progress = ((step - warmup) as f64 / span as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    lr * (min_ratio + (1.0 - min_ratio) * cosine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let lr = |s| learning_rate(s, 100, 5, 1e-4, 0.1);
        assert!(lr(0) < lr(1) && lr(1) < lr(4) && lr(4) < 1e-4);
        assert!((lr(5) - 1e-4).abs() < 1e-12);
        assert!((lr(99) - 1e-5).abs() < 1e-12);
        assert!((5..99).all(|s| lr(s + 1) <= lr(s)));
    }

    /// Two AdamW steps against the update written out by hand in float64.
    #[test]
    fn adamw_matches_the_closed_form() -> Result<()> {
        let cfg = AdamWConfig { weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8 };
        let dev = Device::Cpu;
        let mut p = vec![Tensor::new(&[1.0f32, -2.0], &dev)?];
        let mut opt = AdamW::new(cfg, &p)?;
        let (g1, g2) = ([0.5f64, -1.0], [0.25f64, 2.0]);
        opt.step(&mut p, &[Tensor::new(&[0.5f32, -1.0], &dev)?], 0.01)?;
        opt.step(&mut p, &[Tensor::new(&[0.25f32, 2.0], &dev)?], 0.02)?;
        let got = p[0].to_vec1::<f32>()?;
        for (j, start) in [1.0f64, -2.0].into_iter().enumerate() {
            let (mut x, mut m, mut v) = (start, 0.0, 0.0);
            for (t, (g, lr)) in [(g1[j], 0.01), (g2[j], 0.02)].into_iter().enumerate() {
                let t = t as i32 + 1;
                m = 0.9 * m + 0.1 * g;
                v = 0.95 * v + 0.05 * g * g;
                let (mh, vh) = (m / (1.0 - 0.9f64.powi(t)), v / (1.0 - 0.95f64.powi(t)));
                x = x * (1.0 - lr * 0.1) - lr * mh / (vh.sqrt() + 1e-8);
            }
            assert!((got[j] as f64 - x).abs() < 1e-6, "{j}: {} vs {x}", got[j]);
        }
        Ok(())
    }

    #[test]
    fn clipping_bounds_the_global_norm() -> Result<()> {
        let dev = Device::Cpu;
        let mut g = vec![Tensor::new(&[3.0f32], &dev)?, Tensor::new(&[4.0f32], &dev)?];
        let n = global_norm(&g)?;
        assert!((n - 5.0).abs() < 1e-9);
        clip(&mut g, n, 1.0)?;
        assert!((global_norm(&g)? - 1.0).abs() < 1e-5);
        Ok(())
    }
}
