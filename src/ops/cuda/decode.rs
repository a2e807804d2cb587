//! Launchers of one decoding step's inputs and its output norm (`decode.cu`).

use super::{from, function, view, RowView};
use crate::ops::launch::StepDims;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

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

/// `delta_decode_prep` in decode.cu: one block per (key head, sequence); `n` float32 outputs,
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
            // SAFETY: argument list matches `delta_decode_prep_*` in decode.cu.
            unsafe { builder.launch(cfg) }.w()?;
        }};
    }
    per_dtype!(a.x.0.dtype(), "delta_decode_prep", "decode step", launch);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `out_norm` in decode.cu on the float32 o (rows × n), gated by the `gate` row view (rows
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
            // SAFETY: argument list matches `out_norm_*` in decode.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(per_dtype!(dtype, "out_norm", "output norm", launch))
}
