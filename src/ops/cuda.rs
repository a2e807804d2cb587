//! Launchers for statecut's own CUDA kernels (`kernels.cu`, compiled by build.rs).
//!
//! Each launcher is the `cuda_fwd` half of a custom op whose CPU half, in the op's own module,
//! defines what it computes; `tests/gpu_parity.rs` checks the two agree.

use super::contiguous;
use super::launch::{
    ChunkLayout, Heads, HeadsDst, IntraDims, OutDims, QkvPrep, StepDims, WalkDims, KD_STATS, MAX_DK, TILE,
};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `$launch!(T, name)` for the instance of kernel `$kernel` (suffix `_f32`, `_bf16` or `_f16`)
/// that matches `$dtype`; any other dtype is an error naming `$what`.
macro_rules! per_dtype {
    ($dtype:expr, $kernel:literal, $what:literal, $launch:ident) => {
        match $dtype {
            DType::F32 => $launch!(f32, concat!($kernel, "_f32")),
            DType::BF16 => $launch!(half::bf16, concat!($kernel, "_bf16")),
            DType::F16 => $launch!(half::f16, concat!($kernel, "_f16")),
            dt => candle_core::bail!("{}: unsupported dtype {dt:?}", $what),
        }
    };
}

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// One device's copy of the kernels' module and the functions looked up in it so far.
struct Kernels {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// Kernel `name`, loading the module once per device and each function once: a decoding step
/// launches a few hundred kernels, and a driver lookup per launch would add to each.
fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    static KERNELS: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, Kernels>>> = OnceLock::new();
    let mut all = KERNELS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let kernels = match all.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let module = dev.cuda_stream().context().load_module(Ptx::from_binary(FATBIN.to_vec())).w()?;
            e.insert(Kernels { module, functions: HashMap::new() })
        }
    };
    if let Some(f) = kernels.functions.get(name) {
        return Ok(f.clone());
    }
    let f = kernels.module.load_function(name).w()?;
    kernels.functions.insert(name.to_string(), f.clone());
    Ok(f)
}

/// Sizes of one recurrence launch (see `recurrence` in kernels.cu).
pub struct RecurrenceDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
    pub delta: bool,
    pub scale: f32,
}

/// The inputs of one recurrence launch, each float32 and contiguous: q, k [B,T,H,dk],
/// v [B,T,H,dv], beta and g [B,T,H], gk [B,T,H,dk], s0 [B,H,dk,dv]. Without g there is no
/// per-step decay (the kernel skips it); without gk no per-channel decay.
pub struct RecurrenceInputs<'a> {
    pub q: (&'a CudaStorage, &'a Layout),
    pub k: (&'a CudaStorage, &'a Layout),
    pub v: (&'a CudaStorage, &'a Layout),
    pub beta: (&'a CudaStorage, &'a Layout),
    pub g: Option<(&'a CudaStorage, &'a Layout)>,
    pub gk: Option<(&'a CudaStorage, &'a Layout)>,
    pub s0: (&'a CudaStorage, &'a Layout),
}

/// The view of a contiguous input as elements of T.
fn view<'a, T: CudaDType>((s, l): (&'a CudaStorage, &Layout), what: &str) -> Result<CudaView<'a, T>> {
    let (a, b) = contiguous(l, what)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// o [B,T,H,dv] followed by the final state [B,H,dk,dv], flat; o alone when the final state
/// goes `in_place` over s0.
pub fn recurrence(inp: &RecurrenceInputs, d: &RecurrenceDims, in_place: bool) -> Result<(CudaStorage, Shape)> {
    let dev = inp.q.0.device().clone();
    let f32_view = |x, what| view::<f32>(x, what);
    let (q, k, v) =
        (f32_view(inp.q, "recurrence q")?, f32_view(inp.k, "recurrence k")?, f32_view(inp.v, "recurrence v")?);
    let (beta, s0) = (f32_view(inp.beta, "recurrence beta")?, f32_view(inp.s0, "recurrence state")?);
    let (gated, has_gk) = (inp.g.is_some(), inp.gk.is_some());
    // Absent inputs are never read (the kernel instance or the `gated` flag says so); beta
    // stands in for their pointers.
    let g = inp.g.map(|g| f32_view(g, "recurrence g")).transpose()?;
    let gk = inp.gk.map(|g| f32_view(g, "recurrence gk")).transpose()?;
    let (g, gk) = (g.as_ref().unwrap_or(&beta), gk.as_ref().unwrap_or(&beta));
    // R threads share a state column, each holding `rows` ≤ 32 key rows in registers.
    let r = rows_override(d.dk).map_or(d.dk.div_ceil(32).next_power_of_two().min(32), |rows| d.dk / rows);
    let rows = d.dk.div_ceil(r);
    if rows > 32 {
        candle_core::bail!("recurrence: key width {} is above the kernel's 1024", d.dk);
    }
    let n_o = d.b * d.t * d.h * d.dv;
    let n = if in_place { n_o } else { n_o + d.b * d.h * d.dk * d.dv };
    // SAFETY: every element is written by the kernel (outputs for all (b,t,h,j), all of the state).
    let out = unsafe { dev.alloc::<f32>(n)? };
    let state_out = if in_place { s0.slice(..) } else { out.slice(n_o..) };
    // 8 warps: every block stages all of q and k for its columns, so wide blocks read less.
    let warps = 8;
    let cols_per_block = warps * (32 / r);
    let gk_width = if has_gk { d.dk } else { 0 };
    let stream = dev.cuda_stream();
    let grid_dim = (d.dv.div_ceil(cols_per_block) as u32, (d.b * d.h) as u32, 1);
    let block_dim = (32 * warps as u32, 1, 1);
    let scale = d.scale;
    // The tiled kernel when the rows split exactly into float4 groups it has an instance for
    // (every common head width), else the general one.
    let tiled = r * rows == d.dk && matches!(rows, 16 | 24 | 32);
    let (func, ints, tc, smem) = if tiled {
        // Two buffers of `tc` padded steps (see `recurrence_tiled`) in the default 48 KiB.
        let step_bytes = 4 * (2 * d.dk + gk_width + cols_per_block + 2).div_ceil(4) * 4;
        let tc = (24 * 1024 / step_bytes).clamp(1, 32);
        let decay = if has_gk { 2 } else { gated as u8 };
        let func = function(&dev, &format!("recurrence_t{rows}_{r}_{decay}"))?;
        (func, vec![d.b, d.t, d.h, d.dv, d.delta as usize], tc, 2 * tc * step_bytes)
    } else {
        let maxr = [8, 16, 32].into_iter().find(|&m| rows <= m).unwrap_or(32);
        // Specialised for per-channel decay and for rows that need no bounds check (dk = R · MAXR).
        let full = rows == maxr && r * rows == d.dk;
        let func = function(&dev, &format!("recurrence_{maxr}_{}{}", has_gk as u8, full as u8))?;
        // Time steps staged in shared memory per chunk: as many as fit the default 48 KiB, ≤ 32.
        let step_bytes = 4 * (2 * d.dk + cols_per_block + 2 + gk_width);
        let tc = (48 * 1024 / step_bytes).clamp(1, 32);
        let ints = vec![d.b, d.t, d.h, d.dk, d.dv, r, rows, gated as usize, d.delta as usize];
        (func, ints, tc, tc * step_bytes)
    };
    let ints: Vec<i32> = ints.into_iter().map(|v| v as i32).collect();
    let tc = tc as i32;
    let cfg = LaunchConfig { grid_dim, block_dim, shared_mem_bytes: smem as u32 };
    let mut builder = stream.launch_builder(&func);
    builder.arg(&q).arg(&k).arg(&v).arg(&beta).arg(g).arg(gk).arg(&s0).arg(&out).arg(&state_out);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&scale).arg(&tc);
    // SAFETY: argument list matches `recurrence_t*` / `recurrence_N_*` in kernels.cu (the same
    // buffers, then their integer sizes, scale and chunk length); buffers are sized above.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// `STATECUT_RECURRENCE_ROWS` = 16, 24 or 32: key rows per thread of the tiled recurrence
/// kernel where dk splits into that many rows over a power of two of threads (fewer rows: more
/// threads per column, more blocks, fewer registers); the default holds up to 32.
fn rows_override(dk: usize) -> Option<usize> {
    static ROWS: OnceLock<Option<usize>> = OnceLock::new();
    let rows = (*ROWS.get_or_init(|| {
        std::env::var("STATECUT_RECURRENCE_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|r| matches!(r, 16 | 24 | 32))
    }))?;
    (dk.is_multiple_of(rows) && (dk / rows).is_power_of_two() && dk / rows <= 32).then_some(rows)
}

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
    let super::Rows { offset: x0, stride: xs, .. } = super::Rows::of(xl, "conv")?;
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
            // SAFETY: argument list matches `conv_silu_*` in kernels.cu.
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

/// Steps of one sequence per thread in `conv_silu_vec` (kernels.cu's CONV_VT).
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
    let super::Rows { offset: x0, stride: xs, .. } = super::Rows::of(xl, "conv backward")?;
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
            // SAFETY: argument list matches `conv_silu_bwd_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            (CudaStorage::wrap_cuda_slice(dx, dev.clone()), CudaStorage::wrap_cuda_slice(part, dev))
        }};
    }
    // K <= 4 walks a four-step window in fewer registers (kernels.cu's W).
    Ok(match k <= 4 {
        true => per_dtype!(x.dtype(), "conv_silu_bwd4", "conv backward", launch),
        false => per_dtype!(x.dtype(), "conv_silu_bwd", "conv backward", launch),
    })
}

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
    // One warp per row, eight rows per block.
    let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let ints = [rows as i32, n as i32];
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>((x, xl), "gated norm")?;
            let gv = view::<$ty>((g, gl), "gated norm gate")?;
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes all rows x n outputs.
            let out = unsafe { dev.alloc::<$ty>(rows * n)? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv).arg(&gv).arg(&wv).arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&eps).arg(&gated);
            // SAFETY: argument list matches `gated_rms_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    let out = per_dtype!(x.dtype(), "gated_rms", "gated norm", launch);
    Ok((out, xl.shape().clone()))
}

/// Rows per block of `rms_bwd` (`RMS_BWD_ROWS` in kernels.cu).
const RMS_BWD_ROWS: usize = 64;

/// What [`rms_bwd`] writes: dx (and dg when gated) in x's dtype, and the float32 partial
/// sums of dw [parts, n] that the caller adds up.
pub struct RmsGrads {
    pub dx: CudaStorage,
    pub dg: Option<CudaStorage>,
    pub parts: CudaStorage,
    pub count: usize,
}

/// The backward of the gated RMSNorm (`rms_bwd` in kernels.cu), writing dx and dg in x's dtype
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
    let count = blocks * 8;
    let wv = view::<f32>(w, "norm backward weight")?;
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (ri, ni, gi) = (rows as i32, n as i32, gated as i32);
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let xv = view::<$ty>(x, "norm backward")?;
            let gv = view::<$ty>(g, "norm backward gate")?;
            let dv = view::<$ty>(dy, "norm backward gradient")?;
            let rv = res.map(|r| view::<$ty>(r, "residual gradient")).transpose()?;
            let mut offsets = vec![x.1.start_offset(), g.1.start_offset(), dy.1.start_offset()];
            offsets.extend(res.map(|r| r.1.start_offset()));
            let vec = (vec16::<$ty>(n, &offsets) && vec16::<f32>(0, &[w.1.start_offset()])) as i32;
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
            // SAFETY: argument list matches `rms_bwd_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            RmsGrads {
                dx: CudaStorage::wrap_cuda_slice(dxt, dev.clone()),
                dg: dgt.map(|d| CudaStorage::wrap_cuda_slice(d, dev.clone())),
                parts: CudaStorage::wrap_cuda_slice(out, dev),
                count,
            }
        }};
    }
    Ok(per_dtype!(x.0.dtype(), "rms_bwd", "norm backward", launch))
}

/// A row view for a launch: storage, start offset and row stride in elements.
pub type RowView<'a> = (&'a CudaStorage, usize, usize);

/// The buffers of one [`decode_step`]: x, b, a row views in one dtype; the float32 history,
/// the conv weight and bias (x's dtype), A and dt_bias (float32), each storage and offset.
pub struct StepArgs<'a> {
    pub x: RowView<'a>,
    pub history: (&'a CudaStorage, usize),
    pub weight: (&'a CudaStorage, usize),
    pub bias: Option<(&'a CudaStorage, usize)>,
    pub b: Option<RowView<'a>>,
    pub a: Option<RowView<'a>>,
    pub neg_a: Option<(&'a CudaStorage, usize)>,
    pub dt_bias: Option<(&'a CudaStorage, usize)>,
}

/// A storage's elements of T from `offset` on.
fn from<T: CudaDType>(s: &CudaStorage, offset: usize) -> Result<CudaView<'_, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    Ok(slice.slice(offset..))
}

/// `delta_decode_prep` in kernels.cu: one block per (key head, sequence); `n` float32 outputs,
/// the shifted history the last of them unless it goes `in_place` over the history.
pub fn decode_step(
    a: &StepArgs,
    d: &StepDims,
    flags: i32,
    beta_scale: f32,
    eps: f32,
    n: usize,
    in_place: bool,
) -> Result<CudaStorage> {
    let dev = a.x.0.device().clone();
    let history = from::<f32>(a.history.0, a.history.1)?;
    // Absent inputs are never read (`flags` says so): the history stands in for their pointers.
    let neg_a = a.neg_a.map(|(s, o)| from::<f32>(s, o)).transpose()?;
    let dt_bias = a.dt_bias.map(|(s, o)| from::<f32>(s, o)).transpose()?;
    let (neg_a, dt_bias) = (neg_a.as_ref().unwrap_or(&history), dt_bias.as_ref().unwrap_or(&history));
    // SAFETY: the kernel writes every output (q, k, v, β, g and the whole history).
    let out = unsafe { dev.alloc::<f32>(n)? };
    let history_out = if in_place { history.slice(..) } else { out.slice(n - d.b * (d.kernel - 1) * d.channels()..) };
    let ints = [d.b, d.heads, d.v_heads, d.dk, d.dv, d.kernel].map(|v| v as i32);
    let cfg = LaunchConfig {
        grid_dim: (d.heads as u32, d.b as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (2 * d.dk * 4) as u32,
    };
    let strides = |v: Option<RowView>| v.map_or(0i64, |v| v.2 as i64);
    let (xs, bs, as_) = (a.x.2 as i64, strides(a.b), strides(a.a));
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let x = from::<$ty>(a.x.0, a.x.1)?;
            let w = from::<$ty>(a.weight.0, a.weight.1)?;
            let bias = a.bias.map(|(s, o)| from::<$ty>(s, o)).transpose()?;
            let bv = a.b.map(|(s, o, _)| from::<$ty>(s, o)).transpose()?;
            let av = a.a.map(|(s, o, _)| from::<$ty>(s, o)).transpose()?;
            let (bias, bv, av) = (bias.as_ref().unwrap_or(&x), bv.as_ref().unwrap_or(&x), av.as_ref().unwrap_or(&x));
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&x).arg(&xs).arg(&history).arg(&w).arg(bias).arg(bv).arg(&bs).arg(av).arg(&as_);
            builder.arg(neg_a).arg(dt_bias).arg(&out).arg(&history_out);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&flags).arg(&beta_scale).arg(&eps);
            // SAFETY: argument list matches `delta_decode_prep_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    per_dtype!(a.x.0.dtype(), "delta_decode_prep", "decode step", launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `out_norm` in kernels.cu on the float32 o (rows × n), gated by the `gate` row view (rows
/// b·heads + h at b·stride + h·n); output in `dtype`.
pub fn out_norm(
    o: &CudaStorage,
    ol: &Layout,
    gate: Option<RowView>,
    w: (&CudaStorage, usize),
    dtype: DType,
    (rows, n, heads): (usize, usize, usize),
    eps: f32,
) -> Result<CudaStorage> {
    let dev = o.device().clone();
    let x = view::<f32>((o, ol), "output norm")?;
    let w = from::<f32>(w.0, w.1)?;
    let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (gs, gated) = (gate.map_or(0i64, |g| g.2 as i64), gate.is_some() as i32);
    let ints = [heads as i32, rows as i32, n as i32];
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let g = gate.map(|g| from::<$ty>(g.0, g.1)).transpose()?;
            // SAFETY: the kernel writes all rows x n outputs.
            let out = unsafe { dev.alloc::<$ty>(rows * n)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            // Without a gate the kernel never reads g: x's pointer stands in.
            match &g {
                Some(g) => builder.arg(&x).arg(g),
                None => builder.arg(&x).arg(&x),
            };
            builder.arg(&gs).arg(&ints[0]).arg(&gated).arg(&w).arg(&out).arg(&ints[1]).arg(&ints[2]).arg(&eps);
            // SAFETY: argument list matches `out_norm_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(dtype, "out_norm", "output norm", launch))
}

/// Whether a row-wise kernel over rows of `n` elements of T may take 16 bytes a thread: n a
/// multiple of that, and every operand starting on a 16-byte boundary (candle's allocations do;
/// a view's offset may not).
fn vec16<T>(n: usize, offsets: &[usize]) -> bool {
    let per = 16 / std::mem::size_of::<T>();
    n.is_multiple_of(per) && offsets.iter().all(|o| o.is_multiple_of(per))
}

/// The grid of `swiglu` and `swiglu_bwd`: columns (in 16-byte packs with `vec`) by rows.
fn swiglu_cfg(rows: usize, n: usize, per: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(per).div_ceil(256) as u32, rows.clamp(1, 65535) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `swiglu` in kernels.cu: x [rows, 2n] (contiguous) to [rows, n].
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
            // SAFETY: argument list matches `swiglu_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(x.dtype(), "swiglu", "swiglu", launch))
}

/// `swiglu_bwd` in kernels.cu: d[gate | up] [rows, 2n] from x = [gate | up] and dy [rows, n],
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
            // SAFETY: argument list matches `swiglu_bwd_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(x.0.dtype(), "swiglu_bwd", "swiglu backward", launch))
}

/// Threads per row of `kd_rows` and `kd_rows_bwd` (`KD_THREADS` in kernels.cu).
const KD_THREADS: u32 = 256;

/// `kd_rows` in kernels.cu: rows [r, 5] float32 of student and teacher logits [r, v] (one
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
            // SAFETY: argument list matches `kd_rows_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(s.0.dtype(), "kd_rows", "distillation loss", launch))
}

/// `kd_rows_bwd` in kernels.cu: d(student) [r, v] in the logits' dtype from the logits and the
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
            // SAFETY: argument list matches `kd_rows_bwd_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(s.0.dtype(), "kd_rows_bwd", "distillation loss backward", launch))
}

/// `add_rms` in kernels.cu: a + b (contiguous, one dtype, rows × n) and its RMSNorm with the
/// float32 weight w [n]; output [2, rows, n].
pub fn add_rms(
    (a, al): (&CudaStorage, &Layout),
    (b, bl): (&CudaStorage, &Layout),
    (w, wl): (&CudaStorage, &Layout),
    rows: usize,
    n: usize,
    eps: f32,
) -> Result<CudaStorage> {
    let dev = a.device().clone();
    let wv = view::<f32>((w, wl), "norm weight")?;
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let ints = [rows as i32, n as i32];
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            let (av, bv) = (view::<$ty>((a, al), "residual")?, view::<$ty>((b, bl), "residual update")?);
            // SAFETY: the kernel writes both halves, 2 x rows x n outputs.
            let out = unsafe { dev.alloc::<$ty>(2 * rows * n)? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&av).arg(&bv).arg(&wv).arg(&out).arg(&ints[0]).arg(&ints[1]).arg(&eps);
            // SAFETY: argument list matches `add_rms_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(a.dtype(), "add_rms", "add + norm", launch))
}

/// `col_sumsq` in kernels.cu: per-column sums of squares of x [rows, n] (row stride xs from
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
            // SAFETY: argument list matches `col_sumsq_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    per_dtype!(x.dtype(), "col_sumsq", "column sums", launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `qkv_prep` in kernels.cu: the float32 q | k | v of [`QkvPrep`] from the conv
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
            // SAFETY: argument list matches `qkv_prep_*` in kernels.cu.
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

/// `heads_fwd` in kernels.cu: [`Heads`] of x's rows (start offset and row stride), float32 when
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

/// A buffer of `n` elements of `dtype`, zeroed with `zero`.
///
/// # Safety
/// Without `zero` the contents are undefined: the caller writes every element it reads.
pub(crate) unsafe fn alloc_dtype(dev: &CudaDevice, dtype: DType, n: usize, zero: bool) -> Result<CudaStorage> {
    macro_rules! alloc {
        ($ty:ty) => {{
            let s = if zero { dev.alloc_zeros::<$ty>(n)? } else { dev.alloc::<$ty>(n)? };
            CudaStorage::wrap_cuda_slice(s, dev.clone())
        }};
    }
    Ok(match dtype {
        DType::F32 => alloc!(f32),
        DType::BF16 => alloc!(half::bf16),
        DType::F16 => alloc!(half::f16),
        dt => candle_core::bail!("alloc: unsupported dtype {dt:?}"),
    })
}

/// `heads_fwd` in kernels.cu into `out` (float32 when normed, else x's dtype) laid out by `dst`,
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
            // SAFETY: argument list matches `heads_fwd_*` in kernels.cu; the caller sized `out`
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

/// `heads_bwd` in kernels.cu: d(x) into `out` from element `at` on, [rows, c] in x's dtype, from
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
            // SAFETY: argument list matches `heads_bwd_*` in kernels.cu; `o` holds rows x c.
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

/// A tensor's storage and layout as a CUDA one, or an error naming `what`.
pub fn on_gpu<'a>(s: &'a candle_core::Storage, l: &'a Layout, what: &str) -> Result<(&'a CudaStorage, &'a Layout)> {
    match s {
        candle_core::Storage::Cuda(c) => Ok((c, l)),
        _ => candle_core::bail!("{what}: every input must be on the GPU"),
    }
}

/// Allow `func` up to `bytes` of dynamic shared memory (above the default 48 KiB on request).
fn shared_memory(func: &CudaFunction, bytes: usize) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    if bytes > 227 * 1024 {
        candle_core::bail!("a kernel needs {bytes} bytes of shared memory, above the 227 KiB a block may have");
    }
    if bytes > 48 * 1024 {
        func.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).w()?;
    }
    Ok(())
}

/// Rows of a layout kernel's output, which its 32-bit row arithmetic must hold.
fn layout_rows(rows: usize) -> Result<i32> {
    i32::try_from(rows).map_err(|_| candle_core::Error::Msg(format!("chunk layout: {rows} rows, above 2^31")))
}

/// A layout kernel's launch: 32 threads along a row, `LAYOUT_ROWS` (8) rows a block.
fn layout_config(rows: i32) -> LaunchConfig {
    LaunchConfig { grid_dim: ((rows as u32).div_ceil(8), 1, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 }
}

/// Whether a layout kernel may take its 16-byte form (`*_chunks_vec_*`): d nonzero (its lanes
/// divide 32 by d / 4), and d, the chunk width, the column offset and the model-layout side's and
/// chunk side's element offsets all multiples of 4.
fn layout_vec(l: &ChunkLayout, offsets: [usize; 2]) -> bool {
    l.d > 0 && [l.d, l.width, l.off, offsets[0], offsets[1]].iter().all(|v| v % 4 == 0)
}

/// The 16-byte form's launch: rows of g = d / 4 < 32 column groups share a warp (32 / g rows),
/// `LAYOUT_ROWS` (8) warps a block (kernels.cu's `layout_vec_lane`).
fn layout_vec_config(rows: i32, d: usize) -> LaunchConfig {
    let g = d / 4;
    let per_warp = if g < 32 { 32 / g } else { 1 };
    let grid = (rows as u32).div_ceil(8 * per_warp as u32);
    LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 }
}

/// `to_chunks_*`: each model-layout input into its columns of one chunk-layout float32 buffer
/// (see `ops::chunk_layout`); together the inputs cover every column.
pub fn to_chunks(parts: &[(ChunkLayout, Input)]) -> Result<CudaStorage> {
    let Some((first, (x0, _))) = parts.first() else { candle_core::bail!("to chunks: no input") };
    let dev = x0.device().clone();
    // SAFETY: the inputs' columns cover the width, and each launch writes all of its columns
    // (zeros past T).
    let out = unsafe { dev.alloc::<f32>(first.chunk_len())? };
    for (l, x) in parts {
        let ints = [l.b, l.t, l.h, l.d, l.c, l.width, l.off].map(|v| v as i32);
        let rows = layout_rows(l.n() * l.b * l.h * l.c)?;
        let vec = layout_vec(l, [x.1.start_offset(), 0]);
        let cfg = if vec { layout_vec_config(rows, l.d) } else { layout_config(rows) };
        macro_rules! launch {
            ($ty:ty, $name:expr) => {{
                let xv = view::<$ty>(*x, "to chunks")?;
                let func = function(&dev, $name)?;
                let stream = dev.cuda_stream();
                let mut builder = stream.launch_builder(&func);
                builder.arg(&xv).arg(&out);
                for v in &ints {
                    builder.arg(v);
                }
                builder.arg(&rows);
                // SAFETY: argument list matches `to_chunks_*` in kernels.cu; out sized by the layout.
                unsafe { builder.launch(cfg) }.w()?;
            }};
        }
        match vec {
            true => per_dtype!(x.0.dtype(), "to_chunks_vec", "to chunks", launch),
            false => per_dtype!(x.0.dtype(), "to_chunks", "to chunks", launch),
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `from_chunks_*`: columns off..off+d of a chunk-layout float32 tensor to the model layout in
/// `dtype` (see `ops::chunk_layout`).
pub fn from_chunks(l: &ChunkLayout, y: Input, dtype: DType) -> Result<CudaStorage> {
    let dev = y.0.device().clone();
    let yv = view::<f32>(y, "from chunks")?;
    let ints = [l.b, l.t, l.h, l.d, l.c, l.width, l.off].map(|v| v as i32);
    let rows = layout_rows(l.b * l.t * l.h)?;
    let vec = layout_vec(l, [0, y.1.start_offset()]);
    let cfg = if vec { layout_vec_config(rows, l.d) } else { layout_config(rows) };
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            // SAFETY: the kernel writes every model-layout element.
            let out = unsafe { dev.alloc::<$ty>(l.model_len())? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&yv).arg(&out);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&rows);
            // SAFETY: argument list matches `from_chunks_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(match vec {
        true => per_dtype!(dtype, "from_chunks_vec", "from chunks", launch),
        false => per_dtype!(dtype, "from_chunks", "from chunks", launch),
    })
}

/// `chunk_join_keys`: the key columns of dqk [rows, 2 dk] gain dki (when given) and diag(e)
/// dkend, in place (see `ops::chunk_recurrence`).
pub fn chunk_join_keys(dqk: &mut CudaStorage, dl: &Layout, dki: Option<Input>, dkend: Input, e: Input) -> Result<()> {
    let what = "chunk keys' gradient";
    let (a, b) = contiguous(dl, what)?;
    let (dkend, e) = (view::<f32>(dkend, what)?, view::<f32>(e, what)?);
    let rows = layout_rows(e.len())?;
    let dki = dki.map(|x| view::<f32>(x, what)).transpose()?;
    let dk = super::launch::join_width(b - a, dkend.len(), e.len(), dki.as_ref().map(|x| x.len()))?;
    let has_intra = i32::from(dki.is_some());
    // Absent, dki is never read: dkend stands in for its pointer.
    let dki = dki.as_ref().unwrap_or(&dkend);
    let dev = dqk.device().clone();
    let mut out = dqk.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let func = function(&dev, "chunk_join_keys")?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    let dk = dk as i32;
    builder.arg(&mut out).arg(dki).arg(&dkend).arg(&e).arg(&rows).arg(&dk).arg(&has_intra);
    // SAFETY: argument list matches `chunk_join_keys` in kernels.cu; every length checked above.
    unsafe { builder.launch(layout_config(rows)) }.w()?;
    Ok(())
}

/// The launch grid of the chunk walk: column tiles x heads, 256 threads.
fn walk_config(d: &WalkDims, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (d.dv.div_ceil(TILE) as u32, d.bh as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

type Input<'a> = (&'a CudaStorage, &'a Layout);

/// `chunk_walk_fwd_f32`: U then every chunk-start state, flat (see `ops::chunk_walk`).
pub fn chunk_walk(d: &WalkDims, wkc: Input, k: Input, extra: Input) -> Result<(CudaStorage, Shape)> {
    if d.dk > MAX_DK || d.c > 64 {
        candle_core::bail!("chunk walk: key width {} or chunk {} above the kernels' 256 and 64", d.dk, d.c);
    }
    let dev = wkc.0.device().clone();
    let (wkc, k, extra) =
        (view::<f32>(wkc, "chunk walk")?, view::<f32>(k, "chunk walk")?, view::<f32>(extra, "chunk walk")?);
    let (w, kc) = (wkc.slice(..d.u_len()), wkc.slice(d.u_len()..));
    let (s0, a, e) = walk_extra(d, &extra);
    // SAFETY: the kernel writes every U element and every state (S_0 included).
    let out = unsafe { dev.alloc::<f32>(d.u_len() + d.states_len())? };
    let (u_out, states) = (out.slice(..d.u_len()), out.slice(d.u_len()..));
    // The state's and U's column tiles, and one chunk's staged keys.
    let smem = walk_smem(d);
    let func = function(&dev, &chunk_kernel("chunk_walk_fwd", walk_tensor(d)))?;
    shared_memory(&func, smem)?;
    let ints = [d.n, d.bh, d.c, d.dk, d.dv, d.delta as usize].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&w).arg(&kc).arg(&k).arg(&e).arg(&s0).arg(&a).arg(&u_out).arg(&states);
    for v in &ints {
        builder.arg(v);
    }
    // SAFETY: argument list matches `chunk_walk_fwd_f32` in kernels.cu; buffers sized by WalkDims.
    unsafe { builder.launch(walk_config(d, smem)) }.w()?;
    let n = d.u_len() + d.states_len();
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// A walk kernel's shared memory: the state's (G's) and U's (dU's) column tiles, then one chunk's
/// staged keys (from a 16-byte boundary; on tensor cores 64 rows of them at a padded stride, and
/// their 64 scales, and the backward's [64, 4] row sums).
fn walk_smem(d: &WalkDims) -> usize {
    if walk_tensor(d) {
        return ((d.dk + 64) * TC_STATE_STRIDE + 64 * (d.kk_width() + 4) + 64 + 64 * 4) * 4;
    }
    (((d.dk + d.c) * (TILE + 1)).next_multiple_of(4) + d.c * d.kk_width()) * 4
}

/// Row stride of the tensor-core walk's state tiles (`TC_SW` in kernels.cu).
const TC_STATE_STRIDE: usize = 40;

/// Whether the walk runs on tensor cores: as [`chunk_tensor`], and a key width in whole 16-row
/// tiles.
fn walk_tensor(d: &WalkDims) -> bool {
    chunk_tensor(d.tensor) && d.dk.is_multiple_of(16)
}

/// The walk's extra input split into S₀, the per-row decays a and the per-token key scales e.
fn walk_extra<'a>(
    d: &WalkDims,
    extra: &'a CudaView<'a, f32>,
) -> (CudaView<'a, f32>, CudaView<'a, f32>, CudaView<'a, f32>) {
    let (state, rows) = (d.state_len(), d.decays_len());
    (extra.slice(..state), extra.slice(state..state + rows), extra.slice(state + rows..))
}

/// `chunk_walk_bwd_*`: dW, every chunk's end-state gradient, then ds0, flat (see
/// `ops::chunk_walk`); the `_tc` form appends its column tiles' partial sums of da and de, from
/// the walk's output `res` (U and the states).
pub fn chunk_walk_back(
    d: &WalkDims,
    grad: Input,
    wkc: Input,
    k: Input,
    extra: Input,
    res: Input,
) -> Result<(CudaStorage, Shape)> {
    let dev = grad.0.device().clone();
    let grad = view::<f32>(grad, "chunk walk backward")?;
    let (wkc, k, extra) =
        (view::<f32>(wkc, "chunk walk")?, view::<f32>(k, "chunk walk")?, view::<f32>(extra, "chunk walk")?);
    let res = view::<f32>(res, "chunk walk")?;
    let kc = wkc.slice(d.u_len()..);
    let (_, a, e) = walk_extra(d, &extra);
    let (gu, gs) = (grad.slice(..d.u_len()), grad.slice(d.u_len()..));
    let (lu, lg) = (d.u_len(), d.n * d.state_len());
    let tensor = walk_tensor(d);
    let (la, le) = match tensor {
        true => (d.dv.div_ceil(TILE) * d.n * d.bh * d.dk, d.dv.div_ceil(TILE) * d.n * d.bh * d.c),
        false => (0, 0),
    };
    let n = lu + lg + d.state_len() + la + le;
    // SAFETY: the kernel writes all of dW, every chunk's end-state gradient and ds0 (and every
    // partial sum).
    let out = unsafe { dev.alloc::<f32>(n)? };
    let (dw, gend, ds0) = (out.slice(..lu), out.slice(lu..lu + lg), out.slice(lu + lg..lu + lg + d.state_len()));
    let rest = lu + lg + d.state_len();
    let (da, de) = (out.slice(rest..rest + la), out.slice(rest + la..));
    // G's and dU's column tiles, and one chunk's staged keys.
    let smem = walk_smem(d);
    let func = function(&dev, &chunk_kernel("chunk_walk_bwd", tensor))?;
    shared_memory(&func, smem)?;
    let ints = [d.n, d.bh, d.c, d.dk, d.dv, d.delta as usize].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&kc).arg(&k).arg(&e).arg(&a).arg(&gu).arg(&gs).arg(&dw).arg(&gend).arg(&ds0);
    for v in &ints {
        builder.arg(v);
    }
    let (u, states) = (res.slice(..d.u_len()), res.slice(d.u_len()..));
    if tensor {
        builder.arg(&u).arg(&states).arg(&da).arg(&de);
    }
    // SAFETY: argument list matches `chunk_walk_bwd_*` in kernels.cu; buffers sized above.
    unsafe { builder.launch(walk_config(d, smem)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// The intra-chunk solve's shared memory: its [c, c] matrices at row stride 65 (two forward,
/// four backward), one or two column tiles, and its per-token scalars (three, five). On tensor
/// cores the strides are 68 and 36, with two forward tiles and three backward.
fn intra_smem(backward: bool, tensor: bool) -> usize {
    let (sq, tile) = if tensor { (64 * 68, 64 * 36) } else { (64 * 65, 64 * 33) };
    let tiles = if tensor { 1 } else { 0 } + if backward { 2 } else { 1 };
    4 * if backward { 4 * sq + tiles * tile + 5 * 64 } else { 2 * sq + tiles * tile + 3 * 64 }
}

/// Whether a chunk kernel runs in its `_tc` form: 16-bit inputs (the dims' `tensor`) on a GPU
/// with tensor cores.
fn chunk_tensor(tensor: bool) -> bool {
    cfg!(tensor_cores) && tensor
}

/// A chunk kernel's name in the form [`chunk_tensor`] chose.
fn chunk_kernel(base: &str, tc: bool) -> String {
    format!("{base}_{}", if tc { "tc" } else { "f32" })
}

/// One block of 256 threads per chunk and head (the chunk ops' grid), with `smem` bytes of
/// shared memory; chunks above the kernels' 64 tokens are refused, naming `what`.
fn chunk_config(n: usize, bh: usize, c: usize, smem: usize, what: &str) -> Result<LaunchConfig> {
    if c > 64 {
        candle_core::bail!("{what}: chunks of {c} are above the kernel's 64");
    }
    Ok(LaunchConfig { grid_dim: ((n * bh) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem as u32 })
}

/// `chunk_intra_fwd_f32`: W then Kc, flat (see `ops::chunk_intra`).
pub fn chunk_intra(d: &IntraDims, k: Input, v: Input, scal: Input) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = intra_smem(false, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk solve")?;
    let dev = k.0.device().clone();
    let (k, v, scal) =
        (view::<f32>(k, "chunk solve")?, view::<f32>(v, "chunk solve")?, view::<f32>(scal, "chunk solve")?);
    let (lw, lk) = (d.n * d.bh * d.c * d.dv, d.n * d.bh * d.c * d.dk);
    // SAFETY: the kernel writes every element of W and Kc.
    let out = unsafe { dev.alloc::<f32>(lw + lk)? };
    let (w, kc) = (out.slice(..lw), out.slice(lw..));
    let func = function(&dev, &chunk_kernel("chunk_intra_fwd", tc))?;
    shared_memory(&func, smem)?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&k).arg(&v).arg(&scal).arg(&w).arg(&kc).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    // SAFETY: argument list matches `chunk_intra_fwd_f32` in kernels.cu; buffers sized by IntraDims.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(lw + lk)))
}

/// `chunk_intra_bwd_f32`: dk, dv, dβ, dγ, flat, from dW, dKc and the sign dKc comes with (see
/// `ops::chunk_intra`).
pub fn chunk_intra_back(
    d: &IntraDims,
    (gw, gkc, kc_sign): (Input, Input, f32),
    k: Input,
    v: Input,
    scal: Input,
) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = intra_smem(true, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk solve backward")?;
    let dev = gw.0.device().clone();
    let (gw, gkc) = (view::<f32>(gw, "chunk solve backward")?, view::<f32>(gkc, "chunk solve backward")?);
    if gw.len() != d.v_len() || gkc.len() != d.k_len() {
        candle_core::bail!("chunk solve backward: gradients of {} and {} elements", gw.len(), gkc.len());
    }
    let (k, v, scal) =
        (view::<f32>(k, "chunk solve")?, view::<f32>(v, "chunk solve")?, view::<f32>(scal, "chunk solve")?);
    let n = d.n * d.bh * d.c * (d.dk + d.dv + 2);
    // SAFETY: the kernel writes every element of dk, dv, dβ and dγ.
    let out = unsafe { dev.alloc::<f32>(n)? };
    let func = function(&dev, &chunk_kernel("chunk_intra_bwd", tc))?;
    shared_memory(&func, smem)?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&k).arg(&v).arg(&scal).arg(&gw).arg(&gkc).arg(&out).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&kc_sign);
    // SAFETY: argument list matches `chunk_intra_bwd_f32` in kernels.cu; out sized above.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// The chunk outputs' shared memory: P (and the backward's E ∘ D) at row stride 65, two column
/// tiles, and one (three) per-token scalars. On tensor cores the strides are 68 and 36, with a
/// third backward tile and a second forward scalar.
fn out_smem(backward: bool, tensor: bool) -> usize {
    let (sq, tile) = if tensor { (64 * 68, 64 * 36) } else { (64 * 65, 64 * 33) };
    let t = usize::from(tensor);
    4 * if backward { 2 * sq + (2 + t) * tile + 3 * 64 } else { sq + 2 * tile + (1 + t) * 64 }
}

/// `chunk_out_fwd_f32`: O [N,BH,C,dv] (see `ops::chunk_out`).
pub fn chunk_out(d: &OutDims, qk: Input, walked: Input, gamma: Input) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = out_smem(false, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk outputs")?;
    let dev = qk.0.device().clone();
    let what = "chunk outputs";
    let (qk, walked, gamma) = (view::<f32>(qk, what)?, view::<f32>(walked, what)?, view::<f32>(gamma, what)?);
    // SAFETY: the kernel writes every element of O.
    let out = unsafe { dev.alloc::<f32>(d.o_len())? };
    let func = function(&dev, &chunk_kernel("chunk_out_fwd", tc))?;
    shared_memory(&func, smem)?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&qk).arg(&walked).arg(&gamma).arg(&out).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&d.scale);
    // SAFETY: argument list matches `chunk_out_fwd_f32` in kernels.cu; out sized by OutDims.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(d.o_len())))
}

/// `chunk_out_bwd_f32`: dqk, dU, the states' gradient, dγ, flat (see `ops::chunk_out`).
pub fn chunk_out_back(
    d: &OutDims,
    grad: Input,
    qk: Input,
    walked: Input,
    gamma: Input,
) -> Result<((CudaStorage, Shape), (CudaStorage, Shape))> {
    let tc = chunk_tensor(d.tensor);
    let smem = out_smem(true, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk outputs backward")?;
    let dev = grad.0.device().clone();
    let what = "chunk outputs";
    let grad = view::<f32>(grad, "chunk outputs backward")?;
    let (qk, walked, gamma) = (view::<f32>(qk, what)?, view::<f32>(walked, what)?, view::<f32>(gamma, what)?);
    let n = d.walked_len() + d.scalars();
    // SAFETY: the kernel writes every element of dqk.
    let dqk = unsafe { dev.alloc::<f32>(d.qk_len())? };
    // Zeroed: O does not read the last state, whose gradient the kernel leaves as it is.
    let out = dev.alloc_zeros::<f32>(n)?;
    let func = function(&dev, &chunk_kernel("chunk_out_bwd", tc))?;
    shared_memory(&func, smem)?;
    let (blocks, walked_len) = ((d.n * d.bh) as i64, d.walked_len() as i64);
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&qk).arg(&walked).arg(&gamma).arg(&grad).arg(&dqk).arg(&out).arg(&blocks).arg(&walked_len);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&d.scale);
    // SAFETY: argument list matches `chunk_out_bwd_f32` in kernels.cu; dqk and out sized above.
    unsafe { builder.launch(cfg) }.w()?;
    let dqk = CudaStorage::wrap_cuda_slice(dqk, dev.clone());
    Ok(((dqk, Shape::from(d.qk_len())), (CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n))))
}
