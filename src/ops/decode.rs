//! One decoding step of a delta-rule layer in few kernels, for the step-by-step path where
//! launching kernels, not moving bytes, would bound the step: [`StepInputs`] turns the layer's
//! projections into the recurrence's inputs in one pass, and [`OutNorm`] norms (and gates) the
//! recurrence's float32 output. The CPU halves define what the CUDA kernels compute and are
//! tested against the separate ops the prefill path takes.

pub use super::launch::StepDims;
use super::Rows;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, WithDType};

impl StepDims {
    /// Channels of the conv: [q | k | v].
    pub fn channels(&self) -> usize {
        2 * self.heads * self.dk + self.v_heads * self.dv
    }

    /// Offsets of q, k, v, β, g and the conv history in the step's float32 output.
    fn offsets(&self) -> [usize; 7] {
        let (bh, c) = (self.b * self.v_heads, self.channels());
        let q = 0;
        let k = q + bh * self.dk;
        let v = k + bh * self.dk;
        let beta = v + bh * self.dv;
        let g = beta + bh;
        let conv = g + bh;
        [q, k, v, beta, g, conv, conv + self.b * (self.kernel - 1) * c]
    }
}

/// What one decoding step of a delta-rule layer feeds its recurrence, computed from the
/// pre-conv projection row x = [q | k | v] of each sequence (the op's input, a [`Rows`] view):
/// the short conv continued from the float32 history [B, K-1, C], SiLU rounded to x's dtype (as
/// the prefill's fused conv rounds), L2-normed q and k repeated to the value heads,
/// β = `beta_scale` · sigmoid(b) (1 without b) and g = neg_a · softplus(a + dt_bias) (none
/// without a). Output, float32 and flat: q, k [B, Hv, dk], v [B, Hv, dv], β, g [B, Hv], and the
/// shifted history [B, K-1, C].
pub struct StepInputs {
    pub dims: StepDims,
    /// [B, K-1, C] float32, contiguous
    pub history: Tensor,
    /// [C, K] in x's dtype, contiguous
    pub weight: Tensor,
    /// [C] in x's dtype
    pub bias: Option<Tensor>,
    /// [B, ·, Hv] row views in x's dtype
    pub b: Option<Tensor>,
    pub a: Option<Tensor>,
    /// float32 [Hv] each; present with `a`
    pub neg_a: Option<Tensor>,
    pub dt_bias: Option<Tensor>,
    pub beta_scale: f32,
    pub eps: f32,
    /// Write the shifted history over `history` itself instead of into the output (a step
    /// replayed from a CUDA graph reads and writes fixed addresses). GPU only.
    pub in_place: bool,
}

/// [`StepInputs`]' output, split.
pub struct Step {
    /// [B, 1, Hv, dk]
    pub q: Tensor,
    pub k: Tensor,
    /// [B, 1, Hv, dv]
    pub v: Tensor,
    /// [B, 1, Hv]
    pub beta: Tensor,
    pub g: Option<Tensor>,
    /// [B, K-1, C] float32: the op's `history` itself when it ran in place
    pub history: Tensor,
}

impl StepInputs {
    /// Runs the op on the pre-conv row view `x`.
    pub fn run(&self, x: &Tensor) -> Result<Step> {
        let d = self.dims;
        let out = x.apply_op1_no_bwd(self)?;
        let o = d.offsets();
        let part = |i: usize| out.narrow(0, o[i], o[i + 1] - o[i]);
        let (b, hv) = (d.b, d.v_heads);
        Ok(Step {
            q: part(0)?.reshape((b, 1, hv, d.dk))?,
            k: part(1)?.reshape((b, 1, hv, d.dk))?,
            v: part(2)?.reshape((b, 1, hv, d.dv))?,
            beta: part(3)?.reshape((b, 1, hv))?,
            g: if self.a.is_some() { Some(part(4)?.reshape((b, 1, hv))?) } else { None },
            history: if self.in_place {
                self.history.clone()
            } else {
                part(5)?.reshape((b, d.kernel - 1, d.channels()))?
            },
        })
    }

    fn check(&self, x: &Rows) -> Result<()> {
        let d = self.dims;
        let c = d.channels();
        if x.rows != d.b || x.width != c || d.kernel == 0 || d.heads == 0 || !d.v_heads.is_multiple_of(d.heads) {
            candle_core::bail!("decode step: input {x:?} for {d:?}");
        }
        if self.history.dims() != [d.b, d.kernel - 1, c] || self.weight.dims() != [c, d.kernel] {
            candle_core::bail!(
                "decode step: history {:?} / conv weight {:?} for {d:?}",
                self.history.shape(),
                self.weight.shape()
            );
        }
        if self.a.is_some() != (self.neg_a.is_some() && self.dt_bias.is_some()) {
            candle_core::bail!("decode step: a decay needs a, A and dt_bias");
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn flags(&self) -> i32 {
        self.bias.is_some() as i32 | (self.b.is_some() as i32) << 1 | (self.a.is_some() as i32) << 2
    }

    /// The CPU half on x's rows.
    fn cpu<T: WithDType>(&self, x: &[T], xr: Rows) -> Result<Vec<f32>> {
        let d = self.dims;
        let (c, k, r, kd) = (d.channels(), d.kernel, d.v_heads / d.heads, d.heads * d.dk);
        let history = f32_vec(&self.history)?;
        let weight = typed::<T>(&self.weight)?;
        let bias = self.bias.as_ref().map(typed::<T>).transpose()?;
        let rows = |t: &Option<Tensor>| -> Result<Option<(Vec<T>, Rows)>> {
            t.as_ref().map(|t| Ok((cpu_slice::<T>(t)?, Rows::of(t.layout(), "decode step gate")?))).transpose()
        };
        let (bv, av) = (rows(&self.b)?, rows(&self.a)?);
        let neg_a = self.neg_a.as_ref().map(f32_vec).transpose()?;
        let dt_bias = self.dt_bias.as_ref().map(f32_vec).transpose()?;
        let o = d.offsets();
        let mut out = vec![0f32; o[6]];
        for b in 0..d.b {
            let xb = xr.row(x, b);
            let hist = &history[b * (k - 1) * c..][..(k - 1) * c];
            // conv + SiLU of every channel, rounded as the kernel rounds, and the shifted history
            let mut y = vec![0f32; c];
            for (ch, y) in y.iter_mut().enumerate() {
                let xc = xb[ch].to_f64() as f32;
                let mut acc = bias.as_ref().map_or(0.0, |bias| bias[ch].to_f64() as f32);
                for i in 0..k - 1 {
                    acc += weight[ch * k + i].to_f64() as f32 * hist[i * c + ch];
                }
                acc += weight[ch * k + k - 1].to_f64() as f32 * xc;
                *y = T::from_f64((acc / (1.0 + (-acc).exp())) as f64).to_f64() as f32;
                let shifted = &mut out[o[5] + b * (k - 1) * c..][..(k - 1) * c];
                for i in 0..k.saturating_sub(2) {
                    shifted[i * c + ch] = hist[(i + 1) * c + ch];
                }
                if k > 1 {
                    shifted[(k - 2) * c + ch] = xc;
                }
            }
            for h in 0..d.v_heads {
                let bh = b * d.v_heads + h;
                let kh = h / r;
                let normed = |part: &[f32]| {
                    let ss: f32 = part.iter().map(|v| v * v).sum();
                    let inv = 1.0 / (ss + self.eps).sqrt();
                    part.iter().map(|v| v * inv).collect::<Vec<_>>()
                };
                let q = normed(&y[kh * d.dk..][..d.dk]);
                let kk = normed(&y[kd + kh * d.dk..][..d.dk]);
                out[o[0] + bh * d.dk..][..d.dk].copy_from_slice(&q);
                out[o[1] + bh * d.dk..][..d.dk].copy_from_slice(&kk);
                out[o[2] + bh * d.dv..][..d.dv].copy_from_slice(&y[2 * kd + h * d.dv..][..d.dv]);
                out[o[3] + bh] = match &bv {
                    Some((v, rw)) => self.beta_scale / (1.0 + (-(rw.row(v, b)[h].to_f64() as f32)).exp()),
                    None => 1.0,
                };
                if let (Some((v, rw)), Some(na), Some(dt)) = (&av, &neg_a, &dt_bias) {
                    out[o[4] + bh] = na[h] * softplus(rw.row(v, b)[h].to_f64() as f32 + dt[h]);
                }
            }
        }
        Ok(out)
    }
}

fn softplus(x: f32) -> f32 {
    x.max(0.0) + (1.0 + (-x.abs()).exp()).ln()
}

/// The elements of a (CPU) tensor as T, in its logical order.
fn typed<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

fn f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    typed::<f32>(&t.to_dtype(DType::F32)?)
}

/// The whole storage of a CPU tensor as T (for [`Rows`] views, which index it by offset).
fn cpu_slice<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    let (s, _) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => Ok(T::cpu_storage_as_slice(c)?.to_vec()),
        _ => candle_core::bail!("decode step: expected a CPU tensor"),
    }
}

/// A held tensor's CUDA storage (read-locked by `storage_and_layout`) and start offset.
#[cfg(feature = "cuda")]
fn on_gpu<'a, G: std::ops::Deref<Target = Storage>>(
    g: &'a (G, &Layout),
) -> Result<(&'a candle_core::CudaStorage, usize)> {
    match &*g.0 {
        Storage::Cuda(c) => Ok((c, g.1.start_offset())),
        _ => candle_core::bail!("decode step: every input must be on the GPU"),
    }
}

/// A held row view's CUDA storage, offset and row stride.
#[cfg(feature = "cuda")]
fn row_view<'a, G: std::ops::Deref<Target = Storage>>(
    g: &'a Option<(G, &Layout)>,
    what: &str,
) -> Result<Option<super::cuda::RowView<'a>>> {
    g.as_ref()
        .map(|g| {
            let r = Rows::of(g.1, what)?;
            Ok((on_gpu(g)?.0, r.offset, r.stride))
        })
        .transpose()
}

impl CustomOp1 for StepInputs {
    fn name(&self) -> &'static str {
        "statecut-delta-decode-step"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let xr = Rows::of(l, "decode step input")?;
        self.check(&xr)?;
        if self.in_place {
            candle_core::bail!("decode step: the in-place step runs on a GPU only");
        }
        let out = match x {
            CpuStorage::F32(x) => self.cpu(x, xr)?,
            CpuStorage::BF16(x) => self.cpu(x, xr)?,
            CpuStorage::F16(x) => self.cpu(x, xr)?,
            _ => candle_core::bail!("decode step: unsupported dtype"),
        };
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let xr = Rows::of(l, "decode step input")?;
        self.check(&xr)?;
        let d = self.dims;
        let held = Tensor::storage_and_layout;
        let (hist, w) = (held(&self.history), held(&self.weight));
        let bias = self.bias.as_ref().map(held);
        let (bv, av) = (self.b.as_ref().map(held), self.a.as_ref().map(held));
        let (na, dt) = (self.neg_a.as_ref().map(held), self.dt_bias.as_ref().map(held));
        let args = super::cuda::StepArgs {
            x: (x, xr.offset, xr.stride),
            history: on_gpu(&hist)?,
            weight: on_gpu(&w)?,
            bias: bias.as_ref().map(on_gpu).transpose()?,
            b: row_view(&bv, "decode step gate")?,
            a: row_view(&av, "decode step gate")?,
            neg_a: na.as_ref().map(on_gpu).transpose()?,
            dt_bias: dt.as_ref().map(on_gpu).transpose()?,
        };
        let n = d.offsets()[if self.in_place { 5 } else { 6 }];
        let out = super::cuda::decode_step(&args, &d, self.flags(), self.beta_scale, self.eps, n, self.in_place)?;
        Ok((out, Shape::from(n)))
    }
}

/// RMSNorm over dv of the recurrence's float32 output o [B, T, Hv, dv], rounded first to the
/// layer's dtype (as the layer's output is), then gated by silu(gate) when a gate is given: a
/// [B, T, Hv·dv] row view. Output [B, T, Hv·dv] in `dtype`. One kernel for what separate ops
/// do in three passes (rounding, norm, gate).
pub struct OutNorm {
    /// float32 [dv]
    pub weight: Tensor,
    pub gate: Option<Tensor>,
    pub dtype: DType,
    pub eps: f32,
}

impl OutNorm {
    /// (B, T, heads, dv)
    fn dims(&self, l: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (b, t, h, dv) = l.shape().dims4()?;
        if self.weight.elem_count() != dv {
            candle_core::bail!("output norm: o {:?}, weight {:?}", l.shape(), self.weight.shape());
        }
        if let Some(g) = &self.gate {
            if g.elem_count() != b * t * h * dv {
                candle_core::bail!("output norm: o {:?}, gate {:?}", l.shape(), g.shape());
            }
        }
        Ok((b, t, h, dv))
    }

    /// o's rows of `tokens` tokens, `h` heads of width `dv` each.
    fn cpu<T: WithDType>(&self, o: &[f32], tokens: usize, h: usize, dv: usize) -> Result<Vec<T>> {
        let w = f32_vec(&self.weight)?;
        let gate = match &self.gate {
            Some(g) => Some((cpu_slice::<T>(g)?, Rows::of(g.layout(), "output gate")?)),
            None => None,
        };
        let mut y = Vec::with_capacity(o.len());
        for (row, or) in o.chunks_exact(dv).enumerate() {
            let x: Vec<f32> = or.iter().map(|v| T::from_f64(*v as f64).to_f64() as f32).collect();
            let ss: f32 = x.iter().map(|v| v * v).sum();
            let inv = 1.0 / (ss / dv as f32 + self.eps).sqrt();
            let g = gate.as_ref().map(|(g, r)| &r.row(g, row / h)[(row % h) * dv..][..dv]);
            for i in 0..dv {
                let mut v = x[i] * inv * w[i];
                if let Some(g) = g {
                    let gv = g[i].to_f64() as f32;
                    v *= gv / (1.0 + (-gv).exp());
                }
                y.push(T::from_f64(v as f64));
            }
        }
        debug_assert_eq!(y.len(), tokens * h * dv);
        Ok(y)
    }
}

impl CustomOp1 for OutNorm {
    fn name(&self) -> &'static str {
        "statecut-decode-output-norm"
    }

    fn cpu_fwd(&self, o: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, t, h, dv) = self.dims(l)?;
        let (s, e) = super::contiguous(l, "output norm")?;
        let CpuStorage::F32(o) = o else { candle_core::bail!("output norm: o must be float32") };
        let o = &o[s..e];
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(self.cpu(o, b * t, h, dv)?),
            DType::BF16 => CpuStorage::BF16(self.cpu(o, b * t, h, dv)?),
            DType::F16 => CpuStorage::F16(self.cpu(o, b * t, h, dv)?),
            dt => candle_core::bail!("output norm: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from((b, t, h * dv))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, o: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, t, h, dv) = self.dims(l)?;
        let w = self.weight.storage_and_layout();
        let gate = self.gate.as_ref().map(|g| g.storage_and_layout());
        let gate = row_view(&gate, "output gate")?;
        let out = super::cuda::out_norm(o, l, gate, on_gpu(&w)?, self.dtype, (b * t * h, dv, h), self.eps)?;
        Ok((out, Shape::from((b, t, h * dv))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::ShortConv;
    use crate::ops::norm::{l2_norm, NormWeight, RmsNorm};
    use crate::ops::{repeat_heads, softplus as softplus_t};
    use candle_core::Device;

    fn close(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
        let (a, b) = (a.flatten_all()?, b.flatten_all()?);
        let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
        assert!(diff / scale < 1e-5, "{what}: differs by {diff} (scale {scale})");
        Ok(())
    }

    /// The step's inputs equal the separate ops of the prefill path, on row views of one stacked
    /// projection output [qkv | z | b | a], with two value heads per key head.
    #[test]
    fn step_inputs_match_the_separate_ops() -> Result<()> {
        let dev = Device::Cpu;
        let d = StepDims { b: 3, heads: 2, v_heads: 4, dk: 8, dv: 6, kernel: 4 };
        let (c, hv, k) = (d.channels(), d.v_heads, d.kernel);
        let y = Tensor::randn(0f32, 1.0, (d.b, 1, c + hv * d.dv + 2 * hv), &dev)?;
        let qkv = y.narrow(2, 0, c)?;
        let (b, a) = (y.narrow(2, c + hv * d.dv, hv)?, y.narrow(2, c + hv * d.dv + hv, hv)?);
        let history = Tensor::randn(0f32, 1.0, (d.b, k - 1, c), &dev)?;
        let weight = Tensor::randn(0f32, 0.5, (c, 1, k), &dev)?;
        let bias = Tensor::randn(0f32, 0.5, c, &dev)?;
        let neg_a = Tensor::randn(0f32, 1.0, hv, &dev)?.exp()?.neg()?;
        let dt_bias = Tensor::randn(0f32, 1.0, hv, &dev)?;
        let op = StepInputs {
            dims: d,
            history: history.clone(),
            weight: weight.reshape((c, k))?,
            bias: Some(bias.clone()),
            b: Some(b.clone()),
            a: Some(a.clone()),
            neg_a: Some(neg_a.clone()),
            dt_bias: Some(dt_bias.clone()),
            beta_scale: 2.0,
            eps: 1e-6,
            in_place: false,
        };
        let s = op.run(&qkv)?;

        let conv = ShortConv::new(weight, Some(bias))?;
        let (mixed, next) = conv.forward_cached(&qkv, Some(&history))?;
        let mixed = candle_nn::ops::silu(&mixed)?;
        let kd = d.heads * d.dk;
        let heads = |x: Tensor, h: usize, w: usize| x.reshape((d.b, 1, h, w));
        let q = heads(mixed.narrow(2, 0, kd)?, d.heads, d.dk)?;
        let kk = heads(mixed.narrow(2, kd, kd)?, d.heads, d.dk)?;
        let r = hv / d.heads;
        close(&s.q, &repeat_heads(&l2_norm(&q, 1e-6)?, r)?, "q")?;
        close(&s.k, &repeat_heads(&l2_norm(&kk, 1e-6)?, r)?, "k")?;
        close(&s.v, &heads(mixed.narrow(2, 2 * kd, hv * d.dv)?, hv, d.dv)?, "v")?;
        close(&s.beta, &(candle_nn::ops::sigmoid(&b)? * 2.0)?, "beta")?;
        let g = softplus_t(&a.broadcast_add(&dt_bias)?)?.broadcast_mul(&neg_a)?;
        close(s.g.as_ref().expect("a decay"), &g, "g")?;
        close(&s.history, &next, "history")?;

        // Without b, a and a bias: β = 1, no decay.
        let plain = StepInputs { bias: None, b: None, a: None, neg_a: None, dt_bias: None, ..op };
        let s = plain.run(&qkv)?;
        assert!(s.g.is_none());
        assert_eq!(s.beta.flatten_all()?.to_vec1::<f32>()?, vec![1.0; d.b * hv]);
        // A history of the wrong width is an error, not a wrong read.
        let bad = StepInputs { history: history.narrow(2, 1, c - 1)?.contiguous()?, ..plain };
        assert!(bad.run(&qkv).is_err());
        Ok(())
    }

    /// The output norm equals RMSNorm (gated by silu(z) or not) on the recurrence's output
    /// rounded to the layer's dtype.
    #[test]
    fn out_norm_matches_the_norm_ops() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, dv) = (2, 3, 8);
        let o = Tensor::randn(0f32, 1.0, (b, 1, h, dv), &dev)?;
        let zs = Tensor::randn(0f32, 1.0, (b, 1, 5 + h * dv), &dev)?;
        let z = zs.narrow(2, 5, h * dv)?;
        let w = Tensor::randn(1f32, 0.1, dv, &dev)?;
        let norm = RmsNorm::new(w.clone(), 1e-5, NormWeight::Plain)?;
        let gated = OutNorm { weight: w.clone(), gate: Some(z.clone()), dtype: DType::F32, eps: 1e-5 };
        let want = norm.forward_gated(&o, &z.reshape((b, 1, h, dv))?)?;
        close(&o.apply_op1_no_bwd(&gated)?, &want, "gated")?;
        let plain = OutNorm { gate: None, ..gated };
        close(&o.apply_op1_no_bwd(&plain)?, &norm.forward(&o)?, "plain")?;
        // bf16: o is rounded before the norm, as the prefill rounds the recurrence's output.
        let bf = OutNorm { dtype: DType::BF16, ..plain };
        let want = norm.forward(&o.to_dtype(DType::BF16)?)?.to_dtype(DType::F32)?;
        let got = o.apply_op1_no_bwd(&bf)?.to_dtype(DType::F32)?;
        let diff = (got.flatten_all()? - want.flatten_all()?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff <= 2f32.powi(-6), "bf16 output norm differs by {diff}");
        Ok(())
    }
}
