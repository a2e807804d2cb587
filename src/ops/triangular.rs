//! (I − A)⁻¹ of strictly lower triangular matrices, by forward substitution in float32: the
//! intra-chunk solve of the chunked delta rule, as fla computes it.
//!
//! Row by row, T_i = e_i + Σ_{j<i} A_ij T_j. Its backward needs no solve: with T = (I − A)⁻¹,
//! dT = T dA T, so the gradient of A is Tᵀ G Tᵀ (matmuls), of which only the strictly lower
//! part reaches A (its mask's backward drops the rest).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// (I − A)⁻¹ of every strictly lower triangular A [.., C, C] (entries on and above the diagonal
/// are ignored), float32, differentiable.
pub(crate) fn unit_lower_inverse(a: &Tensor) -> Result<Tensor> {
    a.to_dtype(DType::F32)?.contiguous()?.apply_op1(UnitLowerInverse)
}

struct UnitLowerInverse;

impl CustomOp1 for UnitLowerInverse {
    fn name(&self) -> &'static str {
        "statecut-unit-lower-inverse"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = l.dims().last().copied().unwrap_or(1);
        let (from, to) = super::contiguous(l, "triangular inverse")?;
        let a = &s.as_slice::<f32>()?[from..to];
        let mut out = vec![0f32; a.len()];
        out.par_chunks_mut(c * c).zip(a.par_chunks(c * c)).for_each(|(t, a)| {
            for i in 0..c {
                t[i * c + i] = 1.0;
                for j in 0..i {
                    let aij = a[i * c + j];
                    if aij != 0.0 {
                        for col in 0..=j {
                            t[i * c + col] += aij * t[j * c + col];
                        }
                    }
                }
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::unit_lower_inverse(s, l)
    }

    fn bwd(&self, _a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let tt = res.t()?;
        Ok(Some(tt.matmul(&grad.matmul(&tt)?)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// (I − A) T = I, and the gradient against finite differences in float64 terms.
    #[test]
    fn inverse_and_gradient() -> Result<()> {
        let dev = Device::Cpu;
        for c in [1, 5, 16, 64] {
            let strict: Vec<f32> = (0..c * c).map(|i| if i % c < i / c { 1.0 } else { 0.0 }).collect();
            let mask = Tensor::from_vec(strict, (c, c), &dev)?;
            let a = (Tensor::randn(0f32, 0.3, (3, c, c), &dev)?.broadcast_mul(&mask))?;
            let t = unit_lower_inverse(&a)?;
            let eye = Tensor::eye(c, DType::F32, &dev)?;
            let back = eye.broadcast_sub(&a)?.matmul(&t)?;
            let err = back.broadcast_sub(&eye)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-5, "C {c}: (I - A) T - I reaches {err}");

            let var = Var::from_tensor(&a)?;
            let w = Tensor::randn(0f32, 1.0, (3, c, c), &dev)?;
            let loss =
                |x: &Tensor| -> Result<Tensor> { (unit_lower_inverse(&x.broadcast_mul(&mask)?)? * &w)?.sum_all() };
            let g = loss(var.as_tensor())?.backward()?.get(var.as_tensor()).unwrap().clone();
            let (i, j) = (c - 1, 0);
            if i > j {
                let eps = 1e-2f32;
                let bump = |s: f32| -> Result<f32> {
                    let mut v = a.to_vec3::<f32>()?;
                    v[1][i][j] += s;
                    loss(&Tensor::new(v, &dev)?)?.to_scalar::<f32>()
                };
                let fd = (bump(eps)? - bump(-eps)?) / (2.0 * eps);
                let an = g.get(1)?.get(i)?.get(j)?.to_scalar::<f32>()?;
                assert!((fd - an).abs() < 2e-3 * (1.0 + an.abs()), "C {c}: dA[{i},{j}] {an} against {fd}");
            }
        }
        Ok(())
    }
}
