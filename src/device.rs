//! `--device` and `--dtype`: typed values, resolved to candle's once the device is opened.

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use std::fmt;
use std::str::FromStr;

/// Where a model runs: `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let expected = || "expected cpu, cuda or cuda:N".to_string();
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| expected()),
                None => Err(expected()),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Open the device (fails when this build has no CUDA or the ordinal does not exist).
    pub fn open(self) -> Result<Device> {
        let Self::Cuda(ordinal) = self else { return Ok(Device::Cpu) };
        if !candle_core::utils::cuda_is_available() {
            bail!("--device {self}: this statecut was built without CUDA; rebuild with `cargo build --release --features cuda`");
        }
        let device = Device::new_cuda(ordinal)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = &device {
            // SAFETY: statecut runs all work of a device on its one stream, where cudarc's
            // per-buffer events (two created and destroyed per allocation) serve nothing.
            unsafe { c.disable_event_tracking() }
            pool::keep_freed_memory(c);
        }
        Ok(device)
    }
}

/// The device's default memory pool, which candle's stream-ordered allocations draw from.
#[cfg(feature = "cuda")]
mod pool {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::CudaDevice;

    fn default_pool(dev: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let mut pool = std::ptr::null_mut();
        // SAFETY: a device handle from a live context, and an out-pointer to fill.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev.cuda_stream().context().cu_device()) };
        (r == sys::CUresult::CUDA_SUCCESS && !pool.is_null()).then_some(pool)
    }

    fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Option<u64> {
        let mut v = 0u64;
        // SAFETY: these attributes are 64-bit values.
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    /// Keep freed memory mapped for the next allocation. The pool's default threshold of zero
    /// hands every freed byte back to the driver at each synchronisation, so each training step
    /// or timed pass mapped its working memory anew (several ms a pass at 16 x 2048 tokens). A
    /// failure leaves the default in place: it costs time, not correctness.
    /// `STATECUT_RELEASE_MEMORY=1` keeps the default, for a GPU shared with other processes.
    pub fn keep_freed_memory(dev: &CudaDevice) {
        if std::env::var_os("STATECUT_RELEASE_MEMORY").is_some_and(|v| v == "1") {
            return;
        }
        let Some(pool) = default_pool(dev) else { return };
        let mut keep = u64::MAX;
        // SAFETY: the release threshold is a 64-bit value.
        let _ = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut std::ffi::c_void,
            )
        };
    }

    /// Bytes handed out now, and the most handed out since the last [`reset_high`].
    pub fn used(dev: &CudaDevice) -> Option<(u64, u64)> {
        let pool = default_pool(dev)?;
        let now = attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Some((now, attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?))
    }

    /// Start the high-water mark of [`used`] again from what is in use now.
    pub fn reset_high(dev: &CudaDevice) {
        let Some(pool) = default_pool(dev) else { return };
        let mut zero = 0u64;
        // SAFETY: the high-water mark is a 64-bit value, and zero is the one it may be set to.
        let _ = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut std::ffi::c_void,
            )
        };
    }

    /// Hand every mapped byte the pool is not using back to the driver, so that the next
    /// allocations are mapped afresh rather than fitted between what the pool kept.
    pub fn trim(dev: &CudaDevice) {
        let Some(pool) = default_pool(dev) else { return };
        // SAFETY: a live pool; trimming to zero keeps every allocation still in use.
        let _ = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
    }

    /// Bytes the pool holds mapped but has not handed out: free for statecut's next allocation.
    pub fn cached(dev: &CudaDevice) -> u64 {
        let Some(pool) = default_pool(dev) else { return 0 };
        let reserved = attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        let used = attribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        reserved.zip(used).map_or(0, |(r, u)| r.saturating_sub(u))
    }
}

/// Compute dtype; `auto` is f32 on the CPU and bf16 on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Dtype {
    #[default]
    Auto,
    #[value(alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "float16")]
    F16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let v = clap::ValueEnum::to_possible_value(self).expect("no variant is skipped");
        f.write_str(v.get_name())
    }
}

impl Dtype {
    pub fn resolve(self, device: &Device) -> DType {
        match self {
            Self::Auto if device.is_cpu() => DType::F32,
            Self::Auto | Self::Bf16 => DType::BF16,
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
        }
    }
}

/// Memory of a CUDA device free for statecut's next allocations, in bytes: what the driver
/// reports free plus what statecut's memory pool holds unused. `None` on the CPU or when it
/// cannot be read.
pub fn free_memory(device: &Device) -> Option<usize> {
    let (free, _total) = memory_info(device)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return Some((free + pool::cached(d) as usize).min(_total));
    }
    Some(free)
}

/// Bytes of statecut's allocations in use on a CUDA device after the queued work, and the most
/// in use since the last [`reset_peak_in_use`]. `None` on the CPU or when they cannot be read.
pub fn in_use(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        device.synchronize().ok()?;
        return pool::used(d).map(|(now, high)| (now as usize, high as usize));
    }
    let _ = device;
    None
}

/// Start the peak that [`in_use`] reports again, from what is in use after the queued work.
pub fn reset_peak_in_use(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        if device.synchronize().is_ok() {
            pool::reset_high(d);
        }
    }
    let _ = device;
}

/// Release the memory the pool keeps for reuse once the queued work is done. After running out
/// of memory, what the pool kept is mapped in the sizes of the failed work's allocations, which
/// a different pattern of allocations may not fit.
pub fn release_cached(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        if device.synchronize().is_ok() {
            pool::trim(d);
        }
    }
    let _ = device;
}

/// (free, total) memory of a CUDA device in bytes as the driver reports them (memory statecut's
/// pool keeps for reuse counts as in use); `None` on the CPU or when it cannot be read.
pub fn memory_info(device: &Device) -> Option<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().mem_get_info().ok();
    }
    let _ = device;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceSpec::Cuda(3)));
        for bad in ["", "tpu", "cuda:", "cuda:-1", "cuda:x", "CPU"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
        assert_eq!(Dtype::Bf16.to_string(), "bf16");
        assert_eq!(Dtype::Auto.resolve(&Device::Cpu), DType::F32);
    }
}
