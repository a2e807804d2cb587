//! Launcher of the recurrence without gradients: the sequential kernels (`recurrence.cu`), or
//! for 16-bit models' longer passes the chunked form (`chunk_fused.cu`).

use super::{function, shared_memory, shared_memory_limit, view};
use crate::ops::fused_block::{self, Block};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape};
use std::sync::OnceLock;

/// Sizes of one recurrence launch (see `recurrence` in recurrence.cu).
pub struct RecurrenceDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
    pub delta: bool,
    pub scale: f32,
    /// The caller allows the chunked form on tensor cores (TF32 products): 16-bit models.
    pub chunks: bool,
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
    if let Some(width) = chunked_width(d, has_gk, &dev) {
        let bytes = 4 * fused_block::chunked_floats(width);
        let func = function(&dev, &format!("chunk_fused_fwd_{width}"))?;
        shared_memory(&dev, &func, bytes, "recurrence")?;
        let cfg = LaunchConfig {
            grid_dim: (d.dv.div_ceil(fused_block::CHUNKED_COLUMNS) as u32, (d.b * d.h) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let ints: Vec<i32> = [d.t, d.h, d.dk, d.dv, gated as usize, d.delta as usize].map(|v| v as i32).to_vec();
        let stream = dev.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        builder.arg(&q).arg(&k).arg(&v).arg(&beta).arg(g).arg(&s0).arg(&out).arg(&state_out);
        for v in &ints {
            builder.arg(v);
        }
        builder.arg(&d.scale);
        // SAFETY: argument list matches `chunk_fused_fwd_*` in chunk_fused.cu (the buffers, T, H,
        // dk, dv, gated, delta, scale); buffers are sized above, and shared memory as the kernel's
        // `ChunkFused<DK, C>` lays it out.
        unsafe { builder.launch(cfg) }.w()?;
        return Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)));
    }
    // The tiled kernel when the rows split exactly into float4 groups it has an instance for
    // (every common head width), else the general one.
    let tiled = r * rows == d.dk && matches!(rows, 16 | 24 | 32);
    let Block { warps, cols } = if tiled { fused_block::chosen(d.dv, r)? } else { Block { warps: 8, cols: 1 } };
    let cols_per_block = warps * (32 / r) * cols;
    let gk_width = if has_gk { d.dk } else { 0 };
    let stream = dev.cuda_stream();
    let grid_dim = (d.dv.div_ceil(cols_per_block) as u32, (d.b * d.h) as u32, 1);
    let block_dim = (32 * warps as u32, 1, 1);
    let scale = d.scale;
    let (func, ints, tc, smem) = if tiled {
        // Two buffers of `tc` padded steps (see `recurrence_tiled`) in the default 48 KiB.
        let step_bytes = 4 * (2 * d.dk + gk_width + cols_per_block + 2).div_ceil(4) * 4;
        let tc = (24 * 1024 / step_bytes).clamp(1, 32);
        let decay = if has_gk { 2 } else { gated as u8 };
        let suffix = if cols > 1 { format!("_c{cols}") } else { String::new() };
        let func = function(&dev, &format!("recurrence_t{rows}_{r}_{decay}{suffix}"))?;
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
    // SAFETY: argument list matches `recurrence_t*` / `recurrence_N_*` in recurrence.cu (the same
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

/// The key width of the chunked form's instance for this launch, if it takes the chunked form:
/// the caller allows it, the GPU has tensor cores, and [`fused_block::chunked_width`] has one
/// within the shared memory a block of `dev` may have.
fn chunked_width(d: &RecurrenceDims, has_gk: bool, dev: &CudaDevice) -> Option<usize> {
    if !(d.chunks && cfg!(tensor_cores)) {
        return None;
    }
    fused_block::chunked_width(d.dk, d.t, has_gk, || shared_memory_limit(dev))
}
