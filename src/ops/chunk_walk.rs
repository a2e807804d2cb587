//! The sequential half of the chunked delta rule ([`super::chunked`]) as one op with its own
//! backward: the walk over chunks that carries the [dk, dv] state.
//!
//! Per chunk i, with W_i [C, dv], Kc_i and Kend_i [C, dk] and a decay per state row a_i [dk]:
//!   U_i = W_i − Kc_i S_i   (U_i = W_i under the plain rule, which has no Kc)
//!   S_{i+1} = diag(a_i) S_i + Kend_iᵀ U_i
//! The op returns every U_i and every chunk-start state S_0 … S_N (S_N is the final state): the
//! output products read them, and the backward walks the chunks in reverse from them, keeping
//! nothing else. In candle ops this loop is a handful of launches per chunk, and autograd keeps a
//! full-size gradient for every chunk's slice; here it is one launch each way.
//!
//! The backward, with G the gradient reaching S_{i+1} (from later chunks and the outputs):
//!   dU_i = gU_i + Kend_i G,  dW_i = dU_i,  dKend_i = U_i Gᵀ,  da_i = rowsum(S_i ∘ G),
//!   dKc_i = −dU_i S_iᵀ,  G ← diag(a_i) G − Kc_iᵀ dU_i + gS_i
//! Columns of the state are independent, so the GPU splits them over blocks ([`TILE`] each);
//! the terms summed over columns (dKc, dKend, da) come back per tile and are added here.

pub(crate) use super::launch::{WalkDims, MAX_DK, TILE};
use super::{cpu_f32, cpu_slice as slice};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

impl WalkDims {
    /// Width of the packed keys: Kc | Kend for the delta rule, Kend alone for the plain one.
    pub fn kk_width(&self) -> usize {
        if self.delta {
            2 * self.dk
        } else {
            self.dk
        }
    }
    /// Column of Kend in the packed keys.
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
    fn state_len(&self) -> usize {
        self.bh * self.dk * self.dv
    }
    /// Column tiles of the GPU kernels: their grid's width, and the parts of the backward's
    /// column sums.
    pub fn gpu_tiles(&self) -> usize {
        self.dv.div_ceil(TILE)
    }
    /// Column tiles of the backward on `dev`: the CPU sums every column in one pass.
    fn tiles(&self, dev: &candle_core::Device) -> usize {
        if dev.is_cpu() {
            1
        } else {
            self.gpu_tiles()
        }
    }
}

/// (U [N,BH,C,dv], states [N+1,BH,dk,dv]) of the walk, float32, differentiable in every input:
/// w [N,BH,C,dv], kc (delta rule only) and kend [N,BH,C,dk], s0 [BH,dk,dv], a [N,BH,dk].
pub(crate) fn walk(
    w: &Tensor,
    kc: Option<&Tensor>,
    kend: &Tensor,
    s0: &Tensor,
    a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (out, d) = walk_flat(w, kc, kend, s0, a)?;
    let u = out.narrow(0, 0, d.u_len())?.reshape((d.n, d.bh, d.c, d.dv))?;
    let states = out.narrow(0, d.u_len(), d.states_len())?.reshape((d.n + 1, d.bh, d.dk, d.dv))?;
    Ok((u, states))
}

/// [`walk`]'s U and states as the op returns them, flat (for an op that reads both), and the
/// walk's sizes.
pub(crate) fn walk_flat(
    w: &Tensor,
    kc: Option<&Tensor>,
    kend: &Tensor,
    s0: &Tensor,
    a: &Tensor,
) -> Result<(Tensor, WalkDims)> {
    let (n, bh, c, dv) = w.dims4()?;
    let dk = kend.dim(3)?;
    let d = WalkDims { n, bh, c, dk, dv, delta: kc.is_some() };
    let kk = match kc {
        Some(kc) => Tensor::cat(&[kc, kend], 3)?,
        None => kend.contiguous()?,
    };
    let extra = Tensor::cat(&[s0.flatten_all()?, a.flatten_all()?], 0)?;
    Ok((w.contiguous()?.apply_op3(&kk, &extra, Walk(d))?, d))
}

/// The final state S_N, flat [BH·dk·dv], of [`walk_flat`]'s output.
pub(crate) fn final_state(out: &Tensor, d: &WalkDims) -> Result<Tensor> {
    out.narrow(0, d.u_len() + d.n * d.state_len(), d.state_len())
}

struct Walk(WalkDims);

impl CustomOp3 for Walk {
    fn name(&self) -> &'static str {
        "statecut-chunk-walk"
    }

    fn cpu_fwd(
        &self,
        w: &CpuStorage,
        wl: &Layout,
        kk: &CpuStorage,
        kkl: &Layout,
        extra: &CpuStorage,
        el: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.0;
        let (w, kk, extra) =
            (slice(w, wl, "chunk walk")?, slice(kk, kkl, "chunk walk")?, slice(extra, el, "chunk walk")?);
        let (s0, a) = extra.split_at(d.state_len());
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
                    let (wi, ki, ai) =
                        (&w[blk * cd..][..cd], &kk[blk * d.c * kkw..][..d.c * kkw], &a[blk * d.dk..][..d.dk]);
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
        w: &candle_core::CudaStorage,
        wl: &Layout,
        kk: &candle_core::CudaStorage,
        kkl: &Layout,
        extra: &candle_core::CudaStorage,
        el: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::chunk_walk(&self.0, (w, wl), (kk, kkl), (extra, el))
    }

    fn bwd(
        &self,
        _w: &Tensor,
        kk: &Tensor,
        extra: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.0;
        let tiles = d.tiles(grad.device());
        let back = WalkBack { d, kk: kk.clone(), extra: extra.clone(), res: res.clone() };
        crate::profile::mark("backward: before the walk", grad.device());
        let out = grad.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&back)?;
        crate::profile::mark("backward: walk", grad.device());
        let kkw = d.kk_width();
        let lens = [d.u_len(), tiles * d.n * d.bh * d.c * kkw, tiles * d.n * d.bh * d.dk, d.state_len()];
        let mut at = 0;
        let mut parts = lens.iter().map(|&len| {
            let p = out.narrow(0, at, len);
            at += len;
            p
        });
        let dw = parts.next().expect("four parts")?.reshape((d.n, d.bh, d.c, d.dv))?;
        let dkk = parts.next().expect("four parts")?.reshape((tiles, d.n, d.bh, d.c, kkw))?.sum(0)?;
        let da = parts.next().expect("four parts")?.reshape((tiles, d.n * d.bh * d.dk))?.sum(0)?;
        let ds0 = parts.next().expect("four parts")?;
        let extra = Tensor::cat(&[ds0, da], 0)?;
        crate::profile::mark("backward: walk tiles summed", grad.device());
        Ok((Some(dw), Some(dkk), Some(extra)))
    }
}

/// The walk's backward: from the gradient of its output (U then states), the gradients of W,
/// of the packed keys and of a (both per column tile), and of s0, flat in that order.
struct WalkBack {
    d: WalkDims,
    kk: Tensor,
    extra: Tensor,
    res: Tensor,
}

impl CustomOp1 for WalkBack {
    fn name(&self) -> &'static str {
        "statecut-chunk-walk-backward"
    }

    fn cpu_fwd(&self, grad: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.d;
        let grad = slice(grad, gl, "chunk walk backward")?;
        let (kk, extra, res) = (cpu_f32(&self.kk)?, cpu_f32(&self.extra)?, cpu_f32(&self.res)?);
        let a = &extra[d.state_len()..];
        let (us, states) = res.split_at(d.u_len());
        let (gu, gs) = grad.split_at(d.u_len());
        let (kkw, off) = (d.kk_width(), d.kend_offset());
        let (cd, kd, ck) = (d.c * d.dv, d.dk * d.dv, d.c * kkw);
        // Per head: dW, dKK and da chunk by chunk (last chunk first), and ds0.
        type Head = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>);
        let heads: Vec<Head> = (0..d.bh)
            .into_par_iter()
            .map(|h| {
                let mut g = gs[(d.n * d.bh + h) * kd..][..kd].to_vec();
                let (mut dws, mut dkks, mut das) = (vec![], vec![], vec![]);
                for i in (0..d.n).rev() {
                    let blk = i * d.bh + h;
                    let (ki, ai) = (&kk[blk * ck..][..ck], &a[blk * d.dk..][..d.dk]);
                    let (ui, si) = (&us[blk * cd..][..cd], &states[blk * kd..][..kd]);
                    let mut du = gu[blk * cd..][..cd].to_vec();
                    let mut dkk = vec![0f32; ck];
                    let mut da = vec![0f32; d.dk];
                    for t in 0..d.c {
                        for r in 0..d.dk {
                            let ke = ki[t * kkw + off + r];
                            let (gr, ur) = (&g[r * d.dv..][..d.dv], &ui[t * d.dv..][..d.dv]);
                            let mut acc = 0f32;
                            for j in 0..d.dv {
                                du[t * d.dv + j] += ke * gr[j];
                                acc += ur[j] * gr[j];
                            }
                            dkk[t * kkw + off + r] = acc;
                        }
                    }
                    for r in 0..d.dk {
                        da[r] = (0..d.dv).map(|j| si[r * d.dv + j] * g[r * d.dv + j]).sum();
                    }
                    if d.delta {
                        for t in 0..d.c {
                            for r in 0..d.dk {
                                let sr = &si[r * d.dv..][..d.dv];
                                dkk[t * kkw + r] = -(0..d.dv).map(|j| du[t * d.dv + j] * sr[j]).sum::<f32>();
                            }
                        }
                    }
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
                    dws.push(du);
                    dkks.push(dkk);
                    das.push(da);
                }
                (dws, dkks, das, g)
            })
            .collect();
        let (lw, lk, la) = (d.u_len(), d.n * d.bh * ck, d.n * d.bh * d.dk);
        let mut out = vec![0f32; lw + lk + la + d.state_len()];
        for (h, (dws, dkks, das, g)) in heads.into_iter().enumerate() {
            // Chunks came last first.
            for (back, ((dw, dkk), da)) in dws.iter().zip(&dkks).zip(&das).enumerate() {
                let blk = (d.n - 1 - back) * d.bh + h;
                out[blk * cd..][..cd].copy_from_slice(dw);
                out[lw + blk * ck..][..ck].copy_from_slice(dkk);
                out[lw + lk + blk * d.dk..][..d.dk].copy_from_slice(da);
            }
            out[lw + lk + la + h * kd..][..kd].copy_from_slice(&g);
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, grad: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (kk, extra, res) =
            (self.kk.storage_and_layout(), self.extra.storage_and_layout(), self.res.storage_and_layout());
        super::cuda::chunk_walk_back(
            &self.d,
            (grad, gl),
            super::cuda::on_gpu(&kk.0, kk.1, "chunk walk")?,
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
                let (w, kc, kend, s0) =
                    (r(&[n, bh, c, dv], 1.0), r(&[n, bh, c, dk], 0.3), r(&[n, bh, c, dk], 0.3), r(&[bh, dk, dv], 1.0));
                let a = Var::from_tensor(&Tensor::rand(0.5f32, 1.0, (n, bh, dk), &dev).unwrap()).unwrap();
                let kc_t = delta.then(|| kc.as_tensor());
                let (gu, gs) = (
                    Tensor::randn(0f32, 1.0, (n, bh, c, dv), &dev).unwrap(),
                    Tensor::randn(0f32, 1.0, (n + 1, bh, dk, dv), &dev).unwrap(),
                );
                let run = |fast: bool| {
                    let (u, s) = if fast {
                        walk(w.as_tensor(), kc_t, kend.as_tensor(), s0.as_tensor(), a.as_tensor()).unwrap()
                    } else {
                        composed(w.as_tensor(), kc_t, kend.as_tensor(), s0.as_tensor(), a.as_tensor())
                    };
                    let loss =
                        ((&u * &gu).unwrap().sum_all().unwrap() + (&s * &gs).unwrap().sum_all().unwrap()).unwrap();
                    let grads = loss.backward().unwrap();
                    let mut vars = vec![&w, &kend, &s0, &a];
                    if delta {
                        vars.push(&kc);
                    }
                    let g: Vec<Tensor> = vars.iter().map(|v| grads.get(v.as_tensor()).unwrap().clone()).collect();
                    (u, s, g)
                };
                let ((u1, s1, g1), (u2, s2, g2)) = (run(true), run(false));
                let what = format!("n {n} bh {bh} c {c} dk {dk} dv {dv} delta {delta}");
                assert!(rel(&u1, &u2) < 1e-5 && rel(&s1, &s2) < 1e-5, "{what}: outputs");
                for (name, (a, b)) in ["w", "kend", "s0", "a", "kc"].iter().zip(g1.iter().zip(&g2)) {
                    assert!(rel(a, b) < 1e-5, "{what}: d{name} differs by {}", rel(a, b));
                }
            }
        }
    }
}
