//! Launcher of the in-place AdamW update (`adamw.cu`).

use super::{contiguous, function, view};
use crate::ops::adamw::Update;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

/// `adamw_update`: state [3n] (float32 p | m | v, contiguous) updated in place from g [n].
pub fn adamw(state: &mut CudaStorage, sl: &Layout, g: (&CudaStorage, &Layout), u: &Update) -> Result<()> {
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
    let (n64, clip, scale) = (n as i64, i32::from(u.clip.is_some()), u.clip.unwrap_or(1.0));
    builder.arg(&mut sv).arg(&gv).arg(&n64).arg(&clip).arg(&scale);
    builder.arg(&u.b1).arg(&u.one_minus_b1).arg(&u.b2).arg(&u.one_minus_b2);
    builder.arg(&u.inv_bc1).arg(&u.inv_bc2).arg(&u.eps).arg(&u.decay).arg(&u.lr);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument list matches `adamw_update` in adamw.cu; the state holds 3n elements.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}
