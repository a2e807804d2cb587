//! The chunked recurrence with a decay per head (or none) as one op with its own backward: the
//! intra-chunk solve ([`super::chunk_intra`]), the walk ([`super::chunk_walk`]) and the outputs
//! ([`super::chunk_out`]) run in sequence each way, and the autograd graph holds only the op's
//! inputs (queries and keys in chunks, the values, and β | g | S₀ flat) and its outputs.
//!
//! candle's backward stores every gradient by adding it to a fresh zero tensor, one full-size add
//! per edge of the graph. As separate ops, the steps between the chunk kernels were a dozen such
//! edges over [N, B·H, C, ·] float32 tensors (W | Kc, U | states, the chunked outputs and
//! values), and the final state's narrow padded its gradient to the walk's whole output. Here
//! the backward hands each step's gradient to the next directly.
//!
//! The final state is a second op over the same inputs and the same saved steps, so that a loss
//! that never reads it (training on whole sequences) never runs its backward, and one that reads
//! both gets the sum of the two backwards, which is the whole gradient: the backward is linear
//! in the outputs' gradients.

use super::chunk_intra::{self, Intra};
use super::chunk_layout::{from_chunks, from_chunks_op, scalars_from_chunks, scalars_to_chunks, to_chunks};
use super::chunk_layout::{to_chunks_pair_linked, FromChunks};
use super::chunk_out::{self, Out};
use super::chunk_walk::{self, final_state, Walk, WalkIn};
use super::cpu_slice;
use super::link::{Link, Linked};
use super::recurrence::{Recurrence, Rule};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Outputs o [B,T,H,dv] in the values' dtype and final state [B,H,dk,dv] float32, in chunks of
/// `c` (a power of two); `tensor`: whether the chunk kernels may multiply on tensor cores. o is
/// laid out in the values' dtype by the op itself: a float32 o cast afterwards costs a full-size
/// cast each way and a float32 gradient edge.
pub(crate) fn forward(rec: &Recurrence, c: usize, tensor: bool) -> Result<(Tensor, Tensor)> {
    // [N,BH,C,2dk], linked: the op is its one reader.
    let qk = to_chunks_pair_linked(rec.q, rec.k, c)?;
    // The keys laid out in chunks again rather than copied out of qk's columns, a strided copy
    // several times slower.
    let keys = to_chunks(&rec.k.detach(), c)?;
    let rest = Rest { v: rec.v, beta: rec.beta, g: rec.g, initial: rec.initial, scale: rec.scale, rule: rec.rule };
    let links = Links { qk: Some(&qk), v: None };
    forward_chunked(&Chunked { qk: &qk.value, keys: &keys, t: rec.q.dim(1)?, c, links }, &rest, tensor)
}

/// What the recurrence reads besides q and k (see [`Recurrence`]'s fields of these names).
pub(crate) struct Rest<'a> {
    pub v: &'a Tensor,
    pub beta: &'a Tensor,
    pub g: Option<&'a Tensor>,
    pub initial: Option<&'a Tensor>,
    pub scale: f64,
    pub rule: Rule,
}

/// q and k already in chunks: `qk` [N, B·H, c, 2dk] (q | k, differentiable; rows past T zero)
/// and `keys` [N, B·H, c, dk] (the same keys, untracked), for sequences of `t` steps.
pub(crate) struct Chunked<'a> {
    pub qk: &'a Tensor,
    pub keys: &'a Tensor,
    pub t: usize,
    pub c: usize,
    /// Where q | k and the values came linked (see `ops::link`): `qk` and the values are then
    /// the links' untracked tensors, and their gradients go through the links.
    pub links: Links<'a>,
}

/// The links q | k and the values came through, where they did.
#[derive(Default, Clone, Copy)]
pub(crate) struct Links<'a> {
    pub qk: Option<&'a Linked>,
    pub v: Option<&'a Linked>,
}

/// [`forward`] from q and k in chunks.
pub(crate) fn forward_chunked(x: &Chunked, rec: &Rest, tensor: bool) -> Result<(Tensor, Tensor)> {
    let p = Prepared::run(x, rec, tensor)?;
    let (qk_node, v_node) = x.nodes(rec);
    if super::untracked(&[qk_node, v_node, &p.scal]) {
        let o = from_chunks(&p.saved.take_outputs()?, p.s.b, p.s.t, p.s.h, rec.v.dtype())?;
        return Ok((o, p.saved.state.reshape(p.state_shape())?));
    }
    let (links, state_shape) = (x.link_pair(), p.state_shape());
    let saved = Arc::new(p.saved);
    let o = qk_node.apply_op3(v_node, &p.scal, Output { saved: saved.clone(), state: false, links: links.clone() })?;
    let state = qk_node.apply_op3(v_node, &p.scal, Output { saved, state: true, links })?;
    Ok((o, state.reshape(state_shape)?))
}

/// [`forward_chunked`]'s outputs o alone, linked to the one op that reads them (see `ops::link`),
/// for a recurrence a gradient flows through.
pub(crate) fn forward_chunked_linked(x: &Chunked, rec: &Rest, tensor: bool) -> Result<Linked> {
    let p = Prepared::run(x, rec, tensor)?;
    let (qk_node, v_node) = x.nodes(rec);
    if super::untracked(&[qk_node, v_node, &p.scal]) {
        candle_core::bail!("chunked recurrence: a linked output needs a gradient flowing");
    }
    let op = Output { saved: Arc::new(p.saved), state: false, links: x.link_pair() };
    super::link::link3(qk_node, v_node, &p.scal, op)
}

impl Chunked<'_> {
    /// q | k's and the values' nodes in the graph: a linked input is its token.
    fn nodes<'b>(&'b self, rec: &'b Rest) -> (&'b Tensor, &'b Tensor) {
        (self.links.qk.map_or(self.qk, |l| &l.token), self.links.v.map_or(rec.v, |l| &l.token))
    }

    fn link_pair(&self) -> [Option<Link>; 2] {
        [self.links.qk.map(|l| l.link.clone()), self.links.v.map(|l| l.link.clone())]
    }
}

/// The forward's saved steps and the scalars β | g | S₀ flat, what both forms of the op share.
struct Prepared {
    saved: Saved,
    scal: Tensor,
    s: Sizes,
}

impl Prepared {
    fn run(x: &Chunked, rec: &Rest, tensor: bool) -> Result<Self> {
        let (qk, c, t) = (x.qk, x.c, x.t);
        let (n, bh, cc, dk2) = qk.dims4()?;
        let (b, tv, h, dv) = rec.v.dims4()?;
        let dk = dk2 / 2;
        if cc != c || tv != t || n != t.div_ceil(c) || bh != b * h || x.keys.dims() != [n, bh, c, dk] {
            candle_core::bail!(
                "chunked recurrence: q | k {:?} and keys {:?} are not chunks of {c} of values {:?}",
                qk.shape(),
                x.keys.shape(),
                rec.v.shape()
            );
        }
        let mut scalars = vec![rec.beta.to_dtype(DType::F32)?.flatten_all()?];
        for x in [rec.g, rec.initial].into_iter().flatten() {
            scalars.push(x.to_dtype(DType::F32)?.flatten_all()?);
        }
        let scal = Tensor::cat(&scalars, 0)?;
        let s = Sizes { b, t, h, c, dk, dv, gated: rec.g.is_some(), initial: rec.initial.is_some() };
        let saved = Saved::run(&qk.detach(), x.keys, &rec.v.detach(), &scal.detach(), s, rec, tensor)?;
        Ok(Self { saved, scal, s })
    }

    fn state_shape(&self) -> (usize, usize, usize, usize) {
        (self.s.b, self.s.h, self.s.dk, self.s.dv)
    }
}

/// The recurrence's sizes, and which of the optional inputs the scalars carry.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    b: usize,
    t: usize,
    h: usize,
    c: usize,
    dk: usize,
    dv: usize,
    gated: bool,
    initial: bool,
}

/// What the forward computed, kept for the backward: every step's inputs and outputs, float32,
/// but for two that the backward does not hold twice: the values stay in the model's layout and
/// dtype (the op's input, which the graph keeps anyway) and are laid out in chunks again when the
/// backward needs them, and the chunked outputs go once they are laid out. Each is a float32
/// [N,BH,C,dv]: 0.25 GiB a layer for the 1.3B DeltaNet and Gated DeltaNet at 16 x 2048 tokens,
/// 0.5 GiB for Qwen3.5-9B's.
struct Saved {
    s: Sizes,
    v_dtype: DType,
    /// Queries then keys in chunks [N,BH,C,2dk] (the op's first input).
    qk: Tensor,
    /// The keys alone [N,BH,C,dk], in chunks.
    k: Tensor,
    /// The values [B,T,H,dv] as the op reads them.
    v: Tensor,
    /// β [N,BH,C].
    beta: Tensor,
    /// The walk's key scales e = e^{γ_C − γ} [N,BH,C], and γ_C [N,BH,1] (with a decay).
    e: Tensor,
    last: Option<Tensor>,
    /// The solve and its β | γ input (delta rule); its output W | Kc (β V alone for the plain rule).
    solve: Option<(Intra, Tensor)>,
    wkc: Tensor,
    walk: Walk,
    walk_extra: Tensor,
    walked: Tensor,
    out: Out,
    out_gamma: Tensor,
    /// The outputs in chunks [N,BH,C,dv] until [`Output`] lays them out [B,T,H,dv] with
    /// `unchunk`, and the final state [BH·dk·dv] in a buffer of its own.
    o: Mutex<Option<Tensor>>,
    unchunk: FromChunks,
    state: Tensor,
}

impl Saved {
    /// The forward, on untracked inputs: exactly the steps the separate ops take. `k` is the
    /// keys alone in chunks.
    fn run(qk: &Tensor, k: &Tensor, v: &Tensor, scal: &Tensor, s: Sizes, rec: &Rest, tensor: bool) -> Result<Saved> {
        let (b, t, h, c, dk, dv) = (s.b, s.t, s.h, s.c, s.dk, s.dv);
        let (n, bh) = (t.div_ceil(c), b * h);
        let k = k.clone();
        let vc = to_chunks(v, c)?;
        let len = b * t * h;
        let beta = scalars_to_chunks(&scal.narrow(0, 0, len)?.reshape((b, t, h))?, c)?;
        let gamma = match s.gated {
            true => Some(scalars_to_chunks(&scal.narrow(0, len, len)?.reshape((b, t, h))?, c)?.cumsum(2)?),
            false => None,
        };
        let delta = rec.rule == Rule::Delta;
        let (solve, wkc) = match delta {
            true => {
                let (op, sc) = chunk_intra::op(&k, &vc, &beta, gamma.as_ref(), tensor)?;
                let wkc = k.apply_op3_no_bwd(&vc, &sc, &op)?;
                (Some((op, sc)), wkc)
            }
            false => (None, vc.broadcast_mul(&beta.unsqueeze(3)?)?.flatten_all()?),
        };
        // Kend = diag(e^{γ_C − γ}) K, and the state's rows decay by e^{γ_C} over a chunk.
        let (e, rows, last) = match &gamma {
            Some(g) => {
                let last = g.narrow(2, c - 1, 1)?; // [N,BH,1]
                (last.broadcast_sub(g)?.exp()?, last.exp()?.broadcast_as((n, bh, dk))?, Some(last))
            }
            None => {
                let ones = |shape: (usize, usize, usize)| Tensor::ones(shape, DType::F32, k.device());
                (ones((n, bh, c))?, ones((n, bh, dk))?, None)
            }
        };
        let s0 = match s.initial {
            true => scal.narrow(0, len * (1 + s.gated as usize), bh * dk * dv)?.reshape((bh, dk, dv))?,
            false => Tensor::zeros((bh, dk, dv), DType::F32, k.device())?,
        };
        let x = WalkIn { wkc: &wkc, delta, k: &k, e: &e, s0: &s0, a: &rows, tensor };
        let (walk, walk_extra) = chunk_walk::op(&x)?;
        let walked = wkc.apply_op3_no_bwd(&k, &walk_extra, &walk)?;
        let (out, out_gamma) = chunk_out::op(qk, gamma.as_ref(), rec.scale as f32, dv, tensor)?;
        let o = qk.apply_op3_no_bwd(&walked, &out_gamma, &out)?.reshape((n, bh, c, dv))?;
        let unchunk = from_chunks_op(&o, b, t, h, v.dtype())?;
        let state = final_state(&walked, &walk.0)?.force_contiguous()?;
        Ok(Saved {
            s,
            v_dtype: v.dtype(),
            qk: qk.clone(),
            k,
            v: v.clone(),
            beta,
            e,
            last,
            solve,
            wkc,
            walk,
            walk_extra,
            walked,
            out,
            out_gamma,
            o: Mutex::new(Some(o)),
            unchunk,
            state,
        })
    }

    /// The outputs in chunks, which only the forward reads: taken, so that they go once laid out.
    fn take_outputs(&self) -> Result<Tensor> {
        let taken =
            self.o.lock().map_err(|_| candle_core::Error::Msg("chunk recurrence: a forward panicked".into()))?.take();
        taken.ok_or_else(|| candle_core::Error::Msg("chunk recurrence: the outputs were laid out already".into()))
    }

    /// The gradients of the op's inputs (qk, v, β | g | S₀) from those of its outputs, either of
    /// which may be absent (zero).
    fn backward(&self, go: Option<&Tensor>, gs: Option<&Tensor>) -> Result<(Tensor, Tensor, Tensor)> {
        let s = self.s;
        let (n, bh, c, dk) = (s.t.div_ceil(s.c), s.b * s.h, s.c, s.dk);
        let some = |x: Option<Tensor>, what: &str| {
            x.ok_or_else(|| candle_core::Error::Msg(format!("chunk recurrence: no gradient of {what}")))
        };
        let mark = |stage| crate::profile::mark(stage, self.qk.device());
        mark("backward: before the recurrence");
        // The outputs: dqk, d(U | states) and dγ.
        let (dqk, dwalked, dgamma) = match go {
            Some(go) => {
                let go = to_chunks(go, c)?;
                // The outputs' backward does not read them (its result argument).
                let (a, b, g) = self.out.bwd(&self.qk, &self.walked, &self.out_gamma, &go, &go)?;
                (some(a, "qk")?, some(b, "the walk")?, Some(some(g, "γ")?))
            }
            None => (self.qk.zeros_like()?, self.walked.zeros_like()?, None),
        };
        mark("backward: outputs");
        // The outputs never read the final state: its gradient is the final state's alone.
        if let Some(gs) = gs {
            let len = bh * dk * s.dv;
            let last = dwalked.narrow(0, dwalked.dim(0)? - len, len)?;
            last.slice_set(&gs.to_dtype(DType::F32)?.flatten_all()?.contiguous()?, 0, 0)?;
        }
        let (dw, du_s, dkend, dextra) =
            self.walk.grads(&self.wkc, &self.k, &self.walk_extra, &self.walked, &dwalked)?;
        // Each step's gradient buffers go as soon as the next step has read them.
        drop(dwalked);
        // The solve (dKc = −dU Sᵀ), or the plain rule's W = β V.
        let vc = to_chunks(&self.v, c)?;
        let (dk_solve, d_v, dbeta, dgamma_solve) = match (&self.solve, du_s) {
            (Some((op, sc)), Some(du_s)) => {
                let (dk, dv, ds) = op.grads(&self.k, &vc, sc, &dw, &du_s, -1.0)?;
                (Some(dk), dv, ds.get(0)?, Some(ds.get(1)?))
            }
            _ => (None, dw.broadcast_mul(&self.beta.unsqueeze(3)?)?, (&dw * &vc)?.sum(3)?, None),
        };
        drop((dw, vc));
        mark("backward: walk and solve");
        let state_len = bh * dk * s.dv;
        let mut dscal = vec![scalars_from_chunks(&dbeta, s.b, s.t, s.h)?.flatten_all()?];
        if let Some(last) = &self.last {
            // γ reaches the outputs, the solve, the key scales e = e^{γ_C − γ} and the row
            // decays e^{γ_C}; then γ = cumsum(g) within each chunk.
            let da = dextra.narrow(0, state_len, n * bh * dk)?.reshape((n, bh, dk))?;
            let de = dextra.narrow(0, state_len + n * bh * dk, n * bh * c)?.reshape((n, bh, c))?;
            let ed = (&self.e * de)?;
            let mut dg = match dgamma {
                Some(d) => (d - &ed)?,
                None => ed.neg()?,
            };
            if let Some(d) = dgamma_solve {
                dg = (dg + d)?;
            }
            let dlast = (ed.sum_keepdim(2)? + last.exp()?.broadcast_mul(&da.sum_keepdim(2)?)?)?;
            let at_end = unit_row(c, c - 1, dg.device())?;
            dg = dg.broadcast_add(&dlast.broadcast_mul(&at_end)?)?;
            // dg_t = Σ_{s ≥ t} dγ_s.
            let suffix = suffix_sums(c, dg.device())?;
            let dg = dg.reshape((n * bh, c))?.matmul(&suffix)?.reshape((n, bh, c))?;
            dscal.push(scalars_from_chunks(&dg, s.b, s.t, s.h)?.flatten_all()?);
        }
        if s.initial {
            dscal.push(dextra.narrow(0, 0, state_len)?);
        }
        // The keys' gradient from the solve and the walk joins the outputs' in their buffer.
        let dqk = dqk.contiguous()?;
        dqk.inplace_op3(&dkend, &self.e, &JoinKeys { solve: dk_solve })?;
        let d_v = from_chunks(&d_v, s.b, s.t, s.h, self.v_dtype)?;
        mark("backward: recurrence layout");
        Ok((dqk, d_v, Tensor::cat(&dscal, 0)?))
    }
}

/// The keys' gradient joined into the key columns of dqk [N,BH,C,2dk] in place: dK = dqk's
/// keys + the solve's dK + diag(e) dKend (the walk's). As candle ops that was a scale, two adds
/// and a concatenation, each over the whole of dqk or its keys.
struct JoinKeys {
    solve: Option<Tensor>,
}

impl InplaceOp3 for JoinKeys {
    fn name(&self) -> &'static str {
        "statecut-chunk-join-keys"
    }

    fn cpu_fwd(
        &self,
        dqk: &mut CpuStorage,
        dl: &Layout,
        dkend: &CpuStorage,
        kl: &Layout,
        e: &CpuStorage,
        el: &Layout,
    ) -> Result<()> {
        let what = "chunk keys' gradient";
        let (dkend, e) = (cpu_slice(dkend, kl, what)?, cpu_slice(e, el, what)?);
        let solve = self.solve.as_ref().map(super::cpu_f32).transpose()?;
        let (a, b) = super::contiguous(dl, what)?;
        let CpuStorage::F32(dqk) = dqk else { candle_core::bail!("{what}: dqk is not float32") };
        let dk = super::launch::join_width(b - a, dkend.len(), e.len(), solve.as_ref().map(Vec::len))?;
        for (r, row) in dqk[a..b].chunks_exact_mut(2 * dk).enumerate() {
            for (j, x) in row[dk..].iter_mut().enumerate() {
                let i = r * dk + j;
                *x += e[r] * dkend[i] + solve.as_ref().map_or(0.0, |s| s[i]);
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dqk: &mut candle_core::CudaStorage,
        dl: &Layout,
        dkend: &candle_core::CudaStorage,
        kl: &Layout,
        e: &candle_core::CudaStorage,
        el: &Layout,
    ) -> Result<()> {
        let solve = self.solve.as_ref().map(|t| t.contiguous()).transpose()?;
        let guard = solve.as_ref().map(|t| t.storage_and_layout());
        let solve = match &guard {
            Some((s, l)) => Some(super::cuda::on_gpu(s, l, "chunk keys' gradient")?),
            None => None,
        };
        super::cuda::chunk_join_keys(dqk, dl, solve, (dkend, kl), (e, el))
    }
}

/// [c] zeros with a one at `i`.
fn unit_row(c: usize, i: usize, dev: &candle_core::Device) -> Result<Tensor> {
    Tensor::from_vec((0..c).map(|j| (j == i) as u8 as f32).collect(), c, dev)
}

/// [c, c] with M_st = 1 for t ≤ s: x · M sums each suffix of x (the backward of a cumulative sum).
fn suffix_sums(c: usize, dev: &candle_core::Device) -> Result<Tensor> {
    Tensor::from_vec((0..c * c).map(|i| (i % c <= i / c) as u8 as f32).collect(), (c, c), dev)
}

/// One of the recurrence's two outputs over the saved steps: o [B,T,H,dv] (the forward lays
/// out the saved chunked outputs) or, with `state`, the final state [B·H·dk·dv] (the forward
/// copies the saved one). Its backward is the whole recurrence's with the other output's
/// gradient zero.
struct Output {
    saved: Arc<Saved>,
    state: bool,
    /// The links of q | k and the values, where they came linked.
    links: [Option<Link>; 2],
}

type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

impl CustomOp3 for Output {
    fn name(&self) -> &'static str {
        match self.state {
            false => "statecut-chunk-recurrence",
            true => "statecut-chunk-recurrence-state",
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match self.state {
            false => {
                super::on_cpu(&self.saved.take_outputs()?, "chunk recurrence", |s, l| self.saved.unchunk.cpu_fwd(s, l))
            }
            true => super::copy_cpu(&self.saved.state, "chunk recurrence"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.state {
            false => {
                super::on_gpu(&self.saved.take_outputs()?, "chunk recurrence", |s, l| self.saved.unchunk.cuda_fwd(s, l))
            }
            true => super::copy_gpu(&self.saved.state, "chunk recurrence"),
        }
    }

    fn bwd(&self, qk: &Tensor, v: &Tensor, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Grads> {
        let (go, gs) = if self.state { (None, Some(grad)) } else { (Some(grad), None) };
        let (a, b, c) = self.saved.backward(go, gs)?;
        let hand = |link: &Option<Link>, node: &Tensor, g: Tensor| match link {
            Some(l) => l.hand_over(node, g),
            None => Ok(g),
        };
        Ok((Some(hand(&self.links[0], qk, a)?), Some(hand(&self.links[1], v, b)?), Some(c)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::chunk_layout::to_chunks_pair;
    use candle_core::Device;

    /// The saved steps keep the values as the op reads them (no float32 copy in chunks) and give
    /// up the chunked outputs once the op has laid them out, so that laying them out again is an
    /// error, not stale data; the backward runs from what is left, the values chunked again.
    #[test]
    fn saved_steps_hold_no_second_copy_of_values_or_outputs() -> Result<()> {
        let dev = Device::Cpu;
        let (b, t, h, dk, dv, c) = (2, 70, 3, 8, 5, 64);
        let randn = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev);
        let (q, k, v) = (randn(&[b, t, h, dk])?, randn(&[b, t, h, dk])?, randn(&[b, t, h, dv])?);
        let beta = candle_nn::ops::sigmoid(&randn(&[b, t, h])?)?;
        let (qk, keys, scal) = (to_chunks_pair(&q, &k, c)?, to_chunks(&k, c)?, beta.flatten_all()?);
        let sizes = Sizes { b, t, h, c, dk, dv, gated: false, initial: false };
        let rest = Rest { v: &v, beta: &beta, g: None, initial: None, scale: 0.5, rule: Rule::Delta };
        let saved = Arc::new(Saved::run(&qk, &keys, &v, &scal, sizes, &rest, false)?);
        assert_eq!(saved.v.dims(), v.dims(), "the values are kept as the op reads them");
        let lay_out = || qk.apply_op3(&v, &scal, Output { saved: saved.clone(), state: false, links: [None, None] });
        let o = lay_out()?;
        assert!(saved.o.lock().unwrap().is_none(), "the chunked outputs are still held");
        assert!(lay_out().is_err(), "a second lay-out of outputs already given up");
        let (want, _) = forward(
            &Recurrence {
                q: &q,
                k: &k,
                v: &v,
                beta: &beta,
                g: None,
                gk: None,
                scale: 0.5,
                rule: Rule::Delta,
                initial: None,
            },
            c,
            false,
        )?;
        assert_eq!(o.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
        let (dqk, d_v, dscal) = saved.backward(Some(&o.ones_like()?), None)?;
        assert_eq!((dqk.dims(), d_v.dims(), dscal.dims()), (qk.dims(), v.dims(), scal.dims()));
        Ok(())
    }
}
