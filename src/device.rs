//! `--device` and `--dtype` parsing.

use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// Parse `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        _ if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = s.strip_prefix("cuda:").map(str::parse::<usize>).transpose()?.unwrap_or(0);
            if !candle_core::utils::cuda_is_available() {
                bail!("--device {s}: this statecut was built without CUDA; rebuild with `cargo build --release --features cuda`");
            }
            let device = Device::new_cuda(ordinal)?;
            #[cfg(feature = "cuda")]
            if let Device::Cuda(c) = &device {
                // SAFETY: statecut runs all work of a device on its one stream, where cudarc's
                // per-buffer events (two created and destroyed per allocation) serve nothing.
                unsafe { c.disable_event_tracking() }
            }
            Ok(device)
        }
        _ => bail!("--device {s}: expected cpu, cuda or cuda:N"),
    }
}

/// Parse `auto|f32|bf16|f16`; `auto` is f32 on CPU and bf16 on GPUs.
pub fn parse_dtype(s: &str, device: &Device) -> Result<DType> {
    Ok(match s {
        "auto" => {
            if device.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            }
        }
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" => DType::F16,
        _ => bail!("--dtype {s}: expected auto, f32, bf16 or f16"),
    })
}

/// Free memory of a CUDA device in bytes; `None` on the CPU or when it cannot be read.
pub fn free_memory(device: &Device) -> Option<usize> {
    memory_info(device).map(|(free, _)| free)
}

/// (free, total) memory of a CUDA device in bytes; `None` on the CPU or when it cannot be read.
pub fn memory_info(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}
