//! Launchers for statecut's own CUDA kernels (`kernels.cu`, compiled by build.rs).
//!
//! Each launcher is the `cuda_fwd` half of a custom op whose CPU half, in the op's own module,
//! defines what it computes; `tests/gpu_parity.rs` checks the two agree.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// Kernel `name`, loading the module once per device.
fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    static MODULES: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, Arc<CudaModule>>>> = OnceLock::new();
    let mut modules = MODULES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let module = match modules.get(&dev.id()) {
        Some(m) => m.clone(),
        None => {
            let m = dev.cuda_stream().context().load_module(Ptx::from_binary(FATBIN.to_vec())).w()?;
            modules.insert(dev.id(), m.clone());
            m
        }
    };
    module.load_function(name).w()
}

fn contiguous(layout: &Layout, what: &str) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what}: input must be contiguous")))
}

/// Sizes of one recurrence launch (see `recurrence` in kernels.cu).
pub struct RecurrenceDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
    pub gk: bool,
    pub delta: bool,
    pub scale: f32,
}

/// Packed float32 inputs [B,T,H,P] and initial state [B,H,dk,dv] -> o [B,T,H,dv] followed by the
/// final state [B,H,dk,dv], flat.
pub fn recurrence(
    x: &CudaStorage,
    xl: &Layout,
    s0: &CudaStorage,
    sl: &Layout,
    d: &RecurrenceDims,
) -> Result<(CudaStorage, Shape)> {
    let dev = x.device().clone();
    let (xs, xe) = contiguous(xl, "recurrence")?;
    let (ss, se) = contiguous(sl, "recurrence state")?;
    let x = x.as_cuda_slice::<f32>()?.slice(xs..xe);
    let s0 = s0.as_cuda_slice::<f32>()?.slice(ss..se);
    // R threads share a state column, each holding `rows` ≤ 32 key rows in registers.
    let r = d.dk.div_ceil(32).next_power_of_two().min(32);
    let rows = d.dk.div_ceil(r);
    if rows > 32 {
        candle_core::bail!("recurrence: key width {} is above the kernel's 1024", d.dk);
    }
    let maxr = [8, 16, 32].into_iter().find(|&m| rows <= m).unwrap_or(32);
    // Specialised for per-channel decay and for rows that need no bounds check (dk = R · MAXR).
    let full = rows == maxr && r * rows == d.dk;
    let func = function(&dev, &format!("recurrence_{maxr}_{}{}", d.gk as u8, full as u8))?;
    let n = d.b * d.t * d.h * d.dv + d.b * d.h * d.dk * d.dv;
    // SAFETY: every element is written by the kernel (outputs for all (b,t,h,j), all of the state).
    let out = unsafe { dev.alloc::<f32>(n)? };
    // 8 warps: every block stages all of q and k for its columns, so wide blocks read less.
    let warps = 8;
    let cols_per_block = warps * (32 / r);
    // Time steps staged in shared memory per chunk: as many as fit the default 48 KiB, ≤ 32.
    let step_bytes = 4 * (2 * d.dk + cols_per_block + 2 + if d.gk { d.dk } else { 0 });
    let tc = (48 * 1024 / step_bytes).clamp(1, 32);
    let cfg = LaunchConfig {
        grid_dim: (d.dv.div_ceil(cols_per_block) as u32, (d.b * d.h) as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: (tc * step_bytes) as u32,
    };
    let ints = [d.b, d.t, d.h, d.dk, d.dv, r, rows, d.delta as usize].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&x);
    builder.arg(&s0);
    builder.arg(&out);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&d.scale);
    let tc = tc as i32;
    builder.arg(&tc);
    // SAFETY: argument list matches `recurrence_N` in kernels.cu; buffers are sized above.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// Depthwise causal conv (+ SiLU) of x [B,L,C] with weight [C,K] and bias [C], all one dtype;
/// output [B, T_out, C] with T_out = L − (K−1) + pad.
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
    let t_out = l + pad + 1 - k;
    let n = b * t_out * c;
    let ints = [b, l, t_out, c, k, pad, act as usize].map(|v| v as i32);
    let cfg = LaunchConfig::for_num_elems(n as u32);
    macro_rules! launch {
        ($ty:ty, $name:literal) => {{
            let (xs, xe) = contiguous(xl, "conv")?;
            let (ws, we) = contiguous(wl, "conv weight")?;
            let (bs, be) = contiguous(bl, "conv bias")?;
            let xv = x.as_cuda_slice::<$ty>()?.slice(xs..xe);
            let wv = w.as_cuda_slice::<$ty>()?.slice(ws..we);
            let bv = bias.as_cuda_slice::<$ty>()?.slice(bs..be);
            let func = function(&dev, $name)?;
            // SAFETY: the kernel writes all n outputs.
            let out = unsafe { dev.alloc::<$ty>(n)? };
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&xv);
            builder.arg(&wv);
            builder.arg(&bv);
            builder.arg(&out);
            for v in &ints {
                builder.arg(v);
            }
            // SAFETY: argument list matches `conv_silu_*` in kernels.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    let out = match x.dtype() {
        DType::F32 => launch!(f32, "conv_silu_f32"),
        DType::BF16 => launch!(half::bf16, "conv_silu_bf16"),
        DType::F16 => launch!(half::f16, "conv_silu_f16"),
        dt => candle_core::bail!("conv: unsupported dtype {dt:?}"),
    };
    Ok((out, Shape::from((b, t_out, c))))
}
