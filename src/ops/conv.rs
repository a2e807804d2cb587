//! Depthwise causal short convolution (fla `ShortConvolution`, Mamba-2 and Qwen3.5 `conv1d`).

use super::derived::Derived;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

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
        let tensors = [Some(x), Some(&weight), bias.as_ref(), prev].into_iter().flatten();
        if !super::fusable(&tensors.collect::<Vec<_>>()) {
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
struct FusedConv {
    pad: usize,
    act: bool,
}

impl FusedConv {
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
}
