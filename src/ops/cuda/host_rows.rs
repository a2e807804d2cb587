//! Contiguous GPU buffers to the host as float32, through page-locked staging: calibration's
//! sampled rows (48 buffers of 2,500 x 2,048 bf16 at the 1.3B shapes). A copy into pageable
//! memory goes through the driver's own staging at a fraction of the bus's speed; here each
//! buffer lands in one of two page-locked buffers and is widened from there on every core while
//! the next one copies.

use super::view;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaView, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use rayon::prelude::*;

/// Every buffer's elements as float32, in order, where all are of one dtype among float32, bf16
/// and f16; `None` otherwise (float64 among them), or for no buffers.
pub fn to_host_f32(parts: &[(&CudaStorage, &Layout)]) -> Result<Option<Vec<Vec<f32>>>> {
    let Some(first) = parts.first() else { return Ok(None) };
    let dtype = first.0.dtype();
    if parts.iter().any(|(s, _)| s.dtype() != dtype) {
        return Ok(None);
    }
    Ok(Some(match dtype {
        DType::BF16 => staged(parts, |x: half::bf16| x.to_f32())?,
        DType::F16 => staged(parts, |x: half::f16| x.to_f32())?,
        DType::F32 => staged(parts, |x: f32| x)?,
        _ => return Ok(None),
    }))
}

fn staged<T>(parts: &[(&CudaStorage, &Layout)], widen: fn(T) -> f32) -> Result<Vec<Vec<f32>>>
where
    T: CudaDType + DeviceRepr + ValidAsZeroBits + Copy + Send + Sync,
{
    let views: Vec<CudaView<T>> = parts.iter().map(|&p| view::<T>(p, "rows to the host")).collect::<Result<_>>()?;
    let stream = parts[0].0.device().cuda_stream();
    let longest = views.iter().map(|v| v.len()).max().unwrap_or(0).max(1);
    // Flags 0, not cudarc's default write-combined memory, which the host reads uncached.
    // SAFETY: an element is read only after a copy has written it (the first `len` of a buffer).
    let alloc = || unsafe { stream.context().alloc_pinned_with_flags::<T>(longest, 0) }.w();
    let mut pins = [alloc()?, alloc()?];
    let ptrs = [pins[0].as_mut_ptr().w()?, pins[1].as_mut_ptr().w()?];
    // Copy buffer i into staging i % 2, and the event that marks it done. The copy takes as many
    // elements as its destination holds, so the destination is the buffer's length of the
    // staging, a plain slice: cudarc neither waits for nor records a copy into one, hence the
    // event.
    let copy = |i: usize| -> Result<CudaEvent> {
        let v = &views[i];
        // SAFETY: `pins` holds `longest` ≥ v.len() elements; nothing reads this staging until
        // the event is waited for, and the widening that read it last has returned.
        let stage = unsafe { std::slice::from_raw_parts_mut(ptrs[i % 2], v.len()) };
        stream.memcpy_dtoh(v, stage).w()?;
        stream.record_event(None).w()
    };
    let widened = || -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(views.len());
        let mut next = if views.is_empty() { None } else { Some(copy(0)?) };
        for (i, v) in views.iter().enumerate() {
            let done = next.take().expect("each buffer's copy is issued before its turn");
            // The next copy runs while this buffer is widened.
            if i + 1 < views.len() {
                next = Some(copy(i + 1)?);
            }
            done.synchronize().w()?;
            // SAFETY: the copy into this staging is done (above) and the next one goes to the other.
            let src = unsafe { std::slice::from_raw_parts(ptrs[i % 2] as *const T, v.len()) };
            let mut dst = vec![0f32; v.len()];
            dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| {
                d.iter_mut().zip(s).for_each(|(d, s)| *d = widen(*s));
            });
            out.push(dst);
        }
        Ok(out)
    };
    let out = widened();
    // A copy may still be in flight where the loop stopped on an error: the staging is freed
    // only after the stream is done with it.
    let synced = stream.synchronize().w();
    drop(pins);
    let out = out?;
    synced?;
    Ok(out)
}
