//! Launchers of the recovery loss's rows and their backward (`distill.cu`).

use super::{function, view};
use crate::ops::launch::KD_STATS;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

/// Threads per row of `kd_rows` and `kd_rows_bwd` (`KD_THREADS` in distill.cu).
const KD_THREADS: u32 = 256;

/// `kd_rows` in distill.cu: rows [r, 5] float32 of student and teacher logits [r, v] (one
/// dtype, contiguous) and u32 targets [r]; the teacher is not read unless `kd`.
#[allow(clippy::too_many_arguments)]
pub fn kd_rows(
    s: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
    y: (&CudaStorage, &Layout),
    r: usize,
    v: usize,
    inv_temp: f32,
    kd: bool,
) -> Result<CudaStorage> {
    let dev = s.0.device().clone();
    let cfg = LaunchConfig { grid_dim: (r as u32, 1, 1), block_dim: (KD_THREADS, 1, 1), shared_mem_bytes: 0 };
    let yv = view::<u32>(y, "distillation loss targets")?;
    let (vi, kd) = (v as i32, kd as i32);
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let sv = view::<$ty>(s, "distillation loss student")?;
            let tv = view::<$ty>(t, "distillation loss teacher")?;
            // SAFETY: the kernel writes all r x 5 outputs.
            let out = unsafe { dev.alloc::<f32>(r * KD_STATS)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&sv).arg(&tv).arg(&yv).arg(&out).arg(&vi).arg(&inv_temp).arg(&kd);
            // SAFETY: argument list matches `kd_rows_*` in distill.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(s.0.dtype(), "kd_rows", "distillation loss", launch))
}

/// `kd_rows_bwd` in distill.cu: d(student) [r, v] in the logits' dtype from the logits and the
/// per-row float32 aux [r, 6] (target, d ce, d kl, the three log-sum-exps).
#[allow(clippy::too_many_arguments)]
pub fn kd_rows_bwd(
    s: (&CudaStorage, &Layout),
    t: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    r: usize,
    v: usize,
    inv_temp: f32,
    kd: bool,
) -> Result<CudaStorage> {
    let dev = s.0.device().clone();
    let cfg = LaunchConfig { grid_dim: (r as u32, 1, 1), block_dim: (KD_THREADS, 1, 1), shared_mem_bytes: 0 };
    let av = view::<f32>(aux, "distillation loss backward aux")?;
    let (vi, kd) = (v as i32, kd as i32);
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let sv = view::<$ty>(s, "distillation loss backward student")?;
            let tv = view::<$ty>(t, "distillation loss backward teacher")?;
            // SAFETY: the kernel writes all r x v outputs.
            let out = unsafe { dev.alloc::<$ty>(r * v)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&sv).arg(&tv).arg(&av).arg(&out).arg(&vi).arg(&inv_temp).arg(&kd);
            // SAFETY: argument list matches `kd_rows_bwd_*` in distill.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(s.0.dtype(), "kd_rows_bwd", "distillation loss backward", launch))
}
