//! Depthwise causal short convolution (fla `ShortConvolution`, Mamba-2 and Qwen3.5 `conv1d`).

use super::derived::Derived;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

/// A depthwise causal conv over [B, T, C] with weight [C, 1, K] and an optional bias [C]:
/// y_t[c] = Σ_i w[c, i] · x_{t-K+1+i}[c] (+ b[c]), zero history.
#[derive(Debug, Clone)]
pub struct ShortConv {
    /// [C, K]
    weight: Derived,
    /// [C]
    bias: Option<Derived>,
}

impl ShortConv {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Self::joined(vec![weight], bias.map(|b| vec![b]))
    }

    /// Several stored depthwise convs (`(name, channels)` under `vb`) as one over their
    /// channels in order: a depthwise conv treats every channel alone, so this is exact.
    pub fn concat(vb: &candle_nn::VarBuilder, parts: &[(&str, usize)], kernel: usize, bias: bool) -> Result<Self> {
        let w = parts.iter().map(|(n, c)| vb.pp(*n).get((*c, 1, kernel), "weight")).collect::<Result<Vec<_>>>()?;
        let b = match bias {
            true => Some(parts.iter().map(|(n, c)| vb.pp(*n).get(*c, "bias")).collect::<Result<Vec<_>>>()?),
            false => None,
        };
        Self::joined(w, b)
    }

    /// Weights [C_i, 1, K] and biases [C_i] joined over their channels (a copy when there are
    /// several, so [`Derived`] joins trained parts again at each use).
    fn joined(weights: Vec<Tensor>, biases: Option<Vec<Tensor>>) -> Result<Self> {
        let (mut c, mut k) = (0, 0);
        for w in &weights {
            let (ci, _, ki) = w.dims3()?;
            (c, k) = (c + ci, ki);
        }
        if k == 0 {
            candle_core::bail!("short conv kernel of size 0 (conv_size/conv_kernel in config.json must be at least 1)");
        }
        Ok(Self {
            weight: Derived::joined(weights, move |w| Tensor::cat(w, 0)?.reshape((c, k)))?,
            bias: biases.map(|b| Derived::joined(b, |b| Tensor::cat(b, 0))).transpose()?,
        })
    }

    pub fn load(vb: candle_nn::VarBuilder, channels: usize, kernel: usize, bias: bool) -> Result<Self> {
        let weight = vb.get((channels, 1, kernel), "weight")?;
        let bias = if bias { Some(vb.get(channels, "bias")?) } else { None };
        Self::new(weight, bias)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_cached(x, None)?.0)
    }

    /// The weight [C, K] and bias [C], as they are now.
    pub fn parts(&self) -> Result<(Tensor, Option<Tensor>)> {
        Ok((self.weight.get()?, self.bias.as_ref().map(Derived::get).transpose()?))
    }

    /// SiLU(conv(x)) continuing from `prev` like [`Self::forward_cached`]. On a GPU, when no
    /// gradient flows through it, this is one fused kernel instead of 2K + 2 candle ops.
    pub fn forward_silu_cached(&self, x: &Tensor, prev: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let _s = crate::profile::span("short conv", x.device());
        let (weight, bias) = self.parts()?;
        let tensors: Vec<&Tensor> = [Some(x), Some(&weight), bias.as_ref(), prev].into_iter().flatten().collect();
        // A pass with gradients on a GPU takes the op with its own backward ([`ConvBwd`]): as
        // candle ops, every tap's product and its gradient is a pass over the whole input.
        if !super::fusable(&tensors) && prev.is_none() && !x.device().is_cpu() && weight.dim(1)? <= CONV_BWD_MAX_K {
            let k = weight.dim(1)?;
            return Ok((fused_conv_grad(x, &weight, bias.as_ref(), true)?, last_inputs(x, k - 1)?));
        }
        if !super::fusable(&tensors) {
            let (y, state) = self.forward_cached(x, prev)?;
            return Ok((candle_nn::ops::silu(&y)?, state));
        }
        let k = weight.dim(1)?;
        Ok(match prev {
            Some(p) => {
                let input = Tensor::cat(&[&p.to_dtype(x.dtype())?, x], 1)?;
                (fused_conv(&input, &weight, bias.as_ref(), 0, true)?, last_inputs(&input, k - 1)?)
            }
            None => (fused_conv(x, &weight, bias.as_ref(), k - 1, true)?, last_inputs(x, k - 1)?),
        })
    }

    /// The weight [C, K] and bias [C] in x's dtype (zeros without a bias) for an op that runs
    /// this conv's causal form with SiLU inside itself, with gradients (see
    /// `ops::prep::conv_heads_qk_chunks`): where `forward_silu_cached` on x with no history
    /// would take the differentiable fused op, `None` elsewhere.
    pub fn grad_operands(&self, x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        let (weight, bias) = self.parts()?;
        let tensors: Vec<&Tensor> = [Some(x), Some(&weight), bias.as_ref()].into_iter().flatten().collect();
        if super::fusable(&tensors) || x.device().is_cpu() {
            return Ok(None);
        }
        Self::operands(weight, bias, x.dtype(), x.device())
    }

    /// Whether the kernel is narrow enough for the ops that run the conv inside themselves
    /// with gradients (see [`Self::grad_operands`]); read from the shape alone.
    pub fn fits_ops(&self) -> bool {
        self.weight.shape().dims().get(1).is_some_and(|&k| k <= CONV_BWD_MAX_K)
    }

    /// [`Self::grad_operands`]' weight and bias in `dtype` for an input whose gradient is known
    /// to flow (one linked from its maker, which tracks nothing itself); `None` where the
    /// kernel is too wide for the op's backward.
    pub fn operands_in(&self, dtype: DType, dev: &candle_core::Device) -> Result<Option<(Tensor, Tensor)>> {
        let (weight, bias) = self.parts()?;
        Self::operands(weight, bias, dtype, dev)
    }

    /// The weight [C, K] contiguous and the bias [C] (zeros without one) in `dtype`, where K is
    /// at most [`CONV_BWD_MAX_K`].
    fn operands(
        weight: Tensor,
        bias: Option<Tensor>,
        dtype: DType,
        dev: &candle_core::Device,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if weight.dim(1)? > CONV_BWD_MAX_K {
            return Ok(None);
        }
        let bias = match bias {
            Some(b) => b.to_dtype(dtype)?,
            None => Tensor::zeros(weight.dim(0)?, dtype, dev)?,
        };
        Ok(Some((weight.to_dtype(dtype)?.contiguous()?, bias)))
    }

    /// The [`FusedConv`] op with this conv's weights.
    #[cfg(test)]
    fn fused(&self, input: &Tensor, pad: usize, act: bool) -> Result<Tensor> {
        let (w, b) = self.parts()?;
        fused_conv(input, &w, b.as_ref(), pad, act)
    }

    /// Forward continuing from `prev`, the last K-1 inputs [B, K-1, C] of earlier calls (zeros
    /// when `None`); returns the output and the new last K-1 inputs, for step-by-step decoding.
    pub fn forward_cached(&self, x: &Tensor, prev: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let _s = crate::profile::span("short conv", x.device());
        let (weight, bias) = self.parts()?;
        let (_, t, _) = x.dims3()?;
        let k = weight.dim(1)?;
        let padded = match prev {
            Some(p) => Tensor::cat(&[&p.to_dtype(x.dtype())?, x], 1)?,
            None => x.pad_with_zeros(1, k - 1, 0)?,
        };
        let mut y: Option<Tensor> = None;
        for i in 0..k {
            let w = weight.narrow(1, i, 1)?.squeeze(1)?;
            let term = padded.narrow(1, i, t)?.broadcast_mul(&w)?;
            y = Some(match y {
                None => term,
                Some(acc) => (acc + term)?,
            });
        }
        let y = y.expect("kernel size is at least 1");
        let y = match &bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let state = padded.narrow(1, padded.dim(1)? - (k - 1), k - 1)?;
        Ok((y, state))
    }
}

/// The [`FusedConv`] op: on the CPU it is the reference the CUDA kernel is tested against.
fn fused_conv(input: &Tensor, weight: &Tensor, bias: Option<&Tensor>, pad: usize, act: bool) -> Result<Tensor> {
    let dtype = input.dtype();
    let w = weight.to_dtype(dtype)?.contiguous()?;
    let bias = match bias {
        Some(b) => b.to_dtype(dtype)?,
        None => Tensor::zeros(w.dim(0)?, dtype, input.device())?,
    };
    // A column slice of a stacked projection's output is read where it lies.
    super::as_rows(input)?.apply_op3_no_bwd(&w, &bias, &FusedConv { pad, act })
}

/// The widest kernel [`ConvBwd`] takes (its windows are eight steps).
const CONV_BWD_MAX_K: usize = 8;

/// [`fused_conv`] in its causal form (no history), differentiable: its backward is [`ConvBwd`].
fn fused_conv_grad(input: &Tensor, weight: &Tensor, bias: Option<&Tensor>, act: bool) -> Result<Tensor> {
    let dtype = input.dtype();
    let k = weight.dim(1)?;
    let w = weight.to_dtype(dtype)?.contiguous()?;
    let bias = match bias {
        Some(b) => b.to_dtype(dtype)?,
        None => Tensor::zeros(w.dim(0)?, dtype, input.device())?,
    };
    super::as_rows(input)?.apply_op3(&w, &bias, FusedConv { pad: k - 1, act })
}

/// The last `n` steps of x [B, T, C], zero-padded in front when T < n.
fn last_inputs(x: &Tensor, n: usize) -> Result<Tensor> {
    let t = x.dim(1)?;
    if t >= n {
        x.narrow(1, t - n, n)
    } else {
        x.pad_with_zeros(1, n - t, 0)
    }
}

/// Depthwise causal conv of x [B, L, C] with weight [C, K] and bias [C] (one dtype, float32
/// accumulation), then SiLU when `act`: y[t] = Σ_i w[i] x[t + i − pad], zero outside [0, L).
/// x may be a column slice of a wider matrix (rows of one stride, see `row_strided`).
#[derive(Clone, Copy)]
pub(super) struct FusedConv {
    pad: usize,
    act: bool,
}

impl FusedConv {
    /// The causal form with SiLU for a kernel of `k` taps, which has a backward (up to
    /// [`CONV_BWD_MAX_K`] taps).
    pub(super) fn causal_silu(k: usize) -> Result<Self> {
        if k == 0 || k > CONV_BWD_MAX_K {
            candle_core::bail!("conv: a kernel of {k} taps; the backward takes 1 to {CONV_BWD_MAX_K}");
        }
        Ok(Self { pad: k - 1, act: true })
    }

    /// x's row t of sequence b starts at (b·l + t)·xs.
    fn cpu<T: WithDType>(
        &self,
        x: &[T],
        xs: usize,
        w: &[T],
        bias: &[T],
        (b, l, c, k): (usize, usize, usize, usize),
    ) -> Vec<T> {
        let t_out = l + self.pad + 1 - k;
        let mut y = Vec::with_capacity(b * t_out * c);
        for bi in 0..b {
            for t in 0..t_out {
                for ch in 0..c {
                    let mut acc = bias[ch].to_f64() as f32;
                    for i in 0..k {
                        let s = (t + i) as isize - self.pad as isize;
                        if s >= 0 && (s as usize) < l {
                            acc += w[ch * k + i].to_f64() as f32 * x[(bi * l + s as usize) * xs + ch].to_f64() as f32;
                        }
                    }
                    if self.act {
                        acc /= 1.0 + (-acc).exp();
                    }
                    y.push(T::from_f64(acc as f64));
                }
            }
        }
        y
    }
}

impl CustomOp3 for FusedConv {
    fn name(&self) -> &'static str {
        "statecut-conv-silu"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        bias: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, l, c) = xl.shape().dims3()?;
        let k = wl.shape().dims2()?.1;
        let slice = |lay: &Layout| super::contiguous(lay, "conv");
        let ((ws, we), (bs, be)) = (slice(wl)?, slice(bl)?);
        let super::Rows { offset: x0, stride: rs, .. } = super::Rows::of(xl, "conv")?;
        let dims = (b, l, c, k);
        let out = match (x, w, bias) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(bb)) => {
                CpuStorage::F32(self.cpu(&x[x0..], rs, &w[ws..we], &bb[bs..be], dims))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(bb)) => {
                CpuStorage::BF16(self.cpu(&x[x0..], rs, &w[ws..we], &bb[bs..be], dims))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w), CpuStorage::F16(bb)) => {
                CpuStorage::F16(self.cpu(&x[x0..], rs, &w[ws..we], &bb[bs..be], dims))
            }
            _ => candle_core::bail!("conv: input, weight and bias must share one float dtype"),
        };
        Ok((out, Shape::from((b, l + self.pad + 1 - k, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        bias: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::conv(x, xl, w, wl, bias, bl, self.pad, self.act)
    }

    /// dx, dw and dbias from one [`ConvBwd`] pass over x and the output's gradient.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, l, c) = x.dims3()?;
        let k = w.dim(1)?;
        if self.pad + 1 != k || k > CONV_BWD_MAX_K {
            candle_core::bail!("conv backward: only the causal form with at most {CONV_BWD_MAX_K} taps");
        }
        let f32 = candle_core::DType::F32;
        let wb = Tensor::cat(&[w.to_dtype(f32)?, bias.to_dtype(f32)?.unsqueeze(1)?], 1)?.contiguous()?;
        let dy = grad.to_dtype(x.dtype())?.contiguous()?;
        let rows = super::as_rows(x)?;
        let (dx, parts) = match rows.device().is_cpu() {
            true => {
                let out = rows.apply_op3_no_bwd(&wb, &dy, &ConvBwd { act: self.act })?;
                let n = b * l * c;
                let dx = out.narrow(0, 0, n)?.reshape((b, l, c))?.to_dtype(x.dtype())?;
                (dx, out.narrow(0, n, out.dim(0)? - n)?)
            }
            false => self.grads_gpu(&rows, &wb, &dy)?,
        };
        let parts = parts.reshape((c * (k + 1), ()))?.sum(1)?.reshape((c, k + 1))?;
        let dw = parts.narrow(1, 0, k)?.to_dtype(w.dtype())?;
        let db = parts.narrow(1, k, 1)?.squeeze(1)?.to_dtype(bias.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl FusedConv {
    /// dx [B, L, C] in x's dtype and the float32 partial sums of dw | dbias [C·(K+1)·tiles] from
    /// `conv_silu_bwd` (x as rows of one stride, dy contiguous).
    #[cfg(feature = "cuda")]
    fn grads_gpu(&self, x: &Tensor, wb: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        use super::cuda::on_gpu;
        let (dx, parts) = {
            let ((xs, xl), (ws, wl), (ds, dl)) =
                (x.storage_and_layout(), wb.storage_and_layout(), dy.storage_and_layout());
            let what = "conv backward";
            super::cuda::conv_bwd(on_gpu(&xs, xl, what)?, on_gpu(&ws, wl, what)?, on_gpu(&ds, dl, what)?, self.act)?
        };
        let none = candle_core::op::BackpropOp::none;
        let n = parts.as_cuda_slice::<f32>()?.len();
        let dx = Tensor::from_storage(candle_core::Storage::Cuda(dx), x.shape().clone(), none(), false);
        Ok((dx, Tensor::from_storage(candle_core::Storage::Cuda(parts), n, none(), false)))
    }

    #[cfg(not(feature = "cuda"))]
    fn grads_gpu(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<(Tensor, Tensor)> {
        candle_core::bail!("conv backward: statecut was built without CUDA")
    }
}

/// The backward of [`FusedConv`]'s causal form over (x, w | bias [C, K+1] float32, dy) on the
/// CPU: float32 dx [B·L·C] followed by dw | dbias [C·(K+1)]. It is the reference of
/// `conv_silu_bwd` in cuda/conv.cu, which writes dx in x's dtype and partial sums per tile.
struct ConvBwd {
    act: bool,
}

impl ConvBwd {
    /// The CPU half, in float32 over x's values: (dx, [dw | dbias] by channel).
    fn cpu<T: WithDType>(
        &self,
        x: &[T],
        xs: usize,
        wb: &[f32],
        dy: &[T],
        (b, l, c, k): (usize, usize, usize, usize),
    ) -> Vec<f32> {
        let mut dx = vec![0f32; b * l * c];
        let mut parts = vec![0f32; c * (k + 1)];
        let xv = |bi: usize, s: isize, ch: usize| -> f32 {
            if s < 0 || s as usize >= l {
                0.0
            } else {
                x[(bi * l + s as usize) * xs + ch].to_f64() as f32
            }
        };
        for bi in 0..b {
            for ch in 0..c {
                let w = &wb[ch * (k + 1)..][..k + 1];
                let dpre: Vec<f32> = (0..l)
                    .map(|t| {
                        let pre =
                            w[k] + (0..k).map(|i| w[i] * xv(bi, t as isize - (k - 1 - i) as isize, ch)).sum::<f32>();
                        let d = dy[(bi * l + t) * c + ch].to_f64() as f32;
                        if self.act {
                            let s = 1.0 / (1.0 + (-pre).exp());
                            d * s * (1.0 + pre * (1.0 - s))
                        } else {
                            d
                        }
                    })
                    .collect();
                for (t, d) in dpre.iter().enumerate() {
                    for i in 0..k {
                        parts[ch * (k + 1) + i] += d * xv(bi, t as isize - (k - 1 - i) as isize, ch);
                    }
                    parts[ch * (k + 1) + k] += d;
                }
                for s in 0..l {
                    dx[(bi * l + s) * c + ch] =
                        (0..k).filter(|&i| s + k - 1 - i < l).map(|i| w[i] * dpre[s + k - 1 - i]).sum();
                }
            }
        }
        dx.extend(parts);
        dx
    }
}

impl CustomOp3 for ConvBwd {
    fn name(&self) -> &'static str {
        "statecut-conv-silu-bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        wb: &CpuStorage,
        wbl: &Layout,
        dy: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, l, c) = xl.shape().dims3()?;
        let k = wbl.shape().dims2()?.1 - 1;
        let wb = super::cpu_slice(wb, wbl, "conv backward weight")?;
        let (gs, ge) = super::contiguous(dyl, "conv backward gradient")?;
        let super::Rows { offset: x0, stride: rs, .. } = super::Rows::of(xl, "conv backward")?;
        let dims = (b, l, c, k);
        let out = match (x, dy) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => self.cpu(&x[x0..], rs, wb, &g[gs..ge], dims),
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => self.cpu(&x[x0..], rs, wb, &g[gs..ge], dims),
            (CpuStorage::F16(x), CpuStorage::F16(g)) => self.cpu(&x[x0..], rs, wb, &g[gs..ge], dims),
            _ => candle_core::bail!("conv backward: input and gradient must share one float dtype"),
        };
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn flat(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    fn ramp(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The fused op (the CUDA kernel's CPU twin) against conv + SiLU in candle ops, fresh and
    /// continuing from a history, with and without bias, short and long inputs.
    #[test]
    fn fused_matches_candle_ops() {
        let (c, k) = (6, 4);
        for bias in [false, true] {
            let conv = ShortConv::new(ramp(&[c, 1, k], 1.0), bias.then(|| ramp(&[c], 2.0))).unwrap();
            for t in [1, 2, 9] {
                let x = ramp(&[2, t, c], 3.0 + t as f32);
                let prev = ramp(&[2, k - 1, c], 5.0);
                for p in [None, Some(&prev)] {
                    let (y, st) = conv.forward_cached(&x, p).unwrap();
                    let y = candle_nn::ops::silu(&y).unwrap();
                    let (input, pad) = match p {
                        Some(p) => (Tensor::cat(&[p, &x], 1).unwrap(), 0),
                        None => (x.clone(), k - 1),
                    };
                    let fy = conv.fused(&input, pad, true).unwrap();
                    let diff = (fy - &y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert!(diff < 1e-6, "t {t} bias {bias} prev {}: {diff}", p.is_some());
                    let fst = last_inputs(&input, k - 1).unwrap();
                    let d = (fst - st).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                    assert_eq!(d, 0.0);
                    let half = conv.fused(&input.to_dtype(DType::BF16).unwrap(), pad, true).unwrap();
                    assert_eq!(half.dtype(), DType::BF16);
                    // a column slice of a wider matrix, read where it lies
                    let wide = Tensor::cat(&[&input, &input.narrow(2, 0, 2).unwrap()], 2).unwrap();
                    let sliced = conv.fused(&wide.narrow(2, 0, c).unwrap(), pad, true).unwrap();
                    assert_eq!(flat(&sliced), flat(&conv.fused(&input, pad, true).unwrap()));
                }
            }
        }
    }

    /// The differentiable op's gradients (its backward, [`ConvBwd`], whose CPU half is the
    /// reference for `conv_silu_bwd`) equal those of conv + SiLU in candle ops: for x read as a
    /// column slice, the weight and the bias, with and without SiLU, kernels of 1 to 8 taps,
    /// sequences shorter than the kernel, in float32 and bf16.
    #[test]
    fn conv_gradients_match_candle_ops() {
        use candle_core::Var;
        for (b, l, c, k) in [(2, 9, 5, 4), (1, 3, 4, 4), (2, 7, 3, 1), (1, 12, 2, 8), (3, 5, 6, 2)] {
            for act in [true, false] {
                for dtype in [DType::F32, DType::BF16] {
                    let what = format!("{b}x{l}x{c} k {k} act {act} {dtype:?}");
                    let wide = Var::from_tensor(&ramp(&[b, l, c + 3], 0.3).to_dtype(dtype).unwrap()).unwrap();
                    let w = Var::from_tensor(&ramp(&[c, k], 1.1)).unwrap();
                    let bias = Var::from_tensor(&ramp(&[c], 2.2)).unwrap();
                    let g = ramp(&[b, l, c], 4.4).to_dtype(dtype).unwrap();
                    let x = wide.as_tensor().narrow(2, 1, c).unwrap();
                    let fast = fused_conv_grad(&x, w.as_tensor(), Some(bias.as_tensor()), act).unwrap();
                    // The reference in float32 over the values the op reads (x, w and bias
                    // rounded to the dtype): candle's bf16 ops would also sum in bf16.
                    let f32 = DType::F32;
                    let round = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(f32).unwrap();
                    let conv = ShortConv::new(round(w.as_tensor()).unsqueeze(1).unwrap(), None).unwrap();
                    let (y, _) = conv.forward_cached(&round(&x), None).unwrap();
                    let y = y.broadcast_add(&round(bias.as_tensor())).unwrap();
                    let slow = if act { candle_nn::ops::silu(&y).unwrap() } else { y };
                    let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                    let close = |a: &Tensor, b: &Tensor, name: &str| {
                        let (a, b) = (flat(a), flat(b));
                        let scale = b.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
                        let err = a.iter().zip(&b).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
                        assert!(err < tol, "{what} {name}: {err}");
                    };
                    close(&fast, &slow, "y");
                    let gf = (fast.to_dtype(DType::F32).unwrap() * g.to_dtype(DType::F32).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let gs = (slow.to_dtype(DType::F32).unwrap() * g.to_dtype(DType::F32).unwrap())
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    for (name, v) in [("x", wide.as_tensor()), ("w", w.as_tensor()), ("bias", bias.as_tensor())] {
                        close(gf.get(v).unwrap(), gs.get(v).unwrap(), name);
                    }
                }
            }
        }
    }
}
