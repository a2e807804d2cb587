//! Launchers of the short conv and its backward (`conv.cu`).

use super::{from, function, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

/// Depthwise causal conv (+ SiLU) of x [B,L,C] (rows of one stride) with weight [C,K] and bias
/// [C], all one dtype; output [B, T_out, C] with T_out = L − (K−1) + pad.
#[allow(clippy::too_many_arguments)]
pub fn conv(
    x: &CudaStorage,
    xl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    bias: &CudaStorage,
    bl: &Layout,
    pad: usize,
    act: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device().clone();
    let (b, l, c) = xl.shape().dims3()?;
    let k = wl.shape().dims2()?.1;
    let crate::ops::Rows { offset: x0, stride: xs, .. } = crate::ops::Rows::of(xl, "conv")?;
    let t_out = l + pad + 1 - k;
    let n = b * t_out * c;
    let ints = [b, l, t_out, c, k, pad, act as usize].map(|v| v as i32);
    // 16-byte accesses where every row's channels start 16-byte aligned (`conv_silu_vec`): a
    // thread per 16 bytes of channels and CONV_VT steps. Otherwise 256 channels per block, one
    // tile of steps of one sequence per grid row (`conv_silu`).
    let v = 16 / x.dtype().size_in_bytes();
    let vec = k <= 4 && c % v == 0 && xs % v == 0 && x0 % v == 0;
    let xs = xs as i64;
    let cfg = if vec {
        let threads = b * t_out.div_ceil(CONV_VT) * (c / v);
        LaunchConfig { grid_dim: (threads.div_ceil(128) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }
    } else {
        let tiles = b * t_out.div_ceil(16);
        LaunchConfig {
            grid_dim: (c.div_ceil(256) as u32, tiles.clamp(1, 65535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    };
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = from::<$ty>(x, x0)?;
            let wv = view::<$ty>((w, wl), "conv weight")?;
            let bv = view::<$ty>((bias, bl), "conv bias")?;
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes all n outputs.
            let out = unsafe { dev.alloc::<$ty>(n)? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&wv).arg(&bv).arg(&out);
            for v in &ints {
                builder.arg(v);
            }
            // SAFETY: argument list matches `conv_silu_*` in conv.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    let out = match vec {
        true => per_dtype!(x.dtype(), "conv_silu_vec", "conv", launch),
        false => per_dtype!(x.dtype(), "conv_silu", "conv", launch),
    };
    Ok((out, Shape::from((b, t_out, c))))
}

/// Steps of one sequence per thread in `conv_silu_vec` (conv.cu's CONV_VT).
const CONV_VT: usize = 8;

/// Steps of one sequence per thread in [`conv_bwd`]: the partial sums it leaves are C·(K+1) per
/// tile, and a longer tile costs its 7 trailing steps less often.
pub(crate) const CONV_BWD_TILE: usize = 64;

/// The backward of the causal conv (+ SiLU) of x [B,L,C] (rows of one stride) with wb, the
/// weight | bias [C, K+1] float32, against dy [B,L,C] (x's dtype): dx [B·L·C] in x's dtype and
/// the per-tile float32 partial sums of dw | dbias [C·(K+1), B·⌈L/64⌉] (see `conv_silu_bwd`).
pub fn conv_bwd(
    x: (&CudaStorage, &Layout),
    wb: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    act: bool,
) -> Result<(CudaStorage, CudaStorage)> {
    let ((x, xl), (wb, wbl)) = (x, wb);
    let dev = x.device().clone();
    let (b, l, c) = xl.shape().dims3()?;
    let k = wbl.shape().dims2()?.1 - 1;
    let crate::ops::Rows { offset: x0, stride: xs, .. } = crate::ops::Rows::of(xl, "conv backward")?;
    let ntiles = b * l.div_ceil(CONV_BWD_TILE);
    let ints = [b, l, c, k, act as usize, CONV_BWD_TILE].map(|v| v as i32);
    let xs = xs as i64;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(256) as u32, ntiles.clamp(1, 65535) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let wv = view::<f32>((wb, wbl), "conv backward weight")?;
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = from::<$ty>(x, x0)?;
            let gv = view::<$ty>(dy, "conv backward gradient")?;
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes every dx and every tile's partial sums.
            let dx = unsafe { dev.alloc::<$ty>(b * l * c)? };
            let part = unsafe { dev.alloc::<f32>(c * (k + 1) * ntiles)? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&wv).arg(&gv).arg(&dx).arg(&part);
            for v in &ints {
                builder.arg(v);
            }
            // SAFETY: argument list matches `conv_silu_bwd_*` in conv.cu.
            unsafe { builder.launch(cfg) }.w()?;
            (CudaStorage::wrap_cuda_slice(dx, dev.clone()), CudaStorage::wrap_cuda_slice(part, dev))
        }};
    }
    // K <= 4 walks a four-step window in fewer registers (conv.cu's W).
    Ok(match k <= 4 {
        true => per_dtype!(x.dtype(), "conv_silu_bwd4", "conv backward", launch),
        false => per_dtype!(x.dtype(), "conv_silu_bwd", "conv backward", launch),
    })
}
