//! Math shared by every architecture adapter: written once, reused.

pub mod adamw;
pub mod add;
pub mod attention;
mod chunk_intra;
mod chunk_layout;
mod chunk_out;
mod chunk_recurrence;
mod chunk_walk;
pub mod chunked;
pub mod conv;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decode;
pub mod delta_rule;
pub mod derived;
pub mod distill;
pub mod fused_block;
#[cfg(test)]
mod host_kernels;
mod launch;
pub(crate) mod link;
pub mod mlp;
pub mod norm;
pub mod prep;
pub mod projection;
mod recurrence;
pub mod warm_up;

use candle_core::{Layout, Result, Tensor};

/// `lin` on x [.., in]. Off the CPU the leading dimensions are folded into one, so a batch
/// of single tokens is one matrix product that reads the weight once, not one product per
/// sequence; the CPU keeps candle's own path, the reference, and a pass with gradients keeps
/// the projection's own (whose backward has no reshapes to add up).
pub fn linear<M: candle_core::Module>(lin: &M, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    if x.device().is_cpu() || dims.len() < 3 || !untracked(&[x]) {
        return lin.forward(x);
    }
    let (lead, last) = dims.split_at(dims.len() - 1);
    let y = lin.forward(&x.reshape((lead.iter().product::<usize>(), last[0]))?)?;
    let mut out = lead.to_vec();
    out.push(y.dim(1)?);
    y.reshape(out)
}

/// The sum of all of `t`'s elements. candle reduces each output in one thread block, so off the
/// CPU a whole-tensor sum of a large tensor would run on one multiprocessor: this sums rows of
/// a few thousand elements first. The CPU keeps candle's own order.
pub fn sum_all(t: &Tensor) -> Result<Tensor> {
    let n = t.elem_count();
    let cols = [4096, 2048, 1024, 512, 256].into_iter().find(|&c| n.is_multiple_of(c) && n >= 8 * c);
    match cols {
        Some(c) if !t.device().is_cpu() => t.flatten_all()?.reshape((n / c, c))?.sum(1)?.sum_all(),
        _ => t.sum_all(),
    }
}

/// A scalar whose gradient with respect to `y` is `g` (its value is 0): the root of the
/// backward of a recomputed block, seeded with the gradient of the block's output. It stands
/// for `sum(y · g)`, whose product, sum and their backwards would each pass over the
/// activations; only `g` times the root's gradient remains.
pub fn seed_gradient(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    if y.shape() != g.shape() {
        candle_core::bail!("seed gradient: output {:?}, gradient {:?}", y.shape(), g.shape());
    }
    y.apply_op1(Seed(g.detach()))
}

struct Seed(Tensor);

impl candle_core::CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "statecut-seed-gradient"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        Ok(zero_scalar_cpu())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        zero_scalar_gpu(y.device())
    }

    fn bwd(&self, y: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The root's gradient is one float (1 at the root of a backward): read it rather than
        // broadcast a product over the activations.
        let s = grad.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let g = self.0.to_dtype(y.dtype())?;
        match s.as_slice() {
            [1.0] => Ok(Some(g)),
            [s] => Ok(Some((g * *s as f64)?)),
            _ => candle_core::bail!("seed gradient: the root's gradient is not a scalar"),
        }
    }
}

/// A float32 scalar zero as an op's output on the CPU: what ops whose output only stands in the
/// graph (a backward's root, a linked maker's token) put out.
pub(crate) fn zero_scalar_cpu() -> (candle_core::CpuStorage, candle_core::Shape) {
    (candle_core::CpuStorage::F32(vec![0.0]), candle_core::Shape::from(()))
}

/// [`zero_scalar_cpu`] on the GPU `dev`.
#[cfg(feature = "cuda")]
pub(crate) fn zero_scalar_gpu(dev: &candle_core::CudaDevice) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
    let zero = dev.alloc_zeros::<f32>(1)?;
    Ok((candle_core::CudaStorage::wrap_cuda_slice(zero, dev.clone()), candle_core::Shape::from(())))
}

/// softplus(x) = max(x, 0) + log(1 + exp(-|x|)), stable for large |x|.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// Repeat heads `r` times consecutively along dim 2: head j of the result is head j / r.
pub fn repeat_heads(x: &Tensor, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    let (b, t, h, d) = x.dims4()?;
    x.unsqueeze(3)?.broadcast_as((b, t, h, r, d))?.reshape((b, t, h * r, d))
}

/// Whether one of this module's fused custom ops may stand in for separate candle ops on
/// `inputs` (the first decides the device): never on the CPU, where the separate ops are the
/// path and the fused ops' reference, nor when a gradient must flow through any input (weights
/// included), as the fused ops have no backward.
pub(crate) fn fusable(inputs: &[&Tensor]) -> bool {
    inputs.first().is_some_and(|x| !x.device().is_cpu()) && untracked(inputs)
}

/// Whether no gradient flows through any of `inputs`: an op without a backward (candle's fused
/// softmax, RMSNorm, and statecut's own kernels) may run on them.
pub(crate) fn untracked(inputs: &[&Tensor]) -> bool {
    no_gradients() || !inputs.iter().any(|t| t.track_op())
}

thread_local! {
    static NO_GRADIENTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside [`without_gradients`].
pub(crate) fn no_gradients() -> bool {
    NO_GRADIENTS.with(|c| c.get())
}

/// Run `f` taking the fast ops (fused kernels without a backward) even on tracked tensors: for a
/// pass whose outputs are detached before any backward, such as the forward of an activation-
/// checkpointed step, which only keeps each block's input. A backward through what `f` returns
/// is wrong; detach it.
pub fn without_gradients<R>(f: impl FnOnce() -> R) -> R {
    let before = NO_GRADIENTS.with(|c| c.replace(true));
    let out = f();
    NO_GRADIENTS.with(|c| c.set(before));
    out
}

/// `f` with cuBLAS allowed TF32 operands in its float32 products when `on`: for products over
/// values the tensor-core chunk kernels already read as TF32, where full float32 ran on CUDA
/// cores at a third of the speed. The setting is the process's; it is restored afterwards.
pub(crate) fn tf32_products<R>(on: bool, f: impl FnOnce() -> Result<R>) -> Result<R> {
    #[cfg(feature = "cuda")]
    if on {
        use candle_core::cuda_backend::{gemm_reduced_precision_f32, set_gemm_reduced_precision_f32};
        let before = gemm_reduced_precision_f32();
        set_gemm_reduced_precision_f32(true);
        let out = f();
        set_gemm_reduced_precision_f32(before);
        return out;
    }
    let _ = on;
    f()
}

/// Softmax over the last dimension. candle's one-kernel `softmax_last_dim` has no backward, so a
/// tracked input takes separate ops, with the row maximum held constant: softmax does not depend
/// on it, and its backward then has no path through the maximum to cancel.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    if untracked(&[x]) {
        return candle_nn::ops::softmax_last_dim(x);
    }
    softmax_ops(x)
}

/// [`softmax_last`]'s separate ops, whether or not a gradient flows.
pub(crate) fn softmax_ops(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(candle_core::D::Minus1)?.detach();
    let num = x.broadcast_sub(&max)?.exp()?;
    num.broadcast_div(&num.sum_keepdim(candle_core::D::Minus1)?)
}

/// The CPU storage of a tensor an op saved, for the op's CPU half; an error naming `what`
/// where it lies elsewhere.
pub(crate) fn on_cpu<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&candle_core::CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(s) => f(s, l),
        _ => candle_core::bail!("{what}: the saved tensors are not on the CPU"),
    }
}

/// The GPU storage of a tensor an op saved, for the op's CUDA half.
#[cfg(feature = "cuda")]
pub(crate) fn on_gpu<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&candle_core::CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let (s, l) = cuda::on_gpu(&s, l, what)?;
    f(s, l)
}

/// A copy of `t` as an op's output, on the CPU: for ops whose forward ran as tensor ops before
/// them and hand the result over.
pub(crate) fn copy_cpu(t: &Tensor, what: &str) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
    use candle_core::backend::BackendStorage;
    on_cpu(t, what, |s, l| Ok((s.try_clone(l)?, l.shape().clone())))
}

/// [`copy_cpu`] on the GPU.
#[cfg(feature = "cuda")]
pub(crate) fn copy_gpu(t: &Tensor, what: &str) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
    use candle_core::backend::BackendStorage;
    on_gpu(t, what, |s, l| Ok((s.try_clone(l)?, l.shape().clone())))
}

/// Contiguous GPU tensors' values as float32 on the host, each in one copy through page-locked
/// staging, widened on every core while the next copies (see `cuda::to_host_f32`); `None` where
/// they are not all on a GPU, or not all of one dtype among bf16, f16 and f32, for the caller's
/// own copy.
pub fn gpu_to_host_f32(xs: &[Tensor]) -> Result<Option<Vec<Vec<f32>>>> {
    #[cfg(feature = "cuda")]
    {
        let guards: Vec<_> = xs.iter().map(|x| x.storage_and_layout()).collect();
        let mut parts = Vec::with_capacity(xs.len());
        for (s, l) in &guards {
            match &**s {
                candle_core::Storage::Cuda(c) => parts.push((c, *l)),
                _ => return Ok(None),
            }
        }
        // Float64 rows (a float64 model's) keep the caller's copy, which widens them as candle does.
        cuda::to_host_f32(&parts)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = xs;
        Ok(None)
    }
}

/// The values of a float32 tensor, on the host (the custom ops' CPU halves read their extra
/// inputs this way).
pub(crate) fn cpu_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// The contiguous float32 input of a custom op's CPU half, as a slice.
pub(crate) fn cpu_slice<'a>(s: &'a candle_core::CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (a, b) = contiguous(l, what)?;
    Ok(&s.as_slice::<f32>()?[a..b])
}

/// The storage range of a contiguous layout, for the custom ops' CPU and CUDA halves; an error
/// naming `what` otherwise.
pub(crate) fn contiguous(layout: &Layout, what: &str) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what}: input must be contiguous")))
}

/// Start offset and row stride of a layout whose last dimension is contiguous and whose leading
/// dimensions fold into rows of one stride (a column slice of a wider matrix, such as one part
/// of a stacked projection's output): the custom ops that take row views read it in place.
pub(crate) fn row_strided(layout: &Layout) -> Option<(usize, usize)> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let Some((&width, _)) = dims.split_last() else { return Some((layout.start_offset(), 1)) };
    let n = dims.len();
    if width > 1 && strides[n - 1] != 1 {
        return None;
    }
    // Leading dimensions of size one carry no stride that matters (candle leaves theirs as they
    // came): only the others fold into rows.
    let lead: Vec<(usize, usize)> = (0..n - 1).filter(|&i| dims[i] > 1).map(|i| (dims[i], strides[i])).collect();
    let Some(&(_, rs)) = lead.last() else { return Some((layout.start_offset(), width)) };
    // Rows must not overlap, and every leading dimension must step over whole rows of the one
    // below it.
    let whole = lead.windows(2).all(|w| w[0].1 == w[1].1 * w[1].0);
    (rs >= width && whole).then_some((layout.start_offset(), rs))
}

/// A tensor's layout as rows of one stride ([`row_strided`]): its start offset and row stride,
/// the number of rows (all leading dimensions folded) and their width. A column slice of a
/// stacked projection's output is one, without a copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows {
    pub offset: usize,
    pub stride: usize,
    pub rows: usize,
    pub width: usize,
}

impl Rows {
    /// The rows of `l`, or an error naming `what` for a layout that is not rows of one stride.
    pub(crate) fn of(l: &Layout, what: &str) -> Result<Rows> {
        let (dims, strides) = (l.dims(), l.stride());
        let bad = || candle_core::Error::Msg(format!("{what}: {dims:?} with strides {strides:?} is not a row view"));
        let (&width, lead) = dims.split_last().ok_or_else(bad)?;
        let (offset, stride) = row_strided(l).ok_or_else(bad)?;
        Ok(Rows { offset, stride, rows: lead.iter().product(), width })
    }

    /// Row r of `data`.
    pub(crate) fn row<'a, T>(&self, data: &'a [T], r: usize) -> &'a [T] {
        &data[self.offset + r * self.stride..][..self.width]
    }
}

/// `x` itself when it is rows of one stride (the custom ops read it where it lies), else a
/// contiguous copy.
pub(crate) fn as_rows(x: &Tensor) -> Result<Tensor> {
    if row_strided(x.layout()).is_some() {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::row_strided;
    use candle_core::{Device, Tensor, Var};

    /// The tracked softmax has softmax's gradient: for L = Σ w·softmax(x), dL/dx = p·(w - Σ p·w),
    /// with masked (-inf) entries getting none; an untracked input gives the one-kernel result.
    #[test]
    fn softmax_gradient() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let mut xs = Tensor::randn(0f32, 2.0, (3, 5), &dev)?.to_vec2::<f32>()?;
        xs[1][4] = f32::NEG_INFINITY;
        let x = Var::from_tensor(&Tensor::new(xs, &dev)?)?;
        let w = Tensor::randn(0f32, 1.0, (3, 5), &dev)?;
        let p = super::softmax_last(x.as_tensor())?;
        let fused = candle_nn::ops::softmax_last_dim(&x.as_tensor().detach())?;
        assert!((&p - &fused)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        let grads = (&p * &w)?.sum_all()?.backward()?;
        let got = grads.get(x.as_tensor()).expect("a gradient reaches the softmax input");
        let want = (&p * w.broadcast_sub(&(&p * &w)?.sum_keepdim(1)?)?)?;
        assert!((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        assert_eq!(got.to_vec2::<f32>()?[1][4], 0.0);
        Ok(())
    }

    /// The seeded scalar gives `y` the gradient g times the root's, as sum(y · g) does.
    #[test]
    fn seed_gradient_is_that_of_the_dot_product() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?)?;
        let g = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?;
        let y = x.as_tensor().sqr()?;
        let seeded = (super::seed_gradient(&y, &g)? * 3.0)?.backward()?;
        let dot = ((&y * &g)?.sum_all()? * 3.0)?.backward()?;
        let (a, b) = (seeded.get(x.as_tensor()).expect("seeded"), dot.get(x.as_tensor()).expect("dot"));
        assert!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        assert!(super::seed_gradient(&y, &g.narrow(2, 0, 3)?).is_err());
        Ok(())
    }

    /// candle's backward (vendor/candle-core: a first gradient is stored, not added into zeros)
    /// sums the gradients of a tensor read several times, subtracts where a rule subtracts, and
    /// hands a strided first gradient (a transpose's) over contiguous.
    #[test]
    fn backward_sums_fan_in_and_stores_first_gradients_contiguous() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 4), &dev)?)?;
        let c = Tensor::randn(0f32, 1.0, (4, 3), &dev)?;
        let xs = x.as_tensor();
        // L = Σ x² + Σ xᵀ∘C − Σ 3x: dL/dx = 2x + Cᵀ − 3.
        let loss = ((xs.sqr()?.sum_all()? + (xs.t()? * &c)?.sum_all()?)? - (xs * 3.0)?.sum_all()?)?;
        let got = loss.backward()?.get(xs).expect("a gradient of x").clone();
        let want = (((xs * 2.0)? + c.t()?)? - 3.0)?;
        assert!((&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
        let strided = (xs.t()? * &c)?.sum_all()?.backward()?;
        let first = strided.get(xs).expect("a gradient of x");
        assert!(first.is_contiguous());
        assert_eq!(first.to_vec2::<f32>()?, c.t()?.to_vec2::<f32>()?);
        // The subtracted side's first gradient is the negation.
        let y = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 4), &dev)?)?;
        let grads = (xs - y.as_tensor())?.sum_all()?.backward()?;
        assert_eq!(grads.get(y.as_tensor()).expect("a gradient of y").to_vec2::<f32>()?, vec![vec![-1f32; 4]; 3]);
        Ok(())
    }

    /// A backward that hands over a gradient of the wrong shape is refused, as when every
    /// gradient was added into zeros of the input's shape.
    #[test]
    fn a_gradient_of_the_wrong_shape_is_refused() -> candle_core::Result<()> {
        struct Narrow;
        impl candle_core::CustomOp1 for Narrow {
            fn name(&self) -> &'static str {
                "test-wrong-gradient"
            }
            fn cpu_fwd(
                &self,
                s: &candle_core::CpuStorage,
                l: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                Ok((s.clone(), l.shape().clone()))
            }
            fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
                Ok(Some(grad.narrow(0, 0, x.dim(0)? - 1)?))
            }
        }
        let x = Var::from_tensor(&Tensor::ones((3, 2), candle_core::DType::F32, &Device::Cpu)?)?;
        let err = x.as_tensor().apply_op1(Narrow)?.sum_all()?.backward().expect_err("refused");
        assert!(err.to_string().contains("shape mismatch"), "{err}");
        Ok(())
    }

    /// Column slices of wider matrices are row views; sizes of one carry any stride; transposed
    /// or overlapping layouts are not row views.
    #[test]
    fn row_views() -> candle_core::Result<()> {
        let t = Tensor::zeros((2, 3, 10), candle_core::DType::F32, &Device::Cpu)?;
        assert_eq!(row_strided(t.narrow(2, 4, 5)?.layout()), Some((4, 10)));
        assert_eq!(row_strided(t.layout()), Some((0, 10)));
        // candle's cat along dim 1 of one sequence: [1, 4, 8] with strides [8, 8, 1]
        let a = Tensor::zeros((1, 20, 30), candle_core::DType::F32, &Device::Cpu)?.narrow(2, 5, 8)?.narrow(1, 17, 3)?;
        let b = Tensor::zeros((1, 1, 30), candle_core::DType::F32, &Device::Cpu)?.narrow(2, 5, 8)?;
        let cat = Tensor::cat(&[&a, &b], 1)?;
        assert_eq!(row_strided(cat.layout()), Some((0, 8)));
        assert_eq!(row_strided(t.narrow(1, 1, 1)?.layout()), Some((10, 30)));
        assert_eq!(row_strided(t.transpose(1, 2)?.layout()), None);
        assert_eq!(row_strided(t.narrow(1, 0, 2)?.layout()), None, "sequences 30 apart, rows 10 apart");
        Ok(())
    }
}
