//! The chunked form's change of layout as ops of their own: a model's [B,T,H,d] tensors (any
//! float dtype) to the chunk-major [N,B·H,C,d] float32 that the chunk ops read, T zero-padded to
//! N·C, and the outputs back. Written in candle ops each direction is a cast, a pad, a permute
//! and a copy, and autograd keeps a full-size gradient for every one of them; here it is one
//! launch each way, and each op's backward is the other.

pub(crate) use super::launch::ChunkLayout;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

impl ChunkLayout {
    fn of(x: &Tensor, c: usize, width: usize, off: usize) -> Result<ChunkLayout> {
        let (b, t, h, d) = x.dims4()?;
        Ok(ChunkLayout { b, t, h, c, d, width, off })
    }
    fn chunk_shape(&self) -> Shape {
        Shape::from((self.n(), self.b * self.h, self.c, self.width))
    }
    /// Index in the chunk layout of model element `i` ([B,T,H,d] row-major).
    fn chunk_index(&self, i: usize) -> usize {
        let (r, rest) = (i % self.d, i / self.d);
        let (h, rest) = (rest % self.h, rest / self.h);
        let (time, b) = (rest % self.t, rest / self.t);
        (((time / self.c) * self.b * self.h + b * self.h + h) * self.c + time % self.c) * self.width + self.off + r
    }
}

/// x [B,T,H,d] → [N,B·H,C,d] float32 (chunks of `c`), differentiable.
pub(crate) fn to_chunks(x: &Tensor, c: usize) -> Result<Tensor> {
    let l = ChunkLayout::of(x, c, x.dim(3)?, 0)?;
    x.contiguous()?.apply_op1(ToChunks(l))
}

/// x [B,T,H,dx] and y [B,T,H,dy] side by side: [N,B·H,C,dx+dy] float32, differentiable (the
/// recurrence takes it linked, [`to_chunks_pair_linked`]).
#[cfg(test)]
pub(crate) fn to_chunks_pair(x: &Tensor, y: &Tensor, c: usize) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&y.contiguous()?, ToChunksPair::of(x, y, c)?)
}

/// [`to_chunks_pair`] linked (see `ops::link`): for the one op that reads the pair, whose
/// gradient, twice the size of a 16-bit x and y together, then skips candle's zero fill and add.
pub(crate) fn to_chunks_pair_linked(x: &Tensor, y: &Tensor, c: usize) -> Result<super::link::Linked> {
    super::link::link2(&x.contiguous()?, &y.contiguous()?, ToChunksPair::of(x, y, c)?)
}

/// x [N,B·H,C,d] float32 → [B,T,H,d] in `dtype` (T ≤ N·C: the padding is dropped), differentiable.
pub(crate) fn from_chunks(x: &Tensor, b: usize, t: usize, h: usize, dtype: DType) -> Result<Tensor> {
    x.contiguous()?.apply_op1(from_chunks_op(x, b, t, h, dtype)?)
}

/// [`from_chunks`]'s op, for a caller that runs its forward on a storage itself.
pub(crate) fn from_chunks_op(x: &Tensor, b: usize, t: usize, h: usize, dtype: DType) -> Result<FromChunks> {
    let (n, bh, c, d) = x.dims4()?;
    if bh != b * h || t > n * c || t + c <= n * c {
        candle_core::bail!("chunk layout: {:?} does not hold {b} x {t} x {h} in chunks", x.dims());
    }
    Ok(FromChunks(ChunkLayout { b, t, h, c, d, width: d, off: 0 }, dtype))
}

/// Per-step scalars x [B,T,H] (β, a log decay) → [N,B·H,C] float32, T zero-padded to N·C: the
/// composed layout change, in candle ops (the scalars are small).
pub(crate) fn scalars_to_chunks(x: &Tensor, c: usize) -> Result<Tensor> {
    let (b, t, h) = x.dims3()?;
    let n = t.div_ceil(c);
    let x = x.to_dtype(DType::F32)?;
    let x = if n * c > t { x.pad_with_zeros(1, 0, n * c - t)? } else { x };
    x.reshape((b, n, c, h))?.permute((1, 0, 3, 2))?.reshape((n, b * h, c))
}

/// [`scalars_to_chunks`] backwards: [N,B·H,C] → [B,T,H], the padding dropped.
pub(crate) fn scalars_from_chunks(x: &Tensor, b: usize, t: usize, h: usize) -> Result<Tensor> {
    let (n, _, c) = x.dims3()?;
    x.reshape((n, b, h, c))?.permute((1, 0, 3, 2))?.reshape((b, n * c, h))?.narrow(1, 0, t)
}

/// Model-layout values as float32 on the CPU.
fn host_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, e) = super::contiguous(l, "chunk layout")?;
    fn widen<T: WithDType>(x: &[T]) -> Vec<f32> {
        x.iter().map(|v| v.to_f64() as f32).collect()
    }
    Ok(match s {
        CpuStorage::F32(x) => x[a..e].to_vec(),
        CpuStorage::BF16(x) => widen(&x[a..e]),
        CpuStorage::F16(x) => widen(&x[a..e]),
        _ => candle_core::bail!("chunk layout: unsupported dtype"),
    })
}

/// Scatter model-layout x into its columns of a chunk-layout buffer (the padding stays zero).
fn scatter(l: &ChunkLayout, x: &[f32], out: &mut [f32]) {
    for (i, v) in x.iter().enumerate() {
        out[l.chunk_index(i)] = *v;
    }
}

struct ToChunks(ChunkLayout);

impl CustomOp1 for ToChunks {
    fn name(&self) -> &'static str {
        "statecut-to-chunks"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut out = vec![0f32; self.0.chunk_len()];
        scatter(&self.0, &host_f32(x, l)?, &mut out);
        Ok((CpuStorage::F32(out), self.0.chunk_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::to_chunks(&[(self.0, (x, l))])?, self.0.chunk_shape()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        Ok(Some(g.apply_op1_no_bwd(&FromChunks(self.0, x.dtype()))?))
    }
}

struct ToChunksPair(ChunkLayout, ChunkLayout);

impl ToChunksPair {
    /// x [B,T,H,dx] and y [B,T,H,dy] side by side in chunks of `c`.
    fn of(x: &Tensor, y: &Tensor, c: usize) -> Result<Self> {
        let (dx, dy) = (x.dim(3)?, y.dim(3)?);
        let (lx, ly) = (ChunkLayout::of(x, c, dx + dy, 0)?, ChunkLayout::of(y, c, dx + dy, dx)?);
        if (lx.b, lx.t, lx.h) != (ly.b, ly.t, ly.h) {
            candle_core::bail!("chunk layout: {:?} and {:?} differ before their last dimension", x.dims(), y.dims());
        }
        Ok(Self(lx, ly))
    }
}

impl CustomOp2 for ToChunksPair {
    fn name(&self) -> &'static str {
        "statecut-to-chunks-pair"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, y: &CpuStorage, yl: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut out = vec![0f32; self.0.chunk_len()];
        scatter(&self.0, &host_f32(x, xl)?, &mut out);
        scatter(&self.1, &host_f32(y, yl)?, &mut out);
        Ok((CpuStorage::F32(out), self.0.chunk_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::to_chunks(&[(self.0, (x, xl)), (self.1, (y, yl))])?, self.0.chunk_shape()))
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let dx = g.apply_op1_no_bwd(&FromChunks(self.0, x.dtype()))?;
        let dy = g.apply_op1_no_bwd(&FromChunks(self.1, y.dtype()))?;
        Ok((Some(dx), Some(dy)))
    }
}

/// Columns off..off+d of a chunk-layout float32 tensor, to the model layout in a dtype.
pub(crate) struct FromChunks(ChunkLayout, DType);

impl CustomOp1 for FromChunks {
    fn name(&self) -> &'static str {
        "statecut-from-chunks"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = super::cpu_slice(x, l, "chunk layout")?;
        let l = self.0;
        let v: Vec<f32> = (0..l.model_len()).map(|i| x[l.chunk_index(i)]).collect();
        let out = match self.1 {
            DType::F32 => CpuStorage::F32(v),
            DType::BF16 => CpuStorage::BF16(v.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            DType::F16 => CpuStorage::F16(v.iter().map(|&x| half::f16::from_f32(x)).collect()),
            dt => candle_core::bail!("chunk layout: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from((l.b, l.t, l.h, l.d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = self.0;
        Ok((super::cuda::from_chunks(&c, (x, l), self.1)?, Shape::from((c.b, c.t, c.h, c.d))))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let l = ChunkLayout { width: self.0.d, off: 0, ..self.0 };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&ToChunks(l))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The candle-op layout change that these ops replace: the reference.
    fn composed(x: &Tensor, c: usize) -> Tensor {
        let (b, t, h, d) = x.dims4().unwrap();
        let n = t.div_ceil(c);
        let x = x.to_dtype(DType::F32).unwrap();
        let x = if n * c > t { x.pad_with_zeros(1, 0, n * c - t).unwrap() } else { x };
        x.reshape((b, n, c, h, d)).unwrap().permute((1, 0, 3, 2, 4)).unwrap().reshape((n, b * h, c, d)).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    /// Both directions and their gradients equal the composed layout change exactly, for ragged
    /// T, T below one chunk, each dtype and the side-by-side pair.
    #[test]
    fn matches_composed_layout() {
        let dev = Device::Cpu;
        for (b, t, h, dx, dy, c) in [(2, 7, 3, 4, 5, 4), (1, 3, 2, 2, 3, 8), (2, 16, 1, 3, 1, 8)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let what = format!("{b}x{t}x{h} dx {dx} dy {dy} c {c} {dtype:?}");
                let x =
                    Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, h, dx), &dev).unwrap().to_dtype(dtype).unwrap())
                        .unwrap();
                let y =
                    Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, t, h, dy), &dev).unwrap().to_dtype(dtype).unwrap())
                        .unwrap();
                let n = t.div_ceil(c);
                let g = Tensor::randn(0f32, 1.0, (n, b * h, c, dx + dy), &dev).unwrap();
                // To chunks, one and a pair; each gradient against the composed one's.
                let run = |fast: bool| {
                    let out = if fast {
                        to_chunks_pair(x.as_tensor(), y.as_tensor(), c).unwrap()
                    } else {
                        Tensor::cat(&[composed(x.as_tensor(), c), composed(y.as_tensor(), c)], 3).unwrap()
                    };
                    let grads = (&out * &g).unwrap().sum_all().unwrap().backward().unwrap();
                    (out, grads.get(x.as_tensor()).unwrap().clone(), grads.get(y.as_tensor()).unwrap().clone())
                };
                let ((o1, gx1, gy1), (o2, gx2, gy2)) = (run(true), run(false));
                assert_eq!(max_diff(&o1, &o2), 0.0, "{what}: pair");
                assert_eq!(gx1.dtype(), dtype, "{what}: gradient dtype");
                assert_eq!(max_diff(&gx1, &gx2) + max_diff(&gy1, &gy2), 0.0, "{what}: pair gradients");
                let one = to_chunks(x.as_tensor(), c).unwrap();
                assert_eq!(max_diff(&one, &composed(x.as_tensor(), c)), 0.0, "{what}: one");
                // And back: the model layout again, and the gradient in the chunk layout.
                let z = Var::from_tensor(&one).unwrap();
                let back = from_chunks(z.as_tensor(), b, t, h, dtype).unwrap();
                assert_eq!(back.dtype(), dtype);
                assert_eq!(max_diff(&back, x.as_tensor()), 0.0, "{what}: round trip");
                let gb = Tensor::randn(0f32, 1.0, (b, t, h, dx), &dev).unwrap().to_dtype(dtype).unwrap();
                let grads = (back.to_dtype(DType::F32).unwrap() * gb.to_dtype(DType::F32).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                assert_eq!(
                    max_diff(grads.get(z.as_tensor()).unwrap(), &composed(&gb, c)),
                    0.0,
                    "{what}: back gradient"
                );
            }
        }
        let x = Tensor::zeros((1, 5, 1, 2), DType::F32, &dev).unwrap();
        assert!(
            from_chunks(&to_chunks(&x, 4).unwrap(), 1, 9, 1, DType::F32).is_err(),
            "more steps than the chunks hold"
        );
    }
}
