//! SwiGLU's activation as one op over the stacked gate|up projection's output (the layer
//! itself is `layers::mlp::SwiGlu`).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};

/// silu(gate) · up of x [.., 2n] = [gate | up] by [`Swiglu`] (no backward).
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    gate_up.apply_op1_no_bwd(&Swiglu)
}

/// [`swiglu`], differentiable: its backward is [`SwigluBwd`], one pass where candle's ops
/// take some ten over the intermediate activations.
pub fn swiglu_grad(gate_up: &Tensor) -> Result<Tensor> {
    gate_up.contiguous()?.apply_op1(Swiglu)
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

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dy = grad.to_dtype(x.dtype())?.contiguous()?;
        Ok(Some(x.contiguous()?.apply_op2_no_bwd(&dy, &SwigluBwd)?))
    }
}

/// The backward of [`Swiglu`] over (x = [gate | up], dy): d[gate | up] = [dy · up · silu'(gate)
/// | dy · silu(gate)], float32 inside, in x's dtype. The CUDA half is `swiglu_bwd`.
struct SwigluBwd;

impl SwigluBwd {
    fn rows<T: WithDType>(x: &[T], dy: &[T], n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(x.len());
        for (r, d) in x.chunks_exact(2 * n).zip(dy.chunks_exact(n)) {
            let sig = |i: usize| 1.0 / (1.0 + (-(r[i].to_f64() as f32)).exp());
            for i in 0..n {
                let (g, up, d) = (r[i].to_f64() as f32, r[n + i].to_f64() as f32, d[i].to_f64() as f32);
                out.push(T::from_f64((d * up * sig(i) * (1.0 + g * (1.0 - sig(i)))) as f64));
            }
            for i in 0..n {
                out.push(T::from_f64((d[i].to_f64() as f32 * r[i].to_f64() as f32 * sig(i)) as f64));
            }
        }
        out
    }
}

impl candle_core::CustomOp2 for SwigluBwd {
    fn name(&self) -> &'static str {
        "statecut-swiglu-bwd"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, dy: &CpuStorage, dyl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, _, n) = Swiglu::shape(xl)?;
        let ((s, e), (ds, de)) =
            (super::contiguous(xl, "swiglu backward")?, super::contiguous(dyl, "swiglu backward")?);
        let out = match (x, dy) {
            (CpuStorage::F32(x), CpuStorage::F32(d)) => CpuStorage::F32(Self::rows(&x[s..e], &d[ds..de], n)),
            (CpuStorage::BF16(x), CpuStorage::BF16(d)) => CpuStorage::BF16(Self::rows(&x[s..e], &d[ds..de], n)),
            (CpuStorage::F16(x), CpuStorage::F16(d)) => CpuStorage::F16(Self::rows(&x[s..e], &d[ds..de], n)),
            _ => candle_core::bail!("swiglu backward: x and gradient must share a float dtype"),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (_, rows, n) = Swiglu::shape(xl)?;
        Ok((super::cuda::swiglu_bwd((x, xl), (dy, dyl), rows, n)?, xl.shape().clone()))
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
        // candle's silu and the op's may differ in the last float32 bit, which can move a value
        // that lies on a bf16 rounding boundary by one bf16 step: allow that, no more.
        for (a, b) in fused.flatten_all()?.to_vec1::<f32>()?.iter().zip(&exact) {
            assert!((a - b).abs() <= b.abs() * 2f32.powi(-7), "bf16 swiglu {a} vs {b}");
        }
        assert!(x.narrow(2, 0, 3)?.apply_op1_no_bwd(&Swiglu).is_err(), "an odd width is not [gate | up]");
        Ok(())
    }

    fn x_bf16_reference(xb: &Tensor) -> Result<Vec<f32>> {
        let x = xb.to_dtype(DType::F32)?;
        let (g, u) = (x.narrow(2, 0, 7)?, x.narrow(2, 7, 7)?);
        (candle_nn::ops::silu(&g)? * u)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    }

    /// The differentiable activation's gradient (its backward, [`SwigluBwd`], whose CPU half is
    /// the reference for `swiglu_bwd`) equals that of silu(gate) · up in candle ops.
    #[test]
    fn swiglu_gradient_matches_candle_ops() -> Result<()> {
        let x = candle_core::Var::from_tensor(&Tensor::randn(0f32, 2.0, (3, 4, 2 * 9), &Device::Cpu)?)?;
        let g = Tensor::randn(0f32, 1.0, (3, 4, 9), &Device::Cpu)?;
        let fast = swiglu_grad(x.as_tensor())?;
        let (gate, up) = (x.as_tensor().narrow(2, 0, 9)?, x.as_tensor().narrow(2, 9, 9)?);
        let slow = (candle_nn::ops::silu(&gate)? * up)?;
        let gf = (&fast * &g)?.sum_all()?.backward()?;
        let gs = (&slow * &g)?.sum_all()?.backward()?;
        let diff = (gf.get(x.as_tensor()).unwrap() - gs.get(x.as_tensor()).unwrap())?.abs()?.max_all()?;
        assert!(diff.to_scalar::<f32>()? < 1e-5, "swiglu gradient differs by {diff}");
        Ok(())
    }
}
