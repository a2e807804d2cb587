//! The recovery loss's per-row terms as one op over a chunk of logits: the cross-entropy of the
//! targets and KL(teacher ‖ student) at a temperature, float32 inside whatever the logits'
//! dtype. Written as candle ops the two take some twenty float32 passes over [rows, vocabulary]
//! each way; the op reads the logits once forward and once backward.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

// Columns of the op's output per row: ce, kl, then the log-sum-exps the backward reads
// (student at 1, student at T, teacher at T).
use super::launch::KD_STATS as STATS;

/// Per-row (ce, kl) [R, 2] float32 of student logits [R, V] against targets [R] (u32) and,
/// with a teacher [R, V] (same dtype), KL(softmax(t/T) ‖ softmax(s/T)) at `temperature`
/// (0 without one). Differentiable in the student's logits only.
pub fn kd_rows(student: &Tensor, teacher: Option<&Tensor>, targets: &Tensor, temperature: f64) -> Result<Tensor> {
    if temperature <= 0.0 {
        candle_core::bail!("distillation temperature {temperature} must be positive");
    }
    let s = student.contiguous()?;
    let t = match teacher {
        Some(t) => t.detach().contiguous()?,
        // Never read: the student stands in for the pointer.
        None => s.detach(),
    };
    let op = KdRows { inv_temp: (1.0 / temperature) as f32, kd: teacher.is_some() };
    let out = s.apply_op3(&t, &targets.contiguous()?, op)?;
    out.narrow(1, 0, 2)
}

/// The forward over (student, teacher, targets): rows of [`STATS`] float32. The CPU half defines
/// it; the CUDA half is `kd_rows` in cuda/distill.cu.
struct KdRows {
    inv_temp: f32,
    kd: bool,
}

impl KdRows {
    /// Rows and vocabulary, with the three inputs' shapes checked against each other.
    fn dims(sl: &Layout, tl: &Layout, yl: &Layout) -> Result<(usize, usize)> {
        let (r, v) = sl.shape().dims2()?;
        if tl.shape() != sl.shape() || yl.shape().dims() != [r] {
            candle_core::bail!(
                "distillation loss: student {:?}, teacher {:?}, targets {:?}",
                sl.shape(),
                tl.shape(),
                yl.shape()
            );
        }
        Ok((r, v))
    }

    /// One row's [`STATS`], float32 as the kernel computes them (max first here, online there).
    fn row<T: WithDType>(&self, s: &[T], t: &[T], y: u32) -> [f32; STATS] {
        let f = |x: &T| x.to_f64() as f32;
        let it = self.inv_temp;
        let m = s.iter().map(f).fold(f32::NEG_INFINITY, f32::max);
        let (mut s1, mut st) = (0f32, 0f32);
        for x in s.iter().map(f) {
            s1 += (x - m).exp();
            st += ((x - m) * it).exp();
        }
        let lse1 = m + s1.ln();
        let lse_s = m * it + st.ln();
        let ce = s.get(y as usize).map_or(f32::NAN, |x| lse1 - f(x));
        if !self.kd {
            return [ce, 0.0, lse1, lse_s, 0.0];
        }
        let mt = t.iter().map(f).fold(f32::NEG_INFINITY, f32::max);
        let (mut tt, mut a) = (0f32, 0f32);
        for (xt, xs) in t.iter().map(f).zip(s.iter().map(f)) {
            let e = ((xt - mt) * it).exp();
            tt += e;
            a += e * (xt - xs) * it;
        }
        let lse_t = mt * it + tt.ln();
        // Σ p_t (log p_t − log q) = Σ p_t (t − s)/T − lse_t + lse_s, as Σ p_t = 1.
        [ce, a / tt - lse_t + lse_s, lse1, lse_s, lse_t]
    }

    fn rows<T: WithDType>(&self, s: &[T], t: &[T], y: &[u32], v: usize) -> Vec<f32> {
        let mut out = vec![0f32; y.len() * STATS];
        out.par_chunks_mut(STATS).enumerate().for_each(|(r, o)| {
            o.copy_from_slice(&self.row(&s[r * v..(r + 1) * v], &t[r * v..(r + 1) * v], y[r]));
        });
        out
    }
}

impl CustomOp3 for KdRows {
    fn name(&self) -> &'static str {
        "statecut-kd-rows"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        sl: &Layout,
        t: &CpuStorage,
        tl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (r, v) = Self::dims(sl, tl, yl)?;
        let slice = |lay: &Layout| super::contiguous(lay, "distillation loss");
        let ((ss, se), (ts, te), (ys, ye)) = (slice(sl)?, slice(tl)?, slice(yl)?);
        let CpuStorage::U32(y) = y else { candle_core::bail!("distillation loss: targets must be u32") };
        let y = &y[ys..ye];
        let out = match (s, t) {
            (CpuStorage::F32(s), CpuStorage::F32(t)) => self.rows(&s[ss..se], &t[ts..te], y, v),
            (CpuStorage::BF16(s), CpuStorage::BF16(t)) => self.rows(&s[ss..se], &t[ts..te], y, v),
            (CpuStorage::F16(s), CpuStorage::F16(t)) => self.rows(&s[ss..se], &t[ts..te], y, v),
            _ => candle_core::bail!("distillation loss: student and teacher logits must share a float dtype"),
        };
        Ok((CpuStorage::F32(out), Shape::from((r, STATS))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        sl: &Layout,
        t: &candle_core::CudaStorage,
        tl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, v) = Self::dims(sl, tl, yl)?;
        let out = super::cuda::kd_rows((s, sl), (t, tl), (y, yl), r, v, self.inv_temp, self.kd)?;
        Ok((out, Shape::from((r, STATS))))
    }

    /// d(student) from one [`KdRowsBwd`] pass; the teacher and the targets take none.
    fn bwd(
        &self,
        s: &Tensor,
        t: &Tensor,
        y: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Per row: the target (exact in float32 below 2^24), d ce, d kl, and the three lse.
        let aux =
            Tensor::cat(&[&y.to_dtype(DType::F32)?.unsqueeze(1)?, &grad.narrow(1, 0, 2)?, &res.narrow(1, 2, 3)?], 1)?
                .contiguous()?;
        let op = KdRowsBwd { inv_temp: self.inv_temp, kd: self.kd };
        Ok((Some(s.apply_op3_no_bwd(t, &aux, &op)?), None, None))
    }
}

/// Columns of [`KdRowsBwd`]'s per-row input: target, d ce, d kl, lse₁(s), lse_T(s), lse_T(t).
pub(crate) const AUX: usize = 6;

/// The backward of [`KdRows`] over (student, teacher, aux [R, AUX]):
/// ds = dce·(softmax(s) − onehot(y)) + dkl/T·(softmax(s/T) − softmax(t/T)), in the student's
/// dtype. The CUDA half is `kd_rows_bwd`.
struct KdRowsBwd {
    inv_temp: f32,
    kd: bool,
}

impl KdRowsBwd {
    fn rows<T: WithDType>(&self, s: &[T], t: &[T], aux: &[f32], v: usize) -> Vec<T> {
        let it = self.inv_temp;
        let mut out = vec![T::zero(); s.len()];
        out.par_chunks_mut(v).enumerate().for_each(|(r, o)| {
            let a = &aux[r * AUX..(r + 1) * AUX];
            let (y, dce, dkl, lse1, lse_s, lse_t) = (a[0] as usize, a[1], a[2], a[3], a[4], a[5]);
            for (j, oj) in o.iter_mut().enumerate() {
                let x = s[r * v + j].to_f64() as f32;
                let mut d = dce * ((x - lse1).exp() - if j == y { 1.0 } else { 0.0 });
                if self.kd {
                    let xt = t[r * v + j].to_f64() as f32;
                    d += dkl * it * ((x * it - lse_s).exp() - (xt * it - lse_t).exp());
                }
                *oj = T::from_f64(d as f64);
            }
        });
        out
    }
}

impl CustomOp3 for KdRowsBwd {
    fn name(&self) -> &'static str {
        "statecut-kd-rows-bwd"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        sl: &Layout,
        t: &CpuStorage,
        tl: &Layout,
        a: &CpuStorage,
        al: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, v) = sl.shape().dims2()?;
        let slice = |lay: &Layout| super::contiguous(lay, "distillation loss backward");
        let ((ss, se), (ts, te), (as_, ae)) = (slice(sl)?, slice(tl)?, slice(al)?);
        let CpuStorage::F32(a) = a else { candle_core::bail!("distillation loss backward: aux must be float32") };
        let a = &a[as_..ae];
        let out = match (s, t) {
            (CpuStorage::F32(s), CpuStorage::F32(t)) => CpuStorage::F32(self.rows(&s[ss..se], &t[ts..te], a, v)),
            (CpuStorage::BF16(s), CpuStorage::BF16(t)) => CpuStorage::BF16(self.rows(&s[ss..se], &t[ts..te], a, v)),
            (CpuStorage::F16(s), CpuStorage::F16(t)) => CpuStorage::F16(self.rows(&s[ss..se], &t[ts..te], a, v)),
            _ => candle_core::bail!("distillation loss backward: student and teacher logits must share a float dtype"),
        };
        Ok((out, sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        sl: &Layout,
        t: &candle_core::CudaStorage,
        tl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, v) = sl.shape().dims2()?;
        let out = super::cuda::kd_rows_bwd((s, sl), (t, tl), (a, al), r, v, self.inv_temp, self.kd)?;
        Ok((out, sl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};
    use candle_nn::ops::log_softmax;

    /// (ce, kl) per row in separate candle ops: the form the op replaces.
    fn kd_rows_ops(s: &Tensor, t: Option<&Tensor>, y: &Tensor, temp: f64) -> Result<Tensor> {
        let s = s.to_dtype(DType::F32)?;
        let ce = log_softmax(&s, D::Minus1)?.gather(&y.unsqueeze(1)?, 1)?.neg()?;
        let kl = match t {
            Some(t) => {
                let logq = log_softmax(&(&s / temp)?, D::Minus1)?;
                let logp = log_softmax(&(t.to_dtype(DType::F32)? / temp)?, D::Minus1)?;
                (logp.exp()? * (&logp - logq)?)?.sum_keepdim(1)?
            }
            None => ce.zeros_like()?,
        };
        Tensor::cat(&[ce, kl], 1)
    }

    /// The op's values and student gradient equal the candle-ops form's, with and without a
    /// teacher, in float32 and (over the same rounded logits) bf16, for weights on both terms.
    #[test]
    fn kd_rows_match_candle_ops() -> Result<()> {
        let dev = Device::Cpu;
        let (r, v) = (6, 1000);
        let y = Tensor::new(&[3u32, 999, 0, 500, 17, 42], &dev)?;
        let w = Tensor::new(&[[1.3f32, 0.7]], &dev)?;
        for dtype in [DType::F32, DType::BF16] {
            for kd in [true, false] {
                let round = |t: Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
                let s = Var::from_tensor(&round((Tensor::randn(0f32, 1.0, (r, v), &dev)? * 3.0)?)?)?;
                let t = round((Tensor::randn(0f32, 1.0, (r, v), &dev)? * 3.0)?)?;
                let teacher = kd.then(|| t.to_dtype(dtype)).transpose()?;
                let fast = kd_rows(&s.as_tensor().to_dtype(dtype)?, teacher.as_ref(), &y, 2.0)?;
                let slow = kd_rows_ops(s.as_tensor(), kd.then_some(&t), &y, 2.0)?;
                let err = (&fast - &slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(err < 1e-4, "{dtype:?} kd {kd}: values differ by {err}");
                let grad = |rows: &Tensor| -> Result<Tensor> {
                    let g = rows.broadcast_mul(&w)?.sum_all()?.backward()?;
                    g.get(s.as_tensor()).expect("gradient").to_dtype(DType::F32)
                };
                let (gf, gs) = (grad(&fast)?, grad(&slow)?);
                let scale = gs.abs()?.max_all()?.to_scalar::<f32>()?;
                let err = (gf - &gs)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(err < tol, "{dtype:?} kd {kd}: gradients differ by {err} (relative)");
            }
        }
        Ok(())
    }

    /// A target outside the vocabulary gives a NaN cross-entropy (a skipped step), not a read
    /// out of bounds.
    #[test]
    fn target_outside_the_vocabulary_is_nan() -> Result<()> {
        let s = Tensor::zeros((1, 4), DType::F32, &Device::Cpu)?;
        let rows = kd_rows(&s, None, &Tensor::new(&[4u32], &Device::Cpu)?, 1.0)?;
        assert!(rows.get(0)?.get(0)?.to_scalar::<f32>()?.is_nan());
        Ok(())
    }
}
