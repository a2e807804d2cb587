//! Softmax attention's core, softmax(q·kᵀ·scale + mask)·v, for passes that take gradients.
//! Written out in candle's ops, its graph holds the scores and every step of the softmax at
//! [B, H, T, S] in float32: at 16 x 2048 tokens and 16 heads some 34 GiB for one layer, and the
//! backward needs as much again. As one op the graph holds q, k and v only. The forward runs a
//! group of sequences at a time; the backward recomputes each group's probabilities P and
//! writes the softmax's gradient out, dS = P ∘ (dP − rowsum(dP ∘ P)) with dP = dO·vᵀ, so that
//! one group's few [T, S] tensors are all it holds (candle's backward of the ops would also keep
//! a zero-filled gradient for the softmax's untracked row maximum and the mask).

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// Bytes of float32 scores one group of sequences may hold: the forward's and the backward's
/// working memory is a small multiple of it.
const GROUP_SCORE_BYTES: usize = 1 << 30;

/// softmax(q·kᵀ·scale + mask)·v for q [B, H, T, D], k and v [B, H, S, D] (heads already repeated
/// to q's) and an additive float32 mask [T, S]: the scores in q's dtype, scaled, the softmax in
/// float32 (candle's one-kernel form), then v's dtype for the product. With gradients, one op
/// whose graph holds q, k and v (see the module).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    if super::untracked(&[q, k, v]) {
        return core(q, k, v, mask, scale);
    }
    let (_, h, t, _) = q.dims4()?;
    let s = k.dim(2)?;
    grouped(q, k, v, mask, scale, (GROUP_SCORE_BYTES / (h * t * s * 4).max(1)).max(1))
}

/// [`attention`] with gradients, `group` sequences at a time.
fn grouped(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64, group: usize) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let b = q.dim(0)?;
    let mut parts = Vec::new();
    for b0 in (0..b).step_by(group) {
        let n = group.min(b - b0);
        let part = |x: &Tensor| x.narrow(0, b0, n).map(|x| x.detach());
        parts.push(core(&part(&q)?, &part(&k)?, &part(&v)?, mask, scale)?);
    }
    let out = Tensor::cat(&parts, 0)?;
    drop(parts);
    q.apply_op3(&k, &v, Attention { out: Mutex::new(Some(out)), mask: mask.detach(), scale, group })
}

/// The softmax's probabilities P [B, H, T, S] in float32.
fn probs(q: &Tensor, k: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?.broadcast_add(mask)?;
    candle_nn::ops::softmax_last_dim(&scores)
}

/// The attention's output, P in v's dtype times v.
fn core(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    probs(q, k, mask, scale)?.to_dtype(v.dtype())?.matmul(v)
}

/// The gradients of q, k and v for one group from the output's `go`: the backward of [`core`]'s
/// steps (the casts take the gradient to their input's dtype, as candle's do).
fn group_grads(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    go: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let p = probs(q, k, mask, scale)?;
    let dv = p.to_dtype(v.dtype())?.t()?.matmul(go)?;
    let dp = go.matmul(&v.t()?)?.to_dtype(DType::F32)?;
    let rows = (&dp * &p)?.sum_keepdim(candle_core::D::Minus1)?;
    let ds = (p * dp.broadcast_sub(&rows)?)?;
    drop(dp);
    let ds = (ds.to_dtype(q.dtype())? * scale)?;
    Ok((ds.matmul(k)?, ds.t()?.matmul(q)?, dv))
}

/// The op behind [`attention`] with gradients: its forward hands over the output computed
/// before it (taken out, so that the graph does not hold a second copy); its backward works
/// group by group ([`group_grads`]).
struct Attention {
    out: Mutex<Option<Tensor>>,
    mask: Tensor,
    scale: f64,
    group: usize,
}

impl Attention {
    /// The output, once.
    fn take(&self) -> Result<Tensor> {
        let mut slot = self.out.lock().map_err(|_| candle_core::Error::Msg("attention: a forward panicked".into()))?;
        slot.take().ok_or_else(|| candle_core::Error::Msg("attention: the op's forward ran twice".into()))
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "statecut-attention"
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
        super::copy_cpu(&self.take()?, "attention")
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
        super::copy_gpu(&self.take()?, "attention")
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let b = q.dim(0)?;
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        for b0 in (0..b).step_by(self.group) {
            let n = self.group.min(b - b0);
            let part = |x: &Tensor| x.narrow(0, b0, n);
            let go = part(grad)?.contiguous()?;
            let (gq, gk, gv) = group_grads(&part(q)?, &part(k)?, &part(v)?, &self.mask, self.scale, &go)?;
            dq.push(gq);
            dk.push(gk);
            dv.push(gv);
        }
        Ok((Some(Tensor::cat(&dq, 0)?), Some(Tensor::cat(&dk, 0)?), Some(Tensor::cat(&dv, 0)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// [T, T] causal mask, and with a window of `w` only the last `w` keys.
    fn mask(t: usize, window: Option<usize>) -> Result<Tensor> {
        let m: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..t).map(move |j| if j > i || window.is_some_and(|w| i - j >= w) { f32::NEG_INFINITY } else { 0.0 })
            })
            .collect();
        Tensor::from_vec(m, (t, t), &Device::Cpu)
    }

    /// The op's output and the gradients of q, k and v equal those of the ops written out with
    /// candle's autograd (the softmax as separate ops, as a tracked pass ran it before), in groups
    /// of every sequence, one and two, in float32 and bf16, a windowed mask and values narrower
    /// than the keys (as MLA's) included.
    #[test]
    fn attention_equals_its_ops() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, t, d) = (3, 2, 5, 4);
        for dtype in [DType::F32, DType::BF16] {
            for window in [None, Some(2)] {
                let mask = mask(t, window)?;
                let var = |phase: f64, d: usize| -> Result<Var> {
                    let x = Tensor::arange(0f32, (b * h * t * d) as f32, &dev)?.reshape((b, h, t, d))?;
                    Var::from_tensor(&((x * 0.37)? + phase)?.sin()?.to_dtype(dtype)?)
                };
                let (q, k, v) = (var(0.1, d)?, var(1.3, d)?, var(2.9, d - 1)?);
                let g = Tensor::randn(0f32, 1.0, (b, h, t, d - 1), &dev)?.to_dtype(dtype)?;
                let run = |o: Tensor| -> Result<Vec<Vec<f32>>> {
                    let grads = super::super::seed_gradient(&o, &g)?.backward()?;
                    let mut out = vec![o.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?];
                    for x in [&q, &k, &v] {
                        let gx = grads.get(x.as_tensor()).expect("a gradient");
                        out.push(gx.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                    }
                    Ok(out)
                };
                let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
                let scores = (qt.matmul(&kt.t()?)? * 0.5)?.to_dtype(DType::F32)?.broadcast_add(&mask)?;
                let ops = super::super::softmax_ops(&scores)?.to_dtype(dtype)?.matmul(vt)?;
                let want = run(ops)?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 3e-2 };
                for group in [b, 1, 2] {
                    let got = run(grouped(qt, kt, vt, &mask, 0.5, group)?)?;
                    for (i, (w, a)) in want.iter().zip(&got).enumerate() {
                        let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
                        let err = w.iter().zip(a).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale;
                        assert!(
                            err < tol,
                            "{dtype:?} {window:?} groups of {group}: output/gradient {i} differs by {err}"
                        );
                    }
                }
                let default = run(attention(qt, kt, vt, &mask, 0.5)?)?;
                assert_eq!(default, run(grouped(qt, kt, vt, &mask, 0.5, b)?)?, "{dtype:?}: one group by default");
            }
        }
        Ok(())
    }

    /// Without gradients the op is the ops themselves.
    #[test]
    fn untracked_inputs_take_the_ops() -> Result<()> {
        let q = Tensor::randn(0f32, 1.0, (1, 2, 3, 4), &Device::Cpu)?;
        let m = mask(3, None)?;
        let a = attention(&q, &q, &q, &m, 0.5)?;
        let b = core(&q, &q, &q, &m, 0.5)?;
        assert_eq!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }
}
