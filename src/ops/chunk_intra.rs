//! The intra-chunk solve of the chunked delta rule ([`super::chunked`]) as one op with its own
//! backward, for a decay per head (or none).
//!
//! Per chunk of C tokens with keys K [C, dk], values V [C, dv], β [C] and the in-chunk cumulative
//! log decay γ [C] (zeros without a gate):
//!   A_tj = −β_t e^{γ_t − γ_j} (k_t · k_j) for j < t, else 0;   T = (I − A)⁻¹
//!   X = diag(β) V,   Y = diag(β e^γ) K,   W = T X,   Kc = T Y
//! T is solved in float32 (on the GPU by 16 x 16 blocks, as fla's `solve_tril`) and never leaves the op:
//! the backward recomputes it from K, β and γ, so a pass keeps only the op's inputs.
//!
//! The backward, from dW and dKc:
//!   dX = Tᵀ dW,  dY = Tᵀ dKc,  dT = dW Xᵀ + dKc Yᵀ,  dA = Tᵀ dT Tᵀ (strictly lower part)
//!   with P_tj = dA_tj A_tj and dG_tj = −β_t e^{γ_t − γ_j} dA_tj (j < t):
//!   dK = dG K + dGᵀ K + diag(β e^γ) dY,   dV = diag(β) dX
//!   dβ_t = Σ_j P_tj / β_t (written without the division) + v_t·dX_t + e^{γ_t} k_t·dY_t
//!   dγ_t = Σ_j P_tj − Σ_s P_st + β_t e^{γ_t} k_t·dY_t
//! In candle ops this is a dozen [N, B·H, C, C] tensors kept for autograd and as many launches each
//! way; here it is one launch each way, one block per chunk and head. The composed form's solve,
//! in float64 candle ops, is here too ([`unit_lower_inverse`]): the reference of this op's tests.

pub(crate) use super::launch::IntraDims;
use super::{cpu_f32, cpu_slice as slice};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

impl IntraDims {
    fn blocks(&self) -> usize {
        self.n * self.bh
    }
    pub(crate) fn k_len(&self) -> usize {
        self.blocks() * self.c * self.dk
    }
    pub(crate) fn v_len(&self) -> usize {
        self.blocks() * self.c * self.dv
    }
    fn scalars(&self) -> usize {
        self.blocks() * self.c
    }
}

/// W [N,BH,C,dv] then Kc [N,BH,C,dk], float32 and flat in one buffer (as the walk reads them),
/// differentiable in every input: k [N,BH,C,dk], v [N,BH,C,dv], β [N,BH,C] and γ [N,BH,C] (no
/// decay without it). `tensor`: see [`IntraDims::tensor`].
#[cfg(test)]
pub(crate) fn solve_flat(
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    gamma: Option<&Tensor>,
    tensor: bool,
) -> Result<Tensor> {
    let f32 = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
    let (op, scal) = op(k, v, beta, gamma, tensor)?;
    f32(k)?.apply_op3(&f32(v)?, &scal, op)
}

/// The solve as an op, and its third input (β then γ [2,N,BH,C] float32, γ zeros without a
/// decay): for a caller that runs the op's backward itself.
pub(crate) fn op(
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    gamma: Option<&Tensor>,
    tensor: bool,
) -> Result<(Intra, Tensor)> {
    let (n, bh, c, dk) = k.dims4()?;
    let dv = v.dim(3)?;
    let f32 = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
    let gamma = match gamma {
        Some(g) => f32(g)?,
        None => Tensor::zeros((n, bh, c), DType::F32, k.device())?,
    };
    Ok((Intra(IntraDims { n, bh, c, dk, dv, tensor }), Tensor::stack(&[f32(beta)?, gamma], 0)?))
}

/// [`solve_flat`]'s (W, Kc) as tensors of their own shapes.
#[cfg(test)]
pub(crate) fn solve(k: &Tensor, v: &Tensor, beta: &Tensor, gamma: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (n, bh, c, dk) = k.dims4()?;
    let dv = v.dim(3)?;
    let out = solve_flat(k, v, beta, gamma, false)?;
    let w = out.narrow(0, 0, n * bh * c * dv)?.reshape((n, bh, c, dv))?;
    let kc = out.narrow(0, n * bh * c * dv, n * bh * c * dk)?.reshape((n, bh, c, dk))?;
    Ok((w, kc))
}

pub(crate) struct Intra(IntraDims);

/// One chunk's inputs on the CPU.
struct Chunk<'a> {
    c: usize,
    dk: usize,
    dv: usize,
    k: &'a [f32],
    v: &'a [f32],
    beta: &'a [f32],
    gamma: &'a [f32],
}

impl<'a> Chunk<'a> {
    /// Block `b`'s chunk of the flat inputs.
    fn of(d: IntraDims, b: usize, k: &'a [f32], v: &'a [f32], beta: &'a [f32], gamma: &'a [f32]) -> Chunk<'a> {
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        Chunk {
            c,
            dk,
            dv,
            k: &k[b * c * dk..][..c * dk],
            v: &v[b * c * dv..][..c * dv],
            beta: &beta[b * c..][..c],
            gamma: &gamma[b * c..][..c],
        }
    }

    /// G = K Kᵀ (strictly lower part) and T = (I − A)⁻¹, both [C, C] row-major.
    fn solve(&self) -> (Vec<f32>, Vec<f32>) {
        let (c, dk) = (self.c, self.dk);
        let mut g = vec![0f32; c * c];
        for t in 0..c {
            for j in 0..t {
                g[t * c + j] = (0..dk).map(|r| self.k[t * dk + r] * self.k[j * dk + r]).sum();
            }
        }
        let mut tm = vec![0f32; c * c];
        for i in 0..c {
            tm[i * c + i] = 1.0;
            for j in 0..i {
                let aij = self.a(&g, i, j);
                for col in 0..=j {
                    tm[i * c + col] += aij * tm[j * c + col];
                }
            }
        }
        (g, tm)
    }

    /// A_tj (j < t) from G.
    fn a(&self, g: &[f32], t: usize, j: usize) -> f32 {
        -self.beta[t] * (self.gamma[t] - self.gamma[j]).exp() * g[t * self.c + j]
    }

    /// Row j of Y = diag(β e^γ) K, as its scale.
    fn y_scale(&self, j: usize) -> f32 {
        self.beta[j] * self.gamma[j].exp()
    }
}

impl CustomOp3 for Intra {
    fn name(&self) -> &'static str {
        "statecut-chunk-intra"
    }

    fn cpu_fwd(
        &self,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
        scal: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.0;
        let (k, v, scal) =
            (slice(k, kl, "chunk solve")?, slice(v, vl, "chunk solve")?, slice(scal, sl, "chunk solve")?);
        let (beta, gamma) = scal.split_at(d.scalars());
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..d.blocks())
            .into_par_iter()
            .map(|b| {
                let ch = Chunk::of(d, b, k, v, beta, gamma);
                let (_, tm) = ch.solve();
                let (mut w, mut kc) = (vec![0f32; c * dv], vec![0f32; c * dk]);
                for t in 0..c {
                    for j in 0..=t {
                        let x = tm[t * c + j] * ch.beta[j];
                        let y = tm[t * c + j] * ch.y_scale(j);
                        for col in 0..dv {
                            w[t * dv + col] += x * ch.v[j * dv + col];
                        }
                        for r in 0..dk {
                            kc[t * dk + r] += y * ch.k[j * dk + r];
                        }
                    }
                }
                (w, kc)
            })
            .collect();
        let mut out = vec![0f32; d.v_len() + d.k_len()];
        let (w_out, kc_out) = out.split_at_mut(d.v_len());
        for (b, (w, kc)) in blocks.iter().enumerate() {
            w_out[b * c * dv..][..c * dv].copy_from_slice(w);
            kc_out[b * c * dk..][..c * dk].copy_from_slice(kc);
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
        scal: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::chunk_intra(&self.0, (k, kl), (v, vl), (scal, sl))
    }

    fn bwd(
        &self,
        k: &Tensor,
        v: &Tensor,
        scal: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.0;
        let dw = grad.narrow(0, 0, d.v_len())?;
        let dkc = grad.narrow(0, d.v_len(), d.k_len())?;
        let (dk, dv, ds) = self.grads(k, v, scal, &dw, &dkc, 1.0)?;
        Ok((Some(dk), Some(dv), Some(ds)))
    }
}

impl Intra {
    /// The backward from dW and `kc_sign` · dKc as separate tensors (the walk's backward gives
    /// −dKc's product as it comes, and the sign is free in the kernel): dk, dv, and β | γ.
    pub(crate) fn grads(
        &self,
        k: &Tensor,
        v: &Tensor,
        scal: &Tensor,
        dw: &Tensor,
        dkc: &Tensor,
        kc_sign: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let d = self.0;
        let back = IntraBack { d, k: k.clone(), v: v.clone(), scal: scal.clone(), kc_sign };
        let f32 = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
        let out = f32(dw)?.apply_op2_no_bwd(&f32(dkc)?, &back)?;
        let dk = out.narrow(0, 0, d.k_len())?.reshape(k.shape())?;
        let dv = out.narrow(0, d.k_len(), d.v_len())?.reshape(v.shape())?;
        let ds = out.narrow(0, d.k_len() + d.v_len(), 2 * d.scalars())?.reshape(scal.shape())?;
        Ok((dk, dv, ds))
    }
}

/// The solve's backward: from the gradients of its outputs W and (times `kc_sign`) Kc, the
/// gradients of k, v, and of β then γ, flat in that order.
struct IntraBack {
    d: IntraDims,
    k: Tensor,
    v: Tensor,
    scal: Tensor,
    kc_sign: f32,
}

impl CustomOp2 for IntraBack {
    fn name(&self) -> &'static str {
        "statecut-chunk-intra-backward"
    }

    fn cpu_fwd(&self, gw: &CpuStorage, wl: &Layout, gkc: &CpuStorage, kl: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.d;
        let gw = slice(gw, wl, "chunk solve backward")?;
        let gkc = slice(gkc, kl, "chunk solve backward")?;
        let (k, v, scal) = (cpu_f32(&self.k)?, cpu_f32(&self.v)?, cpu_f32(&self.scal)?);
        let (beta, gamma) = scal.split_at(d.scalars());
        let (c, dk, dv) = (d.c, d.dk, d.dv);
        type Grads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        let blocks: Vec<Grads> = (0..d.blocks())
            .into_par_iter()
            .map(|b| {
                let ch = Chunk::of(d, b, &k, &v, beta, gamma);
                let dw = &gw[b * c * dv..][..c * dv];
                let dkc: Vec<f32> = gkc[b * c * dk..][..c * dk].iter().map(|x| self.kc_sign * x).collect();
                chunk_backward(&ch, dw, &dkc)
            })
            .collect();
        let (lk, lv, ls) = (d.k_len(), d.v_len(), d.scalars());
        let mut out = vec![0f32; lk + lv + 2 * ls];
        for (b, (gk, gv, gb, gg)) in blocks.iter().enumerate() {
            out[b * c * dk..][..c * dk].copy_from_slice(gk);
            out[lk + b * c * dv..][..c * dv].copy_from_slice(gv);
            out[lk + lv + b * c..][..c].copy_from_slice(gb);
            out[lk + lv + ls + b * c..][..c].copy_from_slice(gg);
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gw: &candle_core::CudaStorage,
        wl: &Layout,
        gkc: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (k, v, scal) = (self.k.storage_and_layout(), self.v.storage_and_layout(), self.scal.storage_and_layout());
        super::cuda::chunk_intra_back(
            &self.d,
            ((gw, wl), (gkc, kl), self.kc_sign),
            super::cuda::on_gpu(&k.0, k.1, "chunk solve")?,
            super::cuda::on_gpu(&v.0, v.1, "chunk solve")?,
            super::cuda::on_gpu(&scal.0, scal.1, "chunk solve")?,
        )
    }
}

/// One chunk's (dK, dV, dβ, dγ) from dW and dKc (the module's formulas, in their order).
fn chunk_backward(ch: &Chunk, dw: &[f32], dkc: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (c, dk, dv) = (ch.c, ch.dk, ch.dv);
    let (g, tm) = ch.solve();
    let (mut gk, mut gv, mut gb, mut gg) = (vec![0f32; c * dk], vec![0f32; c * dv], vec![0f32; c], vec![0f32; c]);
    // dX = Tᵀ dW, dY = Tᵀ dKc, and the terms of dK, dV, dβ, dγ they give.
    for j in 0..c {
        let ys = ch.y_scale(j);
        for col in 0..dv {
            let dx: f32 = (j..c).map(|t| tm[t * c + j] * dw[t * dv + col]).sum();
            gv[j * dv + col] = ch.beta[j] * dx;
            gb[j] += dx * ch.v[j * dv + col];
        }
        let mut ky = 0f32;
        for r in 0..dk {
            let dy: f32 = (j..c).map(|t| tm[t * c + j] * dkc[t * dk + r]).sum();
            gk[j * dk + r] = ys * dy;
            ky += dy * ch.k[j * dk + r];
        }
        gb[j] += ch.gamma[j].exp() * ky;
        gg[j] += ys * ky;
    }
    // dT (strictly lower: the rest never reaches A), M = Tᵀ dT, dA = M Tᵀ.
    let mut dt = vec![0f32; c * c];
    for t in 0..c {
        for j in 0..t {
            let x: f32 = (0..dv).map(|col| dw[t * dv + col] * ch.v[j * dv + col]).sum::<f32>() * ch.beta[j];
            let y: f32 = (0..dk).map(|r| dkc[t * dk + r] * ch.k[j * dk + r]).sum::<f32>() * ch.y_scale(j);
            dt[t * c + j] = x + y;
        }
    }
    let mut m = vec![0f32; c * c];
    for t in 0..c {
        for b in 0..c {
            m[t * c + b] = (t..c).map(|a| tm[a * c + t] * dt[a * c + b]).sum();
        }
    }
    for t in 0..c {
        for j in 0..t {
            let da: f32 = (0..=j).map(|b| m[t * c + b] * tm[j * c + b]).sum();
            let decay = (ch.gamma[t] - ch.gamma[j]).exp();
            let p = da * ch.a(&g, t, j);
            gb[t] -= da * decay * g[t * c + j];
            gg[t] += p;
            gg[j] -= p;
            let dg = -ch.beta[t] * decay * da;
            for r in 0..dk {
                gk[t * dk + r] += dg * ch.k[j * dk + r];
                gk[j * dk + r] += dg * ch.k[t * dk + r];
            }
        }
    }
    (gk, gv, gb, gg)
}

/// The composed form's solve: (I − A)⁻¹ of a strictly lower triangular A [.., C, C] (C = 2^m) as
/// Π_{i<log₂C} (I + A^{2^i}), in float64 (differentiable candle ops).
pub(super) fn unit_lower_inverse(a: &Tensor, c: usize) -> Result<Tensor> {
    let a = a.to_dtype(DType::F64)?;
    let eye = Tensor::eye(c, DType::F64, a.device())?;
    let mut inv = a.broadcast_add(&eye)?;
    let mut power = a;
    let mut span = 2;
    while span < c {
        power = power.matmul(&power)?;
        inv = inv.matmul(&power.broadcast_add(&eye)?)?;
        span *= 2;
    }
    Ok(inv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The solve in candle ops (the composed form's float64 inverse): the reference.
    fn composed(k: &Tensor, v: &Tensor, beta: &Tensor, gamma: &Tensor) -> (Tensor, Tensor) {
        let c = k.dim(2).unwrap();
        let dev = k.device();
        let strict: Vec<f32> = (0..c * c).map(|i| if i % c < i / c { 1.0 } else { 0.0 }).collect();
        let strict = Tensor::from_vec(strict, (c, c), dev).unwrap();
        let b = beta.unsqueeze(3).unwrap();
        let diff = gamma.unsqueeze(3).unwrap().broadcast_sub(&gamma.unsqueeze(2).unwrap()).unwrap();
        // exp only where it is used: above the diagonal γ_t − γ_j > 0 may be large.
        let decay = diff.broadcast_mul(&strict).unwrap().exp().unwrap().broadcast_mul(&strict).unwrap();
        let a = (k.matmul(&k.t().unwrap()).unwrap() * decay).unwrap().broadcast_mul(&b).unwrap().neg().unwrap();
        let inv = unit_lower_inverse(&a, c).unwrap().to_dtype(DType::F32).unwrap();
        let x = v.broadcast_mul(&b).unwrap();
        let y = k.broadcast_mul(&(b * gamma.exp().unwrap().unsqueeze(3).unwrap()).unwrap()).unwrap();
        (inv.matmul(&x).unwrap(), inv.matmul(&y).unwrap())
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let num = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        num / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt().max(1e-30)
    }

    /// Outputs and every input's gradient against the composed solve, with and without decay,
    /// at chunk sizes 1 to 64 and widths that do not fill a GPU tile.
    #[test]
    fn matches_composed_solve() {
        let dev = Device::Cpu;
        for (n, bh, c, dk, dv) in [(2, 3, 8, 6, 5), (1, 1, 1, 3, 2), (1, 2, 64, 48, 20), (3, 1, 16, 33, 40)] {
            for gated in [true, false] {
                let keys = Tensor::randn(0f32, 1.0, (n, bh, c, dk), &dev).unwrap();
                let keys = keys.broadcast_div(&keys.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap()).unwrap();
                let k = Var::from_tensor(&keys).unwrap();
                let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, bh, c, dv), &dev).unwrap()).unwrap();
                let beta = Var::from_tensor(&Tensor::rand(0.05f32, 0.95, (n, bh, c), &dev).unwrap()).unwrap();
                let steps = Tensor::rand(-0.3f32, 0.0, (n, bh, c), &dev).unwrap();
                let gamma =
                    Var::from_tensor(&(steps.cumsum(2).unwrap() * if gated { 1.0 } else { 0.0 }).unwrap()).unwrap();
                let (gw, gkc) = (
                    Tensor::randn(0f32, 1.0, (n, bh, c, dv), &dev).unwrap(),
                    Tensor::randn(0f32, 1.0, (n, bh, c, dk), &dev).unwrap(),
                );
                let run = |fast: bool| {
                    let (w, kc) = if fast {
                        solve(k.as_tensor(), v.as_tensor(), beta.as_tensor(), gated.then(|| gamma.as_tensor())).unwrap()
                    } else {
                        composed(k.as_tensor(), v.as_tensor(), beta.as_tensor(), gamma.as_tensor())
                    };
                    let loss =
                        ((&w * &gw).unwrap().sum_all().unwrap() + (&kc * &gkc).unwrap().sum_all().unwrap()).unwrap();
                    let grads = loss.backward().unwrap();
                    let mut vars = vec![&k, &v, &beta];
                    if gated {
                        vars.push(&gamma);
                    }
                    let g: Vec<Tensor> = vars.iter().map(|x| grads.get(x.as_tensor()).unwrap().clone()).collect();
                    (w, kc, g)
                };
                let ((w1, kc1, g1), (w2, kc2, g2)) = (run(true), run(false));
                let what = format!("n {n} bh {bh} c {c} dk {dk} dv {dv} gated {gated}");
                assert!(rel(&w1, &w2) < 1e-5 && rel(&kc1, &kc2) < 1e-5, "{what}: outputs");
                for (name, (a, b)) in ["k", "v", "beta", "gamma"].iter().zip(g1.iter().zip(&g2)) {
                    assert!(rel(a, b) < 1e-5, "{what}: d{name} differs by {}", rel(a, b));
                }
            }
        }
    }
}
