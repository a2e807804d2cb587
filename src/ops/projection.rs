//! Projections as ops with their own backward, the input's leading dimensions folded into rows
//! inside the op (so the graph holds no reshapes, each of which would add a full-size gradient
//! accumulation to the backward).
//! - By a frozen weight, differentiable in its input only. candle's matmul backward computes the
//!   gradient of both operands whatever needs them: behind a frozen weight that is a full product
//!   over the batch and a weight-sized sum per projection, thrown away.
//! - By a trained weight (recovery's adapted projections): the weight's gradient is one product
//!   over all rows. candle's batched matmul against the weight broadcast over sequences computes
//!   it per sequence, adds it up strided through the transpose's backward, then sums over
//!   sequences: three passes over a [B, out, in] tensor.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};

/// Whether x · wᵀ takes [`frozen_linear`]: off the CPU, a gradient flowing through x and none
/// into w, whose rows are contiguous.
pub fn takes_frozen(x: &Tensor, w: &Tensor) -> bool {
    !x.device().is_cpu() && w.is_contiguous() && !super::untracked(&[x]) && super::untracked(&[w])
}

/// x [.., in] · wᵀ for a weight [out, in] with contiguous rows that takes no gradient: one
/// product forward, one (dx = dy · w) backward. The leading dimensions fold into rows inside the
/// op, so the graph holds no reshapes either.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if x.dims().last() != Some(&inp) || !w.is_contiguous() {
        candle_core::bail!("frozen projection: input {:?}, weight [{out}, {inp}] (contiguous rows)", x.shape());
    }
    x.contiguous()?.apply_op1(FrozenLinear::new(w))
}

/// [`frozen_linear`]'s op, which ops ending in a frozen projection run inside their own
/// (`ops::norm`'s norm with its output projection).
pub(super) struct FrozenLinear(Tensor);

impl FrozenLinear {
    /// The projection by `w` [out, in] (contiguous rows), detached.
    pub(super) fn new(w: &Tensor) -> Self {
        Self(w.detach())
    }
}

/// One product: its sizes (batch, m, n, k), the two operands' layouts and the output's shape.
pub(super) type Plan = ((usize, usize, usize, usize), Layout, Layout, Shape);

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "statecut-frozen-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (bmnk, lhs, rhs, shape) = plan(l, self.0.layout())?;
        let (w, _) = self.0.storage_and_layout();
        let Storage::Cpu(w) = &*w else { candle_core::bail!("frozen projection: the weight is not on the CPU") };
        Ok((x.matmul(w, bmnk, &lhs, &rhs)?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (bmnk, lhs, rhs, shape) = plan(l, self.0.layout())?;
        let (w, _) = self.0.storage_and_layout();
        let Storage::Cuda(w) = &*w else { candle_core::bail!("frozen projection: the weight is not on the GPU") };
        Ok((x.matmul(w, bmnk, &lhs, &rhs)?, shape))
    }

    /// dx = dy · w, laid out as x (only x's shape is read).
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let out = self.0.dim(0)?;
        let rows = grad.elem_count() / out.max(1);
        let dx = grad.contiguous()?.reshape((rows, out))?.matmul(&self.0)?;
        Ok(Some(dx.reshape(x.shape())?))
    }
}

/// x [.., in] · wᵀ for a weight [out, in] with contiguous rows, differentiable in both: one
/// product forward; dx = dy · w and dw = dyᵀ · x over all rows backward (dx only where x
/// tracks a gradient, dw only where w does).
pub fn trained_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if x.dims().last() != Some(&inp) || !w.is_contiguous() {
        candle_core::bail!("projection: input {:?}, weight [{out}, {inp}] (contiguous rows)", x.shape());
    }
    x.contiguous()?.apply_op2(w, TrainedLinear)
}

/// [`trained_linear`] (or [`frozen_linear`] where the weight tracks no gradient), its output
/// linked to the one op that reads it (see `ops::link`): d(y) reaches this product's backward
/// without the zero-filled buffer and add that candle's graph gives each edge.
pub(crate) fn linked_linear(x: &Tensor, w: &Tensor) -> Result<super::link::Linked> {
    let (out, inp) = w.dims2()?;
    if x.dims().last() != Some(&inp) || !w.is_contiguous() {
        candle_core::bail!("projection: input {:?}, weight [{out}, {inp}] (contiguous rows)", x.shape());
    }
    let x = x.contiguous()?;
    match w.track_op() {
        true => super::link::link2(&x, w, TrainedLinear),
        false => super::link::link1(&x, FrozenLinear::new(w)),
    }
}

struct TrainedLinear;

impl CustomOp2 for TrainedLinear {
    fn name(&self) -> &'static str {
        "statecut-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (bmnk, lhs, rhs, shape) = plan(xl, wl)?;
        Ok((x.matmul(w, bmnk, &lhs, &rhs)?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (bmnk, lhs, rhs, shape) = plan(xl, wl)?;
        Ok((x.matmul(w, bmnk, &lhs, &rhs)?, shape))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (out, inp) = w.dims2()?;
        let rows = grad.elem_count() / out.max(1);
        let dy = grad.contiguous()?.reshape((rows, out))?;
        let dx = match x.track_op() {
            true => Some(dy.matmul(&w.detach())?.reshape(x.shape())?),
            false => None,
        };
        let dw = match w.track_op() {
            true => Some(dy.t()?.matmul(&x.detach().reshape((rows, inp))?)?),
            false => None,
        };
        Ok((dx, dw))
    }
}

/// The product's sizes (1, rows, out, in) for x [.., in] against a weight [out, in]: x's rows
/// as a [rows, in] layout at its offset, the weight's transpose [in, out], and the output's shape.
pub(super) fn plan(xl: &Layout, wl: &Layout) -> Result<Plan> {
    let (out, inp) = wl.shape().dims2()?;
    let rows = xl.shape().elem_count() / inp.max(1);
    let (start, _) = super::contiguous(xl, "projection")?;
    let lhs = Layout::contiguous_with_offset((rows, inp), start);
    let rhs = wl.transpose(0, 1)?;
    let mut dims = xl.dims().to_vec();
    *dims.last_mut().expect("checked: x has a last dimension") = out;
    Ok(((1, rows, out, inp), lhs, rhs, Shape::from(dims)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// The op's output and input gradient equal candle's matmul's, for 2-D and 3-D inputs, a
    /// weight that is a row view of a wider one, in float32 and bf16; a column view is refused.
    #[test]
    fn frozen_linear_matches_matmul() -> Result<()> {
        let dev = Device::Cpu;
        let wide = Tensor::randn(0f32, 1.0, (9, 6), &dev)?;
        let w = wide.narrow(0, 2, 5)?;
        for dtype in [DType::F32, DType::BF16] {
            for shape in [vec![7, 6], vec![2, 3, 6]] {
                let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape.as_slice(), &dev)?.to_dtype(dtype)?)?;
                let wd = w.to_dtype(dtype)?;
                let mut out = shape.clone();
                *out.last_mut().unwrap() = 5;
                let dy = Tensor::randn(0f32, 1.0, out.as_slice(), &dev)?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 5e-2 };
                let fast = frozen_linear(x.as_tensor(), &wd)?;
                let slow = x.as_tensor().broadcast_matmul(&wd.t()?)?;
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let err = (f(&fast)? - f(&slow)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(err < tol, "{dtype:?} {shape:?}: outputs differ by {err}");
                let grad = |y: &Tensor| -> Result<Tensor> {
                    let g = (f(y)? * &dy)?.sum_all()?.backward()?;
                    f(g.get(x.as_tensor()).expect("dx"))
                };
                let err = (grad(&fast)? - grad(&slow)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(err < tol, "{dtype:?} {shape:?}: input gradients differ by {err}");
            }
        }
        assert!(frozen_linear(&Tensor::zeros((2, 3), DType::F32, &dev)?, &wide.narrow(1, 0, 3)?).is_err());
        Ok(())
    }

    /// The trained projection's output and both gradients equal candle's matmul's, for 2-D and
    /// 3-D inputs and a weight that is a row view of a wider one, in float32 and bf16; with only
    /// one operand tracked, the other gets no gradient.
    #[test]
    fn trained_linear_matches_matmul() -> Result<()> {
        let dev = Device::Cpu;
        let wide = Tensor::randn(0f32, 1.0, (9, 6), &dev)?;
        for dtype in [DType::F32, DType::BF16] {
            for shape in [vec![7, 6], vec![2, 3, 6]] {
                let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape.as_slice(), &dev)?.to_dtype(dtype)?)?;
                let w = Var::from_tensor(&wide.narrow(0, 2, 5)?.to_dtype(dtype)?)?;
                let mut out = shape.clone();
                *out.last_mut().unwrap() = 5;
                let dy = Tensor::randn(0f32, 1.0, out.as_slice(), &dev)?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 5e-2 };
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let diff =
                    |a: &Tensor, b: &Tensor| -> Result<f32> { (f(a)? - f(b)?)?.abs()?.max_all()?.to_scalar::<f32>() };
                let fast = trained_linear(x.as_tensor(), w.as_tensor())?;
                let slow = x.as_tensor().broadcast_matmul(&w.as_tensor().t()?)?;
                assert!(diff(&fast, &slow)? < tol, "{dtype:?} {shape:?}: outputs differ");
                let (gf, gs) = ((f(&fast)? * &dy)?.sum_all()?.backward()?, (f(&slow)? * &dy)?.sum_all()?.backward()?);
                for (what, t) in [("input", x.as_tensor()), ("weight", w.as_tensor())] {
                    let err = diff(gf.get(t).expect("gradient"), gs.get(t).expect("gradient"))?;
                    assert!(err < tol, "{dtype:?} {shape:?}: {what} gradients differ by {err}");
                }
                let frozen = trained_linear(x.as_tensor(), &w.as_tensor().detach())?;
                let g = (f(&frozen)? * &dy)?.sum_all()?.backward()?;
                assert!(g.get(x.as_tensor()).is_some() && g.get(w.as_tensor()).is_none());
            }
        }
        assert!(trained_linear(&Tensor::zeros((2, 3), DType::F32, &dev)?, &wide.narrow(1, 0, 3)?).is_err());
        Ok(())
    }
}
