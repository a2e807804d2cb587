//! a + b for two tensors of one shape and dtype, as an op whose GPU half reads and writes 16
//! bytes a thread (`add_packs`): candle's add kernel takes an element a thread and ran at under
//! half the memory bandwidth. Where most large sums happen:
//! - the residual add that ends a decoder layer ([`add`]);
//! - the backward's sums of the gradients of a tensor with several readers ([`grad_sum`],
//!   which candle's backward calls once [`use_for_gradients`] has installed it, as the
//!   statecut binary does at start).
//!
//! Each element is rounded once, as candle's add rounds it, so results are the same bits.

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// a + b, differentiable in both (the gradient reaches each as it is).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !same(a, b) {
        return a + b;
    }
    a.apply_op2(b, Add)
}

/// a + b without a gradient: the sum of two gradients of one tensor in candle's backward.
pub fn grad_sum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !same(a, b) {
        return a + b;
    }
    a.apply_op2_no_bwd(b, &Add)
}

/// Let candle's backward sum a tensor's gradients with [`grad_sum`] (once per process).
pub fn use_for_gradients() {
    candle_core::backprop::set_grad_sum(grad_sum);
}

/// Whether the op applies: one shape, dtype and device (candle's add reports anything else).
fn same(a: &Tensor, b: &Tensor) -> bool {
    a.shape() == b.shape() && a.dtype() == b.dtype() && a.device().same_device(b.device())
}

struct Add;

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "statecut-add"
    }

    fn cpu_fwd(&self, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((a.binary_impl::<candle_core::op::Add>(b, al, bl)?, al.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda_sum(a, al, b, bl)?, al.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// a + b on the GPU by `add_packs`; strided inputs, dtypes it has no kernel for (float64: the
/// composed per-key-channel recurrence sums its gradients in it), or counts and offsets that do
/// not allow 16 bytes a thread take candle's kernel. Either way each sum is rounded once, as
/// candle rounds it.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_sum(
    a: &candle_core::CudaStorage,
    al: &Layout,
    b: &candle_core::CudaStorage,
    bl: &Layout,
) -> Result<candle_core::CudaStorage> {
    let packed = match al.is_contiguous() && bl.is_contiguous() {
        true => super::cuda::add_packs((a, al), (b, bl))?,
        false => None,
    };
    match packed {
        Some(sum) => Ok(sum),
        None => a.binary_impl::<candle_core::op::Add>(b, al, bl),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// The op's sums equal candle's add bit for bit in each dtype, strided inputs included.
    #[test]
    fn sums_equal_candles_add() -> Result<()> {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 3.0, (5, 37), &dev)?;
        let b = (Tensor::randn(0f32, 1e-3, (5, 37), &dev)? + 1e-7)?;
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let (a, b) = (a.to_dtype(dt)?, b.to_dtype(dt)?);
            assert_eq!(bits(&add(&a, &b)?), bits(&(&a + &b)?), "{dt:?}");
            assert_eq!(bits(&grad_sum(&a, &b)?), bits(&(&a + &b)?), "{dt:?}");
            let (at, bt) = (a.t()?, b.t()?);
            assert_eq!(bits(&add(&at, &bt)?), bits(&(&at + &bt)?), "{dt:?} transposed");
        }
        // Shapes that differ go to candle's add, which reports them.
        assert!(add(&a, &a.narrow(1, 0, 3)?).is_err());
        Ok(())
    }

    /// Both inputs get the sum's gradient, also where one tensor reaches the sum twice and
    /// through another reader (the backward then sums its gradients).
    #[test]
    fn gradient_reaches_both_inputs() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 6), &dev)?)?;
        let y = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 6), &dev)?)?;
        let w = Tensor::randn(0f32, 1.0, (4, 6), &dev)?;
        let loss = |s: Tensor| -> Result<Tensor> { ((s * &w)? + x.as_tensor().sqr()?)?.sum_all() };
        let got = loss(add(&add(x.as_tensor(), y.as_tensor())?, x.as_tensor())?)?.backward()?;
        let want = loss(((x.as_tensor() + y.as_tensor())? + x.as_tensor())?)?.backward()?;
        for v in [&x, &y] {
            assert_eq!(bits(got.get(v.as_tensor()).unwrap()), bits(want.get(v.as_tensor()).unwrap()));
        }
        Ok(())
    }
}
