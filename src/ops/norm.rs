//! RMS and L2 normalisation, computed in float32 whatever the weight dtype.

use super::derived::Derived;
use super::link::Operand;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType, D};

/// How a norm applies its weight: fla/mamba use `x̂·w`, Qwen3.5 decoder norms `x̂·(1+w)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    Plain,
    OnePlus,
}

/// RMSNorm over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// The applied weight (w or 1 + w) in float32.
    weight: Derived,
    /// The stored weight when it is the applied one and in a half-precision dtype: a
    /// half-precision input then normalises in one fused kernel with the same result.
    native: Option<Tensor>,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64, kind: NormWeight) -> Result<Self> {
        let native = (kind == NormWeight::Plain && weight.dtype() != DType::F32).then(|| weight.clone());
        let weight = Derived::new(weight, move |w| match kind {
            NormWeight::Plain => w.to_dtype(DType::F32),
            NormWeight::OnePlus => w.to_dtype(DType::F32)? + 1.0,
        })?;
        Ok(Self { weight, native, eps })
    }

    /// The applied weight (w or 1 + w), float32, and eps.
    pub fn applied(&self) -> Result<(Tensor, f64)> {
        Ok((self.weight.get()?, self.eps))
    }

    pub fn load(vb: candle_nn::VarBuilder, size: usize, eps: f64, kind: NormWeight) -> Result<Self> {
        Self::new(vb.get(size, "weight")?, eps, kind)
    }

    /// x̂·w computed in float32, returned in x's dtype. Off the CPU, when no gradient flows
    /// through it, one fused kernel (float32 inside): statecut's on a GPU, candle's elsewhere
    /// (on x directly when the weight is exact in x's dtype).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let weight = self.weight.get()?;
        // candle's fused kernel has no backward: a pass that differentiates the input or the
        // weight takes statecut's op with one (on a GPU) or the ops.
        if !super::fusable(&[x, &weight]) {
            if rms_grad_applies(x) {
                return rms_grad(x, None, &weight, self.eps);
            }
            return self.forward_ops(x, &weight);
        }
        let eps = self.eps as f32;
        // On a GPU, statecut's kernel: 16 bytes a lane with the float32 weight, in one pass for
        // any weight (candle's reads an element a thread, and a 1 + w weight took three passes).
        if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            let x = x.contiguous()?;
            return x.apply_op3_no_bwd(&x, &weight, &GatedRms::plain(eps));
        }
        match &self.native {
            Some(w) if w.dtype() == x.dtype() => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps),
            _ => candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &weight, eps)?.to_dtype(x.dtype()),
        }
    }

    /// The residual sum h + y and its norm, (h + y, norm(h + y)): off the CPU, when no gradient
    /// flows, one kernel ([`AddRms`]) for the two ops (and their two launches).
    pub fn add_forward(&self, h: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        let weight = self.weight.get()?;
        if !super::fusable(&[h, y, &weight]) || h.shape() != y.shape() || h.dtype() != y.dtype() {
            let h = (h + y)?;
            let x = self.forward(&h)?;
            return Ok((h, x));
        }
        let both = h.contiguous()?.apply_op3_no_bwd(&y.contiguous()?, &weight, &AddRms { eps: self.eps as f32 })?;
        Ok((both.get(0)?, both.get(1)?))
    }

    /// [`Self::forward`] in separate float32 ops (the CPU path, and the reference in tests).
    fn forward_ops(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let y = x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.broadcast_mul(weight)?;
        y.to_dtype(dtype)
    }

    /// Gated form used by fla `FusedRMSNormGated` and Qwen3.5: norm(x)·w·silu(gate), in float32,
    /// returned in x's dtype. Off the CPU, when no gradient flows, one kernel ([`GatedRms`]).
    pub fn forward_gated(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let weight = self.weight.get()?;
        if !super::fusable(&[x, gate, &weight]) {
            if rms_grad_applies(x) {
                return rms_grad(x, Some(gate), &weight, self.eps);
            }
            return self.forward_gated_ops(x, gate, &weight);
        }
        let gate = gate.to_dtype(x.dtype())?.contiguous()?;
        x.contiguous()?.apply_op3_no_bwd(&gate, &weight, &GatedRms { eps: self.eps as f32, gated: true })
    }

    /// [`Self::forward`] per head: x [.., heads, n] normed over n, laid out [.., heads·n] (as the
    /// output projection reads it). With gradients on a GPU the op writes that layout itself:
    /// a reshape is a node of candle's graph, whose backward adds its gradient into a fresh zero
    /// buffer like any other edge.
    pub fn forward_heads(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.len() < 2 {
            candle_core::bail!("norm by heads: x {:?} has no heads", x.shape());
        }
        let mut flat = dims[..dims.len() - 2].to_vec();
        flat.push(dims[dims.len() - 2] * dims[dims.len() - 1]);
        let weight = self.weight.get()?;
        if !super::fusable(&[x, &weight]) && rms_grad_applies(x) {
            let x = x.contiguous()?;
            // Ungated, the gate's place is never read: x itself, detached, in the output's shape.
            let op = GatedRms { eps: self.eps as f32, gated: false };
            return x.apply_op3(&x.detach().reshape(flat)?, &weight, op);
        }
        self.forward(x)?.reshape(flat)
    }

    /// [`Self::forward_gated`] per head: x [.., heads, n] and the gate [.., heads·n], laid out as
    /// the gate (as the output projection reads it). With gradients on a GPU the op reads both as
    /// they are: a reshape is a node of candle's graph, whose backward adds its gradient into a
    /// fresh zero buffer like any other edge.
    pub fn forward_gated_heads(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let weight = self.weight.get()?;
        if !super::fusable(&[x, gate, &weight]) && rms_grad_applies(x) {
            return rms_grad(x, Some(gate), &weight, self.eps);
        }
        self.forward_gated(x, &gate.reshape(x.shape())?)?.reshape(gate.shape())
    }

    /// [`Self::forward_heads`] (or [`Self::forward_gated_heads`] with `gate`) followed by the
    /// frozen projection `w` [out, heads·n] (contiguous rows), as one op where gradients flow on a
    /// GPU ([`NormProjected`]): the normed output is then no node of the graph, neither kept for
    /// the projection's backward (the norm's backward recomputes what it needs from x) nor an
    /// edge whose gradient candle's backward adds into a fresh buffer. `None` where the op does
    /// not apply; the caller then runs the norm and the projection.
    pub fn project_heads(&self, x: &Tensor, gate: Option<&Tensor>, w: &Tensor) -> Result<Option<Tensor>> {
        let weight = self.weight.get()?;
        let dims = x.dims();
        let width = dims.len().checked_sub(2).map(|i| dims[i] * dims[i + 1]);
        let fits = w.rank() == 2 && w.is_contiguous() && width == Some(w.dim(1)?) && super::untracked(&[w]);
        let tracked = !super::fusable(&[x, &weight].into_iter().chain(gate).collect::<Vec<_>>());
        if !fits || !tracked || !rms_grad_applies(x) {
            return Ok(None);
        }
        norm_projected(Operand::Tracked(x), gate, &weight, self.eps, w).map(Some)
    }

    /// Whether [`Self::project_heads_linked`] takes o [.., heads, n] of `dims` and the frozen
    /// output projection `w`: w's inputs the heads' width, w contiguous and frozen.
    pub fn projects_linked_heads(&self, dims: &[usize], w: &Tensor) -> bool {
        let width = dims.len().checked_sub(2).map(|i| dims[i] * dims[i + 1]);
        w.rank() == 2 && w.is_contiguous() && width == w.dims().get(1).copied() && super::untracked(&[w])
    }

    /// [`Self::project_heads`] of o linked from the recurrence (see `ops::link`), where
    /// [`Self::projects_linked_heads`] holds: its gradient goes to the recurrence's backward
    /// without an edge of candle's graph.
    pub(crate) fn project_heads_linked(
        &self,
        x: &super::link::Linked,
        gate: Option<&Tensor>,
        w: &Tensor,
    ) -> Result<Tensor> {
        self.check_linked(x, w)?;
        norm_projected(Operand::Linked(x), gate, &self.weight.get()?, self.eps, w)
    }

    /// [`Self::project_heads_linked`] with its output linked in turn to the one op that reads it
    /// (the residual sum inside the next frozen MLP step, `ops::mlp::frozen_mlp_step`).
    pub(crate) fn project_heads_linked_through(
        &self,
        x: &super::link::Linked,
        gate: Option<&Tensor>,
        w: &Tensor,
    ) -> Result<super::link::Linked> {
        self.check_linked(x, w)?;
        let (op, gate) = NormProjected::with_gate(&x.value, gate, self.eps, w)?;
        super::link::link3_from(Operand::Linked(x), &gate, &self.weight.get()?, op)
    }

    fn check_linked(&self, x: &super::link::Linked, w: &Tensor) -> Result<()> {
        if !self.projects_linked_heads(x.value.dims(), w) || !x.value.is_contiguous() {
            candle_core::bail!("norm projection: o {:?} linked, projection {:?}", x.value.shape(), w.shape());
        }
        Ok(())
    }

    /// [`Self::forward_gated`] in separate float32 ops (the CPU path, and the reference in tests).
    fn forward_gated_ops(&self, x: &Tensor, gate: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?;
        (self.forward_ops(&x.to_dtype(DType::F32)?, weight)? * g)?.to_dtype(x.dtype())
    }
}

/// Whether a norm with gradients takes [`rms_grad`]: on a GPU (the CPU keeps the ops, the
/// reference).
fn rms_grad_applies(x: &Tensor) -> bool {
    !x.device().is_cpu()
}

/// norm(x)·w (·silu(gate)) in float32, in x's dtype, differentiable in x, the gate and the
/// float32 weight: one kernel forward ([`GatedRms`]) and one backward ([`RmsBwd`]), where
/// candle's ops take some twenty passes over the rows between them.
fn rms_grad(x: &Tensor, gate: Option<&Tensor>, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    let op = GatedRms { eps: eps as f32, gated: gate.is_some() };
    match gate {
        Some(g) => x.apply_op3(&g.to_dtype(x.dtype())?.contiguous()?, weight, op),
        // Ungated, the gate's place holds x itself and is never read.
        None => x.apply_op3(&x.detach(), weight, op),
    }
}

/// [`RmsNorm::project_heads`]' op, on any device: x [.., heads, n] normed (gated by `gate`
/// [.., heads·n] when given) into the gate's layout, then times `proj`ᵀ.
/// x may come linked from the recurrence (see [`RmsNorm::project_heads_linked`]).
pub(crate) fn norm_projected(
    x: Operand,
    gate: Option<&Tensor>,
    weight: &Tensor,
    eps: f64,
    proj: &Tensor,
) -> Result<Tensor> {
    let laid;
    let x = match x {
        Operand::Tracked(x) => {
            laid = x.contiguous()?;
            Operand::Tracked(&laid)
        }
        linked => linked,
    };
    let (op, gate) = NormProjected::with_gate(x.value(), gate, eps, proj)?;
    match x {
        Operand::Tracked(x) => x.apply_op3(&gate, weight, op),
        Operand::Linked(l) => super::link::read3(l, &gate, weight, op),
    }
}

/// A [`GatedRms`] whose output goes through a frozen projection [out, in] in the same op: the
/// forward multiplies the norm's output by the projection and drops it; the backward takes the
/// projection's input gradient (dy · W) to the norm's backward, which recomputes the norm from x.
struct NormProjected {
    norm: GatedRms,
    proj: super::projection::FrozenLinear,
}

impl NormProjected {
    /// The op for x [.., heads, n], and what goes in the gate's place: the gate in x's dtype,
    /// laid out [.., heads·n], or, ungated, x itself so laid out (never read).
    fn with_gate(x: &Tensor, gate: Option<&Tensor>, eps: f64, proj: &Tensor) -> Result<(Self, Tensor)> {
        let dims = x.dims();
        let mut flat = dims[..dims.len() - 2].to_vec();
        flat.push(dims[dims.len() - 2] * dims[dims.len() - 1]);
        let op = NormProjected {
            norm: GatedRms { eps: eps as f32, gated: gate.is_some() },
            proj: super::projection::FrozenLinear::new(proj),
        };
        let gate = match gate {
            Some(g) => g.to_dtype(x.dtype())?.contiguous()?.reshape(flat)?,
            None => x.detach().reshape(flat)?,
        };
        Ok((op, gate))
    }
}

impl CustomOp3 for NormProjected {
    fn name(&self) -> &'static str {
        "statecut-norm-projected"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (normed, shape) = self.norm.cpu_fwd(x, xl, g, gl, w, wl)?;
        self.proj.cpu_fwd(&normed, &Layout::contiguous(&shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (normed, shape) = self.norm.cuda_fwd(x, xl, g, gl, w, wl)?;
        self.proj.cuda_fwd(&normed, &Layout::contiguous(&shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The gate's place has the norm's output layout, the projection's input.
        let dn = self.proj.bwd(g, res, &grad.to_dtype(x.dtype())?)?;
        let dn = dn.ok_or_else(|| candle_core::Error::Msg("norm projection: no input gradient".into()))?;
        self.norm.bwd(x, g, w, res, &dn)
    }
}

/// The gated RMSNorm as one op over (x, gate, float32 weight): rows of the last dimension,
/// float32 inside, one rounding to x's dtype, laid out as the gate. The CPU half defines it;
/// the CUDA half is `gated_rms` in cuda/norm.cu. Ungated (`gated` false), the gate is not read.
pub(crate) struct GatedRms {
    eps: f32,
    gated: bool,
}

impl GatedRms {
    /// The ungated norm, for ops that run it inside their own forward (its gate input is then
    /// x itself, never read).
    pub(crate) fn plain(eps: f32) -> Self {
        Self { eps, gated: false }
    }

    /// The gate as many elements as x (its shape may group x's last dimensions, as a projection
    /// lays out heads), the weight as wide as x's last dimension.
    fn check(xl: &Layout, gl: &Layout, wl: &Layout) -> Result<()> {
        let n = wl.shape().elem_count();
        if gl.shape().elem_count() != xl.shape().elem_count()
            || xl.shape().dims().last() != Some(&n)
            || gl.shape().dims().last().is_none_or(|&d| d % n.max(1) != 0)
        {
            candle_core::bail!("gated norm: x {:?}, gate {:?}, weight {:?}", xl.shape(), gl.shape(), wl.shape());
        }
        Ok(())
    }

    fn rows<T: WithDType>(&self, x: &[T], g: &[T], w: &[f32]) -> Vec<T> {
        let n = w.len();
        let mut y = Vec::with_capacity(x.len());
        for (xr, gr) in x.chunks_exact(n).zip(g.chunks_exact(n)) {
            let ss: f32 = xr.iter().map(|v| (v.to_f64() as f32).powi(2)).sum();
            let inv = 1.0 / (ss / n as f32 + self.eps).sqrt();
            for ((xv, gv), wv) in xr.iter().zip(gr).zip(w) {
                let gv = gv.to_f64() as f32;
                let s = if self.gated { gv / (1.0 + (-gv).exp()) } else { 1.0 };
                y.push(T::from_f64((xv.to_f64() as f32 * inv * wv * s) as f64));
            }
        }
        y
    }
}

impl CustomOp3 for GatedRms {
    fn name(&self) -> &'static str {
        "statecut-gated-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::check(xl, gl, wl)?;
        let slice = |lay: &Layout| super::contiguous(lay, "gated norm");
        let ((xs, xe), (gs, ge), (ws, we)) = (slice(xl)?, slice(gl)?, slice(wl)?);
        let CpuStorage::F32(w) = w else { candle_core::bail!("gated norm: the weight must be float32") };
        let w = &w[ws..we];
        let out = match (x, g) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(self.rows(&x[xs..xe], &g[gs..ge], w)),
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => CpuStorage::BF16(self.rows(&x[xs..xe], &g[gs..ge], w)),
            (CpuStorage::F16(x), CpuStorage::F16(g)) => CpuStorage::F16(self.rows(&x[xs..xe], &g[gs..ge], w)),
            _ => candle_core::bail!("gated norm: x and gate must share a float dtype"),
        };
        Ok((out, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Self::check(xl, gl, wl)?;
        let (out, _) = super::cuda::gated_rms(x, xl, g, gl, w, wl, self.eps, self.gated)?;
        Ok((out, gl.shape().clone()))
    }

    /// dx, dgate and dw from one [`RmsBwd`] pass.
    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = grad.to_dtype(x.dtype())?.contiguous()?;
        // Ungated, the gate is never read: x stands in.
        let g = if self.gated { g.to_dtype(x.dtype())?.contiguous()? } else { x.contiguous()? };
        let weight = w.detach().contiguous()?;
        let (dx, dg, dw) = rms_grads(&x.contiguous()?, &g, &weight, &dy, None, self.eps, self.gated)?;
        let dg = dg.map(|d| d.reshape(g.shape())).transpose()?;
        Ok((Some(dx), dg, Some(dw.reshape(w.shape())?)))
    }
}

/// The gradients of a residual step `h + f(norm(h))` through its ungated norm: d(h) = res +
/// (the norm's input gradient for an output gradient `dy`), in h's dtype (`res` is the step's
/// output gradient, which reaches h directly), and dw float32 in w's shape. On a GPU one kernel
/// (`rms_bwd`) writes d(h), where the norm's float32 dx, its cast and the residual's add
/// would be three passes. h, dy and res share one shape; w is the float32 applied weight.
pub(crate) fn rms_residual_backward(
    h: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    res: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let n = w.elem_count();
    if h.dims().last() != Some(&n) || dy.shape() != h.shape() || res.shape() != h.shape() || w.dtype() != DType::F32 {
        candle_core::bail!(
            "norm backward: h {:?}, dy {:?}, res {:?}, weight {:?} {:?}",
            h.shape(),
            dy.shape(),
            res.shape(),
            w.shape(),
            w.dtype()
        );
    }
    let (h, dy, res) = (h.contiguous()?, dy.to_dtype(h.dtype())?.contiguous()?, res.to_dtype(h.dtype())?.contiguous()?);
    let (dh, _, dw) = rms_grads(&h, &h, &w.detach().contiguous()?, &dy, Some(&res), eps as f32, false)?;
    Ok((dh, dw.reshape(w.shape())?))
}

/// The norm's backward: dx (res + dx where `res` is given) and dgate (gated) in x's dtype, laid
/// out as x, and dw float32 [n]. x, the gate, dy and res contiguous in x's dtype, w float32. On
/// a GPU one `rms_bwd` kernel writes all of them; the CPU runs [`RmsBwd`] (the reference) and
/// rounds once.
fn rms_grads(
    x: &Tensor,
    g: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    res: Option<&Tensor>,
    eps: f32,
    gated: bool,
) -> Result<(Tensor, Option<Tensor>, Tensor)> {
    #[cfg(feature = "cuda")]
    if !x.device().is_cpu() {
        return rms_grads_gpu(x, g, w, dy, res, eps, gated);
    }
    let op = RmsBwd { eps, gated, weight: w.clone() };
    let out = x.apply_op3_no_bwd(g, dy, &op)?;
    let len = x.elem_count();
    let dx = out.narrow(0, 0, len)?.reshape(x.shape())?;
    let dx = match res {
        Some(r) => (dx + r.to_dtype(DType::F32)?)?,
        None => dx,
    };
    let at = if gated { 2 * len } else { len };
    let dg = gated.then(|| out.narrow(0, len, len)?.reshape(x.shape())?.to_dtype(x.dtype())).transpose()?;
    let dw = out.narrow(0, at, out.dim(0)? - at)?;
    Ok((dx.to_dtype(x.dtype())?, dg, dw))
}

/// dx (res + dx where `res` is given) and dg (gated) in x's dtype, laid out as x, and dw
/// float32 [n], from one `rms_bwd` kernel. Every input contiguous on the GPU.
#[cfg(feature = "cuda")]
fn rms_grads_gpu(
    x: &Tensor,
    g: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    res: Option<&Tensor>,
    eps: f32,
    gated: bool,
) -> Result<(Tensor, Option<Tensor>, Tensor)> {
    use super::cuda::on_gpu;
    let n = w.elem_count();
    let grads = {
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = g.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (ds, dl) = dy.storage_and_layout();
        let r = res.map(|r| r.storage_and_layout());
        let what = "norm backward";
        let r = match &r {
            Some((rs, rl)) => Some(on_gpu(rs, rl, what)?),
            None => None,
        };
        super::cuda::rms_bwd(
            on_gpu(&xs, xl, what)?,
            on_gpu(&gs, gl, what)?,
            on_gpu(&ws, wl, what)?,
            on_gpu(&ds, dl, what)?,
            r,
            eps,
            gated,
        )?
    };
    let none = candle_core::op::BackpropOp::none;
    let wrap = |s: candle_core::CudaStorage, shape: Shape| {
        Tensor::from_storage(candle_core::Storage::Cuda(s), shape, none(), false)
    };
    let dx = wrap(grads.dx, x.shape().clone());
    let dg = grads.dg.map(|d| wrap(d, x.shape().clone()));
    let parts = wrap(grads.parts, Shape::from((grads.count, n)));
    Ok((dx, dg, parts.t()?.contiguous()?.sum(1)?))
}

/// The backward of [`GatedRms`] over (x, gate, dy) on the CPU, with the float32 weight held by
/// the op: float32 dx [rows·n], dgate [rows·n] when gated, then dw [n]. It is the reference of
/// `rms_bwd` in cuda/norm.cu, which writes dx and dgate in x's dtype (see `rms_grads_gpu`).
struct RmsBwd {
    eps: f32,
    gated: bool,
    weight: Tensor,
}

impl RmsBwd {
    fn rows<T: WithDType>(&self, x: &[T], g: &[T], dy: &[T], w: &[f32]) -> Vec<f32> {
        let n = w.len();
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let mut dx = Vec::with_capacity(x.len());
        let mut dg = Vec::with_capacity(if self.gated { x.len() } else { 0 });
        let mut dw = vec![0f32; n];
        let f = |v: &T| v.to_f64() as f32;
        for ((xr, gr), dr) in x.chunks_exact(n).zip(g.chunks_exact(n)).zip(dy.chunks_exact(n)) {
            let u: Vec<f32> =
                dr.iter().zip(gr).map(|(d, gv)| f(d) * if self.gated { silu(f(gv)) } else { 1.0 }).collect();
            let ss: f32 = xr.iter().map(|v| f(v).powi(2)).sum();
            let inv = 1.0 / (ss / n as f32 + self.eps).sqrt();
            let dot: f32 = xr.iter().zip(&u).zip(w).map(|((v, u), w)| u * w * f(v)).sum();
            let m = inv * dot / n as f32;
            for i in 0..n {
                let xh = f(&xr[i]) * inv;
                dx.push(inv * (u[i] * w[i] - xh * m));
                dw[i] += u[i] * xh;
                if self.gated {
                    let gv = f(&gr[i]);
                    let sig = 1.0 / (1.0 + (-gv).exp());
                    dg.push(f(&dr[i]) * xh * w[i] * sig * (1.0 + gv * (1.0 - sig)));
                }
            }
        }
        dx.extend(dg);
        dx.extend(dw);
        dx
    }
}

impl CustomOp3 for RmsBwd {
    fn name(&self) -> &'static str {
        "statecut-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
        dy: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let slice = |lay: &Layout| super::contiguous(lay, "norm backward");
        let ((xs, xe), (gs, ge), (ds, de)) = (slice(xl)?, slice(gl)?, slice(dyl)?);
        let w = super::cpu_f32(&self.weight)?;
        let out = match (x, g, dy) {
            (CpuStorage::F32(x), CpuStorage::F32(g), CpuStorage::F32(d)) => {
                self.rows(&x[xs..xe], &g[gs..ge], &d[ds..de], &w)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g), CpuStorage::BF16(d)) => {
                self.rows(&x[xs..xe], &g[gs..ge], &d[ds..de], &w)
            }
            (CpuStorage::F16(x), CpuStorage::F16(g), CpuStorage::F16(d)) => {
                self.rows(&x[xs..xe], &g[gs..ge], &d[ds..de], &w)
            }
            _ => candle_core::bail!("norm backward: x, gate and gradient must share a float dtype"),
        };
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }
}

/// h = a + b, rounded to their dtype, and RMSNorm(h) with a float32 weight: [`RmsNorm::add_forward`].
/// Output [2, ..] = h | norm(h).
struct AddRms {
    eps: f32,
}

impl AddRms {
    fn check(al: &Layout, bl: &Layout, wl: &Layout) -> Result<usize> {
        let n = al.shape().dims().last().copied().unwrap_or(0);
        if al.shape() != bl.shape() || wl.shape().elem_count() != n || n == 0 {
            candle_core::bail!("add + norm: {:?} + {:?}, weight {:?}", al.shape(), bl.shape(), wl.shape());
        }
        Ok(n)
    }

    fn rows<T: WithDType>(&self, a: &[T], b: &[T], w: &[f32]) -> Vec<T> {
        let n = w.len();
        let h: Vec<T> =
            a.iter().zip(b).map(|(x, y)| T::from_f64((x.to_f64() as f32 + y.to_f64() as f32) as f64)).collect();
        let mut out = h.clone();
        for hr in h.chunks_exact(n) {
            let ss: f32 = hr.iter().map(|v| (v.to_f64() as f32).powi(2)).sum();
            let inv = 1.0 / (ss / n as f32 + self.eps).sqrt();
            out.extend(hr.iter().zip(w).map(|(v, wv)| T::from_f64((v.to_f64() as f32 * inv * wv) as f64)));
        }
        out
    }

    fn out_shape(al: &Layout) -> Shape {
        let mut dims = vec![2];
        dims.extend_from_slice(al.dims());
        Shape::from(dims)
    }
}

impl CustomOp3 for AddRms {
    fn name(&self) -> &'static str {
        "statecut-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::check(al, bl, wl)?;
        let slice = |lay: &Layout| super::contiguous(lay, "add + norm");
        let ((as_, ae), (bs, be), (ws, we)) = (slice(al)?, slice(bl)?, slice(wl)?);
        let CpuStorage::F32(w) = w else { candle_core::bail!("add + norm: the weight must be float32") };
        let w = &w[ws..we];
        let out = match (a, b) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(self.rows(&a[as_..ae], &b[bs..be], w)),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => CpuStorage::BF16(self.rows(&a[as_..ae], &b[bs..be], w)),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => CpuStorage::F16(self.rows(&a[as_..ae], &b[bs..be], w)),
            _ => candle_core::bail!("add + norm: both inputs must share a float dtype"),
        };
        Ok((out, Self::out_shape(al)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = Self::check(al, bl, wl)?;
        let rows = al.shape().elem_count() / n;
        let out = super::cuda::add_rms((a, al), (b, bl), (w, wl), rows, n, self.eps)?;
        Ok((out, Self::out_shape(al)))
    }
}

/// x / sqrt(Σx² + eps) over the last dimension (fla's l2norm puts eps inside the sqrt),
/// computed in float32 and returned in x's dtype; fused off the CPU, by the RMSNorm ops with
/// a backward when a gradient flows.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    if super::fusable(&[x]) {
        l2_norm_fused(x, eps)
    } else if rms_grad_applies(x) {
        l2_norm_grad(x, eps)
    } else {
        l2_norm_ops(x, eps)
    }
}

/// The L2 norm as an RMSNorm over width n: x·rsqrt(Σx²/n + eps/n)·(1/√n) = x / sqrt(Σx² + eps).
/// Its weight (1/√n, [n] float32) and epsilon.
fn l2_as_rms(x: &Tensor, eps: f64) -> Result<(Tensor, f64)> {
    let n = x.dim(D::Minus1)?;
    Ok((Tensor::full((n as f32).sqrt().recip(), n, x.device())?, eps / n as f64))
}

/// [`l2_as_rms`] on the RMSNorm op with a backward: one pass each way where the separate ops
/// take about fifteen over q and k.
fn l2_norm_grad(x: &Tensor, eps: f64) -> Result<Tensor> {
    let (alpha, eps) = l2_as_rms(x, eps)?;
    rms_grad(x, None, &alpha, eps)
}

fn l2_norm_ops(x: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let n = (x.sqr()?.sum_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&n)?.to_dtype(dtype)
}

/// [`l2_as_rms`] through candle's fused RMSNorm (no backward).
fn l2_norm_fused(x: &Tensor, eps: f64) -> Result<Tensor> {
    let (alpha, eps) = l2_as_rms(x, eps)?;
    candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &alpha, eps as f32)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// The fused residual add + norm equals the add and the norm as separate ops, in float32 and
    /// in bf16 (the sum rounded before it is normed, as the separate add rounds).
    #[test]
    fn add_rms_matches_add_then_norm() {
        let dev = Device::Cpu;
        let w = Tensor::randn(1f32, 0.2, 24, &dev).unwrap();
        let norm = RmsNorm::new(w.clone(), 1e-6, NormWeight::Plain).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let a = Tensor::randn(0f32, 1.0, (3, 1, 24), &dev).unwrap().to_dtype(dtype).unwrap();
            let b = Tensor::randn(0f32, 1.0, (3, 1, 24), &dev).unwrap().to_dtype(dtype).unwrap();
            let both = a.apply_op3_no_bwd(&b, &norm.weight.get().unwrap(), &AddRms { eps: 1e-6 }).unwrap();
            let (h, x) = norm.add_forward(&a, &b).unwrap();
            let f = |t: Tensor| t.to_dtype(DType::F32).unwrap();
            assert_eq!(both.dims(), &[2, 3, 1, 24]);
            assert_eq!(max_rel(&f(both.get(0).unwrap()), &f(h)), 0.0, "{dtype:?}: the sums differ");
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
            let err = max_rel(&f(both.get(1).unwrap()), &f(x));
            assert!(err < tol, "{dtype:?}: the norms differ by {err}");
        }
    }

    /// The fused forms used on GPUs agree with the separate-op forms (candle's fused kernels run
    /// on the CPU too, so this checks the algebra anywhere; tests/gpu_parity.rs checks the GPU).
    #[test]
    fn fused_norms_match_separate_ops() {
        let x = Tensor::randn(0f32, 1.0, (3, 5, 64), &Device::Cpu).unwrap();
        let l2 = l2_norm_fused(&x, 1e-6).unwrap();
        assert!(max_rel(&l2, &l2_norm_ops(&x, 1e-6).unwrap()) < 1e-6);
        let w = Tensor::randn(1f32, 0.1, 64, &Device::Cpu).unwrap();
        let norm = RmsNorm::new(w.clone(), 1e-5, NormWeight::Plain).unwrap();
        let fused = candle_nn::ops::rms_norm(&x, &norm.weight.get().unwrap(), 1e-5).unwrap();
        assert!(max_rel(&fused, &norm.forward_ops(&x, &norm.weight.get().unwrap()).unwrap()) < 1e-6);
        // A bf16 weight keeps its native copy; a 1 + w weight does not (1 + w rounds in bf16).
        let half = w.to_dtype(DType::BF16).unwrap();
        assert!(RmsNorm::new(half.clone(), 1e-5, NormWeight::Plain).unwrap().native.is_some());
        assert!(RmsNorm::new(half, 1e-5, NormWeight::OnePlus).unwrap().native.is_none());
    }

    /// The gated-norm op (whose CPU half is the reference for its CUDA kernel) matches the
    /// separate float32 ops, in float32 and, to one bf16 rounding, in bf16.
    #[test]
    fn gated_norm_op_matches_separate_ops() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 7, 3, 64), &dev).unwrap();
        let gate = Tensor::randn(0f32, 2.0, (2, 7, 3, 64), &dev).unwrap();
        let norm = RmsNorm::new(Tensor::randn(1f32, 0.1, 64, &dev).unwrap(), 1e-6, NormWeight::Plain).unwrap();
        let op = GatedRms { eps: 1e-6, gated: true };
        let fused = x.apply_op3_no_bwd(&gate, &norm.weight.get().unwrap(), &op).unwrap();
        assert!(max_rel(&fused, &norm.forward_gated_ops(&x, &gate, &norm.weight.get().unwrap()).unwrap()) < 1e-6);
        let (xb, gb) = (x.to_dtype(DType::BF16).unwrap(), gate.to_dtype(DType::BF16).unwrap());
        let fused = xb.apply_op3_no_bwd(&gb, &norm.weight.get().unwrap(), &op).unwrap().to_dtype(DType::F32).unwrap();
        let ops = norm.forward_gated_ops(&xb, &gb, &norm.weight.get().unwrap()).unwrap().to_dtype(DType::F32).unwrap();
        assert!(max_rel(&fused, &ops) < 1e-2);
    }

    /// The norm and its output projection as one op give the norm op followed by the frozen
    /// projection: the same output and the same gradients of x, the gate and the norm's weight
    /// (the same arithmetic in the same order), gated and not, in float32 and bf16. On the CPU
    /// `project_heads` leaves the two to the caller.
    #[test]
    fn norm_and_projection_as_one_op_match_the_two() -> Result<()> {
        use candle_core::Var;
        let dev = Device::Cpu;
        for (gated, dtype) in [(false, DType::F32), (true, DType::F32), (false, DType::BF16), (true, DType::BF16)] {
            let what = format!("gated {gated} {dtype:?}");
            let randn = |shape: &[usize], s: f32| Tensor::randn(0f32, s, shape, &dev)?.to_dtype(dtype);
            let x = Var::from_tensor(&randn(&[2, 5, 3, 16], 1.0)?)?;
            let gate = Var::from_tensor(&randn(&[2, 5, 48], 2.0)?)?;
            let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 16, &dev)?)?;
            let proj = randn(&[7, 48], 0.2)?;
            let dy = Tensor::randn(0f32, 1.0, (2, 5, 7), &dev)?;
            let g = gated.then(|| gate.as_tensor());
            let fast = norm_projected(Operand::Tracked(x.as_tensor()), g, w.as_tensor(), 1e-5, &proj)?;
            let normed = match g {
                Some(g) => rms_grad(x.as_tensor(), Some(g), w.as_tensor(), 1e-5)?,
                None => {
                    let flat = x.as_tensor().detach().reshape((2, 5, 48))?;
                    x.as_tensor().apply_op3(&flat, w.as_tensor(), GatedRms { eps: 1e-5, gated: false })?
                }
            };
            let slow = super::super::projection::frozen_linear(&normed, &proj)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            assert_eq!(fast.dims(), [2, 5, 7], "{what}");
            assert_eq!(f(&fast)?, f(&slow)?, "{what}: outputs");
            let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &dy)?.sum_all()?.backward();
            let (gf, gs) = (loss(&fast)?, loss(&slow)?);
            let mut vars = vec![("x", &x), ("w", &w)];
            if gated {
                vars.push(("gate", &gate));
            }
            for (name, v) in vars {
                let (a, b) = (gf.get(v.as_tensor()).expect("gradient"), gs.get(v.as_tensor()).expect("gradient"));
                assert_eq!(f(a)?, f(b)?, "{what}: d{name}");
            }
            let norm = RmsNorm::new(w.as_tensor().clone(), 1e-5, NormWeight::Plain)?;
            assert!(norm.project_heads(x.as_tensor(), g, &proj)?.is_none(), "{what}: the CPU keeps the two ops");
        }
        Ok(())
    }

    /// The L2 norm through the differentiable RMSNorm op gives the separate ops' values and
    /// input gradient.
    #[test]
    fn l2_norm_gradient_matches_separate_ops() {
        use candle_core::Var;
        for n in [128, 48, 7] {
            let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, 3, n), &Device::Cpu).unwrap()).unwrap();
            let dy = Tensor::randn(0f32, 1.0, (2, 5, 3, n), &Device::Cpu).unwrap();
            let (fast, slow) = (l2_norm_grad(&x, 1e-6).unwrap(), l2_norm_ops(&x, 1e-6).unwrap());
            assert!(max_rel(&fast, &slow) < 1e-6, "n {n}: forward");
            let grad = |y: &Tensor| (y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let (gf, gs) = (grad(&fast), grad(&slow));
            let err = max_rel(gf.get(&x).unwrap(), gs.get(&x).unwrap());
            assert!(err < 1e-5, "n {n}: dx differs by {err}");
        }
    }

    /// The differentiable norm's gradients (its backward, [`RmsBwd`], whose CPU half is the
    /// reference for `rms_bwd`) equal those of the separate float32 ops, for x, the gate and
    /// the weight, gated and not, a weight of 1 + w, in float32 and (over the same rounded
    /// values) bf16.
    #[test]
    fn norm_gradients_match_separate_ops() {
        use candle_core::Var;
        let dev = Device::Cpu;
        for (gated, kind, dtype) in [
            (false, NormWeight::Plain, DType::F32),
            (true, NormWeight::Plain, DType::F32),
            (false, NormWeight::OnePlus, DType::F32),
            (true, NormWeight::Plain, DType::BF16),
            (false, NormWeight::Plain, DType::BF16),
        ] {
            let what = format!("gated {gated} {kind:?} {dtype:?}");
            let round = |t: Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let x = Var::from_tensor(&round(Tensor::randn(0f32, 1.0, (3, 5, 40), &dev).unwrap())).unwrap();
            let gate = Var::from_tensor(&round(Tensor::randn(0f32, 2.0, (3, 5, 40), &dev).unwrap())).unwrap();
            let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 40, &dev).unwrap()).unwrap();
            let dy = round(Tensor::randn(0f32, 1.0, (3, 5, 40), &dev).unwrap());
            let norm = RmsNorm::new(w.as_tensor().clone(), 1e-5, kind).unwrap();
            let applied = norm.weight.get().unwrap();
            let (xd, gd) = (x.as_tensor().to_dtype(dtype).unwrap(), gate.as_tensor().to_dtype(dtype).unwrap());
            let fast = rms_grad(&xd, gated.then_some(&gd), &applied, 1e-5).unwrap();
            let slow = if gated {
                norm.forward_gated_ops(x.as_tensor(), gate.as_tensor(), &applied).unwrap()
            } else {
                norm.forward_ops(x.as_tensor(), &applied).unwrap()
            };
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            assert!(max_rel(&f(&fast), &slow) < tol, "{what}: forward");
            let loss = |y: &Tensor| (f(y) * &dy).unwrap().sum_all().unwrap().backward().unwrap();
            let (gf, gs) = (loss(&fast), loss(&slow));
            let mut vars = vec![("x", &x), ("w", &w)];
            if gated {
                vars.push(("gate", &gate));
            }
            for (name, v) in vars {
                let err = max_rel(gf.get(v.as_tensor()).unwrap(), gs.get(v.as_tensor()).unwrap());
                assert!(err < tol, "{what} d{name}: {err}");
            }
        }
    }
}
