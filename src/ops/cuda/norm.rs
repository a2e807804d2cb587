//! Launchers of the RMSNorms: the gated norm, its backward and the residual add with the next
//! norm (`norm.cu`).

use super::{function, vec16, vec16_of, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

/// Gated RMSNorm of rows [rows, n] of x and gate (one dtype) with a float32 weight [n]; output
/// in x's dtype and shape.
#[allow(clippy::too_many_arguments)]
pub fn gated_rms(
    x: &CudaStorage,
    xl: &Layout,
    g: &CudaStorage,
    gl: &Layout,
    w: &CudaStorage,
    wl: &Layout,
    eps: f32,
    gated: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device().clone();
    let n = xl.shape().dims().last().copied().unwrap_or(1);
    let rows = xl.shape().elem_count() / n.max(1);
    let wv = view::<f32>((w, wl), "gated norm weight")?;
    let gated = gated as i32;
    // 16 bytes a lane where every operand allows it (as rms_bwd).
    let wvec = vec16::<f32>(0, &[wl.start_offset()]);
    let ints = [rows as i32, n as i32];
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>((x, xl), "gated norm")?;
            let gv = view::<$ty>((g, gl), "gated norm gate")?;
            let vec = wvec && vec16::<$ty>(n, &[xl.start_offset(), gl.start_offset()]);
            let lanes = norm_lanes::<$ty>(n, vec);
            // Eight warps a block, 32 / lanes rows a warp.
            let per_block = 8 * (32 / lanes as usize);
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(per_block) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let vec = vec as i32;
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes all rows x n outputs.
            let out = unsafe { dev.alloc::<$ty>(rows * n)? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&gv).arg(&wv).arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&eps).arg(&gated);
            builder.arg(&vec).arg(&lanes);
            // SAFETY: argument list matches `gated_rms_*` in norm.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    let out = per_dtype!(x.dtype(), "gated_rms", "gated norm", launch);
    Ok((out, xl.shape().clone()))
}

/// Rows per block of `rms_bwd` (`RMS_BWD_ROWS` in norm.cu).
const RMS_BWD_ROWS: usize = 64;

/// The most packs of 16 bytes a lane keeps its partial dw for in `rms_bwd` (`RMS_BWD_PACKS`).
const RMS_BWD_PACKS: usize = 8;

/// The lanes of a warp that take a row of `n` elements of T in `gated_rms` (g in
/// norm.cu): with 16 bytes a lane (`vec`), as many as a row has packs where that is fewer than
/// 32 and divides 32, so that a warp takes several rows; otherwise the whole warp.
fn norm_lanes<T>(n: usize, vec: bool) -> i32 {
    let packs = n / (16 / std::mem::size_of::<T>());
    match vec && (1..32).contains(&packs) && 32 % packs == 0 {
        true => packs as i32,
        false => 32,
    }
}

/// What [`rms_bwd`] writes: dx (and dg when gated) in x's dtype, and the float32 partial
/// sums of dw [parts, n] that the caller adds up.
pub struct RmsGrads {
    pub dx: CudaStorage,
    pub dg: Option<CudaStorage>,
    pub parts: CudaStorage,
    pub count: usize,
}

/// The backward of the gated RMSNorm (`rms_bwd` in norm.cu), writing dx and dg in x's dtype
/// (no float32 planes to cast afterwards), dx as res + dx where `res` is given (a residual
/// step's input gradient: the step's output gradient plus the norm's). x, g, dy and res share
/// one dtype and element count.
pub fn rms_bwd(
    x: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    dy: (&CudaStorage, &Layout),
    res: Option<(&CudaStorage, &Layout)>,
    eps: f32,
    gated: bool,
) -> Result<RmsGrads> {
    let dev = x.0.device().clone();
    let n = x.1.shape().dims().last().copied().unwrap_or(1);
    let rows = x.1.shape().elem_count() / n.max(1);
    let blocks = rows.div_ceil(RMS_BWD_ROWS);
    let wv = view::<f32>(w, "norm backward weight")?;
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (ri, ni, gi) = (rows as i32, n as i32, gated as i32);
    let size = x.0.dtype().size_in_bytes();
    let mut offsets = vec![x.1.start_offset(), g.1.start_offset(), dy.1.start_offset()];
    offsets.extend(res.map(|r| r.1.start_offset()));
    let vec = vec16_of(size, n, &offsets) && vec16::<f32>(0, &[w.1.start_offset()]);
    // A block's warps keep their partials in registers and add them into one row where every
    // lane has a pack of a row and at most RMS_BWD_PACKS (PK > 0 in `rms_bwd_*`), else a row a
    // warp (`rms_bwd_mem_*`: see norm.cu for why a kernel of its own).
    let per = 16 / size.max(1);
    let regs = vec && n >= 32 * per && n.div_ceil(32 * per) <= RMS_BWD_PACKS;
    let count = if regs { blocks } else { blocks * 8 };
    let vec = vec as i32;
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>(x, "norm backward")?;
            let gv = view::<$ty>(g, "norm backward gate")?;
            let dv = view::<$ty>(dy, "norm backward gradient")?;
            let rv = res.map(|r| view::<$ty>(r, "residual gradient")).transpose()?;
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes every dx (every dg when gated) and every block's partial dw.
            let dxt = unsafe { dev.alloc::<$ty>(rows * n)? };
            let dgt = if gated { Some(unsafe { dev.alloc::<$ty>(rows * n)? }) } else { None };
            let out = unsafe { dev.alloc::<f32>(count * n)? };
            let hi = res.is_some() as i32;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            // A missing res is not read (dy stands in), nor a missing dg written (dx stands in).
            builder.arg(&xv).arg(&gv).arg(&wv).arg(&dv).arg(rv.as_ref().unwrap_or(&dv)).arg(&dxt);
            builder.arg(dgt.as_ref().unwrap_or(&dxt));
            builder.arg(&out).arg(&ri).arg(&ni).arg(&eps).arg(&gi).arg(&hi).arg(&vec);
            // SAFETY: argument list matches `rms_bwd_*` and `rms_bwd_mem_*` in norm.cu.
            unsafe { builder.launch(cfg) }.w()?;
            RmsGrads {
                dx: CudaStorage::wrap_cuda_slice(dxt, dev.clone()),
                dg: dgt.map(|d| CudaStorage::wrap_cuda_slice(d, dev.clone())),
                parts: CudaStorage::wrap_cuda_slice(out, dev),
                count,
            }
        }};
    }
    Ok(match regs {
        true => per_dtype!(x.0.dtype(), "rms_bwd", "norm backward", launch),
        false => per_dtype!(x.0.dtype(), "rms_bwd_mem", "norm backward", launch),
    })
}

/// `add_rms` in norm.cu: a + b (contiguous, one dtype, rows × n) and its RMSNorm with the
/// float32 weight w [n]; output [2, rows, n]. A warp a row (`add_rms_rows`) from
/// [`ADD_RMS_ROWS_FROM`] rows on where 16 bytes a lane fit, else a block a row.
pub fn add_rms(
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    rows: usize,
    n: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let launch = |rows_kernel| add_rms_launch(a, b, w, rows, n, eps, true, rows_kernel);
    if rows >= ADD_RMS_ROWS_FROM {
        if let Some((both, _)) = launch(true)? {
            return Ok(both);
        }
    }
    let both = launch(false)?.map(|(both, _)| both);
    both.ok_or_else(|| candle_core::Error::Msg("add + norm: a block a row refused the layout".into()))
}

/// Rows from which [`add_rms`] takes a warp a row (`add_rms_rows`): below, a decoding step's few
/// rows would leave most of the GPU idle, so each takes a block.
const ADD_RMS_ROWS_FROM: usize = 256;

/// `add_rms_rows` in norm.cu: (a + b, norm(a + b)) for contiguous a, b [rows, n] of one dtype and
/// the float32 weight w [n], in two buffers, or in one [2, rows, n] (`joined`, as [`add_rms`]
/// returns it); `None` where n or an offset does not allow 16 bytes a lane.
pub fn add_rms_rows(
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    rows: usize,
    n: usize,
    eps: f32,
    joined: bool,
) -> Result<Option<(CudaStorage, Option<CudaStorage>)>> {
    add_rms_launch(a, b, w, rows, n, eps, joined, true)
}

/// `add_rms_rows` (`rows_kernel`: a warp a row, 16 bytes a lane, `None` where those do not fit)
/// or `add_rms` (a block a row, any width); the two kernels take the same arguments.
#[allow(clippy::too_many_arguments)]
fn add_rms_launch(
    (a, al): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    rows: usize,
    n: usize,
    eps: f32,
    joined: bool,
    rows_kernel: bool,
) -> Result<Option<(CudaStorage, Option<CudaStorage>)>> {
    let dev = a.device().clone();
    if rows_kernel && !vec16::<f32>(0, &[wl.start_offset()]) {
        return Ok(None);
    }
    let wv = view::<f32>((w, wl), "norm weight")?;
    // A warp a row (eight rows a block) or a block a row.
    let blocks = if rows_kernel { rows.div_ceil(8) } else { rows };
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let ints = [rows as i32, n as i32];
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            if rows_kernel && !vec16::<$ty>(n, &[al.start_offset(), bl.start_offset()]) {
                return Ok(None);
            }
            let (av, bv) = (view::<$ty>((a, al), "residual")?, view::<$ty>((b, bl), "residual update")?);
            // SAFETY: the kernel writes every element of h and y.
            let (h, y) = match joined {
                true => (unsafe { dev.alloc::<$ty>(2 * rows * n)? }, None),
                false => (unsafe { dev.alloc::<$ty>(rows * n)? }, Some(unsafe { dev.alloc::<$ty>(rows * n)? })),
            };
            let func = function(&dev, $name)?;
            {
                let (hv, yv) = match &y {
                    Some(y) => (h.slice(0..rows * n), y.slice(0..rows * n)),
                    None => (h.slice(0..rows * n), h.slice(rows * n..2 * rows * n)),
                };
                let stream = dev.cuda_stream();
                let mut builder = stream.launch_builder(&func);
                builder.arg(&av).arg(&bv).arg(&wv).arg(&hv).arg(&yv).arg(&ints[0]).arg(&ints[1]).arg(&eps);
                // SAFETY: argument list matches `add_rms_*` and `add_rms_rows_*` in norm.cu.
                unsafe { builder.launch(cfg) }.w()?;
            }
            (CudaStorage::wrap_cuda_slice(h, dev.clone()), y.map(|y| CudaStorage::wrap_cuda_slice(y, dev.clone())))
        }};
    }
    Ok(Some(match rows_kernel {
        true => per_dtype!(a.dtype(), "add_rms_rows", "add + norm", launch),
        false => per_dtype!(a.dtype(), "add_rms", "add + norm", launch),
    }))
}

/// `add_packs` in norm.cu: a + b for contiguous a and b of one dtype and element count, each sum
/// rounded once as candle's add rounds it; `None` where the dtype has no kernel (float64, the
/// integers) or the count or an offset does not allow 16 bytes a thread.
pub fn add_packs((a, al): (&CudaStorage, &Layout), (b, bl): (&CudaStorage, &Layout)) -> Result<Option<CudaStorage>> {
    let dev = a.device().clone();
    let count = al.shape().elem_count();
    if bl.shape().elem_count() != count || a.dtype() != b.dtype() {
        candle_core::bail!("residual add: {:?} {:?} and {:?} {:?}", al.shape(), a.dtype(), bl.shape(), b.dtype());
    }
    if !matches!(a.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Ok(None);
    }
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            if !vec16::<$ty>(count, &[al.start_offset(), bl.start_offset()]) {
                return Ok(None);
            }
            let packs = (count / (16 / std::mem::size_of::<$ty>())) as i64;
            let (av, bv) = (view::<$ty>((a, al), "residual")?, view::<$ty>((b, bl), "residual update")?);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<$ty>(count)? };
            let func = function(&dev, $name)?;
            // A thread a pack, up to 4096 blocks of 256 (a large GPU's worth many times over);
            // past that each thread strides on.
            let blocks = (packs as usize).div_ceil(256).clamp(1, 4096) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&av).arg(&bv).arg(&out).arg(&packs);
            // SAFETY: argument list matches `add_packs_*` in norm.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(Some(per_dtype!(a.dtype(), "add_packs", "residual add", launch)))
}
