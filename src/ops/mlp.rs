//! SwiGLU's activation as one op over the stacked gate|up projection's output (the layer
//! itself is `layers::mlp::SwiGlu`).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

/// silu(gate) · up of x [.., 2n] = [gate | up] by [`Swiglu`] (no backward).
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    gate_up.apply_op1_no_bwd(&Swiglu)
}

/// silu(gate) · up on [.., 2n] = [gate | up], in float32, rounded once: the stacked
/// projection's activation in one pass.
pub struct Swiglu;

impl Swiglu {
    fn rows<T: WithDType>(x: &[T], n: usize) -> Vec<T> {
        let mut y = Vec::with_capacity(x.len() / 2);
        for r in x.chunks_exact(2 * n) {
            for i in 0..n {
                let g = r[i].to_f64() as f32;
                y.push(T::from_f64((g / (1.0 + (-g).exp()) * r[n + i].to_f64() as f32) as f64));
            }
        }
        y
    }

    fn shape(l: &Layout) -> Result<(Shape, usize, usize)> {
        let dims = l.dims();
        let two_n = dims.last().copied().unwrap_or(0);
        if !two_n.is_multiple_of(2) || two_n == 0 {
            candle_core::bail!("swiglu: last dimension {two_n} is not [gate | up]");
        }
        let mut out = dims.to_vec();
        *out.last_mut().expect("non-empty") = two_n / 2;
        Ok((Shape::from(out), l.shape().elem_count() / two_n, two_n / 2))
    }
}

impl CustomOp1 for Swiglu {
    fn name(&self) -> &'static str {
        "statecut-swiglu"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (shape, _, n) = Self::shape(l)?;
        let (s, e) = super::contiguous(l, "swiglu")?;
        let out = match x {
            CpuStorage::F32(x) => CpuStorage::F32(Self::rows(&x[s..e], n)),
            CpuStorage::BF16(x) => CpuStorage::BF16(Self::rows(&x[s..e], n)),
            CpuStorage::F16(x) => CpuStorage::F16(Self::rows(&x[s..e], n)),
            _ => candle_core::bail!("swiglu: unsupported dtype"),
        };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (shape, rows, n) = Self::shape(l)?;
        Ok((super::cuda::swiglu(x, l, rows, n)?, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The fused activation equals silu(gate) · up in float32, rounded once.
    #[test]
    fn swiglu_matches_silu_times_up() -> Result<()> {
        let x = Tensor::randn(0f32, 2.0, (3, 1, 2 * 7), &Device::Cpu)?;
        let fused = x.apply_op1_no_bwd(&Swiglu)?;
        let (g, u) = (x.narrow(2, 0, 7)?, x.narrow(2, 7, 7)?);
        let reference = (candle_nn::ops::silu(&g)? * u)?;
        let diff = (fused - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "swiglu differs by {diff}");
        // bf16: one rounding of the float32 value
        let xb = x.to_dtype(DType::BF16)?;
        let fused = xb.apply_op1_no_bwd(&Swiglu)?.to_dtype(DType::F32)?;
        let exact = x_bf16_reference(&xb)?;
        assert_eq!(fused.flatten_all()?.to_vec1::<f32>()?, exact);
        assert!(x.narrow(2, 0, 3)?.apply_op1_no_bwd(&Swiglu).is_err(), "an odd width is not [gate | up]");
        Ok(())
    }

    fn x_bf16_reference(xb: &Tensor) -> Result<Vec<f32>> {
        let x = xb.to_dtype(DType::F32)?;
        let (g, u) = (x.narrow(2, 0, 7)?, x.narrow(2, 7, 7)?);
        (candle_nn::ops::silu(&g)? * u)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    }
}
