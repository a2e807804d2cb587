//! The delta-rule recurrence's float32 inputs from the short conv's output in one pass: q and k
//! L2-normed per key head and repeated for the value heads that read it, v widened. Separate
//! candle ops take six passes over the same data (two copies out of the stacked output, two
//! widenings, two norms) and a seventh for v.

pub use super::launch::{Heads, HeadsDst, QkvPrep};
use super::link::Operand;
use super::Rows;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};
use std::sync::{Arc, Mutex};

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

/// The recurrence's inputs from the short conv's output with gradients, one op per part: q and
/// k ([`Heads`] with a norm) and v (without) each read their columns of the rows in place, and
/// each backward writes d(rows) whole in one pass. As candle ops a part is a narrow, a cast, a
/// reshape (v: a copy), a norm and a repeat, and the backward adds a full-size gradient for
/// every one of them, the narrow's padded to the rows' whole width.
impl Heads {
    /// [.., heads·rep, d] from x [.., C] (rows of one stride): float32 when normed, else x's
    /// dtype; differentiable in x.
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        self.check(x.dims().last().copied().unwrap_or(0))?;
        super::as_rows(x)?.apply_op1(*self)
    }

    /// Write d(x) from the outputs' gradient into the heads' columns of `dx` (contiguous, x's
    /// shape and dtype), the others untouched.
    fn grad_into(&self, dx: &Tensor, x: &Tensor, grad: &Tensor, src: Option<HeadsDst>) -> Result<()> {
        let want = if self.norm.is_some() { candle_core::DType::F32 } else { x.dtype() };
        dx.inplace_op3(x, &grad.to_dtype(want)?.contiguous()?, &HeadsInto(*self, src))
    }

    /// The normed heads of x's rows written into `out` laid out by `dst` (and into `keys`, in
    /// chunks of width d at column 0, when given with chunks): the CPU half of the normed
    /// [`Heads`] and of [`heads_qk_chunks`].
    fn fwd_cpu_into<T: WithDType>(
        &self,
        x: &[T],
        r: &Rows,
        dst: Option<&HeadsDst>,
        out: &mut [f32],
        keys: Option<&mut [f32]>,
    ) {
        let (h, d, rep) = (self.heads, self.d, self.rep);
        let eps = self.norm.unwrap_or(0.0);
        let alone = dst.map(|o| HeadsDst { w: d, col: 0, ..*o });
        let mut keys = keys;
        for row in 0..r.rows {
            for kh in 0..h {
                let xs: Vec<f32> = r.row(x, row)[self.off + kh * d..][..d].iter().map(|v| v.to_f64() as f32).collect();
                let n = match self.norm {
                    Some(_) => (xs.iter().map(|v| v * v).sum::<f32>() + eps).sqrt(),
                    None => 1.0,
                };
                for j in 0..rep {
                    let o = HeadsDst::at(dst, row, kh * rep + j, h * rep, d, r.rows);
                    let a = HeadsDst::at(alone.as_ref(), row, kh * rep + j, h * rep, d, r.rows);
                    for (i, v) in xs.iter().enumerate() {
                        out[o + i] = v / n;
                        if let Some(k) = keys.as_deref_mut() {
                            k[a + i] = v / n;
                        }
                    }
                }
            }
        }
    }

    /// An error unless the heads fit rows of `c` columns.
    fn check(&self, c: usize) -> Result<()> {
        if self.heads == 0 || self.d == 0 || self.rep == 0 || self.off + self.heads * self.d > c {
            candle_core::bail!("heads: {} x {} from column {} do not fit rows of {c}", self.heads, self.d, self.off);
        }
        Ok(())
    }

    fn out_shape(&self, l: &Layout) -> Shape {
        let mut dims = l.dims()[..l.dims().len() - 1].to_vec();
        dims.extend([self.heads * self.rep, self.d]);
        Shape::from(dims)
    }

    fn fwd_cpu<T: WithDType>(&self, x: &[T], r: &Rows) -> CpuStorage {
        let (h, d, rep) = (self.heads, self.d, self.rep);
        let head = |row: usize, kh: usize| &r.row(x, row)[self.off + kh * d..][..d];
        match self.norm {
            Some(_) => {
                let mut out = vec![0f32; r.rows * h * rep * d];
                self.fwd_cpu_into(x, r, None, &mut out, None);
                CpuStorage::F32(out)
            }
            None => {
                let mut out = Vec::with_capacity(r.rows * h * rep * d);
                for row in 0..r.rows {
                    for kh in 0..h {
                        for _ in 0..rep {
                            out.extend_from_slice(head(row, kh));
                        }
                    }
                }
                T::to_cpu_storage_owned(out)
            }
        }
    }

    /// d(x) from the outputs' gradient g (the module's formulas), written into the heads' columns
    /// of `out` [rows, width], the others untouched.
    fn bwd_cpu_into<T: WithDType, G: WithDType>(
        &self,
        x: &[T],
        r: &Rows,
        g: &[G],
        out: &mut [T],
        src: Option<&HeadsDst>,
    ) {
        let (h, d, rep) = (self.heads, self.d, self.rep);
        for row in 0..r.rows {
            for kh in 0..h {
                let xs: Vec<f32> = r.row(x, row)[self.off + kh * d..][..d].iter().map(|v| v.to_f64() as f32).collect();
                let at = |j: usize| HeadsDst::at(src, row, kh * rep + j, h * rep, d, r.rows);
                let gs: Vec<f32> =
                    (0..d).map(|i| (0..rep).map(|j| g[at(j) + i].to_f64() as f32).sum::<f32>()).collect();
                let dx: Vec<f32> = match self.norm {
                    Some(eps) => {
                        let n = (xs.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
                        let yg = xs.iter().zip(&gs).map(|(v, g)| v * g).sum::<f32>() / n;
                        xs.iter().zip(&gs).map(|(v, g)| (g - v / n * yg) / n).collect()
                    }
                    None => gs,
                };
                for (i, v) in dx.into_iter().enumerate() {
                    out[row * r.width + self.off + kh * d + i] = T::from_f64(v as f64);
                }
            }
        }
    }
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        "statecut-heads"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let r = Rows::of(l, "heads")?;
        let out = match x {
            CpuStorage::F32(x) => self.fwd_cpu(x, &r),
            CpuStorage::BF16(x) => self.fwd_cpu(x, &r),
            CpuStorage::F16(x) => self.fwd_cpu(x, &r),
            _ => candle_core::bail!("heads: unsupported dtype"),
        };
        Ok((out, self.out_shape(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let r = Rows::of(l, "heads")?;
        Ok((super::cuda::heads(x, (r.offset, r.stride), r.rows, self)?, self.out_shape(l)))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dx = Tensor::zeros(x.shape(), x.dtype(), x.device())?;
        self.grad_into(&dx, x, grad, None)?;
        Ok(Some(dx))
    }
}

/// q, k and v of the recurrence from the rows x [.., C] with one gradient edge into x: each
/// part is a [`Heads`] op, and their backwards write their columns of one d(x). candle's backward
/// adds each input's gradient into a fresh full-size buffer, so three parts with a gradient of
/// x each cost three [rows, C] adds, each gradient zero outside its part's columns.
///
/// k's op also takes q's output and v's takes k's (inputs they do not read), so that the
/// backward, which runs an op only after every op that reads its output, runs v's, then k's,
/// then q's: v's starts d(x) (zeros), k's writes into it, and both hand candle no gradient of x;
/// q's writes its columns and hands over the whole of d(x). The three outputs must all reach the
/// loss (the recurrence reads them together): an output that reaches it only through the next
/// part's unread input would get no gradient, which candle's backward refuses.
pub fn heads_qkv(x: &Tensor, q: Heads, k: Heads, v: Heads) -> Result<(Tensor, Tensor, Tensor)> {
    let c = x.dims().last().copied().unwrap_or(0);
    for p in [&q, &k, &v] {
        p.check(c)?;
    }
    let x = super::as_rows(x)?;
    let slot: Slot = Arc::new(Mutex::new(None));
    let tq = x.apply_op1(Part { heads: q, slot: slot.clone(), opens: false })?;
    let tk = x.apply_op2(&tq, Part { heads: k, slot: slot.clone(), opens: false })?;
    let tv = x.apply_op2(&tk, Part { heads: v, slot, opens: true })?;
    Ok((tq, tk, tv))
}

/// A tensor one op hands another: the d(x) that [`heads_qkv`]'s parts write into between their
/// backwards, or what a forward leaves for the next op (the keys alone, the conv's output).
type Slot = Arc<Mutex<Option<Tensor>>>;

fn lock(slot: &Slot) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
    slot.lock().map_err(|_| candle_core::Error::Msg("heads: an op panicked holding a shared tensor".into()))
}

/// The tensor one op left in `slot` for another, taken out; an error naming what is `missing`.
fn take(slot: &Slot, missing: &str) -> Result<Tensor> {
    let taken = lock(slot)?.take();
    taken.ok_or_else(|| candle_core::Error::Msg(missing.to_string()))
}

/// Leave `t` in `slot` for the op that [`take`]s it.
fn leave(slot: &Slot, t: Tensor) -> Result<()> {
    *lock(slot)? = Some(t);
    Ok(())
}

/// The d(x) buffer in `slot` (taken out), or fresh zeros of x's shape when there is none or the
/// caller `opens` it.
fn take_or_zeros(slot: &mut Option<Tensor>, x: &Tensor, opens: bool) -> Result<Tensor> {
    match slot.take() {
        Some(b) if !opens => Ok(b),
        _ => Tensor::zeros(x.shape(), x.dtype(), x.device()),
    }
}

/// One part of [`heads_qkv`]: a [`Heads`] whose backward writes into the shared d(x); `opens`:
/// the part whose backward runs first (it starts d(x) afresh).
struct Part {
    heads: Heads,
    slot: Slot,
    opens: bool,
}

impl Part {
    /// Write this part's columns of d(x) from the output's gradient into the shared buffer.
    fn deposit(&self, x: &Tensor, grad: &Tensor) -> Result<()> {
        let mut slot = lock(&self.slot)?;
        let buf = take_or_zeros(&mut slot, x, self.opens)?;
        self.heads.grad_into(&buf, x, grad, None)?;
        *slot = Some(buf);
        Ok(())
    }

    fn fwd_cpu(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.heads.cpu_fwd(x, l)
    }
}

impl CustomOp1 for Part {
    fn name(&self) -> &'static str {
        "statecut-heads-part"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu(x, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.heads.cuda_fwd(x, l)
    }

    /// The last backward of the three: hands over d(x) whole.
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.deposit(x, grad)?;
        Ok(lock(&self.slot)?.take())
    }
}

impl CustomOp2 for Part {
    fn name(&self) -> &'static str {
        "statecut-heads-part"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.fwd_cpu(x, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.heads.cuda_fwd(x, l)
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.deposit(x, grad)?;
        Ok((None, None))
    }
}

/// The recurrence's inputs from the rows x [B, T, C] for the chunk kernels with gradients: q and
/// k normed straight into the chunked layout the kernels read, [N, B·H, c, 2d] with q | k side by
/// side (H = heads · rep), the keys alone [N, B·H, c, d] (untracked: the kernels' copy of them),
/// and v as [`heads_qkv`] gives it. The rows past T in the last chunk are zero. As heads then a
/// layout op, q and k were each a float32 node of the graph whose gradient candle adds into a
/// fresh buffer, and each way a pass over both to lay them out.
///
/// The ops chain as [`heads_qkv`]'s: v's takes the pairs (unread), so that its backward runs
/// first and starts d(x); the pairs' writes q's and k's columns and hands it over. All three
/// outputs must reach the loss.
pub fn heads_qk_chunks(x: &Tensor, q: Heads, k: Heads, v: Heads, c: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (first, second, keys) = QkChunks::ops(x, q, k, v, c)?;
    let x = super::as_rows(x)?;
    let qk = x.apply_op1(first)?;
    let tv = x.apply_op2(&qk, second)?;
    Ok((qk, QkChunks::keys(&keys)?, tv))
}

/// The recurrence's inputs in chunks as the chunk recurrence alone reads them: q | k and v
/// linked to it (see `ops::link`), so that neither gradient, q | k's float32 [N, B·H, c, 2d]
/// and v's [B, T, H, dv], is a full-size edge of candle's graph.
pub struct QkvChunks {
    pub(crate) qk: super::link::Linked,
    pub(crate) keys: Tensor,
    pub(crate) v: super::link::Linked,
}

/// [`heads_qk_chunks`], linked: the same ops in the same order, for `ops::chunked::delta_from_linked`.
pub fn heads_qk_linked(x: &Tensor, q: Heads, k: Heads, v: Heads, c: usize) -> Result<QkvChunks> {
    use super::link::{link1, link2};
    let (first, second, keys) = QkChunks::ops(x, q, k, v, c)?;
    let x = super::as_rows(x)?;
    let qk = link1(&x, first)?;
    let tv = link2(&x, &qk.token, second)?;
    Ok(QkvChunks { qk, keys: QkChunks::keys(&keys)?, v: tv })
}

/// [`heads_qk_chunks`] with the short conv before it inside the ops: x [B, T, C] is the conv's
/// input, `w` [C, K] and `bias` [C] its weights in x's dtype (see `ShortConv::grad_operands`),
/// the conv causal and followed by SiLU. The conv's output is made in the forward, read by the
/// three parts and dropped; the backward makes it again (one conv launch) for the q/k norms'
/// backward, then runs the conv's. As ops of their own, the conv's output was kept for the
/// heads' backward, [B·T, C] in the model's dtype, and its gradient was one more edge of that
/// size, which candle's backward adds into a fresh buffer. v is copied from the conv's output
/// and its backward reads nothing of it.
pub fn conv_heads_qk_chunks(
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    q: Heads,
    k: Heads,
    v: Heads,
    c: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (first, second, keys) = ConvQkChunks::ops(x, w, q, k, v, c)?;
    let x = super::as_rows(x)?;
    let qk = x.apply_op3(w, bias, first)?;
    let tv = x.apply_op2(&qk, second)?;
    Ok((qk, QkChunks::keys(&keys)?, tv))
}

/// [`conv_heads_qk_chunks`], linked (see [`heads_qk_linked`]). x may come linked from its maker
/// too (the projection before the conv, see `ops::projection::linked_linear`), so that d(x),
/// [B·T, C], reaches the projection's backward without an edge of candle's graph.
pub(crate) fn conv_heads_qk_linked(
    x: Operand,
    w: &Tensor,
    bias: &Tensor,
    q: Heads,
    k: Heads,
    v: Heads,
    c: usize,
) -> Result<QkvChunks> {
    use super::link::{link2_from, link3_from};
    let (first, second, keys) = ConvQkChunks::ops(x.value(), w, q, k, v, c)?;
    let laid;
    let x = match x {
        Operand::Tracked(x) => {
            laid = super::as_rows(x)?;
            Operand::Tracked(&laid)
        }
        Operand::Linked(l) if super::row_strided(l.value.layout()).is_none() => {
            candle_core::bail!("conv and heads in chunks: a linked input must be laid out in rows")
        }
        linked => linked,
    };
    let qk = link3_from(x, w, bias, first)?;
    let tv = link2_from(x, &qk.token, second)?;
    Ok(QkvChunks { qk, keys: QkChunks::keys(&keys)?, v: tv })
}

/// q | k in chunks (see [`heads_qk_chunks`]); the forward leaves the keys alone in `keys`.
struct QkChunks {
    q: Heads,
    k: Heads,
    t: usize,
    c: usize,
    slot: Slot,
    keys: Slot,
}

impl QkChunks {
    /// The op for rows x [B, T, C] (checked against the three parts) and chunks of `c`.
    fn new(x: &Tensor, q: Heads, k: Heads, v: Heads, c: usize) -> Result<Self> {
        let (_, t, width) = x.dims3()?;
        for p in [&q, &k, &v] {
            p.check(width)?;
        }
        let ok =
            q.norm.is_some() && k.norm.is_some() && q.d == k.d && q.heads * q.rep == k.heads * k.rep && c > 0 && t > 0;
        if !ok {
            candle_core::bail!("heads in chunks: q {q:?} and k {k:?} must be normed heads of one width and count");
        }
        Ok(QkChunks { q, k, t, c, slot: Arc::new(Mutex::new(None)), keys: Arc::new(Mutex::new(None)) })
    }

    /// The two ops of [`heads_qk_chunks`] (q | k, then v's part, which opens the shared d(x)),
    /// and the slot the first leaves the keys in.
    fn ops(x: &Tensor, q: Heads, k: Heads, v: Heads, c: usize) -> Result<(Self, Part, Slot)> {
        let op = QkChunks::new(x, q, k, v, c)?;
        let (slot, keys) = (op.slot.clone(), op.keys.clone());
        Ok((op, Part { heads: v, slot, opens: true }, keys))
    }

    /// The keys the forward left in `keys`.
    fn keys(keys: &Slot) -> Result<Tensor> {
        take(keys, "heads in chunks: the forward left no keys")
    }

    /// q's and k's columns of d(x) written into the shared buffer (fresh zeros when the slot
    /// holds none), which is returned.
    fn grad(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let (qd, kd, _, _) = self.plan(x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1))?;
        let buf = take_or_zeros(&mut *lock(&self.slot)?, x, false)?;
        self.q.grad_into(&buf, x, grad, Some(qd))?;
        self.k.grad_into(&buf, x, grad, Some(kd))?;
        Ok(buf)
    }

    /// Where q and k go, and the output's and the keys' shapes, for `rows` rows.
    fn plan(&self, rows: usize) -> Result<(HeadsDst, HeadsDst, Shape, Shape)> {
        if !rows.is_multiple_of(self.t) {
            candle_core::bail!("heads in chunks: {rows} rows are not sequences of {}", self.t);
        }
        let (d, hr, n) = (self.q.d, self.q.heads * self.q.rep, self.t.div_ceil(self.c));
        let bh = rows / self.t * hr;
        let qd = HeadsDst { t: self.t, c: self.c, w: 2 * d, col: 0 };
        Ok((qd, HeadsDst { col: d, ..qd }, Shape::from((n, bh, self.c, 2 * d)), Shape::from((n, bh, self.c, d))))
    }
}

impl CustomOp1 for QkChunks {
    fn name(&self) -> &'static str {
        "statecut-heads-qk-chunks"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let r = Rows::of(l, "heads in chunks")?;
        let (qd, kd, shape, kshape) = self.plan(r.rows)?;
        let mut out = vec![0f32; shape.elem_count()];
        let mut keys = vec![0f32; kshape.elem_count()];
        macro_rules! go {
            ($x:expr) => {{
                self.q.fwd_cpu_into($x, &r, Some(&qd), &mut out, None);
                self.k.fwd_cpu_into($x, &r, Some(&kd), &mut out, Some(&mut keys));
            }};
        }
        match x {
            CpuStorage::F32(x) => go!(x),
            CpuStorage::BF16(x) => go!(x),
            CpuStorage::F16(x) => go!(x),
            _ => candle_core::bail!("heads in chunks: unsupported dtype"),
        }
        leave(&self.keys, Tensor::from_vec(keys, kshape, &candle_core::Device::Cpu)?)?;
        Ok((CpuStorage::F32(out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let r = Rows::of(l, "heads in chunks")?;
        let (qd, kd, shape, kshape) = self.plan(r.rows)?;
        // Rows past T in the last chunk are never written: zeros there.
        let pad = !self.t.is_multiple_of(self.c);
        // SAFETY: without padding, q and k write every element of a chunk row of the pairs, and
        // k every element of the keys.
        let alloc = |n: usize| unsafe { super::cuda::alloc_dtype(x.device(), candle_core::DType::F32, n, pad) };
        let (mut out, mut keys) = (alloc(shape.elem_count())?, alloc(kshape.elem_count())?);
        let at = (r.offset, r.stride);
        super::cuda::heads_into(&mut out, None, x, at, r.rows, &self.q, Some(&qd))?;
        super::cuda::heads_into(&mut out, Some(&mut keys), x, at, r.rows, &self.k, Some(&kd))?;
        let keys =
            Tensor::from_storage(candle_core::Storage::Cuda(keys), kshape, candle_core::op::BackpropOp::none(), false);
        leave(&self.keys, keys)?;
        Ok((out, shape))
    }

    /// The last backward of the chain: q's and k's columns of d(x), then d(x) whole.
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.grad(x, grad)?))
    }
}

/// [`conv_heads_qk_chunks`]' first op, over (x, w, bias): the conv, then [`QkChunks`] on its
/// output, which it leaves in `mixed` for v's part.
struct ConvQkChunks {
    chunks: QkChunks,
    conv: super::conv::FusedConv,
    mixed: Slot,
}

impl ConvQkChunks {
    /// The two ops of [`conv_heads_qk_chunks`] on x with the conv weights `w`, and the slot
    /// the first leaves the keys in.
    fn ops(x: &Tensor, w: &Tensor, q: Heads, k: Heads, v: Heads, c: usize) -> Result<(Self, ConvPart, Slot)> {
        let chunks = QkChunks::new(x, q, k, v, c)?;
        if v.norm.is_some() || w.dims2()?.0 != x.dim(2)? {
            candle_core::bail!(
                "conv and heads in chunks: v {v:?} must be copied heads, w {:?} one row a channel",
                w.shape()
            );
        }
        let conv = super::conv::FusedConv::causal_silu(w.dim(1)?)?;
        let (slot, keys, mixed) = (chunks.slot.clone(), chunks.keys.clone(), Arc::new(Mutex::new(None)));
        let second = ConvPart { part: Part { heads: v, slot, opens: true }, mixed: mixed.clone() };
        Ok((ConvQkChunks { chunks, conv, mixed }, second, keys))
    }
}

impl CustomOp3 for ConvQkChunks {
    fn name(&self) -> &'static str {
        "statecut-conv-heads-qk-chunks"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (mixed, shape) = self.conv.cpu_fwd(x, xl, w, wl, b, bl)?;
        let out = self.chunks.cpu_fwd(&mixed, &Layout::contiguous(&shape))?;
        let none = candle_core::op::BackpropOp::none();
        leave(&self.mixed, Tensor::from_storage(candle_core::Storage::Cpu(mixed), shape, none, false))?;
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (mixed, shape) = self.conv.cuda_fwd(x, xl, w, wl, b, bl)?;
        let out = self.chunks.cuda_fwd(&mixed, &Layout::contiguous(&shape))?;
        let none = candle_core::op::BackpropOp::none();
        leave(&self.mixed, Tensor::from_storage(candle_core::Storage::Cuda(mixed), shape, none, false))?;
        Ok(out)
    }

    /// The last backward of the chain: the conv's output again, q's and k's columns of its
    /// gradient (v's part wrote its own), then the conv's backward.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mixed = x.apply_op3_no_bwd(w, b, &self.conv)?;
        let dmixed = self.chunks.grad(&mixed, grad)?;
        self.conv.bwd(x, w, b, &mixed, &dmixed)
    }
}

/// v's part of [`conv_heads_qk_chunks`], over (x, the q | k chunks, unread): its forward copies
/// v from the conv's output the first op left, its backward is [`Part`]'s (an opening part: it
/// runs first). v is copied, so the backward reads nothing of the conv's output; x, of the same
/// shape, stands in for its layout.
struct ConvPart {
    part: Part,
    mixed: Slot,
}

impl ConvPart {
    fn mixed(&self) -> Result<Tensor> {
        take(&self.mixed, "conv and heads in chunks: v's part ran without the conv")
    }
}

impl CustomOp2 for ConvPart {
    fn name(&self) -> &'static str {
        "statecut-conv-heads-part"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        super::on_cpu(&self.mixed()?, "conv and heads in chunks", |s, l| self.part.heads.cpu_fwd(s, l))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::on_gpu(&self.mixed()?, "conv and heads in chunks", |s, l| self.part.heads.cuda_fwd(s, l))
    }

    fn bwd(&self, x: &Tensor, _: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.part.deposit(x, grad)?;
        Ok((None, None))
    }
}

/// [`Heads`]' backward written into the heads' columns of a d(x) buffer (contiguous, x's
/// shape and dtype), over (x, the outputs' gradient).
struct HeadsInto(Heads, Option<HeadsDst>);

impl candle_core::InplaceOp3 for HeadsInto {
    fn name(&self) -> &'static str {
        "statecut-heads-bwd-into"
    }

    fn cpu_fwd(
        &self,
        out: &mut CpuStorage,
        ol: &Layout,
        x: &CpuStorage,
        xl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        let r = Rows::of(xl, "heads backward")?;
        let (a, b) = super::contiguous(gl, "heads backward gradient")?;
        let (oa, ob) = super::contiguous(ol, "heads backward buffer")?;
        if ob - oa != r.rows * r.width {
            candle_core::bail!("heads backward: a buffer of {} for {} x {}", ob - oa, r.rows, r.width);
        }
        macro_rules! go {
            ($x:expr, $out:expr) => {
                match g {
                    CpuStorage::F32(g) => self.0.bwd_cpu_into($x, &r, &g[a..b], &mut $out[oa..ob], self.1.as_ref()),
                    CpuStorage::BF16(g) => self.0.bwd_cpu_into($x, &r, &g[a..b], &mut $out[oa..ob], self.1.as_ref()),
                    CpuStorage::F16(g) => self.0.bwd_cpu_into($x, &r, &g[a..b], &mut $out[oa..ob], self.1.as_ref()),
                    _ => candle_core::bail!("heads backward: unsupported dtype"),
                }
            };
        }
        match (x, out) {
            (CpuStorage::F32(x), CpuStorage::F32(o)) => go!(x, o),
            (CpuStorage::BF16(x), CpuStorage::BF16(o)) => go!(x, o),
            (CpuStorage::F16(x), CpuStorage::F16(o)) => go!(x, o),
            _ => candle_core::bail!("heads backward: the buffer's dtype is not the input's"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        ol: &Layout,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        use candle_core::backend::BackendStorage;
        let r = Rows::of(xl, "heads backward")?;
        let (oa, ob) = super::contiguous(ol, "heads backward buffer")?;
        if ob - oa != r.rows * r.width || out.dtype() != x.dtype() {
            candle_core::bail!(
                "heads backward: a buffer of {} {:?} for {} x {}",
                ob - oa,
                out.dtype(),
                r.rows,
                r.width
            );
        }
        let rows = (r.rows, r.width);
        super::cuda::heads_bwd_into(out, oa, x, (r.offset, r.stride), rows, (g, gl), &self.0, self.1.as_ref())
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

    /// The heads op equals the candle ops it stands for, forward and backward: q/k-style (a
    /// norm, float32, repeated for two value heads) and v-style (a copy in the input's dtype),
    /// on a column slice of a wider matrix, in float32 and bf16; columns outside the heads get a
    /// zero gradient, and heads past the rows' width are refused.
    #[test]
    fn heads_match_candle_ops() -> Result<()> {
        let dev = Device::Cpu;
        let wide = Tensor::randn(0f32, 1.0, (2, 5, 30), &dev)?;
        for dtype in [DType::F32, DType::BF16] {
            for (off, heads, d, rep, norm) in [(4, 2, 6, 2, Some(1e-6f32)), (16, 3, 4, 1, None)] {
                let x = candle_core::Var::from_tensor(&wide.to_dtype(dtype)?)?;
                let rows = x.as_tensor().narrow(2, 1, 28)?;
                let p = Heads { off, heads, d, rep, norm };
                let fast = p.run(&rows)?;
                let part = rows.narrow(2, off, heads * d)?.reshape((2, 5, heads, d))?;
                let slow = match norm {
                    Some(eps) => repeat_heads(&l2_norm(&part.to_dtype(DType::F32)?, eps as f64)?, rep)?,
                    None => part.contiguous()?,
                };
                assert_eq!((fast.dims(), fast.dtype()), (slow.dims(), slow.dtype()));
                let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
                assert!(max_diff(&f(&fast), &f(&slow)) < tol, "outputs differ ({dtype:?}, norm {norm:?})");
                let dy = Tensor::randn(0f32, 1.0, fast.dims(), &dev)?;
                let grad = |y: &Tensor| -> Result<Tensor> {
                    let g = (f(y) * &dy)?.sum_all()?.backward()?;
                    Ok(f(g.get(x.as_tensor()).expect("a gradient")))
                };
                let (gf, gs) = (grad(&fast)?, grad(&slow)?);
                assert!(max_diff(&gf, &gs) < tol, "gradients differ ({dtype:?}, norm {norm:?})");
                let outside = gf.narrow(2, 1 + off + heads * d, 29 - off - heads * d)?;
                assert_eq!(outside.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
            }
        }
        assert!(Heads { off: 20, heads: 2, d: 6, rep: 1, norm: None }.run(&wide).is_err());
        Ok(())
    }

    /// The three parts with one gradient edge give the outputs and the gradient of the separate
    /// ops (columns outside the parts zero), on a column slice, in float32 and bf16, and again in
    /// a second backward over the same graph.
    #[test]
    fn grouped_heads_match_separate_ones() -> Result<()> {
        let dev = Device::Cpu;
        let wide = Tensor::randn(0f32, 1.0, (2, 5, 40), &dev)?;
        let (q, k, v) = (
            Heads { off: 0, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 12, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 24, heads: 4, d: 3, rep: 1, norm: None },
        );
        for dtype in [DType::F32, DType::BF16] {
            let x = candle_core::Var::from_tensor(&wide.to_dtype(dtype)?)?;
            let rows = x.as_tensor().narrow(2, 1, 38)?;
            let grouped = heads_qkv(&rows, q, k, v)?;
            let separate = (q.run(&rows)?, k.run(&rows)?, v.run(&rows)?);
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let w: Vec<Tensor> = [&separate.0, &separate.1, &separate.2]
                .iter()
                .map(|t| Tensor::randn(0f32, 1.0, t.dims(), &dev))
                .collect::<Result<_>>()?;
            let grad = |(a, b, c): &(Tensor, Tensor, Tensor)| -> Result<Tensor> {
                let loss = ((f(a) * &w[0])?.sum_all()? + (f(b) * &w[1])?.sum_all()?)?;
                let g = (loss + (f(c) * &w[2])?.sum_all()?)?.backward()?;
                Ok(f(g.get(x.as_tensor()).expect("a gradient")))
            };
            for (a, b) in [(&grouped.0, &separate.0), (&grouped.1, &separate.1), (&grouped.2, &separate.2)] {
                assert_eq!(max_diff(&f(a), &f(b)), 0.0, "outputs ({dtype:?})");
            }
            let want = grad(&separate)?;
            for pass in 0..2 {
                let got = grad(&grouped)?;
                assert!(max_diff(&got, &want) < 1e-6, "gradient, backward {pass} ({dtype:?})");
            }
            assert_eq!(want.narrow(2, 1 + 36, 3)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        }
        assert!(heads_qkv(&wide, q, k, Heads { off: 30, heads: 4, d: 3, rep: 1, norm: None }).is_err());
        Ok(())
    }

    /// q and k normed straight into chunks equal the heads laid out afterwards (the rows past T
    /// zero), the keys alone too, v as the grouped parts give it; the gradient of the rows is the
    /// same, in a second backward too; on a column slice, with padding, in float32 and bf16.
    #[test]
    fn chunked_heads_match_heads_then_layout() -> Result<()> {
        use crate::ops::chunk_layout::{to_chunks, to_chunks_pair};
        let dev = Device::Cpu;
        let (b, t, c) = (2, 7, 4);
        let wide = Tensor::randn(0f32, 1.0, (b, t, 40), &dev)?;
        let (q, k, v) = (
            Heads { off: 0, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 12, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 24, heads: 4, d: 3, rep: 1, norm: None },
        );
        for dtype in [DType::F32, DType::BF16] {
            let x = candle_core::Var::from_tensor(&wide.to_dtype(dtype)?)?;
            let rows = x.as_tensor().narrow(2, 1, 38)?;
            let (qk, keys, tv) = heads_qk_chunks(&rows, q, k, v, c)?;
            let (rq, rk, rv) = heads_qkv(&rows, q, k, v)?;
            let want = to_chunks_pair(&rq, &rk, c)?;
            assert_eq!(qk.dims(), want.dims());
            assert_eq!(max_diff(&qk, &want), 0.0, "q | k ({dtype:?})");
            assert_eq!(max_diff(&keys, &to_chunks(&rk, c)?), 0.0, "keys ({dtype:?})");
            assert!(!keys.track_op(), "the keys are the kernels' copy, outside the graph");
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            assert_eq!(max_diff(&f(&tv), &f(&rv)), 0.0, "v ({dtype:?})");
            let (w1, w2) = (Tensor::randn(0f32, 1.0, qk.dims(), &dev)?, Tensor::randn(0f32, 1.0, tv.dims(), &dev)?);
            let grad = |a: &Tensor, v: &Tensor| -> Result<Tensor> {
                let g = ((a * &w1)?.sum_all()? + (f(v) * &w2)?.sum_all()?)?.backward()?;
                Ok(f(g.get(x.as_tensor()).expect("a gradient")))
            };
            let expect = grad(&want, &rv)?;
            for pass in 0..2 {
                let got = grad(&qk, &tv)?;
                assert!(max_diff(&got, &expect) < 1e-6, "gradient, backward {pass} ({dtype:?})");
            }
        }
        let odd = Heads { off: 12, heads: 2, d: 5, rep: 2, norm: Some(1e-6) };
        assert!(heads_qk_chunks(&wide, q, odd, v, c).is_err(), "q and k of different widths");
        assert!(heads_qk_chunks(&wide, q, Heads { norm: None, ..k }, v, c).is_err(), "unnormed keys");
        Ok(())
    }

    /// The short conv inside the heads' ops gives what the conv op followed by the heads in
    /// chunks gives: the same q | k, keys and v, and the same gradients of the conv's input (a
    /// column slice), weight and bias, in a second backward over the graph too, in float32 and
    /// bf16. A normed v, or a kernel wider than the conv's backward takes, is refused.
    #[test]
    fn conv_inside_the_heads_matches_conv_then_heads() -> Result<()> {
        use crate::ops::conv::FusedConv;
        let dev = Device::Cpu;
        let (b, t, c, taps) = (2, 7, 4, 4);
        let wide = Tensor::randn(0f32, 1.0, (b, t, 40), &dev)?;
        let (q, k, v) = (
            Heads { off: 0, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 12, heads: 2, d: 6, rep: 2, norm: Some(1e-6) },
            Heads { off: 24, heads: 4, d: 3, rep: 1, norm: None },
        );
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let x = candle_core::Var::from_tensor(&wide.to_dtype(dtype)?)?;
            let w = candle_core::Var::from_tensor(&Tensor::randn(0f32, 0.5, (38, taps), &dev)?.to_dtype(dtype)?)?;
            let bias = candle_core::Var::from_tensor(&Tensor::randn(0f32, 0.5, 38, &dev)?.to_dtype(dtype)?)?;
            let rows = x.as_tensor().narrow(2, 1, 38)?;
            let (qk, keys, tv) = conv_heads_qk_chunks(&rows, w.as_tensor(), bias.as_tensor(), q, k, v, c)?;
            let mixed = rows.apply_op3(w.as_tensor(), bias.as_tensor(), FusedConv::causal_silu(taps)?)?;
            let (rqk, rkeys, rv) = heads_qk_chunks(&mixed, q, k, v, c)?;
            assert_eq!(max_diff(&qk, &rqk), 0.0, "q | k ({dtype:?})");
            assert_eq!(max_diff(&keys, &rkeys), 0.0, "keys ({dtype:?})");
            assert_eq!(max_diff(&f(&tv), &f(&rv)), 0.0, "v ({dtype:?})");
            let (w1, w2) = (Tensor::randn(0f32, 1.0, qk.dims(), &dev)?, Tensor::randn(0f32, 1.0, tv.dims(), &dev)?);
            let grads = |a: &Tensor, v: &Tensor| -> Result<Vec<Tensor>> {
                let g = ((a * &w1)?.sum_all()? + (f(v) * &w2)?.sum_all()?)?.backward()?;
                Ok([&x, &w, &bias].iter().map(|t| f(g.get(t.as_tensor()).expect("a gradient"))).collect())
            };
            let expect = grads(&rqk, &rv)?;
            for pass in 0..2 {
                for (name, (got, want)) in ["x", "w", "bias"].iter().zip(grads(&qk, &tv)?.iter().zip(&expect)) {
                    assert!(max_diff(got, want) < 1e-6, "d{name}, backward {pass} ({dtype:?})");
                }
            }
        }
        let (w, bias) = (Tensor::zeros((40, taps), DType::F32, &dev)?, Tensor::zeros(40, DType::F32, &dev)?);
        let normed = Heads { norm: Some(1e-6), ..v };
        assert!(conv_heads_qk_chunks(&wide, &w, &bias, q, k, normed, c).is_err(), "a normed v");
        let wide_kernel = Tensor::zeros((40, 9), DType::F32, &dev)?;
        assert!(conv_heads_qk_chunks(&wide, &wide_kernel, &bias, q, k, v, c).is_err(), "nine taps");
        Ok(())
    }
}
