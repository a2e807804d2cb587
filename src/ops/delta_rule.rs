//! The (gated) delta-rule recurrence, and its linear-attention special case, on float32.
//!
//! Per head, with state S ∈ R^{dk×dv}, decay a_t = exp(g_t), an optional per-key-channel decay
//! exp(gk_t) ∈ R^{dk} (GLA) and write strength β_t:
//!   S' = a_t diag(exp gk_t) S_{t-1}   (row i of S scaled by a_t exp(gk_t[i]));  u_t = β_t (v_t − S'ᵀk_t)  (delta rule)  or  u_t = β_t v_t  (plain);
//!   S_t = S' + k_t u_tᵀ;  o_t = S_tᵀ (scale · q_t).
//! DeltaNet is g = 0, Gated DeltaNet the full form (fla `naive_recurrent_gated_delta_rule`),
//! the Mamba-2 SSM the plain form with k = B, q = C, v = x, β = dt, g = dt·A, and GLA (SSE's
//! partitions) the plain form with β = 1, g = 0 and the per-channel decay gk.
//!
//! The forward is a CPU custom op with an exact backward (reverse-mode through the recurrence,
//! re-computing states from checkpoints every `CHUNK` steps), so candle autograd can take
//! gradients through it for the Grad selector.

use super::chunked::Form;
use super::cpu_f32;
pub use super::recurrence::{Recurrence, Rule};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const CHUNK: usize = 64;

/// Widest key dimension the fused CUDA kernel takes (`recurrence` in cuda/recurrence.cu).
const MAX_FUSED_DK: usize = 1024;

/// When a delta-rule layer's pass without gradients on a GPU takes the chunk kernels instead of
/// the fused sequential kernel (with 16-bit values, on tensor cores, and a decay per head or
/// none): sequences of at least this many tokens...
pub const CHUNKS_FROM_TOKENS: usize = 512;
/// ...over at most this many of the fused kernel's blocks (B · H · dv/32). The fused kernel
/// walks every token in turn, one block per 32 state columns of a head; with fewer blocks than
/// the GPU has multiprocessors (132 on an H200) it waits on each step, where the chunk kernels
/// also spread the chunks over blocks. On the H200 (docs/BENCHMARKS.md) one sequence of 2,048
/// tokens and 16 heads of 128 x 128 took 0.70 ms on the chunk kernels against 1.35 ms, while at
/// 8 sequences a calibration pass ran faster on the fused kernel.
pub const CHUNKS_UP_TO_BLOCKS: usize = 128;

#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    dk: usize,
    dv: usize,
    /// The packed input carries a per-key-channel log decay (dk fields after g).
    gk: bool,
}

impl Dims {
    fn p(&self) -> usize {
        2 * self.dk + self.dv + 2 + if self.gk { self.dk } else { 0 }
    }

    /// Decay of row i of the state at a step whose packed input is `x`: a · exp(gk[i]).
    #[inline]
    fn row_decay(&self, x: &[f32], a: f32, i: usize) -> f32 {
        if self.gk {
            a * x[2 * self.dk + self.dv + 2 + i].exp()
        } else {
            a
        }
    }
    /// Offset of token t of head h in sequence b in the packed [B,T,H,P] buffer.
    fn at(&self, b: usize, t: usize, h: usize) -> usize {
        ((b * self.t + t) * self.h + h) * self.p()
    }
}

/// One step of the recurrence on a state; returns (S' scaled state kept in `s`, u).
#[inline]
fn step(s: &mut [f32], x: &[f32], d: Dims, rule: Rule, u: &mut [f32]) {
    let (dk, dv) = (d.dk, d.dv);
    let k = &x[dk..2 * dk];
    let v = &x[2 * dk..2 * dk + dv];
    let beta = x[2 * dk + dv];
    let a = x[2 * dk + dv + 1].exp();
    if d.gk {
        for i in 0..dk {
            let f = d.row_decay(x, a, i);
            if f != 1.0 {
                s[i * dv..(i + 1) * dv].iter_mut().for_each(|e| *e *= f);
            }
        }
    } else if a != 1.0 {
        s.iter_mut().for_each(|e| *e *= a);
    }
    match rule {
        Rule::Delta => {
            u.copy_from_slice(v);
            for i in 0..dk {
                let ki = k[i];
                let row = &s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    u[j] -= row[j] * ki;
                }
            }
            u.iter_mut().for_each(|e| *e *= beta);
        }
        Rule::Plain => u.iter_mut().zip(v).for_each(|(e, vj)| *e = beta * vj),
    }
    for i in 0..dk {
        let ki = k[i];
        let row = &mut s[i * dv..(i + 1) * dv];
        for j in 0..dv {
            row[j] += ki * u[j];
        }
    }
}

/// Forward of one (sequence, head): writes o [T, dv] and leaves the final state in `s`.
fn forward_head(x: &[f32], d: Dims, (b, h): (usize, usize), scale: f32, rule: Rule, s: &mut [f32], o: &mut [f32]) {
    let (dk, dv) = (d.dk, d.dv);
    let mut u = vec![0f32; dv];
    for t in 0..d.t {
        let xt = &x[d.at(b, t, h)..d.at(b, t, h) + d.p()];
        step(s, xt, d, rule, &mut u);
        let q = &xt[..dk];
        let ot = &mut o[t * dv..(t + 1) * dv];
        ot.fill(0.0);
        for i in 0..dk {
            let qi = q[i] * scale;
            let row = &s[i * dv..(i + 1) * dv];
            for j in 0..dv {
                ot[j] += row[j] * qi;
            }
        }
    }
}

/// Runs the forward for all (sequence, head) pairs in parallel, from `initial` states
/// [B,H,dk,dv] (zeros when `None`); returns (o [B,T,H,dv], S [B,H,dk,dv]).
fn forward_all(x: &[f32], d: Dims, scale: f32, rule: Rule, initial: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let n = d.dk * d.dv;
    let per: Vec<(Vec<f32>, Vec<f32>)> = (0..d.b * d.h)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / d.h, bh % d.h);
            let mut s = match initial {
                Some(init) => init[bh * n..(bh + 1) * n].to_vec(),
                None => vec![0f32; n],
            };
            let mut o = vec![0f32; d.t * d.dv];
            forward_head(x, d, (b, h), scale, rule, &mut s, &mut o);
            (o, s)
        })
        .collect();
    let mut out = vec![0f32; d.b * d.t * d.h * d.dv];
    let mut states = Vec::with_capacity(d.b * d.h * d.dk * d.dv);
    for (bh, (o, s)) in per.into_iter().enumerate() {
        let (b, h) = (bh / d.h, bh % d.h);
        for t in 0..d.t {
            let dst = ((b * d.t + t) * d.h + h) * d.dv;
            out[dst..dst + d.dv].copy_from_slice(&o[t * d.dv..(t + 1) * d.dv]);
        }
        states.extend_from_slice(&s);
    }
    (out, states)
}

/// Reverse-mode gradient of one (sequence, head), accumulated into `gx` (packed like `x`).
fn backward_head(x: &[f32], go: &[f32], d: Dims, b: usize, h: usize, scale: f32, rule: Rule) -> Vec<(usize, Vec<f32>)> {
    let (dk, dv, p) = (d.dk, d.dv, d.p());
    let n = dk * dv;
    // States before each chunk.
    let mut checkpoints = Vec::new();
    let mut s = vec![0f32; n];
    let mut u = vec![0f32; dv];
    for t in 0..d.t {
        if t % CHUNK == 0 {
            checkpoints.push(s.clone());
        }
        step(&mut s, &x[d.at(b, t, h)..d.at(b, t, h) + p], d, rule, &mut u);
    }
    let mut ds = vec![0f32; n];
    let mut grads = Vec::with_capacity(d.t);
    let mut prev = vec![vec![0f32; n]; CHUNK];
    let (mut sp, mut st, mut dsp) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let (mut e, mut du) = (vec![0f32; dv], vec![0f32; dv]);
    for c in (0..checkpoints.len()).rev() {
        let t0 = c * CHUNK;
        let t1 = (t0 + CHUNK).min(d.t);
        // Re-compute S_{t-1} for every t of the chunk.
        let mut s = checkpoints[c].clone();
        for t in t0..t1 {
            prev[t - t0].copy_from_slice(&s);
            step(&mut s, &x[d.at(b, t, h)..d.at(b, t, h) + p], d, rule, &mut u);
        }
        for t in (t0..t1).rev() {
            let xt = &x[d.at(b, t, h)..d.at(b, t, h) + p];
            let (q, k, v) = (&xt[..dk], &xt[dk..2 * dk], &xt[2 * dk..2 * dk + dv]);
            let beta = xt[2 * dk + dv];
            let a = xt[2 * dk + dv + 1].exp();
            let do_t = &go[((b * d.t + t) * d.h + h) * dv..][..dv];
            let s_prev = &prev[t - t0];
            for i in 0..dk {
                let f = d.row_decay(xt, a, i);
                sp[i * dv..(i + 1) * dv].iter_mut().zip(&s_prev[i * dv..(i + 1) * dv]).for_each(|(o, s)| *o = f * s);
            }
            // e = v − S'ᵀk (delta) or v (plain); u = β e.
            e.copy_from_slice(v);
            if rule == Rule::Delta {
                for i in 0..dk {
                    for j in 0..dv {
                        e[j] -= sp[i * dv + j] * k[i];
                    }
                }
            }
            for i in 0..dk {
                for j in 0..dv {
                    st[i * dv + j] = sp[i * dv + j] + k[i] * beta * e[j];
                }
            }
            let mut g = vec![0f32; p];
            // o_t = S_tᵀ (scale q)
            for i in 0..dk {
                let mut acc = 0f32;
                for j in 0..dv {
                    acc += st[i * dv + j] * do_t[j];
                    ds[i * dv + j] += scale * q[i] * do_t[j];
                }
                g[i] = scale * acc;
            }
            // S_t = S' + k uᵀ
            dsp.copy_from_slice(&ds);
            du.fill(0.0);
            for i in 0..dk {
                let mut acc = 0f32;
                for j in 0..dv {
                    acc += ds[i * dv + j] * beta * e[j];
                    du[j] += ds[i * dv + j] * k[i];
                }
                g[dk + i] = acc;
            }
            // u = β e
            let dbeta: f32 = du.iter().zip(e.iter()).map(|(a, b)| a * b).sum();
            for j in 0..dv {
                g[2 * dk + j] = beta * du[j];
            }
            g[2 * dk + dv] = dbeta;
            if rule == Rule::Delta {
                // e = v − S'ᵀk: d(pred) = −β du
                for i in 0..dk {
                    let mut acc = 0f32;
                    for j in 0..dv {
                        let dpred = -beta * du[j];
                        dsp[i * dv + j] += k[i] * dpred;
                        acc += sp[i * dv + j] * dpred;
                    }
                    g[dk + i] += acc;
                }
            }
            // S' = a diag(exp gk) S_{t-1}: dg = Σ dS' ∘ S', dgk_i = Σ_j dS'_ij S'_ij
            g[2 * dk + dv + 1] = dsp.iter().zip(sp.iter()).map(|(a, b)| a * b).sum();
            for i in 0..dk {
                let row = i * dv..(i + 1) * dv;
                if d.gk {
                    g[2 * dk + dv + 2 + i] = dsp[row.clone()].iter().zip(&sp[row.clone()]).map(|(a, b)| a * b).sum();
                }
                let f = d.row_decay(xt, a, i);
                ds[row.clone()].iter_mut().zip(&dsp[row]).for_each(|(o, d)| *o = f * d);
            }
            grads.push((d.at(b, t, h), g));
        }
    }
    grads
}

struct RecurrenceOp {
    h: usize,
    dk: usize,
    dv: usize,
    scale: f32,
    rule: Rule,
    gk: bool,
}

impl RecurrenceOp {
    fn dims(&self, shape: &Shape) -> Result<Dims> {
        let (b, t, h, p) = shape.dims4()?;
        let d = Dims { b, t, h, dk: self.dk, dv: self.dv, gk: self.gk };
        if h != self.h || p != d.p() {
            candle_core::bail!("recurrence: packed input has shape {shape:?}, expected [B,T,{},{}]", self.h, d.p());
        }
        Ok(d)
    }
}

impl CustomOp1 for RecurrenceOp {
    fn name(&self) -> &'static str {
        "statecut-recurrence"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(layout.shape())?;
        let (start, end) = super::contiguous(layout, "recurrence")?;
        let x = &storage.as_slice::<f32>()?[start..end];
        let (o, _) = forward_all(x, d, self.scale, self.rule, None);
        Ok((CpuStorage::F32(o), Shape::from((d.b, d.t, d.h, d.dv))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let d = self.dims(arg.shape())?;
        let x = arg.flatten_all()?.to_vec1::<f32>()?;
        let go = grad_res.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let parts: Vec<Vec<(usize, Vec<f32>)>> = (0..d.b * d.h)
            .into_par_iter()
            .map(|bh| backward_head(&x, &go, d, bh / d.h, bh % d.h, self.scale, self.rule))
            .collect();
        let mut gx = vec![0f32; x.len()];
        for (off, g) in parts.into_iter().flatten() {
            gx[off..off + g.len()].copy_from_slice(&g);
        }
        Ok(Some(Tensor::from_vec(gx, arg.shape(), arg.device())?))
    }
}

/// The forward as one op over q, k, v (float32, contiguous [B,T,H,·]) with the other inputs
/// held by the op, output o [B,T,H,dv] followed by the final state [B,H,dk,dv], flat:
/// [`forward_all`] on the packed inputs on the CPU; one CUDA kernel reading every input where
/// it lies on GPUs (`recurrence` in cuda/recurrence.cu, the same sequential float32 math), so nothing
/// is packed there. Not differentiable.
struct FusedOp {
    op: RecurrenceOp,
    /// [B,T,H] float32
    beta: Tensor,
    /// [B,T,H] float32, or `None`: no decay
    g: Option<Tensor>,
    /// [B,T,H,dk] float32 per-key-channel log decay
    gk: Option<Tensor>,
    /// [B,H,dk,dv] float32 initial state
    s0: Tensor,
    /// The final state goes over `s0` (GPU only); the output is o alone.
    in_place: bool,
    /// The GPU may compute it in chunks on tensor cores ([`Kernel::FusedChunks`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    chunks: bool,
}

impl FusedOp {
    /// The sizes, once every input is checked against them: the kernels index by them alone.
    fn dims(&self, q: &Shape, k: &Shape, v: &Shape) -> Result<Dims> {
        let (b, t, h, dk) = q.dims4()?;
        let dv = self.op.dv;
        let ok = h == self.op.h
            && dk == self.op.dk
            && k.dims() == [b, t, h, dk]
            && v.dims() == [b, t, h, dv]
            && self.beta.dims() == [b, t, h]
            && self.g.as_ref().is_none_or(|g| g.dims() == [b, t, h])
            && self.gk.as_ref().is_none_or(|g| g.dims() == [b, t, h, dk])
            && self.s0.dims() == [b, h, dk, dv];
        if !ok {
            candle_core::bail!("recurrence: inputs of mismatched shapes (q {q:?}, k {k:?}, v {v:?})");
        }
        Ok(Dims { b, t, h, dk, dv, gk: self.op.gk })
    }
}

/// The packed [B,T,H,P] layout of the CPU kernels, q | k | v | beta | g | gk per token and head,
/// from row-major [B,T,H,·] inputs (g = 0, no decay, when absent): `Recurrence::packed` on
/// slices, for the fused op's CPU half, where no gradient flows.
fn pack(d: Dims, q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: Option<&[f32]>, gk: Option<&[f32]>) -> Vec<f32> {
    let (dk, dv) = (d.dk, d.dv);
    let mut x = Vec::with_capacity(d.b * d.t * d.h * d.p());
    for i in 0..d.b * d.t * d.h {
        x.extend_from_slice(&q[i * dk..(i + 1) * dk]);
        x.extend_from_slice(&k[i * dk..(i + 1) * dk]);
        x.extend_from_slice(&v[i * dv..(i + 1) * dv]);
        x.push(beta[i]);
        x.push(g.map_or(0.0, |g| g[i]));
        if let Some(gk) = gk {
            x.extend_from_slice(&gk[i * dk..(i + 1) * dk]);
        }
    }
    x
}

impl CustomOp3 for FusedOp {
    fn name(&self) -> &'static str {
        "statecut-recurrence-fused"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(ql.shape(), kl.shape(), vl.shape())?;
        if self.in_place {
            candle_core::bail!("recurrence: the in-place step runs on a GPU only");
        }
        let slice = |s: &CpuStorage, l: &Layout| -> Result<Vec<f32>> {
            let (a, b) = super::contiguous(l, "recurrence")?;
            Ok(s.as_slice::<f32>()?[a..b].to_vec())
        };
        let (q, k, v) = (slice(q, ql)?, slice(k, kl)?, slice(v, vl)?);
        let beta = cpu_f32(&self.beta)?;
        let g = self.g.as_ref().map(cpu_f32).transpose()?;
        let gk = self.gk.as_ref().map(cpu_f32).transpose()?;
        let x = pack(d, &q, &k, &v, &beta, g.as_deref(), gk.as_deref());
        let s0 = cpu_f32(&self.s0)?;
        let (mut o, s) = forward_all(&x, d, self.op.scale, self.op.rule, Some(&s0));
        o.extend_from_slice(&s);
        let n = o.len();
        Ok((CpuStorage::F32(o), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = self.dims(ql.shape(), kl.shape(), vl.shape())?;
        let dims = super::cuda::RecurrenceDims {
            b: d.b,
            t: d.t,
            h: d.h,
            dk: d.dk,
            dv: d.dv,
            delta: self.op.rule == Rule::Delta,
            scale: self.op.scale,
            chunks: self.chunks,
        };
        // The op's other inputs are read where they lie (read locks, as candle takes for q/k/v).
        let (beta, g, gk, s0) = (
            self.beta.storage_and_layout(),
            self.g.as_ref().map(|t| t.storage_and_layout()),
            self.gk.as_ref().map(|t| t.storage_and_layout()),
            self.s0.storage_and_layout(),
        );
        let inputs = super::cuda::RecurrenceInputs {
            q: (q, ql),
            k: (k, kl),
            v: (v, vl),
            beta: super::cuda::on_gpu(&beta.0, beta.1, "recurrence")?,
            g: g.as_ref().map(|(s, l)| super::cuda::on_gpu(s, l, "recurrence")).transpose()?,
            gk: gk.as_ref().map(|(s, l)| super::cuda::on_gpu(s, l, "recurrence")).transpose()?,
            s0: super::cuda::on_gpu(&s0.0, s0.1, "recurrence")?,
        };
        super::cuda::recurrence(&inputs, &dims, self.in_place)
    }
}

/// Which implementation computes a [`Recurrence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// This module's float32 CPU kernel (inputs on another device are copied to the host).
    Sequential,
    /// [`super::chunked`] in candle ops: batched matmuls on the inputs' own device,
    /// differentiable; the reference form.
    Chunked,
    /// [`super::chunked`] with its walk over chunks and its intra-chunk solve as statecut's own
    /// ops (one CUDA launch each way on GPUs), differentiable.
    ChunkedKernels,
    /// The sequential float32 recurrence as one op on the inputs' own device (one CUDA kernel
    /// on GPUs); not differentiable.
    Fused,
    /// The fused op, on GPUs with tensor cores computed in chunks with TF32 products (one CUDA
    /// kernel, `chunk_fused.cu`) for passes of [`FUSED_CHUNKS_FROM_TOKENS`] or more with a decay
    /// per head or none: for the 16-bit models' passes without gradients, whose layers ask for
    /// it ([`Self::fused_in_chunks`]); elsewhere as [`Self::Fused`].
    FusedChunks,
}

pub use super::fused_block::FUSED_CHUNKS_FROM_TOKENS;

impl Kernel {
    /// The chunked form when a gradient has to flow through the recurrence (the Grad selector,
    /// recovery; on the CPU the composed form, whose float64 intra-chunk solve keeps the decay
    /// gradients of strongly decaying heads within 1e-4 of PyTorch's float64 ones, where the
    /// sequential kernel's float32 backward drifts to 1e-3; on GPUs the same form on statecut's
    /// chunk kernels); otherwise the fused kernel on GPUs (a layer whose long sequences measured
    /// faster on the chunk kernels asks for them: [`Self::chunks_without_gradients`]) and the
    /// sequential kernel on the CPU, where the per-head loop is exact and fast for the model
    /// sizes that run there. `STATECUT_RECURRENCE=sequential|chunked|chunked-kernels|fused|fused-chunks`
    /// overrides the choice (for benchmarks and tests).
    pub fn choose(rec: &Recurrence) -> Kernel {
        let tracked = [Some(rec.q), Some(rec.k), Some(rec.v), Some(rec.beta), rec.g, rec.gk, rec.initial]
            .into_iter()
            .flatten()
            .any(Tensor::track_op)
            && !super::no_gradients();
        let gpu = !rec.q.device().is_cpu();
        // Asked only where a chunked form is chosen, not on every decoding step.
        let chunked = || match rec.q.dim(3).is_ok_and(|dk| walkable(rec.q.device(), dk)) {
            true => Kernel::ChunkedKernels,
            false => Kernel::Chunked,
        };
        let choice = Self::overridden().unwrap_or(if tracked {
            chunked()
        } else if rec.q.device().is_cpu() {
            Kernel::Sequential
        } else {
            Kernel::Fused
        });
        match choice {
            // The fused op has no backward: a tracked input needs one of the other two; its CUDA
            // kernel keeps at most 32 x 32 key rows of a state column in registers.
            Kernel::Fused | Kernel::FusedChunks if tracked || rec.q.dim(3).is_ok_and(|dk| dk > MAX_FUSED_DK) => {
                if gpu {
                    chunked()
                } else {
                    Kernel::Sequential
                }
            }
            k => k,
        }
    }

    /// The kernel `STATECUT_RECURRENCE` or [`Self::scoped`] asks for, if any.
    fn overridden() -> Option<Kernel> {
        static FROM_ENV: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
        let from_env = *FROM_ENV.get_or_init(|| match std::env::var("STATECUT_RECURRENCE").as_deref() {
            Ok("chunked") => Some(Kernel::Chunked),
            Ok("chunked-kernels") => Some(Kernel::ChunkedKernels),
            Ok("sequential") => Some(Kernel::Sequential),
            Ok("fused") => Some(Kernel::Fused),
            Ok("fused-chunks") => Some(Kernel::FusedChunks),
            _ => None,
        });
        FORCED.with(|f| f.get()).or(from_env)
    }

    /// Whether a delta-rule layer's pass without gradients over `b` sequences of `t` tokens, `h`
    /// heads with keys `dk` and values `dv` wide, on `device`, should run on the chunk kernels
    /// (given 16-bit values and no per-channel decay; the layer then hands them its values in
    /// their own dtype, not widened for the fused kernel, and scopes the recurrence to them):
    /// long sequences too few to fill the GPU ([`CHUNKS_FROM_TOKENS`], [`CHUNKS_UP_TO_BLOCKS`]),
    /// unless `STATECUT_RECURRENCE` or [`Self::scoped`] asks for a kernel.
    pub fn chunks_without_gradients(device: &Device, (b, t, h): (usize, usize, usize), dk: usize, dv: usize) -> bool {
        // The device is asked last: decoding steps pass here every token.
        let wanted = match Self::overridden() {
            Some(k) => k == Kernel::ChunkedKernels,
            None => long_and_few((b, t, h), dv),
        };
        wanted && walkable(device, dk)
    }

    /// Whether a layer's recurrence without gradients on `device`, for a model in `dtype`, should
    /// take the fused op's chunked form (the layer then scopes it to [`Kernel::FusedChunks`]):
    /// off the CPU, for 16-bit models (its TF32 products are finer than their inputs), unless
    /// `STATECUT_RECURRENCE` or [`Self::scoped`] asks for another kernel. On an H100 it measured
    /// faster than the sequential kernel at every shape timed, from one sequence to 64 and key
    /// widths 64 to 256 (docs/BENCHMARKS.md, "The fused op's chunked form timed").
    pub fn fused_in_chunks(device: &Device, dtype: DType) -> bool {
        let wanted = matches!(Self::overridden(), None | Some(Kernel::FusedChunks));
        !device.is_cpu() && matches!(dtype, DType::BF16 | DType::F16) && wanted
    }

    /// Whether a delta-rule recurrence with gradients on `device`, keys `dk` wide, runs on the
    /// chunk kernels (what [`Self::choose`] picks for tracked inputs there, unless
    /// `STATECUT_RECURRENCE` or [`Self::scoped`] asks for another form).
    pub fn chunk_kernels_with_gradients(device: &Device, dk: usize) -> bool {
        !super::no_gradients()
            && matches!(Self::overridden(), None | Some(Kernel::ChunkedKernels))
            && walkable(device, dk)
    }

    /// Run `f` with every recurrence this thread starts computed by `kernel` (where it applies).
    pub fn scoped<R>(kernel: Kernel, f: impl FnOnce() -> R) -> R {
        let before = FORCED.with(|c| c.replace(Some(kernel)));
        let out = f();
        FORCED.with(|c| c.set(before));
        out
    }
}

/// Whether the chunked form walks its chunks in statecut's own kernels on `device` for keys `dk`
/// wide: on a CUDA GPU, keys within the state tiles' `launch::MAX_DK` rows, and every chunk kernel's
/// shared memory within what the GPU gives a block (an A100 takes keys up to 128 wide). Elsewhere
/// the composed form runs.
fn walkable(device: &Device, dk: usize) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => super::cuda::chunk_kernels_fit(dev, dk),
        _ => {
            let _ = dk;
            false
        }
    }
}

/// Sequences long enough, and few enough to leave the fused kernel short of blocks (see
/// [`CHUNKS_FROM_TOKENS`]).
fn long_and_few((b, t, h): (usize, usize, usize), dv: usize) -> bool {
    t >= CHUNKS_FROM_TOKENS && b * h * dv.div_ceil(32) <= CHUNKS_UP_TO_BLOCKS
}

thread_local! {
    static FORCED: std::cell::Cell<Option<Kernel>> = const { std::cell::Cell::new(None) };
}

impl Recurrence<'_> {
    /// The [B, T, H, P] float32 packing of every input, on the host, in candle ops so that
    /// gradients flow back through it to q, k, v, beta and the gates (the sequential kernel's
    /// backward gives the gradient of the packed input). [`pack`] is the same layout from slices.
    fn packed(&self) -> Result<Tensor> {
        let f = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        let g = match self.g {
            Some(g) => f(g)?,
            None => Tensor::zeros(self.beta.shape(), DType::F32, &Device::Cpu)?,
        };
        let mut parts = vec![f(self.q)?, f(self.k)?, f(self.v)?, f(self.beta)?.unsqueeze(3)?, g.unsqueeze(3)?];
        if let Some(gk) = self.gk {
            parts.push(f(gk)?);
        }
        Tensor::cat(&parts, 3)?.contiguous()
    }

    fn op(&self) -> Result<RecurrenceOp> {
        let (_, _, h, dk) = self.q.dims4()?;
        Ok(RecurrenceOp { h, dk, dv: self.v.dim(3)?, scale: self.scale as f32, rule: self.rule, gk: self.gk.is_some() })
    }

    /// Outputs o [B, T, H, dv] (differentiable), on the input's device and dtype.
    pub fn forward(&self) -> Result<Tensor> {
        match Kernel::choose(self) {
            Kernel::Chunked => super::chunked::forward(self)?.0.to_dtype(self.v.dtype()),
            Kernel::ChunkedKernels => super::chunked::forward_in(self, Form::Kernels)?.0.to_dtype(self.v.dtype()),
            Kernel::Fused => self.fused_with_state()?.0.to_dtype(self.v.dtype()),
            Kernel::FusedChunks => self.fused(false, true)?.0.to_dtype(self.v.dtype()),
            Kernel::Sequential => self.forward_sequential(),
        }
    }

    /// Outputs o [B, T, H, dv] and the final state [B, H, dk, dv], both float32 on the inputs'
    /// device, through [`FusedOp`].
    pub fn fused_with_state(&self) -> Result<(Tensor, Tensor)> {
        self.fused_state(false)
    }

    /// [`Self::fused_with_state`], in chunks on tensor cores where `chunks` and the GPU's kernel
    /// has the shape ([`Kernel::FusedChunks`]).
    fn fused_state(&self, chunks: bool) -> Result<(Tensor, Tensor)> {
        let (o, s) = self.fused(false, chunks)?;
        Ok((o, s.expect("an out-of-place recurrence returns its state")))
    }

    /// o [B, T, H, dv] float32, the final state written over the initial one: a step replayed
    /// from a CUDA graph must read and write its state at fixed addresses. The initial state
    /// must be float32, contiguous and on the inputs' device (a converted copy would take the
    /// write instead); GPU only.
    pub fn fused_in_place(&self) -> Result<Tensor> {
        let ok = self
            .initial
            .is_some_and(|s| s.dtype() == DType::F32 && s.is_contiguous() && s.device().same_device(self.q.device()));
        if !ok {
            candle_core::bail!("recurrence: an in-place step needs a float32 contiguous state on the inputs' device");
        }
        Ok(self.fused(true, false)?.0)
    }

    fn fused(&self, in_place: bool, chunks: bool) -> Result<(Tensor, Option<Tensor>)> {
        let dev = self.q.device();
        let op = self.op()?;
        let f = |t: &Tensor| t.to_device(dev)?.to_dtype(DType::F32)?.contiguous();
        let (b, t, h, _) = self.q.dims4()?;
        let s0 = match self.initial {
            Some(s) => f(s)?,
            None => Tensor::zeros((b, h, op.dk, op.dv), DType::F32, dev)?,
        };
        // The kernels with a per-channel decay read the per-step one too: zeros stand in for it.
        let g = match (self.g, self.gk) {
            (None, Some(_)) => Some(Tensor::zeros(self.beta.shape(), DType::F32, dev)?),
            (g, _) => g.map(f).transpose()?,
        };
        let fused = FusedOp { beta: f(self.beta)?, g, gk: self.gk.map(f).transpose()?, s0, op, in_place, chunks };
        let (q, k, v) = (f(self.q)?, f(self.k)?, f(self.v)?);
        crate::profile::mark("recurrence: inputs to float32", dev);
        let out = q.apply_op3_no_bwd(&k, &v, &fused)?;
        let (dk, dv) = (fused.op.dk, fused.op.dv);
        let n = b * t * h * dv;
        let o = out.narrow(0, 0, n)?.reshape((b, t, h, dv))?;
        if in_place {
            return Ok((o, None));
        }
        let s = out.narrow(0, n, b * h * dk * dv)?.reshape((b, h, dk, dv))?;
        Ok((o, Some(s)))
    }

    /// [`Self::forward`] on the sequential kernel, whatever the device.
    pub fn forward_sequential(&self) -> Result<Tensor> {
        if self.initial.is_some() {
            return Ok(self.sequential_with_state()?.0);
        }
        let o = self.packed()?.apply_op1(self.op()?)?;
        o.to_device(self.q.device())?.to_dtype(self.v.dtype())
    }

    /// Outputs o [B, T, H, dv] and the final state S [B, H, dk, dv] (not differentiable).
    pub fn forward_with_state(&self) -> Result<(Tensor, Tensor)> {
        let (o, s) = match Kernel::choose(self) {
            Kernel::Chunked => super::chunked::forward(self)?,
            Kernel::ChunkedKernels => super::chunked::forward_in(self, Form::Kernels)?,
            Kernel::Fused => self.fused_with_state()?,
            Kernel::FusedChunks => self.fused_state(true)?,
            Kernel::Sequential => return self.sequential_with_state(),
        };
        Ok((o.to_dtype(self.v.dtype())?, s))
    }

    /// [`Self::forward_with_state`] on the sequential kernel, whatever the device.
    pub fn sequential_with_state(&self) -> Result<(Tensor, Tensor)> {
        let op = self.op()?;
        let x = self.packed()?;
        let d = op.dims(x.shape())?;
        let init = match self.initial {
            Some(s) => Some(s.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let (o, s) = forward_all(&x.flatten_all()?.to_vec1::<f32>()?, d, op.scale, op.rule, init.as_deref());
        let dev = self.q.device();
        let o = Tensor::from_vec(o, (d.b, d.t, d.h, d.dv), &Device::Cpu)?.to_device(dev)?;
        let s = Tensor::from_vec(s, (d.b, d.h, d.dk, d.dv), &Device::Cpu)?.to_device(dev)?;
        Ok((o.to_dtype(self.v.dtype())?, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rand_tensor(shape: &[usize], rng: &mut StdRng, scale: f32, offset: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * (rng.random::<f32>() - 0.5)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The chunk kernels take long sequences too few to fill the fused kernel's blocks, and
    /// never the CPU's passes.
    #[test]
    fn long_passes_of_few_sequences_take_the_chunk_kernels() {
        assert!(long_and_few((1, 2048, 16), 128), "one sequence, 64 blocks");
        assert!(long_and_few((2, 2048, 8), 256), "Gated DeltaNet 1.3B, two sequences: 128 blocks");
        assert!(!long_and_few((4, 2048, 16), 128), "256 blocks fill the GPU");
        assert!(!long_and_few((8, 2048, 8), 256), "a calibration pass");
        assert!(!long_and_few((1, CHUNKS_FROM_TOKENS - 1, 16), 128), "too short");
        assert!(!long_and_few((1, 1, 16), 128), "a decoding step");
        assert!(!Kernel::chunks_without_gradients(&Device::Cpu, (1, 4096, 16), 128, 128));
    }

    #[test]
    fn no_fused_chunks_on_the_cpu() {
        assert!(!Kernel::fused_in_chunks(&Device::Cpu, DType::BF16));
    }

    /// The recurrence written with candle tensor ops, one token at a time (independent check).
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        beta: &Tensor,
        g: &Tensor,
        gk: Option<&Tensor>,
        scale: f64,
        rule: Rule,
    ) -> (Tensor, Tensor) {
        let (b, t, h, dk) = q.dims4().unwrap();
        let dv = v.dim(3).unwrap();
        let mut s = Tensor::zeros((b, h, dk, dv), DType::F32, &Device::Cpu).unwrap();
        let mut outs = Vec::new();
        for i in 0..t {
            let qt = (q.narrow(1, i, 1).unwrap().squeeze(1).unwrap().contiguous().unwrap() * scale).unwrap(); // [b,h,dk]
            let kt = k.narrow(1, i, 1).unwrap().squeeze(1).unwrap().contiguous().unwrap();
            let vt = v.narrow(1, i, 1).unwrap().squeeze(1).unwrap();
            let bt = beta.narrow(1, i, 1).unwrap().squeeze(1).unwrap().unsqueeze(2).unwrap();
            let at = g
                .narrow(1, i, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
                .exp()
                .unwrap()
                .unsqueeze(2)
                .unwrap()
                .unsqueeze(3)
                .unwrap();
            s = s.broadcast_mul(&at).unwrap();
            if let Some(gk) = gk {
                // [b,h,dk,1]: row i of S scaled by exp(gk[i])
                let f = gk.narrow(1, i, 1).unwrap().squeeze(1).unwrap().exp().unwrap().unsqueeze(3).unwrap();
                s = s.broadcast_mul(&f).unwrap();
            }
            let pred = kt.unsqueeze(2).unwrap().matmul(&s).unwrap().squeeze(2).unwrap(); // [b,h,dv]
            let u = match rule {
                Rule::Delta => (vt - pred).unwrap().broadcast_mul(&bt).unwrap(),
                Rule::Plain => vt.broadcast_mul(&bt).unwrap(),
            };
            s = (s + kt.unsqueeze(3).unwrap().matmul(&u.unsqueeze(2).unwrap()).unwrap()).unwrap();
            outs.push(qt.unsqueeze(2).unwrap().matmul(&s).unwrap().squeeze(2).unwrap());
        }
        (Tensor::stack(&outs, 1).unwrap(), s)
    }

    fn inputs(t: usize) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
        let mut rng = StdRng::seed_from_u64(7);
        let (b, h, dk, dv) = (2, 3, 5, 4);
        (
            rand_tensor(&[b, t, h, dk], &mut rng, 1.0, 0.0),
            rand_tensor(&[b, t, h, dk], &mut rng, 0.8, 0.0),
            rand_tensor(&[b, t, h, dv], &mut rng, 2.0, 0.0),
            rand_tensor(&[b, t, h], &mut rng, 0.5, 0.5),
            rand_tensor(&[b, t, h], &mut rng, 0.2, -0.1),
            rand_tensor(&[b, t, h, dk], &mut rng, 0.3, -0.15),
        )
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn forward_matches_token_loop() {
        let (q, k, v, beta, g, gk) = inputs(37);
        for (rule, gk) in [(Rule::Delta, None), (Rule::Plain, None), (Rule::Delta, Some(&gk)), (Rule::Plain, Some(&gk))]
        {
            let rec = Recurrence { q: &q, k: &k, v: &v, beta: &beta, g: Some(&g), gk, scale: 0.7, rule, initial: None };
            let (o, s) = rec.forward_with_state().unwrap();
            let (o2, s2) = naive(&q, &k, &v, &beta, &g, gk, 0.7, rule);
            let with = gk.is_some();
            assert!(max_abs_diff(&o, &o2) < 1e-4, "{rule:?} gk {with}: outputs differ");
            assert!(max_abs_diff(&s, &s2) < 1e-4, "{rule:?} gk {with}: states differ");
            assert!(max_abs_diff(&rec.forward().unwrap(), &o2) < 1e-4);
        }
    }

    /// The fused op (whose CPU half is the reference for the CUDA kernel) gives the sequential
    /// kernel's outputs and states, with and without an initial state and per-channel decay.
    #[test]
    fn fused_op_matches_sequential() {
        let (q, k, v, beta, g, gk) = inputs(37);
        let s0 = rand_tensor(&[2, 3, 5, 4], &mut StdRng::seed_from_u64(9), 1.0, 0.0);
        for (rule, gk) in [(Rule::Delta, None), (Rule::Plain, None), (Rule::Delta, Some(&gk)), (Rule::Plain, Some(&gk))]
        {
            for init in [None, Some(&s0)] {
                let rec =
                    Recurrence { q: &q, k: &k, v: &v, beta: &beta, g: Some(&g), gk, scale: 0.7, rule, initial: init };
                let (o, s) = rec.fused_with_state().unwrap();
                let (o2, s2) = rec.sequential_with_state().unwrap();
                let what = format!("{rule:?} gk {} init {}", gk.is_some(), init.is_some());
                assert_eq!(max_abs_diff(&o, &o2), 0.0, "{what}");
                assert_eq!(max_abs_diff(&s, &s2), 0.0, "{what}");
                let forced = Kernel::scoped(Kernel::Fused, || rec.forward().unwrap());
                assert_eq!(max_abs_diff(&forced, &o2), 0.0, "{what}");
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        // T = 70 crosses a checkpoint boundary of the backward.
        let (q, k, v, beta, g, gk) = inputs(70);
        for (rule, gk) in [(Rule::Delta, None), (Rule::Plain, None), (Rule::Delta, Some(&gk)), (Rule::Plain, Some(&gk))]
        {
            let rec = Recurrence { q: &q, k: &k, v: &v, beta: &beta, g: Some(&g), gk, scale: 0.7, rule, initial: None };
            let packed = rec.packed().unwrap();
            let op = || RecurrenceOp { h: 3, dk: 5, dv: 4, scale: 0.7, rule, gk: gk.is_some() };
            let var = candle_core::Var::from_tensor(&packed).unwrap();
            let mut rng = StdRng::seed_from_u64(3);
            let w = rand_tensor(&[2, 70, 3, 4], &mut rng, 2.0, 0.0);
            let loss = |x: &Tensor| (x.apply_op1(op()).unwrap() * &w).unwrap().sum_all().unwrap();
            let grads = loss(var.as_tensor()).backward().unwrap();
            let gx = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let x0 = packed.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let gmax = gx.iter().fold(0f32, |a, b| a.max(b.abs()));
            // Probe a spread of coordinates (every field of the packed layout gets hit).
            let p = x0.len() / (2 * 70 * 3);
            let probes: Vec<usize> =
                (0..x0.len()).step_by(97).chain((p - 5..p).flat_map(|f| [f, 40 * 3 * p + p + f])).collect();
            for idx in probes {
                let eps = 1e-2f32;
                let at = |d: f32| {
                    let mut x = x0.clone();
                    x[idx] += d;
                    let t = Tensor::from_vec(x, packed.shape(), &Device::Cpu).unwrap();
                    loss(&t).to_scalar::<f32>().unwrap()
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                assert!(
                    (fd - gx[idx]).abs() < 2e-3 * gmax.max(1.0),
                    "{rule:?} grad[{idx}]: analytic {} vs numeric {fd}",
                    gx[idx]
                );
            }
        }
    }
}
