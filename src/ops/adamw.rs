//! One AdamW update of a float32 parameter as one op, in place: the parameter and its two
//! moments sit in one buffer [p | m | v], and the gradient (scaled first when it is clipped)
//! updates all three. A recovery step updates a few hundred small tensors (adapters, convs,
//! norms); as candle ops each took sixteen launches and as many allocations, and the step waited
//! on them.
//!
//! The update is candle's op for op: the same float32 operations in the same order, each
//! constant rounded to float32 as candle's `affine` rounds it (`x * c` is `x·c + 0`, `x / c` is
//! `x·(1/c) + 0`, `x + c` is `x·1 + c`). The CUDA kernel spells every rounding out, so that no
//! multiply-add is fused, and both halves give the bits the candle ops gave.

use super::{contiguous, cpu_slice};
use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};

/// The float32 constants of one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Update {
    /// Scale of the gradient (the clipping factor), when it is clipped.
    pub clip: Option<f32>,
    pub b1: f32,
    pub one_minus_b1: f32,
    pub b2: f32,
    pub one_minus_b2: f32,
    /// 1 / (1 − β₁ᵗ) and 1 / (1 − β₂ᵗ).
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub eps: f32,
    /// 1 − lr · weight decay.
    pub decay: f32,
    pub lr: f32,
}

impl Update {
    /// Update `t` (from 1) with betas `b1`, `b2`, `eps`, learning rate `lr`, weight decay `wd`
    /// and the gradients scaled by `clip`, each constant made as candle's `affine` makes it from
    /// the float64 expression.
    pub fn new(b1: f64, b2: f64, eps: f64, t: u64, lr: f64, wd: f64, clip: Option<f64>) -> Self {
        let (bc1, bc2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
        Self {
            clip: clip.map(|s| s as f32),
            b1: b1 as f32,
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            inv_bc1: (1.0 / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            eps: eps as f32,
            decay: (1.0 - lr * wd) as f32,
            lr: lr as f32,
        }
    }

    /// The parameter, first and second moments after one update from `(p, m, v)` with gradient
    /// `g`.
    fn apply(&self, p: f32, m: f32, v: f32, g: f32) -> (f32, f32, f32) {
        let g = match self.clip {
            Some(s) => g * s + 0.0,
            None => g,
        };
        let m = (m * self.b1 + 0.0) + (g * self.one_minus_b1 + 0.0);
        let v = (v * self.b2 + 0.0) + ((g * g) * self.one_minus_b2 + 0.0);
        let m_hat = m * self.inv_bc1 + 0.0;
        let denom = (v * self.inv_bc2 + 0.0).sqrt() * 1.0 + self.eps;
        let decayed = p * self.decay + 0.0;
        (decayed - ((m_hat / denom) * self.lr + 0.0), m, v)
    }
}

/// Update `state` [3n] (float32 p | m | v, contiguous) in place from the gradient `g` [n]
/// (float32, contiguous).
pub fn update(state: &Tensor, g: &Tensor, u: Update) -> Result<()> {
    if state.elem_count() != 3 * g.elem_count() {
        candle_core::bail!("adamw: state of {} elements for a gradient of {}", state.elem_count(), g.elem_count());
    }
    state.inplace_op2(g, &u)
}

impl InplaceOp2 for Update {
    fn name(&self) -> &'static str {
        "statecut-adamw"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, sl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let g = cpu_slice(g, gl, "adamw gradient")?;
        let (a, b) = contiguous(sl, "adamw state")?;
        let CpuStorage::F32(s) = s else { candle_core::bail!("adamw: the state is not float32") };
        let (p, mv) = s[a..b].split_at_mut(g.len());
        let (m, v) = mv.split_at_mut(g.len());
        for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            (*p, *m, *v) = self.apply(*p, *m, *v, *g);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        sl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let k = [
            self.b1,
            self.one_minus_b1,
            self.b2,
            self.one_minus_b2,
            self.inv_bc1,
            self.inv_bc2,
            self.eps,
            self.decay,
            self.lr,
        ];
        super::cuda::adamw(s, sl, (g, gl), self.clip, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use rand::{Rng, SeedableRng};

    /// AdamW as candle ops, as the optimizer ran it before this op.
    fn by_ops(
        p: &Tensor,
        m: &Tensor,
        v: &Tensor,
        g: &Tensor,
        u: (f64, f64, f64, u64, f64, f64, Option<f64>),
    ) -> Vec<Tensor> {
        let (b1, b2, eps, t, lr, wd, clip) = u;
        let g = match clip {
            Some(s) => (g * s).unwrap(),
            None => g.clone(),
        };
        let (bc1, bc2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
        let m = ((m * b1).unwrap() + (&g * (1.0 - b1)).unwrap()).unwrap();
        let v = ((v * b2).unwrap() + (g.sqr().unwrap() * (1.0 - b2)).unwrap()).unwrap();
        let m_hat = (&m / bc1).unwrap();
        let denom = ((&v / bc2).unwrap().sqrt().unwrap() + eps).unwrap();
        let decayed = (p * (1.0 - lr * wd)).unwrap();
        let p = (decayed - ((m_hat / denom).unwrap() * lr).unwrap()).unwrap();
        vec![p, m, v]
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// Bit for bit what the candle ops give, over values that include zeros of both signs,
    /// tiny and large gradients, with and without clipping, at several update counts.
    #[test]
    fn update_is_the_candle_ops_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let n = 257;
        let mut draw = |scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| match i % 17 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => 1e-30,
                    _ => rng.random_range(-scale..scale),
                })
                .collect()
        };
        for (t, lr, clip) in [(1, 1e-4, None), (2, 3e-4, Some(0.37)), (40, 1e-3, None), (1000, 2e-5, Some(1.0))] {
            let p = Tensor::from_vec(draw(1.0), n, &dev)?;
            let m = Tensor::from_vec(draw(1e-3), n, &dev)?;
            let v = Tensor::from_vec(draw(1e-6), n, &dev)?.abs()?;
            let g = Tensor::from_vec(draw(10.0), n, &dev)?;
            let want = by_ops(&p, &m, &v, &g, (0.9, 0.95, 1e-15, t, lr, 0.1, clip));
            let state = Tensor::cat(&[&p, &m, &v], 0)?;
            update(&state, &g, Update::new(0.9, 0.95, 1e-15, t, lr, 0.1, clip))?;
            for (k, w) in want.iter().enumerate() {
                assert_eq!(bits(&state.narrow(0, k * n, n)?), bits(w), "t {t}: part {k}");
            }
        }
        Ok(())
    }

    #[test]
    fn mismatched_sizes_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let state = Tensor::zeros(9, DType::F32, &dev)?;
        assert!(update(&state, &Tensor::zeros(4, DType::F32, &dev)?, Update::new(0.9, 0.95, 1e-8, 1, 1e-3, 0.0, None))
            .is_err());
        Ok(())
    }
}
