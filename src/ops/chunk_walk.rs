//! The sequential half of the chunked delta rule ([`super::chunked`]) as one op with its own
//! backward: the walk over chunks that carries the [dk, dv] state.
//!
//! Per chunk i, with W_i [C, dv], Kc_i and K_i [C, dk], a per-token scale e_i [C] that makes the
//! keys' contribution to the state Kend_i = diag(e_i) K_i, and a decay per state row a_i [dk]:
//!   U_i = W_i − Kc_i S_i   (U_i = W_i under the plain rule, which has no Kc)
//!   S_{i+1} = diag(a_i) S_i + Kend_iᵀ U_i
//! The op returns every U_i and every chunk-start state S_0 … S_N (S_N is the final state): the
//! output products read them, and the backward walks the chunks in reverse from them, keeping
//! nothing else. In candle ops this loop is a handful of launches per chunk, and autograd keeps a
//! full-size gradient for every chunk's slice; here it is one launch each way. W and Kc come in
//! one flat buffer (the intra-chunk solve's output as it is), and Kend is formed while a chunk's
//! keys are staged, so neither needs a copy of its own.
//!
//! The backward, with G_{i+1} the gradient reaching S_{i+1} (from later chunks and the outputs):
//!   dU_i = gU_i + Kend_i G_{i+1},  dW_i = dU_i,  G_i = diag(a_i) G_{i+1} − Kc_iᵀ dU_i + gS_i
//! is the sequential part, and the kernel does only that, writing every G_{i+1}. The terms that
//! sum over the state's columns are then batched products over all chunks at once:
//!   dKend_i = U_i G_{i+1}ᵀ,  dKc_i = −dU_i S_iᵀ,  da_i = rowsum(S_i ∘ G_{i+1}),
//!   dK_i = diag(e_i) dKend_i,  de_i = rowsum(K_i ∘ dKend_i)
//! (the GPU splits the state's columns over blocks, which could only add those sums up per tile).

pub(crate) use super::launch::WalkDims;
use super::{cpu_f32, cpu_slice as slice};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

impl WalkDims {
    /// Width of a staged chunk's keys: Kc | Kend for the delta rule, Kend alone for the plain one.
    pub fn kk_width(&self) -> usize {
        if self.delta {
            2 * self.dk
        } else {
            self.dk
        }
    }
    /// Column of Kend in a staged chunk's keys.
    pub fn kend_offset(&self) -> usize {
        if self.delta {
            self.dk
        } else {
            0
        }
    }
    pub fn u_len(&self) -> usize {
        self.n * self.bh * self.c * self.dv
    }
    pub fn states_len(&self) -> usize {
        (self.n + 1) * self.bh * self.dk * self.dv
    }
    pub fn state_len(&self) -> usize {
        self.bh * self.dk * self.dv
    }
    /// Length of the per-row decays a in the extra input (after S₀, before the key scales e).
    pub fn decays_len(&self) -> usize {
        self.n * self.bh * self.dk
    }
}

/// The walk's inputs, float32: W [N,BH,C,dv] and Kc [N,BH,C,dk] (delta rule only) flat in one
/// buffer `wkc`, the keys k [N,BH,C,dk] and their per-token scale e [N,BH,C] (Kend = diag(e) K),
/// S₀ [BH,dk,dv] and the per-row decays a [N,BH,dk].
pub(crate) struct WalkIn<'a> {
    pub wkc: &'a Tensor,
    pub delta: bool,
    pub k: &'a Tensor,
    pub e: &'a Tensor,
    pub s0: &'a Tensor,
    pub a: &'a Tensor,
    /// See [`WalkDims::tensor`].
    pub tensor: bool,
}

/// W and Kc as the walk's flat `wkc` input, from separate tensors.
pub(crate) fn pack(w: &Tensor, kc: Option<&Tensor>) -> Result<Tensor> {
    match kc {
        Some(kc) => Tensor::cat(&[w.flatten_all()?, kc.flatten_all()?], 0),
        None => w.flatten_all(),
    }
}

/// (U [N,BH,C,dv], states [N+1,BH,dk,dv]) of the walk, float32, differentiable in every input.
pub(crate) fn walk(x: &WalkIn) -> Result<(Tensor, Tensor)> {
    let (out, d) = walk_flat(x)?;
    let u = out.narrow(0, 0, d.u_len())?.reshape((d.n, d.bh, d.c, d.dv))?;
    let states = out.narrow(0, d.u_len(), d.states_len())?.reshape((d.n + 1, d.bh, d.dk, d.dv))?;
    Ok((u, states))
}

/// [`walk`]'s U and states as the op returns them, flat (for an op that reads both), and the
/// walk's sizes.
pub(crate) fn walk_flat(x: &WalkIn) -> Result<(Tensor, WalkDims)> {
    let (op, extra) = op(x)?;
    let d = op.0;
    Ok((x.wkc.contiguous()?.apply_op3(&x.k.contiguous()?, &extra, op)?, d))
}

/// The walk as an op, and its third input (S₀, the row decays a, the key scales e, flat): for
/// a caller that runs the op's backward itself.
pub(crate) fn op(x: &WalkIn) -> Result<(Walk, Tensor)> {
    let (n, bh, c, dk) = x.k.dims4()?;
    let dv = x.s0.dim(2)?;
    let d = WalkDims { n, bh, c, dk, dv, delta: x.delta, tensor: x.tensor };
    Ok((Walk(d), Tensor::cat(&[x.s0.flatten_all()?, x.a.flatten_all()?, x.e.flatten_all()?], 0)?))
}

/// The final state S_N, flat [BH·dk·dv], of [`walk_flat`]'s output.
pub(crate) fn final_state(out: &Tensor, d: &WalkDims) -> Result<Tensor> {
    out.narrow(0, d.u_len() + d.n * d.state_len(), d.state_len())
}

pub(crate) struct Walk(pub(crate) WalkDims);

/// One chunk's keys as the kernels stage them: [C, kk_width] rows of Kc | Kend.
fn staged(d: &WalkDims, blk: usize, kc: &[f32], k: &[f32], e: &[f32]) -> Vec<f32> {
    let (kkw, off) = (d.kk_width(), d.kend_offset());
    let mut kk = vec![0f32; d.c * kkw];
    for t in 0..d.c {
        let row = (blk * d.c + t) * d.dk;
        if d.delta {
            kk[t * kkw..][..d.dk].copy_from_slice(&kc[row..][..d.dk]);
        }
        for r in 0..d.dk {
            kk[t * kkw + off + r] = e[blk * d.c + t] * k[row + r];
        }
    }
    kk
}

impl CustomOp3 for Walk {
    fn name(&self) -> &'static str {
        "statecut-chunk-walk"
    }

    fn cpu_fwd(
        &self,
        wkc: &CpuStorage,
        wl: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        extra: &CpuStorage,
        el: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.0;
        let (wkc, k, extra) =
            (slice(wkc, wl, "chunk walk")?, slice(k, kl, "chunk walk")?, slice(extra, el, "chunk walk")?);
        let (w, kc) = wkc.split_at(d.u_len());
        let (s0, rest) = extra.split_at(d.state_len());
        let (a, e) = rest.split_at(d.decays_len());
        let (kkw, off) = (d.kk_width(), d.kend_offset());
        let (cd, kd) = (d.c * d.dv, d.dk * d.dv);
        // Per head: its U (chunk by chunk) and its states.
        let heads: Vec<(Vec<f32>, Vec<f32>)> = (0..d.bh)
            .into_par_iter()
            .map(|h| {
                let mut s = s0[h * kd..][..kd].to_vec();
                let (mut us, mut states) = (Vec::with_capacity(d.n * cd), Vec::with_capacity((d.n + 1) * kd));
                for i in 0..d.n {
                    states.extend_from_slice(&s);
                    let blk = i * d.bh + h;
                    let (wi, ai) = (&w[blk * cd..][..cd], &a[blk * d.dk..][..d.dk]);
                    let ki = staged(&d, blk, kc, k, e);
                    let mut u = wi.to_vec();
                    if d.delta {
                        for t in 0..d.c {
                            for r in 0..d.dk {
                                let kc = ki[t * kkw + r];
                                for j in 0..d.dv {
                                    u[t * d.dv + j] -= kc * s[r * d.dv + j];
                                }
                            }
                        }
                    }
                    for r in 0..d.dk {
                        for j in 0..d.dv {
                            s[r * d.dv + j] *= ai[r];
                        }
                        for t in 0..d.c {
                            let ke = ki[t * kkw + off + r];
                            for j in 0..d.dv {
                                s[r * d.dv + j] += ke * u[t * d.dv + j];
                            }
                        }
                    }
                    us.extend_from_slice(&u);
                }
                states.extend_from_slice(&s);
                (us, states)
            })
            .collect();
        let mut out = vec![0f32; d.u_len() + d.states_len()];
        let (u_out, s_out) = out.split_at_mut(d.u_len());
        for (h, (us, states)) in heads.iter().enumerate() {
            for i in 0..d.n {
                u_out[(i * d.bh + h) * cd..][..cd].copy_from_slice(&us[i * cd..][..cd]);
            }
            for i in 0..=d.n {
                s_out[(i * d.bh + h) * kd..][..kd].copy_from_slice(&states[i * kd..][..kd]);
            }
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        wkc: &candle_core::CudaStorage,
        wl: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        extra: &candle_core::CudaStorage,
        el: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::chunk_walk(&self.0, (wkc, wl), (k, kl), (extra, el))
    }

    fn bwd(
        &self,
        wkc: &Tensor,
        k: &Tensor,
        extra: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (du, du_s, dkend, dextra) = self.grads(wkc, k, extra, res, grad)?;
        let dwkc = match du_s {
            Some(du_s) => Tensor::cat(&[du.flatten_all()?, du_s.neg()?.flatten_all()?], 0)?,
            None => du.flatten_all()?,
        };
        let d = self.0;
        let e = extra.narrow(0, d.state_len() + d.decays_len(), d.n * d.bh * d.c)?;
        let dk = dkend.broadcast_mul(&e.reshape((d.n, d.bh, d.c, 1))?)?;
        Ok((Some(dwkc), Some(dk), Some(dextra)))
    }
}

impl Walk {
    /// The backward's gradients: of W (= dU), the product dU Sᵀ = −dKc (delta rule; the
    /// solve's backward takes the sign), of Kend = diag(e) K before the key scales (dK =
    /// diag(e) dKend: a caller that sums dK with other terms scales it there), and of S₀ | a | e
    /// (flat, as `extra`).
    pub(crate) fn grads(
        &self,
        wkc: &Tensor,
        k: &Tensor,
        extra: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>, Tensor, Tensor)> {
        let d = self.0;
        let back = WalkBack { d, wkc: wkc.clone(), k: k.clone(), extra: extra.clone(), res: res.clone() };
        crate::profile::mark("backward: before the walk", grad.device());
        let out = grad.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&back)?;
        crate::profile::mark("backward: walk", grad.device());
        let (n, bh, c, dk, dv) = (d.n, d.bh, d.c, d.dk, d.dv);
        let du = out.narrow(0, 0, d.u_len())?.reshape((n, bh, c, dv))?;
        let g = out.narrow(0, d.u_len(), n * d.state_len())?.reshape((n, bh, dk, dv))?;
        let ds0 = out.narrow(0, d.u_len() + n * d.state_len(), d.state_len())?;
        let u = res.narrow(0, 0, d.u_len())?.reshape((n, bh, c, dv))?;
        let s = res.narrow(0, d.u_len(), n * d.state_len())?.reshape((n, bh, dk, dv))?;
        // The column sums, batched over every chunk: dKend [N,BH,C,dk].
        let dkend = super::tf32_products(d.tensor, || u.matmul(&g.t()?))?;
        // The tensor-core kernel appends its column tiles' partial sums of da and de.
        let base = d.u_len() + (n + 1) * d.state_len();
        let (da, de) = match (out.dim(0)? - base) / (n * bh * (dk + c)) {
            0 => ((&s * &g)?.sum(3)?, (&dkend * k)?.sum(3)?),
            tiles => {
                let part =
                    |off: usize, w: usize| out.narrow(0, base + off, tiles * n * bh * w)?.reshape((tiles, n, bh, w));
                (part(0, dk)?.sum(0)?, part(tiles * n * bh * dk, c)?.sum(0)?)
            }
        };
        let du_s = d.delta.then(|| super::tf32_products(d.tensor, || du.matmul(&s.t()?))).transpose()?;
        let dextra = Tensor::cat(&[ds0, da.flatten_all()?, de.flatten_all()?], 0)?;
        crate::profile::mark("backward: walk sums", grad.device());
        Ok((du, du_s, dkend, dextra))
    }
}

/// The walk's backward, its sequential part: from the gradient of its output (U then states),
/// dW (= dU), the gradient G_{i+1} reaching each chunk's end state, and ds0, flat in that order.
/// On tensor cores the kernel also sums da and de over each of its column tiles, and appends
/// those partial sums ([tiles, N, BH, dk] then [tiles, N, BH, C]).
struct WalkBack {
    d: WalkDims,
    wkc: Tensor,
    k: Tensor,
    extra: Tensor,
    /// The walk's output: U and the chunk-start states (read by the CUDA kernel's sums).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    res: Tensor,
}

impl CustomOp1 for WalkBack {
    fn name(&self) -> &'static str {
        "statecut-chunk-walk-backward"
    }

    fn cpu_fwd(&self, grad: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.d;
        let grad = slice(grad, gl, "chunk walk backward")?;
        let (wkc, k, extra) = (cpu_f32(&self.wkc)?, cpu_f32(&self.k)?, cpu_f32(&self.extra)?);
        let kc = &wkc[d.u_len()..];
        let rest = &extra[d.state_len()..];
        let (a, e) = rest.split_at(d.decays_len());
        let (gu, gs) = grad.split_at(d.u_len());
        let (kkw, off) = (d.kk_width(), d.kend_offset());
        let (cd, kd) = (d.c * d.dv, d.dk * d.dv);
        // Per head: dU and G_{i+1} chunk by chunk (last chunk first), and ds0.
        type Head = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>);
        let heads: Vec<Head> = (0..d.bh)
            .into_par_iter()
            .map(|h| {
                let mut g = gs[(d.n * d.bh + h) * kd..][..kd].to_vec();
                let (mut dus, mut gends) = (vec![], vec![]);
                for i in (0..d.n).rev() {
                    let blk = i * d.bh + h;
                    let ki = staged(&d, blk, kc, &k, e);
                    let ai = &a[blk * d.dk..][..d.dk];
                    let mut du = gu[blk * cd..][..cd].to_vec();
                    for t in 0..d.c {
                        for r in 0..d.dk {
                            let ke = ki[t * kkw + off + r];
                            for j in 0..d.dv {
                                du[t * d.dv + j] += ke * g[r * d.dv + j];
                            }
                        }
                    }
                    gends.push(g.clone());
                    let gsi = &gs[blk * kd..][..kd];
                    for r in 0..d.dk {
                        for j in 0..d.dv {
                            g[r * d.dv + j] = ai[r] * g[r * d.dv + j] + gsi[r * d.dv + j];
                        }
                        if d.delta {
                            for t in 0..d.c {
                                let kc = ki[t * kkw + r];
                                for j in 0..d.dv {
                                    g[r * d.dv + j] -= kc * du[t * d.dv + j];
                                }
                            }
                        }
                    }
                    dus.push(du);
                }
                (dus, gends, g)
            })
            .collect();
        let (lu, lg) = (d.u_len(), d.n * d.state_len());
        let mut out = vec![0f32; lu + lg + d.state_len()];
        for (h, (dus, gends, g)) in heads.into_iter().enumerate() {
            // Chunks came last first.
            for (back, (du, gend)) in dus.iter().zip(&gends).enumerate() {
                let blk = (d.n - 1 - back) * d.bh + h;
                out[blk * cd..][..cd].copy_from_slice(du);
                out[lu + blk * kd..][..kd].copy_from_slice(gend);
            }
            out[lu + lg + h * kd..][..kd].copy_from_slice(&g);
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, grad: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (wkc, k, extra) =
            (self.wkc.storage_and_layout(), self.k.storage_and_layout(), self.extra.storage_and_layout());
        let res = self.res.storage_and_layout();
        super::cuda::chunk_walk_back(
            &self.d,
            (grad, gl),
            super::cuda::on_gpu(&wkc.0, wkc.1, "chunk walk")?,
            super::cuda::on_gpu(&k.0, k.1, "chunk walk")?,
            super::cuda::on_gpu(&extra.0, extra.1, "chunk walk")?,
            super::cuda::on_gpu(&res.0, res.1, "chunk walk")?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The walk written as a loop of candle ops (autograd differentiates it): the reference.
    fn composed(w: &Tensor, kc: Option<&Tensor>, kend: &Tensor, s0: &Tensor, a: &Tensor) -> (Tensor, Tensor) {
        let n = w.dim(0).unwrap();
        let mut s = s0.clone();
        let (mut us, mut states) = (vec![], vec![s.clone()]);
        for i in 0..n {
            let u = match kc {
                Some(kc) => (w.get(i).unwrap() - kc.get(i).unwrap().matmul(&s).unwrap()).unwrap(),
                None => w.get(i).unwrap(),
            };
            let decayed = s.broadcast_mul(&a.get(i).unwrap().unsqueeze(2).unwrap()).unwrap();
            s = (decayed + kend.get(i).unwrap().t().unwrap().matmul(&u).unwrap()).unwrap();
            us.push(u);
            states.push(s.clone());
        }
        (Tensor::stack(&us, 0).unwrap(), Tensor::stack(&states, 0).unwrap())
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let num = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        num / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt().max(1e-30)
    }

    /// Outputs and every input's gradient against the composed loop, for both rules and for
    /// widths that do not fill a GPU tile (dk ≠ dv, odd sizes).
    #[test]
    fn matches_composed_walk() {
        let dev = Device::Cpu;
        for (n, bh, c, dk, dv) in [(3, 2, 4, 5, 7), (1, 1, 1, 3, 2), (4, 3, 8, 6, 6)] {
            for delta in [true, false] {
                let r = |shape: &[usize], s: f64| {
                    Var::from_tensor(&(Tensor::randn(0f32, 1.0, shape, &dev).unwrap() * s).unwrap()).unwrap()
                };
                let (w, kc, k, s0) =
                    (r(&[n, bh, c, dv], 1.0), r(&[n, bh, c, dk], 0.3), r(&[n, bh, c, dk], 0.3), r(&[bh, dk, dv], 1.0));
                let a = Var::from_tensor(&Tensor::rand(0.5f32, 1.0, (n, bh, dk), &dev).unwrap()).unwrap();
                let e = Var::from_tensor(&Tensor::rand(0.5f32, 1.5, (n, bh, c), &dev).unwrap()).unwrap();
                let kc_t = delta.then(|| kc.as_tensor());
                let (gu, gs) = (
                    Tensor::randn(0f32, 1.0, (n, bh, c, dv), &dev).unwrap(),
                    Tensor::randn(0f32, 1.0, (n + 1, bh, dk, dv), &dev).unwrap(),
                );
                let run = |fast: bool| {
                    let (u, s) = if fast {
                        let wkc = pack(w.as_tensor(), kc_t).unwrap();
                        let x = WalkIn {
                            wkc: &wkc,
                            delta,
                            k: k.as_tensor(),
                            e: e.as_tensor(),
                            s0: s0.as_tensor(),
                            a: a.as_tensor(),
                            tensor: false,
                        };
                        walk(&x).unwrap()
                    } else {
                        let kend = k.as_tensor().broadcast_mul(&e.as_tensor().unsqueeze(3).unwrap()).unwrap();
                        composed(w.as_tensor(), kc_t, &kend, s0.as_tensor(), a.as_tensor())
                    };
                    let loss =
                        ((&u * &gu).unwrap().sum_all().unwrap() + (&s * &gs).unwrap().sum_all().unwrap()).unwrap();
                    let grads = loss.backward().unwrap();
                    let mut vars = vec![&w, &k, &e, &s0, &a];
                    if delta {
                        vars.push(&kc);
                    }
                    let g: Vec<Tensor> = vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()).collect();
                    (u, s, g)
                };
                let ((u1, s1, g1), (u2, s2, g2)) = (run(true), run(false));
                let what = format!("n {n} bh {bh} c {c} dk {dk} dv {dv} delta {delta}");
                assert!(rel(&u1, &u2) < 1e-5 && rel(&s1, &s2) < 1e-5, "{what}: outputs");
                for (name, (a, b)) in ["w", "k", "e", "s0", "a", "kc"].iter().zip(g1.iter().zip(&g2)) {
                    assert!(rel(a, b) < 1e-5, "{what}: d{name} differs by {}", rel(a, b));
                }
            }
        }
    }
}
