//! AdamW with decoupled weight decay, global-norm clipping and the learning-rate schedule of
//! the recovery recipe (linear warm-up, then cosine decay to a floor). The moments are float32
//! whatever the model's dtype.

use anyhow::Result;
use candle_core::{DType, Tensor, TensorId};

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
    /// Per parameter, the buffer [p | m | v] the last update wrote in place, and the ids of the
    /// views of it it handed out as the parameter and its moments. While those are still the
    /// ones in place, the next update reuses the buffer; a parameter or moment replaced since
    /// (a resumed run loads them) is packed again.
    packed: Vec<Option<(Tensor, [TensorId; 3])>>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &[Tensor]) -> Result<Self> {
        let zeros = || params.iter().map(|p| p.zeros_like().map_err(Into::into)).collect::<Result<Vec<_>>>();
        Ok(Self { cfg, m: zeros()?, v: zeros()?, t: 0, packed: vec![None; params.len()] })
    }

    /// One update of `params` (float32) with `grads` at learning rate `lr`, the gradients
    /// scaled by `clip` first when given (see [`clip_scale`]): one op a parameter
    /// ([`crate::ops::adamw`]), giving the values candle's ops gave.
    pub fn step(&mut self, params: &mut [Tensor], grads: &[Tensor], lr: f64, clip: Option<f64>) -> Result<()> {
        self.t += 1;
        let c = self.cfg;
        let u = crate::ops::adamw::Update::new(c.beta1, c.beta2, c.eps, self.t, lr, c.weight_decay, clip);
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            let n = p.elem_count();
            if n == 0 {
                continue;
            }
            let ids = [p.id(), self.m[i].id(), self.v[i].id()];
            let state = match &self.packed[i] {
                Some((buf, held)) if *held == ids => buf.clone(),
                _ => {
                    let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all();
                    Tensor::cat(&[flat(p)?, flat(&self.m[i])?, flat(&self.v[i])?], 0)?
                }
            };
            let g = g.to_dtype(DType::F32)?.flatten_all()?.contiguous()?;
            crate::ops::adamw::update(&state, &g, u)?;
            let shape = p.shape().clone();
            let part = |k: usize| state.narrow(0, k * n, n)?.reshape(&shape);
            (*p, self.m[i], self.v[i]) = (part(0)?, part(1)?, part(2)?);
            self.packed[i] = Some((state, [p.id(), self.m[i].id(), self.v[i].id()]));
        }
        Ok(())
    }
}

/// The L2 norm of all gradients together: each gradient's float32 sum of squares, summed in
/// float64 in order on the host. The sums come off the device together, in one copy.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let sums =
        grads.iter().map(|g| crate::ops::sum_all(&g.sqr()?)?.reshape(1)).collect::<candle_core::Result<Vec<_>>>()?;
    if sums.is_empty() {
        return Ok(0.0);
    }
    let sums = Tensor::cat(&sums, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(sums.into_iter().fold(0f64, |a, s| a + s).sqrt())
}

/// The factor that scales gradients of global norm `norm` to at most `max` (none when `max`
/// is 0 or the norm is within it).
pub fn clip_scale(norm: f64, max: f64) -> Option<f64> {
    (max > 0.0 && norm > max).then(|| max / (norm + 1e-6))
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
        opt.step(&mut p, &[Tensor::new(&[0.5f32, -1.0], &dev)?], 0.01, None)?;
        opt.step(&mut p, &[Tensor::new(&[0.25f32, 2.0], &dev)?], 0.02, None)?;
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
        let g = vec![Tensor::new(&[3.0f32], &dev)?, Tensor::new(&[4.0f32], &dev)?];
        let n = global_norm(&g)?;
        assert!((n - 5.0).abs() < 1e-9);
        assert_eq!(clip_scale(n, 0.0), None);
        assert_eq!(clip_scale(n, 6.0), None);
        let s = clip_scale(n, 1.0).expect("clipped");
        let clipped: Vec<Tensor> = g.iter().map(|g| g * s).collect::<candle_core::Result<_>>()?;
        assert!((global_norm(&clipped)? - 1.0).abs() < 1e-5);
        Ok(())
    }

    /// The packed buffer is reused while the parameter and moments in place are its views,
    /// and packed again once one is replaced (as a resume replaces them): both give the same
    /// values as a fresh optimizer fed the same state.
    #[test]
    fn replaced_state_is_packed_again() -> Result<()> {
        let cfg = AdamWConfig { weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8 };
        let dev = Device::Cpu;
        let g = [Tensor::new(&[[0.5f32, -1.0], [0.25, 2.0]], &dev)?];
        let mut p = vec![Tensor::new(&[[1.0f32, -2.0], [0.5, 3.0]], &dev)?];
        let mut opt = AdamW::new(cfg, &p)?;
        opt.step(&mut p, &g, 0.01, None)?;
        assert_eq!(p[0].dims(), [2, 2]);
        opt.step(&mut p, &g, 0.01, Some(0.5))?;
        // A resume: the same values, as new tensors.
        let mut q = vec![p[0].copy()?];
        let mut fresh = AdamW::new(cfg, &q)?;
        (fresh.m[0], fresh.v[0], fresh.t) = (opt.m[0].copy()?, opt.v[0].copy()?, opt.t);
        opt.m[0] = opt.m[0].copy()?;
        opt.step(&mut p, &g, 0.02, None)?;
        fresh.step(&mut q, &g, 0.02, None)?;
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&p[0]), flat(&q[0]));
        assert_eq!(flat(&opt.v[0]), flat(&fresh.v[0]));
        Ok(())
    }
}
