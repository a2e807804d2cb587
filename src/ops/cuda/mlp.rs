//! Launchers of SwiGLU and its backward (`mlp.cu`).

use super::{function, vec16, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

/// The grid of `swiglu` and `swiglu_bwd`: columns (in 16-byte packs with `vec`) by rows.
fn swiglu_cfg(rows: usize, n: usize, per: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(per).div_ceil(256) as u32, rows.clamp(1, 65535) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `swiglu` in mlp.cu: x [rows, 2n] (contiguous) to [rows, n].
pub fn swiglu(x: &CudaStorage, xl: &Layout, rows: usize, n: usize) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let total = rows * n;
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>((x, xl), "swiglu")?;
            let vec = vec16::<$ty>(n, &[xl.start_offset()]);
            let cfg = swiglu_cfg(rows, n, if vec { 16 / std::mem::size_of::<$ty>() } else { 1 });
            // SAFETY: the kernel writes all rows x n outputs.
            let out = unsafe { dev.alloc::<$ty>(total)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            let (rows, n, vec) = (rows as i64, n as i32, vec as i32);
            builder.arg(&xv).arg(&out).arg(&rows).arg(&n).arg(&vec);
            // SAFETY: argument list matches `swiglu_*` in mlp.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(x.dtype(), "swiglu", "swiglu", launch))
}

/// `swiglu_bwd` in mlp.cu: d[gate | up] [rows, 2n] from x = [gate | up] and dy [rows, n],
/// all contiguous and of x's dtype.
pub fn swiglu_bwd(
    x: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    rows: usize,
    n: usize,
) -> Result<CudaStorage> {
    let dev = x.0.device().clone();
    let total = 2 * rows * n;
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>(x, "swiglu backward")?;
            let gv = view::<$ty>(dy, "swiglu backward gradient")?;
            let vec = vec16::<$ty>(n, &[x.1.start_offset(), dy.1.start_offset()]);
            let cfg = swiglu_cfg(rows, n, if vec { 16 / std::mem::size_of::<$ty>() } else { 1 });
            // SAFETY: the kernel writes all rows x 2n outputs.
            let out = unsafe { dev.alloc::<$ty>(total)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            let (rows, n, vec) = (rows as i64, n as i32, vec as i32);
            builder.arg(&xv).arg(&gv).arg(&out).arg(&rows).arg(&n).arg(&vec);
            // SAFETY: argument list matches `swiglu_bwd_*` in mlp.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(x.0.dtype(), "swiglu_bwd", "swiglu backward", launch))
}
