//! A CUDA device's first-use costs, paid on a thread while the weights load.
//!
//! The first launch of each of candle's kernel modules loads that module (they ship as PTX,
//! loaded through the driver's compute cache, 10-40 ms each), and the first matrix product
//! initialises cuBLAS (65-150 ms on an H100). A pass over the model paid these inside its first
//! batch. A [`WarmUp`] started when the device opens runs one small op of each kind, so that
//! they overlap the reading of the checkpoint instead. `STATECUT_WARMUP=0` turns it off.

use candle_core::{DType, Device, Result, Tensor};
use std::thread::JoinHandle;

/// The warm-up thread of one device; dropping it waits for the thread.
#[must_use = "the warm-up runs until this is dropped"]
pub struct WarmUp(Option<JoinHandle<()>>);

impl WarmUp {
    /// Start warming `device` up for work in `dtype`: nothing on a CPU or with `STATECUT_WARMUP=0`.
    pub fn start(device: &Device, dtype: DType) -> Self {
        let off = std::env::var("STATECUT_WARMUP").is_ok_and(|v| v == "0");
        if !device.is_cuda() || off {
            return Self(None);
        }
        let device = device.clone();
        // The thread shares the device's stream and cuBLAS handle with the load, which runs no
        // products; cuBLAS allows one handle on several threads while none changes its settings.
        // Best effort: an error here would meet the work that follows, which reports it.
        let spawned = std::thread::Builder::new().name("warm-up".into()).spawn(move || {
            let _ = first_uses(&device, dtype, 1024);
        });
        Self(spawned.ok())
    }

    /// Wait for the warm-up to finish (as dropping it does).
    pub fn finish(self) {}
}

impl Drop for WarmUp {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

/// One op from each of candle's kernel modules that a pass uses, an n x n matrix product in
/// `dtype` and in float32 (once where they are one), and statecut's own kernel module loaded.
fn first_uses(dev: &Device, dtype: DType, n: usize) -> Result<()> {
    let dtypes: &[DType] = if dtype == DType::F32 { &[DType::F32] } else { &[dtype, DType::F32] };
    let ids = Tensor::arange(0u32, 8, dev)?;
    for &dt in dtypes {
        let x = Tensor::ones((n, n), dt, dev)?; // fill
        let y = x.affine(0.5, 1.0)?; // affine
        let z = ((&x + &y)? * &y)?.exp()?; // binary, unary
        let t = z.t()?.contiguous()?.to_dtype(DType::F32)?; // copy, cast
        let picked = t.index_select(&ids, 0)?; // indexing
        let mask = picked.ge(1.0)?; // comparison
        let _ = mask.where_cond(&picked, &picked.zeros_like()?)?.sum_keepdim(1)?.max_keepdim(0)?; // ternary, reduce
        let _ = x.matmul(&y)?; // cuBLAS
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = dev {
        super::cuda::load_module(c)?;
    }
    dev.synchronize()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a CPU the warm-up starts no thread; the ops it runs work on any device.
    #[test]
    fn warm_up_ops_run() -> Result<()> {
        let w = WarmUp::start(&Device::Cpu, DType::F32);
        assert!(w.0.is_none());
        w.finish();
        first_uses(&Device::Cpu, DType::BF16, 64)
    }
}
