//! The outputs of the chunked delta rule ([`super::chunked`]) from the walk's U and chunk-start
//! states, as one op with its own backward, for a decay per head (or none).
//!
//! Per chunk with queries and keys Q, K [C, dk] (Q̃ = scale·Q), U [C, dv], start state S [dk, dv]
//! and the in-chunk cumulative log decay γ [C]:
//!   P = Q̃ Kᵀ ∘ D,  D_tj = e^{γ_t − γ_j} for j ≤ t, else 0
//!   O = diag(e^γ) Q̃ S + P U
//! The backward, from dO, with E = dO Uᵀ ∘ D (j ≤ t):
//!   dU = Pᵀ dO,  dS = Q̃ᵀ diag(e^γ) dO,  dQ̃ = diag(e^γ) dO Sᵀ + E K,  dK = Eᵀ Q̃
//!   with F_tj = (dO Uᵀ)_tj P_tj:  dγ_t = e^{γ_t} q̃_t·(dO S ᵀ)_t + Σ_{j<t} F_tj − Σ_{s>t} F_st
//! In candle ops these are two [C, C] products, the decay masks and the decayed queries, each a
//! full-size tensor kept for autograd; here one launch each way, one block per chunk and head.

pub(crate) use super::launch::OutDims;
use super::{cpu_f32, cpu_slice as slice};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

impl OutDims {
    fn blocks(&self) -> usize {
        self.n * self.bh
    }
    pub(crate) fn qk_len(&self) -> usize {
        self.blocks() * self.c * 2 * self.dk
    }
    pub(crate) fn u_len(&self) -> usize {
        self.blocks() * self.c * self.dv
    }
    pub(crate) fn walked_len(&self) -> usize {
        self.u_len() + (self.n + 1) * self.bh * self.dk * self.dv
    }
    pub(crate) fn o_len(&self) -> usize {
        self.u_len()
    }
    pub(crate) fn scalars(&self) -> usize {
        self.blocks() * self.c
    }
}

/// O [N,BH,C,dv] float32, differentiable in every input: qk [N,BH,C,2dk] (queries then keys, the
/// queries unscaled), `walked` the walk's flat output (U [N,BH,C,dv] then the states
/// [N+1,BH,dk,dv]) and γ [N,BH,C] (no decay without it). `tensor`: see [`OutDims::tensor`].
#[cfg(test)]
pub(crate) fn output(
    qk: &Tensor,
    walked: &Tensor,
    gamma: Option<&Tensor>,
    scale: f32,
    dv: usize,
    tensor: bool,
) -> Result<Tensor> {
    let (n, bh, c, _) = qk.dims4()?;
    let (op, gamma) = op(qk, gamma, scale, dv, tensor)?;
    let o = qk.contiguous()?.apply_op3(&walked.contiguous()?, &gamma, op)?;
    o.reshape((n, bh, c, dv))
}

/// The outputs as an op, and its third input (γ [N,BH,C] float32, zeros without a decay): for a
/// caller that runs the op's backward itself.
pub(crate) fn op(qk: &Tensor, gamma: Option<&Tensor>, scale: f32, dv: usize, tensor: bool) -> Result<(Out, Tensor)> {
    let (n, bh, c, dk2) = qk.dims4()?;
    let gamma = match gamma {
        Some(g) => g.to_dtype(DType::F32)?.contiguous()?,
        None => Tensor::zeros((n, bh, c), DType::F32, qk.device())?,
    };
    Ok((Out(OutDims { n, bh, c, dk: dk2 / 2, dv, scale, tensor }), gamma))
}

pub(crate) struct Out(OutDims);

/// One chunk's inputs on the CPU.
struct Chunk<'a> {
    d: OutDims,
    qk: &'a [f32],
    u: &'a [f32],
    s: &'a [f32],
    gamma: &'a [f32],
}

impl<'a> Chunk<'a> {
    fn of(d: OutDims, b: usize, qk: &'a [f32], walked: &'a [f32], gamma: &'a [f32]) -> Chunk<'a> {
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        Chunk {
            d,
            qk: &qk[b * c * 2 * dk..][..c * 2 * dk],
            u: &walked[b * c * dv..][..c * dv],
            s: &walked[d.u_len() + b * dk * dv..][..dk * dv],
            gamma: &gamma[b * c..][..c],
        }
    }
    fn q(&self, t: usize, r: usize) -> f32 {
        self.d.scale * self.qk[t * 2 * self.d.dk + r]
    }
    fn k(&self, t: usize, r: usize) -> f32 {
        self.qk[t * 2 * self.d.dk + self.d.dk + r]
    }
    /// P = Q̃ Kᵀ ∘ D, row-major [C, C].
    fn p(&self) -> Vec<f32> {
        let (c, dk) = (self.d.c, self.d.dk);
        let mut p = vec![0f32; c * c];
        for t in 0..c {
            for j in 0..=t {
                let dot: f32 = (0..dk).map(|r| self.q(t, r) * self.k(j, r)).sum();
                p[t * c + j] = dot * (self.gamma[t] - self.gamma[j]).exp();
            }
        }
        p
    }
}

impl CustomOp3 for Out {
    fn name(&self) -> &'static str {
        "statecut-chunk-out"
    }

    fn cpu_fwd(
        &self,
        qk: &CpuStorage,
        ql: &Layout,
        walked: &CpuStorage,
        wl: &Layout,
        gamma: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.0;
        let what = "chunk outputs";
        let (qk, walked, gamma) = (slice(qk, ql, what)?, slice(walked, wl, what)?, slice(gamma, gl, what)?);
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        let mut out = vec![0f32; d.o_len()];
        out.par_chunks_mut(c * dv).enumerate().for_each(|(b, o)| {
            let ch = Chunk::of(d, b, qk, walked, gamma);
            let p = ch.p();
            for t in 0..c {
                let e = ch.gamma[t].exp();
                for col in 0..dv {
                    let inter: f32 = (0..dk).map(|r| ch.q(t, r) * ch.s[r * dv + col]).sum();
                    let intra: f32 = (0..=t).map(|j| p[t * c + j] * ch.u[j * dv + col]).sum();
                    o[t * dv + col] = e * inter + intra;
                }
            }
        });
        Ok((CpuStorage::F32(out), Shape::from(d.o_len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qk: &candle_core::CudaStorage,
        ql: &Layout,
        walked: &candle_core::CudaStorage,
        wl: &Layout,
        gamma: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::chunk_out(&self.0, (qk, ql), (walked, wl), (gamma, gl))
    }

    fn bwd(
        &self,
        qk: &Tensor,
        walked: &Tensor,
        gamma: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.0;
        let back =
            OutBack { d, qk: qk.clone(), walked: walked.clone(), gamma: gamma.clone(), rest: Default::default() };
        let dqk = grad.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&back)?.reshape(qk.shape())?;
        let rest = back.take_rest()?;
        let dwalked = rest.narrow(0, 0, d.walked_len())?.reshape(walked.shape())?;
        let dgamma = rest.narrow(0, d.walked_len(), d.scalars())?.reshape(gamma.shape())?;
        Ok((Some(dqk), Some(dwalked), Some(dgamma)))
    }
}

/// The outputs' backward: from dO, the gradient of qk as the op's output, and those of the walk's
/// flat output (U, then the states, the last of which O does not read) and of γ, flat in that
/// order, in `rest`. Two buffers, so that the walk's gradients can be freed once read while dqk
/// is still being summed into.
struct OutBack {
    d: OutDims,
    qk: Tensor,
    walked: Tensor,
    gamma: Tensor,
    rest: std::sync::Mutex<Option<Tensor>>,
}

impl OutBack {
    fn slot(&self) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.rest.lock().map_err(|_| candle_core::Error::Msg("chunk outputs: poisoned".into()))
    }
    fn keep_rest(&self, rest: Tensor) -> Result<()> {
        *self.slot()? = Some(rest);
        Ok(())
    }
    fn take_rest(&self) -> Result<Tensor> {
        self.slot()?.take().ok_or_else(|| candle_core::Error::Msg("chunk outputs: no backward ran".into()))
    }
}

impl CustomOp1 for OutBack {
    fn name(&self) -> &'static str {
        "statecut-chunk-out-backward"
    }

    fn cpu_fwd(&self, grad: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.d;
        let grad = slice(grad, gl, "chunk outputs backward")?;
        let (qk, walked, gamma) = (cpu_f32(&self.qk)?, cpu_f32(&self.walked)?, cpu_f32(&self.gamma)?);
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        type Grads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let blocks: Vec<Grads> = (0..d.blocks())
            .into_par_iter()
            .map(|b| chunk_backward(&Chunk::of(d, b, &qk, &walked, &gamma), &grad[b * c * dv..][..c * dv]))
            .collect();
        let lw = d.walked_len();
        let (mut dqk, mut rest) = (vec![0f32; d.qk_len()], vec![0f32; lw + d.scalars()]);
        for (b, (gqk, gu, gs, gg)) in blocks.iter().enumerate() {
            dqk[b * c * 2 * dk..][..c * 2 * dk].copy_from_slice(gqk);
            rest[b * c * dv..][..c * dv].copy_from_slice(gu);
            rest[d.u_len() + b * dk * dv..][..dk * dv].copy_from_slice(gs);
            rest[lw + b * c..][..c].copy_from_slice(gg);
        }
        self.keep_rest(Tensor::from_vec(rest, lw + d.scalars(), &candle_core::Device::Cpu)?)?;
        let n = dqk.len();
        Ok((CpuStorage::F32(dqk), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, grad: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (qk, walked, gamma) =
            (self.qk.storage_and_layout(), self.walked.storage_and_layout(), self.gamma.storage_and_layout());
        let (dqk, (rest, shape)) = super::cuda::chunk_out_back(
            &self.d,
            (grad, gl),
            super::cuda::on_gpu(&qk.0, qk.1, "chunk outputs")?,
            super::cuda::on_gpu(&walked.0, walked.1, "chunk outputs")?,
            super::cuda::on_gpu(&gamma.0, gamma.1, "chunk outputs")?,
        )?;
        let none = candle_core::op::BackpropOp::none();
        self.keep_rest(Tensor::from_storage(candle_core::Storage::Cuda(rest), shape, none, false))?;
        Ok(dqk)
    }
}

/// One chunk's (dqk, dU, dS, dγ) from dO (the module's formulas).
fn chunk_backward(ch: &Chunk, go: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (c, dk, dv, scale) = (ch.d.c, ch.d.dk, ch.d.dv, ch.d.scale);
    let p = ch.p();
    let (mut gqk, mut gu, mut gs, mut gg) =
        (vec![0f32; c * 2 * dk], vec![0f32; c * dv], vec![0f32; dk * dv], vec![0f32; c]);
    for j in 0..c {
        for col in 0..dv {
            gu[j * dv + col] = (j..c).map(|t| p[t * c + j] * go[t * dv + col]).sum();
        }
    }
    for r in 0..dk {
        for col in 0..dv {
            gs[r * dv + col] = (0..c).map(|t| ch.q(t, r) * ch.gamma[t].exp() * go[t * dv + col]).sum();
        }
    }
    // E ∘ D (j ≤ t) and F = (dO Uᵀ) ∘ P.
    let mut ed = vec![0f32; c * c];
    for t in 0..c {
        for j in 0..=t {
            let e: f32 = (0..dv).map(|col| go[t * dv + col] * ch.u[j * dv + col]).sum();
            ed[t * c + j] = e * (ch.gamma[t] - ch.gamma[j]).exp();
            if j < t {
                let f = e * p[t * c + j];
                gg[t] += f;
                gg[j] -= f;
            }
        }
    }
    for t in 0..c {
        let e = ch.gamma[t].exp();
        let mut decayed = 0f32;
        for r in 0..dk {
            let inter = e * (0..dv).map(|col| go[t * dv + col] * ch.s[r * dv + col]).sum::<f32>();
            decayed += inter * ch.q(t, r);
            let intra: f32 = (0..=t).map(|j| ed[t * c + j] * ch.k(j, r)).sum();
            gqk[t * 2 * dk + r] = scale * (inter + intra);
            gqk[t * 2 * dk + dk + r] = (t..c).map(|s| ed[s * c + t] * ch.q(s, r)).sum();
        }
        gg[t] += decayed;
    }
    (gqk, gu, gs, gg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The outputs in candle ops, as the composed form writes them: the reference.
    fn composed(qk: &Tensor, walked: &Tensor, gamma: &Tensor, scale: f64, dv: usize) -> Tensor {
        let (n, bh, c, dk2) = qk.dims4().unwrap();
        let dk = dk2 / 2;
        let q = (qk.narrow(3, 0, dk).unwrap() * scale).unwrap();
        let k = qk.narrow(3, dk, dk).unwrap();
        let u = walked.narrow(0, 0, n * bh * c * dv).unwrap().reshape((n, bh, c, dv)).unwrap();
        let s = walked.narrow(0, n * bh * c * dv, n * bh * dk * dv).unwrap().reshape((n, bh, dk, dv)).unwrap();
        let causal: Vec<f32> = (0..c * c).map(|i| if i % c <= i / c { 1.0 } else { 0.0 }).collect();
        let causal = Tensor::from_vec(causal, (c, c), qk.device()).unwrap();
        let diff = gamma.unsqueeze(3).unwrap().broadcast_sub(&gamma.unsqueeze(2).unwrap()).unwrap();
        let decay = diff.broadcast_mul(&causal).unwrap().exp().unwrap().broadcast_mul(&causal).unwrap();
        let p = (q.matmul(&k.t().unwrap()).unwrap() * decay).unwrap();
        let qd = q.broadcast_mul(&gamma.exp().unwrap().unsqueeze(3).unwrap()).unwrap();
        (qd.matmul(&s).unwrap() + p.matmul(&u).unwrap()).unwrap()
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let num = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        num / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt().max(1e-30)
    }

    /// Outputs and every input's gradient against the composed products, with and without decay,
    /// at chunk sizes 1 to 64 and widths that do not fill a GPU tile.
    #[test]
    fn matches_composed_outputs() {
        let dev = Device::Cpu;
        for (n, bh, c, dk, dv) in [(2, 3, 8, 6, 5), (1, 1, 1, 3, 2), (1, 2, 64, 48, 20), (3, 1, 16, 33, 40)] {
            for gated in [true, false] {
                let qk = Var::from_tensor(&Tensor::randn(0f32, 0.5, (n, bh, c, 2 * dk), &dev).unwrap()).unwrap();
                let len = n * bh * c * dv + (n + 1) * bh * dk * dv;
                let walked = Var::from_tensor(&Tensor::randn(0f32, 1.0, len, &dev).unwrap()).unwrap();
                let steps = Tensor::rand(-0.3f32, 0.0, (n, bh, c), &dev).unwrap();
                let gamma =
                    Var::from_tensor(&(steps.cumsum(2).unwrap() * if gated { 1.0 } else { 0.0 }).unwrap()).unwrap();
                let go = Tensor::randn(0f32, 1.0, (n, bh, c, dv), &dev).unwrap();
                let run = |fast: bool| {
                    let o = if fast {
                        output(qk.as_tensor(), walked.as_tensor(), gated.then(|| gamma.as_tensor()), 0.7, dv, false)
                            .unwrap()
                    } else {
                        composed(qk.as_tensor(), walked.as_tensor(), gamma.as_tensor(), 0.7, dv)
                    };
                    let grads = (&o * &go).unwrap().sum_all().unwrap().backward().unwrap();
                    let mut vars = vec![&qk, &walked];
                    if gated {
                        vars.push(&gamma);
                    }
                    let g: Vec<Tensor> = vars.iter().map(|x| grads.get(x.as_tensor()).unwrap().clone()).collect();
                    (o, g)
                };
                let ((o1, g1), (o2, g2)) = (run(true), run(false));
                let what = format!("n {n} bh {bh} c {c} dk {dk} dv {dv} gated {gated}");
                assert!(rel(&o1, &o2) < 1e-5, "{what}: outputs differ by {}", rel(&o1, &o2));
                for (name, (a, b)) in ["qk", "walked", "gamma"].iter().zip(g1.iter().zip(&g2)) {
                    assert!(rel(a, b) < 1e-5, "{what}: d{name} differs by {}", rel(a, b));
                }
            }
        }
    }
}
