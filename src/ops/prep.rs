//! The delta-rule recurrence's float32 inputs from the short conv's output in one pass: q and k
//! L2-normed per key head and repeated for the value heads that read it, v widened. Separate
//! candle ops take six passes over the same data (two copies out of the stacked output, two
//! widenings, two norms) and a seventh for v.

pub use super::launch::QkvPrep;
use super::Rows;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

impl QkvPrep {
    /// Floats written for `rows` rows: q and k [rows, Hv, dk], v [rows, Hv, dv].
    pub(crate) fn out_len(&self, rows: usize) -> usize {
        rows * self.v_heads * (2 * self.dk + self.dv)
    }

    fn width(&self) -> usize {
        2 * self.heads * self.dk + self.v_heads * self.dv
    }

    /// q, k [B, T, Hv, dk] and v [B, T, Hv, dv], float32 and contiguous, from x [B, T, width]
    /// (which may be a column slice of a wider matrix).
    pub fn run(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, c) = x.dims3()?;
        if c != self.width() || self.heads == 0 || !self.v_heads.is_multiple_of(self.heads) {
            candle_core::bail!(
                "recurrence inputs: width {c} is not [q | k | v] of {} x {} key and {} x {} value heads",
                self.heads,
                self.dk,
                self.v_heads,
                self.dv
            );
        }
        let flat = super::as_rows(x)?.apply_op1_no_bwd(self)?;
        let (nk, nv) = (b * t * self.v_heads * self.dk, b * t * self.v_heads * self.dv);
        let q = flat.narrow(0, 0, nk)?.reshape((b, t, self.v_heads, self.dk))?;
        let k = flat.narrow(0, nk, nk)?.reshape((b, t, self.v_heads, self.dk))?;
        let v = flat.narrow(0, 2 * nk, nv)?.reshape((b, t, self.v_heads, self.dv))?;
        Ok((q, k, v))
    }

    fn rows_cpu<T: WithDType>(&self, x: &[T], xs: usize, rows: usize) -> Vec<f32> {
        let (h, hv, dk, dv) = (self.heads, self.v_heads, self.dk, self.dv);
        let r = hv / h;
        let mut out = vec![0f32; self.out_len(rows)];
        let (qk_n, kd) = (rows * hv * dk, h * dk);
        for row in 0..rows {
            let xr = &x[row * xs..row * xs + self.width()];
            let f = |i: usize| xr[i].to_f64() as f32;
            for kh in 0..h {
                for (part, base) in [(0, kh * dk), (1, kd + kh * dk)] {
                    let ss: f32 = (0..dk).map(|i| f(base + i).powi(2)).sum();
                    let norm = (ss + self.eps).sqrt();
                    for j in 0..r {
                        let o = part * qk_n + (row * hv + kh * r + j) * dk;
                        for i in 0..dk {
                            out[o + i] = f(base + i) / norm;
                        }
                    }
                }
            }
            let v0 = 2 * qk_n + row * hv * dv;
            for j in 0..hv * dv {
                out[v0 + j] = f(2 * kd + j);
            }
        }
        out
    }
}

impl CustomOp1 for QkvPrep {
    fn name(&self) -> &'static str {
        "statecut-qkv-prep"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Rows { offset: o, stride: xs, rows, .. } = Rows::of(l, "recurrence inputs")?;
        let out = match x {
            CpuStorage::F32(x) => self.rows_cpu(&x[o..], xs, rows),
            CpuStorage::BF16(x) => self.rows_cpu(&x[o..], xs, rows),
            CpuStorage::F16(x) => self.rows_cpu(&x[o..], xs, rows),
            _ => candle_core::bail!("recurrence inputs: unsupported dtype"),
        };
        Ok((CpuStorage::F32(out), Shape::from(self.out_len(rows))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let r = Rows::of(l, "recurrence inputs")?;
        Ok((super::cuda::qkv_prep(x, (r.offset, r.stride), r.rows, self)?, Shape::from(self.out_len(r.rows))))
    }
}

/// Per-column sums of squares over chunks of [`ColumnSquares::CHUNK`] rows, float32
/// [chunks, n], for x [.., n] in rows of one stride. [`column_sums_of_squares`] adds the chunks.
pub struct ColumnSquares;

impl ColumnSquares {
    pub const CHUNK: usize = 256;

    fn cpu<T: WithDType>(x: &[T], xs: usize, rows: usize, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows.div_ceil(Self::CHUNK) * n);
        for r0 in (0..rows).step_by(Self::CHUNK) {
            for c in 0..n {
                let mut s = 0f32;
                for r in r0..(r0 + Self::CHUNK).min(rows) {
                    let v = x[r * xs + c].to_f64() as f32;
                    s += v * v;
                }
                out.push(s);
            }
        }
        out
    }
}

impl CustomOp1 for ColumnSquares {
    fn name(&self) -> &'static str {
        "statecut-column-squares"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Rows { offset: o, stride: xs, rows, width: n } = Rows::of(l, "column sums")?;
        let out = match x {
            CpuStorage::F32(x) => Self::cpu(&x[o..], xs, rows, n),
            CpuStorage::BF16(x) => Self::cpu(&x[o..], xs, rows, n),
            CpuStorage::F16(x) => Self::cpu(&x[o..], xs, rows, n),
            _ => candle_core::bail!("column sums: unsupported dtype"),
        };
        Ok((CpuStorage::F32(out), Shape::from((rows.div_ceil(Self::CHUNK), n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let Rows { offset, stride, rows, width: n } = Rows::of(l, "column sums")?;
        let out = super::cuda::col_sumsq(x, (offset, stride), rows, n, Self::CHUNK)?;
        Ok((out, Shape::from((rows.div_ceil(Self::CHUNK), n))))
    }
}

/// Σ over rows of x² for each column of x [.., n] (float32 [n]): the chunks' sums added in
/// order, so the result is the same on every run.
pub fn column_sums_of_squares(x: &Tensor) -> Result<Tensor> {
    super::as_rows(x)?.apply_op1_no_bwd(&ColumnSquares)?.sum(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::norm::l2_norm;
    use crate::ops::repeat_heads;
    use candle_core::{DType, Device};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// One pass equals the separate ops the layer runs on the CPU: slices of [q | k | v], L2
    /// norms in float32, key heads repeated for their value heads, v widened; also on a column
    /// slice of a wider matrix and in bf16.
    #[test]
    fn qkv_prep_matches_separate_ops() -> Result<()> {
        let (h, hv, dk, dv) = (2, 4, 8, 6);
        let p = QkvPrep { heads: h, v_heads: hv, dk, dv, eps: 1e-6 };
        let wide = Tensor::randn(0f32, 1.0, (2, 5, p.width() + 3), &Device::Cpu)?;
        for x in [wide.narrow(2, 0, p.width())?, wide.narrow(2, 0, p.width())?.contiguous()?] {
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype)?;
                let (q, k, v) = p.run(&x)?;
                let part = |off: usize, heads: usize, d: usize| -> Result<Tensor> {
                    x.narrow(2, off, heads * d)?.reshape((2, 5, heads, d))?.to_dtype(DType::F32)
                };
                let rq = repeat_heads(&l2_norm(&part(0, h, dk)?, 1e-6)?, hv / h)?;
                let rk = repeat_heads(&l2_norm(&part(h * dk, h, dk)?, 1e-6)?, hv / h)?;
                let rv = part(2 * h * dk, hv, dv)?;
                assert!(q.is_contiguous() && k.is_contiguous() && v.is_contiguous());
                assert!(max_diff(&q, &rq) < 1e-6 && max_diff(&k, &rk) < 1e-6, "q/k differ ({dtype:?})");
                assert_eq!(max_diff(&v, &rv), 0.0);
            }
        }
        assert!(p.run(&wide).is_err(), "a width that is not [q | k | v] is refused");
        Ok(())
    }

    /// Column sums of squares over chunks equal the plain sum, on more rows than one chunk and
    /// on a column slice.
    #[test]
    fn column_sums_match_plain_sum() -> Result<()> {
        let wide = Tensor::randn(0f32, 1.0, (3, 200, 7), &Device::Cpu)?;
        let x = wide.narrow(2, 1, 5)?;
        let sums = column_sums_of_squares(&x)?;
        let plain = x.sqr()?.reshape((600, 5))?.sum(0)?;
        let rel = max_diff(&sums, &plain) / plain.max_all()?.to_scalar::<f32>()?;
        assert!(rel < 1e-5, "column sums differ by {rel}");
        assert_eq!(x.apply_op1_no_bwd(&ColumnSquares)?.dims(), &[3, 5]);
        Ok(())
    }
}
