//! SwiGLU's activation as one op over the stacked gate|up projection's output, a frozen SwiGLU
//! MLP as one op differentiable in its input, and a whole residual step over a frozen MLP (the
//! layer itself is `layers::mlp::SwiGlu`).

use super::link::Operand;
use super::norm::GatedRms;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor, WithDType};
use std::sync::Mutex;

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

/// down(silu(gate) · up) of x [.., in] with frozen weights, the stacked gate|up [2n, in] and
/// down [out, n] (contiguous rows, no bias), differentiable in x. As three ops (two projections
/// and the activation) candle's backward adds the gradient of the [.., 2n] and [.., n]
/// intermediates into fresh zeros, two full-size passes over the largest activations of the
/// layer, and the graph holds both; here dx = (swiglu'(gu) ∘ (dy · down)) · gate_up with the
/// op keeping only gu.
pub fn frozen_swiglu_mlp(x: &Tensor, gate_up: &Tensor, down: &Tensor) -> Result<Tensor> {
    let ((two_n, inp), (_, n)) = (gate_up.dims2()?, down.dims2()?);
    if x.dims().last() != Some(&inp) || two_n != 2 * n || !gate_up.is_contiguous() || !down.is_contiguous() {
        candle_core::bail!(
            "frozen MLP: input {:?}, gate|up {:?}, down {:?} (contiguous rows)",
            x.shape(),
            gate_up.shape(),
            down.shape()
        );
    }
    let op = FrozenMlp { gate_up: gate_up.detach(), down: down.detach(), gu: Mutex::new(None) };
    x.contiguous()?.apply_op1(op)
}

struct FrozenMlp {
    gate_up: Tensor,
    down: Tensor,
    /// The gate|up projection's output from the forward, for the backward.
    gu: Mutex<Option<Tensor>>,
}

impl FrozenMlp {
    fn slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.gu.lock().map_err(|_| candle_core::Error::Msg("frozen MLP: a backward panicked".into()))
    }

    /// The sizes of the two products (see `projection::plan`) for x laid out as `l`.
    fn plans(&self, l: &Layout) -> Result<(super::projection::Plan, super::projection::Plan)> {
        let first = super::projection::plan(l, self.gate_up.layout())?;
        let mut s_dims = first.3.dims().to_vec();
        *s_dims.last_mut().expect("x has a last dimension") /= 2;
        let second = super::projection::plan(&Layout::contiguous(s_dims), self.down.layout())?;
        Ok((first, second))
    }
}

impl CustomOp1 for FrozenMlp {
    fn name(&self) -> &'static str {
        "statecut-frozen-mlp"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((bmnk, lhs, rhs, gu_shape), (bmnk2, lhs2, rhs2, shape)) = self.plans(l)?;
        let (wg, wd) = (self.gate_up.storage_and_layout().0, self.down.storage_and_layout().0);
        let (Storage::Cpu(wg), Storage::Cpu(wd)) = (&*wg, &*wd) else {
            candle_core::bail!("frozen MLP: the weights are not on the CPU")
        };
        let gu = x.matmul(wg, bmnk, &lhs, &rhs)?;
        let (s, _) = Swiglu.cpu_fwd(&gu, &Layout::contiguous(gu_shape.clone()))?;
        let y = s.matmul(wd, bmnk2, &lhs2, &rhs2)?;
        *self.slot()? =
            Some(Tensor::from_storage(Storage::Cpu(gu), gu_shape, candle_core::op::BackpropOp::none(), false));
        Ok((y, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let ((bmnk, lhs, rhs, gu_shape), (bmnk2, lhs2, rhs2, shape)) = self.plans(l)?;
        let (wg, wd) = (self.gate_up.storage_and_layout().0, self.down.storage_and_layout().0);
        let (Storage::Cuda(wg), Storage::Cuda(wd)) = (&*wg, &*wd) else {
            candle_core::bail!("frozen MLP: the weights are not on the GPU")
        };
        let gu = x.matmul(wg, bmnk, &lhs, &rhs)?;
        let (rows, n) = (bmnk.1, bmnk.2 / 2);
        let s = super::cuda::swiglu(&gu, &Layout::contiguous(gu_shape.clone()), rows, n)?;
        let y = s.matmul(wd, bmnk2, &lhs2, &rhs2)?;
        *self.slot()? =
            Some(Tensor::from_storage(Storage::Cuda(gu), gu_shape, candle_core::op::BackpropOp::none(), false));
        Ok((y, shape))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.input_grad(|| Ok(x.detach()), x, grad)?))
    }
}

impl FrozenMlp {
    /// d(x) of the MLP for its output gradient `grad`, x laid out as `like`; `x` gives the input
    /// where the forward's gate|up output is gone (a second backward over the same graph).
    fn input_grad(&self, x: impl FnOnce() -> Result<Tensor>, like: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let gu = match self.slot()?.take() {
            Some(gu) => gu,
            None => super::projection::frozen_linear(&x()?, &self.gate_up)?,
        };
        let (out, n) = self.down.dims2()?;
        let rows = gu.elem_count() / (2 * n).max(1);
        let dy = grad.to_dtype(like.dtype())?.contiguous()?.reshape((rows, out))?;
        let ds = dy.matmul(&self.down)?;
        let dgu = gu.reshape((rows, 2 * n))?.apply_op2_no_bwd(&ds, &SwigluBwd)?;
        dgu.matmul(&self.gate_up)?.reshape(like.shape())
    }
}

/// The residual step `h + down(silu(gate) · up)(norm(h))` over a frozen SwiGLU MLP (the stacked
/// gate|up [2n, d] and down [d, n], contiguous, no bias) and an ungated RMSNorm with the float32
/// applied weight `norm_w` [d], differentiable in h and the weight. As separate ops the step's
/// graph has four edges over [.., d]: h into the norm and into the sum, the norm's output into
/// the MLP, the MLP's output into the sum, each costing candle's backward a zero-filled buffer
/// and an add; here it has one, the norm's backward adds the step's output gradient to its own
/// in one kernel, and the graph keeps gate|up's output alone.
///
/// `pending`: the last step's output, added into h inside the op (h + pending is the residual
/// stream this step norms and adds to), and possibly linked from the op that made it (see
/// `ops::link`). As a sum before the op, the sum was one more edge of that size in candle's
/// graph; here the op hands the sum's gradient to both.
pub fn frozen_mlp_step(
    h: &Tensor,
    pending: Option<&Tensor>,
    norm_w: &Tensor,
    eps: f64,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    frozen_mlp_step_from(h, pending.map(Operand::Tracked), norm_w, eps, gate_up, down)
}

/// [`frozen_mlp_step`] with the pending output possibly linked.
pub(crate) fn frozen_mlp_step_from(
    h: &Tensor,
    pending: Option<Operand>,
    norm_w: &Tensor,
    eps: f64,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let ((two_n, inp), (out, n)) = (gate_up.dims2()?, down.dims2()?);
    let ok = h.dims().last() == Some(&inp)
        && out == inp
        && norm_w.elem_count() == inp
        && norm_w.dtype() == candle_core::DType::F32
        && two_n == 2 * n
        && gate_up.is_contiguous()
        && down.is_contiguous();
    if !ok {
        candle_core::bail!(
            "MLP step: input {:?}, norm weight {:?} {:?}, gate|up {:?}, down {:?} (contiguous rows, float32 norm)",
            h.shape(),
            norm_w.shape(),
            norm_w.dtype(),
            gate_up.shape(),
            down.shape()
        );
    }
    if let Some(y) = pending.map(|y| y.value().clone()) {
        if y.shape() != h.shape()
            || y.dtype() != h.dtype()
            || (matches!(pending, Some(Operand::Linked(_))) && !y.is_contiguous())
        {
            candle_core::bail!("MLP step: the pending output {:?} is not h's {:?}", y.shape(), h.shape());
        }
    }
    let mlp = FrozenMlp { gate_up: gate_up.detach(), down: down.detach(), gu: Mutex::new(None) };
    let step = MlpStep { mlp, eps: eps as f32 };
    match pending {
        None => h.contiguous()?.apply_op2(&norm_w.contiguous()?, step),
        Some(y) => {
            let op = MlpStepOnSum { step, sum: Mutex::new(None) };
            let (h, w) = (h.contiguous()?, norm_w.contiguous()?);
            match y {
                Operand::Tracked(y) => y.contiguous()?.apply_op3(&h, &w, op),
                Operand::Linked(y) => super::link::read3(y, &h, &w, op),
            }
        }
    }
}

struct MlpStep {
    mlp: FrozenMlp,
    eps: f32,
}

impl CustomOp2 for MlpStep {
    fn name(&self) -> &'static str {
        "statecut-frozen-mlp-step"
    }

    fn cpu_fwd(&self, h: &CpuStorage, hl: &Layout, w: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, shape) = GatedRms::plain(self.eps).cpu_fwd(h, hl, h, hl, w, wl)?;
        let (y, y_shape) = self.mlp.cpu_fwd(&x, &Layout::contiguous(shape))?;
        Ok((h.binary_impl::<candle_core::op::Add>(&y, hl, &Layout::contiguous(y_shape))?, hl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (x, shape) = GatedRms::plain(self.eps).cuda_fwd(h, hl, h, hl, w, wl)?;
        self.cuda_from_normed(h, hl, &x, &Layout::contiguous(shape))
    }

    fn bwd(&self, h: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dh, dw) = self.grads(h, w, grad)?;
        Ok((Some(dh), Some(dw)))
    }
}

impl MlpStep {
    /// h + mlp(x) for x the normed h, the sum by `ops::add::cuda_sum`.
    #[cfg(feature = "cuda")]
    fn cuda_from_normed(
        &self,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, y_shape) = self.mlp.cuda_fwd(x, xl)?;
        let yl = Layout::contiguous(y_shape);
        Ok((super::add::cuda_sum(h, hl, &y, &yl)?, hl.shape().clone()))
    }

    /// d(h) and d(norm weight) of the step on the residual stream h.
    fn grads(&self, h: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        let h = h.detach();
        let plain = GatedRms::plain(self.eps);
        let dx = self.mlp.input_grad(|| h.apply_op3_no_bwd(&h, &w.detach(), &plain), &h, grad)?;
        super::norm::rms_residual_backward(&h, w, &dx, grad, self.eps as f64)
    }
}

/// [`MlpStep`] on y + h over (y, h, norm weight), y first so that it may come linked; the sum
/// made in the op (rounded once, as candle's add rounds h + y) and kept for the backward, which
/// gives y and h its gradient.
struct MlpStepOnSum {
    step: MlpStep,
    sum: Mutex<Option<Tensor>>,
}

impl MlpStepOnSum {
    fn keep(&self, s: candle_core::Storage, shape: Shape) -> Result<()> {
        let s = Tensor::from_storage(s, shape, candle_core::op::BackpropOp::none(), false);
        *self.sum.lock().map_err(|_| candle_core::Error::Msg("MLP step: a forward panicked".into()))? = Some(s);
        Ok(())
    }
}

impl CustomOp3 for MlpStepOnSum {
    fn name(&self) -> &'static str {
        "statecut-frozen-mlp-step-on-sum"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        yl: &Layout,
        h: &CpuStorage,
        hl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let s = h.binary_impl::<candle_core::op::Add>(y, hl, yl)?;
        let out = self.step.cpu_fwd(&s, &Layout::contiguous(hl.shape()), w, wl)?;
        self.keep(Storage::Cpu(s), hl.shape().clone())?;
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        h: &candle_core::CudaStorage,
        hl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = hl.shape().dims().last().copied().unwrap_or(1);
        let rows = hl.shape().elem_count() / n.max(1);
        let sl = Layout::contiguous(hl.shape());
        // The sum and its norm in one pass where the layout allows (the norm as GatedRms's).
        let (s, out) = match super::cuda::add_rms_rows((h, hl), (y, yl), (w, wl), rows, n, self.step.eps, false)? {
            Some((s, Some(x))) => {
                let out = self.step.cuda_from_normed(&s, &sl, &x, &sl)?;
                (s, out)
            }
            _ => {
                let s = super::add::cuda_sum(h, hl, y, yl)?;
                let out = self.step.cuda_fwd(&s, &sl, w, wl)?;
                (s, out)
            }
        };
        self.keep(Storage::Cuda(s), hl.shape().clone())?;
        Ok(out)
    }

    fn bwd(
        &self,
        _y: &Tensor,
        _h: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let s = self.sum.lock().map_err(|_| candle_core::Error::Msg("MLP step: a forward panicked".into()))?.clone();
        let s = s.ok_or_else(|| candle_core::Error::Msg("MLP step: the forward left no sum".into()))?;
        let (ds, dw) = self.step.grads(&s, w, grad)?;
        Ok((Some(ds.clone()), Some(ds), Some(dw)))
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

    /// The frozen MLP's output and input gradient equal the three ops' (projections and the
    /// activation), for 2-D and 3-D inputs, a down weight that is a row view, in float32 and
    /// bf16, and a second backward over the same graph; a bias-shaped mismatch is refused.
    #[test]
    fn frozen_mlp_matches_the_composed_form() -> Result<()> {
        let dev = Device::Cpu;
        let gate_up = (Tensor::randn(0f32, 1.0, (2 * 7, 5), &dev)? * 0.5)?;
        let down_wide = (Tensor::randn(0f32, 1.0, (6, 7), &dev)? * 0.5)?;
        for dtype in [DType::F32, DType::BF16] {
            let (wg, wd) = (gate_up.to_dtype(dtype)?, down_wide.to_dtype(dtype)?.narrow(0, 1, 4)?);
            for shape in [vec![9, 5], vec![2, 3, 5]] {
                let x =
                    candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, shape.as_slice(), &dev)?.to_dtype(dtype)?)?;
                let mut out = shape.clone();
                *out.last_mut().unwrap() = 4;
                let dy = Tensor::randn(0f32, 1.0, out.as_slice(), &dev)?;
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let diff =
                    |a: &Tensor, b: &Tensor| -> Result<f32> { (f(a)? - f(b)?)?.abs()?.max_all()?.to_scalar::<f32>() };
                let tol = if dtype == DType::F32 { 1e-5 } else { 6e-2 };
                let fast = frozen_swiglu_mlp(x.as_tensor(), &wg, &wd)?;
                let slow = swiglu_grad(&x.as_tensor().broadcast_matmul(&wg.t()?)?)?.broadcast_matmul(&wd.t()?)?;
                assert!(diff(&fast, &slow)? < tol, "{dtype:?} {shape:?}: outputs differ");
                let loss = (f(&fast)? * &dy)?.sum_all()?;
                let gs = (f(&slow)? * &dy)?.sum_all()?.backward()?;
                let want = gs.get(x.as_tensor()).expect("gradient");
                for pass in 0..2 {
                    let gf = loss.backward()?;
                    let err = diff(gf.get(x.as_tensor()).expect("gradient"), want)?;
                    assert!(err < tol, "{dtype:?} {shape:?} backward {pass}: input gradients differ by {err}");
                }
            }
        }
        let x = Tensor::zeros((2, 5), DType::F32, &dev)?;
        assert!(frozen_swiglu_mlp(&x, &gate_up.narrow(0, 0, 13)?, &down_wide).is_err());
        Ok(())
    }

    /// The residual step's output and its gradients in h, the pending output and the norm
    /// weight equal those of its ops (the sum h + pending, the norm in float32 ops, the frozen
    /// MLP, the residual sum) in float32 and bf16, with and without a pending output, over a
    /// second backward of the same graph; a down projection that does not return to h's width,
    /// or a pending output of another shape, is refused.
    #[test]
    fn mlp_step_matches_its_ops() -> Result<()> {
        let dev = Device::Cpu;
        let (d, n, eps) = (6, 5, 1e-6);
        let gate_up = (Tensor::randn(0f32, 1.0, (2 * n, d), &dev)? * 0.5)?;
        let down = (Tensor::randn(0f32, 1.0, (d, n), &dev)? * 0.5)?;
        let w = candle_core::Var::from_tensor(&(Tensor::randn(0f32, 0.3, d, &dev)? + 1.0)?)?;
        for dtype in [DType::F32, DType::BF16] {
            let (wg, wd) = (gate_up.to_dtype(dtype)?, down.to_dtype(dtype)?);
            for pending in [false, true] {
                let var = |s: f32| -> Result<candle_core::Var> {
                    candle_core::Var::from_tensor(&Tensor::randn(0f32, s, (2, 3, d), &dev)?.to_dtype(dtype)?)
                };
                let (h, y) = (var(1.0)?, var(0.5)?);
                let dy = Tensor::randn(0f32, 1.0, (2, 3, d), &dev)?;
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                let diff =
                    |a: &Tensor, b: &Tensor| -> Result<f32> { (f(a)? - f(b)?)?.abs()?.max_all()?.to_scalar::<f32>() };
                let tol = if dtype == DType::F32 { 1e-5 } else { 8e-2 };
                let y_in = pending.then_some(y.as_tensor());
                let fast = frozen_mlp_step(h.as_tensor(), y_in, w.as_tensor(), eps, &wg, &wd)?;
                let stream = match y_in {
                    Some(y) => (h.as_tensor() + y)?,
                    None => h.as_tensor().clone(),
                };
                let x = f(&stream)?;
                let ms = x.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
                let normed = x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w.as_tensor())?.to_dtype(dtype)?;
                let slow = (&stream + frozen_swiglu_mlp(&normed, &wg, &wd)?)?;
                assert!(diff(&fast, &slow)? < tol, "{dtype:?}: outputs differ by {}", diff(&fast, &slow)?);
                let loss = (f(&fast)? * &dy)?.sum_all()?;
                let gs = (f(&slow)? * &dy)?.sum_all()?.backward()?;
                for pass in 0..2 {
                    let gf = loss.backward()?;
                    let vars = [("h", h.as_tensor()), ("pending", y.as_tensor()), ("norm weight", w.as_tensor())];
                    for (what, v) in vars {
                        let (a, b) = (gf.get(v), gs.get(v));
                        if what == "pending" && !pending {
                            assert!(a.is_none() && b.is_none());
                            continue;
                        }
                        let (a, b) = (a.expect("gradient"), b.expect("gradient"));
                        let scale = f(b)?.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
                        let err = diff(a, b)? / scale;
                        assert!(
                            err < tol,
                            "{dtype:?} pending {pending} backward {pass}: {what} gradients differ by {err}"
                        );
                    }
                }
            }
        }
        let h = Tensor::zeros((2, d), DType::F32, &dev)?;
        assert!(frozen_mlp_step(&h, None, w.as_tensor(), eps, &gate_up, &down.narrow(0, 0, d - 1)?).is_err());
        let wrong = Tensor::zeros((2, d - 1), DType::F32, &dev)?;
        assert!(frozen_mlp_step(&h, Some(&wrong), w.as_tensor(), eps, &gate_up, &down).is_err());
        Ok(())
    }
}
