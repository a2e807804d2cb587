//! Launchers for statecut's own CUDA kernels: the `.cu` files beside this module, compiled by
//! build.rs into one module (`kernels.cu` includes the others), and one launcher module per
//! kernel file.
//!
//! Each launcher is the `cuda_fwd` half of a custom op whose CPU half, in the op's own module,
//! defines what it computes; `tests/gpu_parity.rs` checks the two agree.

use super::contiguous;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaView};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};
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

mod adamw;
mod chunk;
mod conv;
mod decode;
mod distill;
mod host_rows;
mod mlp;
mod norm;
mod prep;
mod recurrence;

pub use adamw::adamw;
pub use chunk::{
    chunk_intra, chunk_intra_back, chunk_join_keys, chunk_out, chunk_out_back, chunk_walk, chunk_walk_back,
    from_chunks, to_chunks,
};
pub use conv::{conv, conv_bwd};
pub use decode::{decode_step, out_norm, StepArgs};
pub use distill::{kd_rows, kd_rows_bwd};
pub use host_rows::to_host_f32;
pub use mlp::{swiglu, swiglu_bwd};
pub use norm::{add_packs, add_rms, add_rms_rows, gated_rms, rms_bwd};
pub use prep::{col_sumsq, heads, heads_bwd_into, heads_into, qkv_prep};
pub use recurrence::{recurrence, RecurrenceDims, RecurrenceInputs};

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// One device's copy of the kernels' module and the functions looked up in it so far.
struct Kernels {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// `dev`'s kernels, its module loaded on the first call.
fn with_kernels<R>(dev: &CudaDevice, f: impl FnOnce(&mut Kernels) -> Result<R>) -> Result<R> {
    static KERNELS: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, Kernels>>> = OnceLock::new();
    let mut all = KERNELS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let kernels = match all.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let module = dev.cuda_stream().context().load_module(Ptx::from_binary(FATBIN.to_vec())).w()?;
            e.insert(Kernels { module, functions: HashMap::new() })
        }
    };
    f(kernels)
}

/// Load the kernels' module on `dev` now (`crate::ops::warm_up`).
pub fn load_module(dev: &CudaDevice) -> Result<()> {
    with_kernels(dev, |_| Ok(()))
}

/// Kernel `name`, loading the module once per device and each function once: a decoding step
/// launches a few hundred kernels, and a driver lookup per launch would add to each.
fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    with_kernels(dev, |kernels| {
        if let Some(f) = kernels.functions.get(name) {
            return Ok(f.clone());
        }
        let f = kernels.module.load_function(name).w()?;
        kernels.functions.insert(name.to_string(), f.clone());
        Ok(f)
    })
}

/// The view of a contiguous input as elements of T.
fn view<'a, T: CudaDType>((s, l): (&'a CudaStorage, &Layout), what: &str) -> Result<CudaView<'a, T>> {
    let (a, b) = contiguous(l, what)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// A row view for a launch: storage, start offset and row stride in elements.
pub type RowView<'a> = (&'a CudaStorage, usize, usize);

/// A storage's elements of T from `offset` on.
fn from<T: CudaDType>(s: &CudaStorage, offset: usize) -> Result<CudaView<'_, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    Ok(slice.slice(offset..))
}

/// Whether a row-wise kernel over rows of `n` elements of T may take 16 bytes a thread: n a
/// multiple of that, and every operand starting on a 16-byte boundary (candle's allocations do;
/// a view's offset may not).
fn vec16<T>(n: usize, offsets: &[usize]) -> bool {
    vec16_of(std::mem::size_of::<T>(), n, offsets)
}

/// [`vec16`] for elements of `size` bytes, where the dtype is known only at run time.
fn vec16_of(size: usize, n: usize, offsets: &[usize]) -> bool {
    let per = 16 / size.max(1);
    n.is_multiple_of(per) && offsets.iter().all(|o| o.is_multiple_of(per))
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

/// A tensor's storage and layout as a CUDA one, or an error naming `what`.
pub fn on_gpu<'a>(s: &'a candle_core::Storage, l: &'a Layout, what: &str) -> Result<(&'a CudaStorage, &'a Layout)> {
    match s {
        candle_core::Storage::Cuda(c) => Ok((c, l)),
        _ => candle_core::bail!("{what}: every input must be on the GPU"),
    }
}

/// The most shared memory a block may ask for on `dev` (227 KiB on an H100 or H200, 163 KiB on
/// an A100, 99 KiB on most other GPUs), for kernels that have a form which needs less. Asked of
/// the driver once per device: launches and the recurrence's choice of form read it every pass.
fn shared_memory_limit(dev: &CudaDevice) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    static LIMITS: OnceLock<Mutex<HashMap<candle_core::cuda_backend::DeviceId, usize>>> = OnceLock::new();
    let mut all = LIMITS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    *all.entry(dev.id()).or_insert_with(|| {
        let optin = A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        dev.cuda_stream().context().attribute(optin).map_or(48 * 1024, |b| b.max(0) as usize)
    })
}

/// Whether the chunk kernels for keys `dk` wide fit the blocks of `dev` (see
/// [`crate::ops::launch::chunk_kernels_fit`]); where they do not, the recurrence takes the
/// composed chunked form.
pub fn chunk_kernels_fit(dev: &CudaDevice, dk: usize) -> bool {
    crate::ops::launch::chunk_kernels_fit(dk, cfg!(tensor_cores), shared_memory_limit(dev))
}

/// Allow `func` on `dev` up to `bytes` of dynamic shared memory (above the default 48 KiB on
/// request), or say which kernel needs more than the GPU gives a block.
fn shared_memory(dev: &CudaDevice, func: &CudaFunction, bytes: usize, what: &str) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    let limit = shared_memory_limit(dev);
    if bytes > limit {
        candle_core::bail!(
            "{what}: its kernel needs {bytes} bytes of shared memory a block and this GPU gives {limit}; \
             STATECUT_RECURRENCE=chunked runs the recurrence in candle's ops instead"
        );
    }
    if bytes > 48 * 1024 {
        func.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).w()?;
    }
    Ok(())
}

type Input<'a> = (&'a CudaStorage, &'a Layout);
