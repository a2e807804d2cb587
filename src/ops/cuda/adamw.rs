//! Launcher of the in-place AdamW update (`adamw.cu`).

use super::{contiguous, function, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

/// `adamw_update`: state [3n] (float32 p | m | v, contiguous) updated in place from g [n],
/// scaled by `clip` when given; `k`: β₁, 1 − β₁, β₂, 1 − β₂, 1 / (1 − β₁ᵗ), 1 / (1 − β₂ᵗ), ε,
/// 1 − lr · weight decay, lr (see `ops::adamw::Update`).
pub fn adamw(
    state: &mut CudaStorage,
    sl: &Layout,
    g: (&CudaStorage, &Layout),
    clip: Option<f32>,
    k: [f32; 9],
) -> Result<()> {
    let what = "adamw";
    let (a, b) = contiguous(sl, what)?;
    let gv = view::<f32>(g, what)?;
    let n = gv.len();
    if b - a != 3 * n {
        candle_core::bail!("{what}: state of {} elements for a gradient of {n}", b - a);
    }
    if n == 0 {
        return Ok(());
    }
    let dev = state.device().clone();
    let mut sv = state.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let func = function(&dev, "adamw_update")?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    let (n64, clipped, scale) = (n as i64, i32::from(clip.is_some()), clip.unwrap_or(1.0));
    builder.arg(&mut sv).arg(&gv).arg(&n64).arg(&clipped).arg(&scale);
    for x in &k {
        builder.arg(x);
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches `adamw_update` in adamw.cu; the state holds 3n elements.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}
