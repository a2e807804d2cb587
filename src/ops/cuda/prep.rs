//! Launchers of the recurrence's inputs from the conv's output: column sums of squares,
//! q | k | v in float32 and the heads ops (`prep.cu`).

use super::{alloc_dtype, contiguous, from, function};
use crate::ops::launch::{Heads, HeadsDst, QkvPrep};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

/// `col_sumsq` in prep.cu: per-column sums of squares of x [rows, n] (row stride xs from
/// `offset`) over chunks of `chunk` rows, float32 [ceil(rows / chunk), n].
pub fn col_sumsq(
    x: &CudaStorage,
    (offset, xs): (usize, usize),
    rows: usize,
    n: usize,
    chunk: usize,
) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let chunks = rows.div_ceil(chunk);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, chunks as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (xs, rows_i, n_i, chunk_i) = (xs as i64, rows as i64, n as i32, chunk as i32);
    // SAFETY: the kernel writes every chunk's n sums.
    let out = unsafe { dev.alloc::<f32>(chunks * n)? };
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = from::<$ty>(x, offset)?;
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&out).arg(&rows_i).arg(&n_i).arg(&chunk_i);
            // SAFETY: argument list matches `col_sumsq_*` in prep.cu.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    per_dtype!(x.dtype(), "col_sumsq", "column sums", launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `qkv_prep` in prep.cu: the float32 q | k | v of [`QkvPrep`] from the conv
/// output x (`rows` rows of stride xs from `offset`).
pub fn qkv_prep(x: &CudaStorage, (offset, xs): (usize, usize), rows: usize, p: &QkvPrep) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let warps = rows * p.heads;
    let cfg = LaunchConfig { grid_dim: (warps.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (xs, rows_i) = (xs as i64, rows as i64);
    let ints = [p.heads, p.v_heads, p.dk, p.dv].map(|v| v as i32);
    // SAFETY: the kernel writes all of q, k and v.
    let out = unsafe { dev.alloc::<f32>(p.out_len(rows))? };
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = from::<$ty>(x, offset)?;
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&out).arg(&rows_i);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&p.eps);
            // SAFETY: argument list matches `qkv_prep_*` in prep.cu.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    per_dtype!(x.dtype(), "qkv_prep", "recurrence inputs", launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// What `heads_fwd` and `heads_bwd` share: one warp per (row, head), eight warps a block, and
/// their trailing arguments (heads, d, rep, norm) and eps.
fn heads_launch(rows: usize, p: &Heads) -> (LaunchConfig, [i32; 4], f32) {
    let cfg = LaunchConfig {
        grid_dim: ((rows * p.heads).div_ceil(8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [p.heads, p.d, p.rep, p.norm.is_some() as usize].map(|v| v as i32);
    (cfg, ints, p.norm.unwrap_or(0.0))
}

/// `heads_fwd` in prep.cu: [`Heads`] of x's rows (start offset and row stride), float32 when
/// normed, else in x's dtype, [rows, heads·rep, d] flat.
pub fn heads(x: &CudaStorage, (offset, xs): (usize, usize), rows: usize, p: &Heads) -> Result<CudaStorage> {
    let dev = x.device().clone();
    let n = rows * p.heads * p.rep * p.d;
    let dtype = if p.norm.is_some() { DType::F32 } else { x.dtype() };
    // SAFETY: the kernel writes all n outputs.
    let mut out = unsafe { alloc_dtype(&dev, dtype, n, false)? };
    heads_into(&mut out, None, x, (offset, xs), rows, p, None)?;
    Ok(out)
}

/// `heads_fwd` in prep.cu into `out` (float32 when normed, else x's dtype) laid out by `dst`,
/// and with `keys` the normed heads also in chunks of width d (see `HeadsDst`).
pub fn heads_into(
    out: &mut CudaStorage,
    keys: Option<&mut CudaStorage>,
    x: &CudaStorage,
    (offset, xs): (usize, usize),
    rows: usize,
    p: &Heads,
    dst: Option<&HeadsDst>,
) -> Result<()> {
    let dev = x.device().clone();
    let (cfg, ints, eps) = heads_launch(rows, p);
    let (cc, ct, cw, ccol) = HeadsDst::args(dst);
    if keys.is_some() && (p.norm.is_none() || dst.is_none()) {
        candle_core::bail!("heads: the keys alone are written only for normed heads in chunks");
    }
    let (xs, rows, off) = (xs as i64, rows as i64, p.off as i32);
    let null = 0u64;
    // The output's element type: float32 when normed, else the input's.
    macro_rules! run {
        ($ty:ty, $out:ty, $name:expr) => {{
            let xv = from::<$ty>(x, offset)?;
            let func = function(&dev, $name)?;
            let o = out.as_cuda_slice_mut::<$out>()?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&off).arg(o).arg(&rows);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&eps).arg(&cc).arg(&ct).arg(&cw).arg(&ccol);
            let k2;
            match keys {
                Some(k) => {
                    k2 = k.as_cuda_slice_mut::<f32>()?;
                    builder.arg(k2);
                }
                None => {
                    builder.arg(&null);
                }
            }
            // SAFETY: argument list matches `heads_fwd_*` in prep.cu; the caller sized `out`
            // (and `keys`) for the layout.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            match p.norm {
                Some(_) => run!($ty, f32, $name),
                None => run!($ty, $ty, $name),
            }
        }};
    }
    // Pairs of columns a lane where every access stays aligned to them.
    let (w, col) = dst.map_or((0, 0), |o| (o.w, o.col));
    match [p.d, p.off, offset, xs as usize, w, col].iter().all(|v| v % 2 == 0) {
        true => per_dtype!(x.dtype(), "heads_fwd2", "heads", launch),
        false => per_dtype!(x.dtype(), "heads_fwd", "heads", launch),
    }
    Ok(())
}

/// `heads_bwd` in prep.cu: d(x) into `out` from element `at` on, [rows, c] in x's dtype, from
/// dy (contiguous; float32 when normed, else x's dtype); the heads' columns are written, the
/// others left as they are; dy laid out by `src` (see `HeadsDst`).
#[allow(clippy::too_many_arguments)]
pub fn heads_bwd_into(
    out: &mut CudaStorage,
    at: usize,
    x: &CudaStorage,
    (offset, xs): (usize, usize),
    (rows, c): (usize, usize),
    dy: (&CudaStorage, &Layout),
    p: &Heads,
    src: Option<&HeadsDst>,
) -> Result<()> {
    let dev = x.device().clone();
    let (cfg, ints, eps) = heads_launch(rows, p);
    let (cc, ct, cw, ccol) = HeadsDst::args(src);
    let (xs, rows_i, off, c_i) = (xs as i64, rows as i64, p.off as i32, c as i32);
    let (da, db) = contiguous(dy.1, "heads backward gradient")?;
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = from::<$ty>(x, offset)?;
            let mut o = out.as_cuda_slice_mut::<$ty>()?.slice_mut(at..at + rows * c);
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&xs).arg(&off);
            let (g32, gt);
            match p.norm {
                Some(_) => {
                    g32 = dy.0.as_cuda_slice::<f32>()?.slice(da..db);
                    builder.arg(&g32);
                }
                None => {
                    gt = dy.0.as_cuda_slice::<$ty>()?.slice(da..db);
                    builder.arg(&gt);
                }
            }
            builder.arg(&mut o).arg(&rows_i).arg(&c_i);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&eps).arg(&cc).arg(&ct).arg(&cw).arg(&ccol);
            // SAFETY: argument list matches `heads_bwd_*` in prep.cu; `o` holds rows x c.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    let (w, col) = src.map_or((0, 0), |o| (o.w, o.col));
    match [p.d, p.off, offset, xs as usize, c, at, da, w, col].iter().all(|v| v % 2 == 0) {
        true => per_dtype!(x.dtype(), "heads_bwd2", "heads backward", launch),
        false => per_dtype!(x.dtype(), "heads_bwd", "heads backward", launch),
    }
    Ok(())
}
