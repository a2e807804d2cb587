//! Launchers of the chunked recurrence's kernels: the layout, the walk, the solve and the
//! outputs, in float32 (`chunk_*.cu`) or on tensor cores (`chunk_tc.cu`).

use super::{contiguous, function, shared_memory, view, Input};
use crate::ops::launch::{ChunkLayout, IntraDims, OutDims, WalkDims, MAX_DK, TILE};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

/// Rows of a layout kernel's output, which its 32-bit row arithmetic must hold.
fn layout_rows(rows: usize) -> Result<i32> {
    i32::try_from(rows).map_err(|_| candle_core::Error::Msg(format!("chunk layout: {rows} rows, above 2^31")))
}

/// A layout kernel's launch: 32 threads along a row, `LAYOUT_ROWS` (8) rows a block.
fn layout_config(rows: i32) -> LaunchConfig {
    LaunchConfig { grid_dim: ((rows as u32).div_ceil(8), 1, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 }
}

/// Whether a layout kernel may take its 16-byte form (`*_chunks_vec_*`): d nonzero (its lanes
/// divide 32 by d / 4), and d, the chunk width, the column offset and the model-layout side's and
/// chunk side's element offsets all multiples of 4.
fn layout_vec(l: &ChunkLayout, offsets: [usize; 2]) -> bool {
    l.d > 0 && [l.d, l.width, l.off, offsets[0], offsets[1]].iter().all(|v| v % 4 == 0)
}

/// The 16-byte form's launch: rows of g = d / 4 < 32 column groups share a warp (32 / g rows),
/// `LAYOUT_ROWS` (8) warps a block (chunk_layout.cu's `layout_vec_lane`).
fn layout_vec_config(rows: i32, d: usize) -> LaunchConfig {
    let g = d / 4;
    let per_warp = if g < 32 { 32 / g } else { 1 };
    let grid = (rows as u32).div_ceil(8 * per_warp as u32);
    LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 }
}

/// `to_chunks_*`: each model-layout input into its columns of one chunk-layout float32 buffer
/// (see `ops::chunk_layout`); together the inputs cover every column.
pub fn to_chunks(parts: &[(ChunkLayout, Input)]) -> Result<CudaStorage> {
    let Some((first, (x0, _))) = parts.first() else { candle_core::bail!("to chunks: no input") };
    let dev = x0.device().clone();
    // SAFETY: the inputs' columns cover the width, and each launch writes all of its columns
    // (zeros past T).
    let out = unsafe { dev.alloc::<f32>(first.chunk_len())? };
    for (l, x) in parts {
        let ints = [l.b, l.t, l.h, l.d, l.c, l.width, l.off].map(|v| v as i32);
        let rows = layout_rows(l.n() * l.b * l.h * l.c)?;
        let vec = layout_vec(l, [x.1.start_offset(), 0]);
        let cfg = if vec { layout_vec_config(rows, l.d) } else { layout_config(rows) };
        macro_rules! launch {
            ($ty:ty, $name:expr) => {{
                let xv = view::<$ty>(*x, "to chunks")?;
                let func = function(&dev, $name)?;
                let stream = dev.cuda_stream();
                let mut builder = stream.launch_builder(&func);
                builder.arg(&xv).arg(&out);
                for v in &ints {
                    builder.arg(v);
                }
                builder.arg(&rows);
                // SAFETY: argument list matches `to_chunks_*` in chunk_*.cu; out sized by the layout.
                unsafe { builder.launch(cfg) }.w()?;
            }};
        }
        match vec {
            true => per_dtype!(x.0.dtype(), "to_chunks_vec", "to chunks", launch),
            false => per_dtype!(x.0.dtype(), "to_chunks", "to chunks", launch),
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `from_chunks_*`: columns off..off+d of a chunk-layout float32 tensor to the model layout in
/// `dtype` (see `ops::chunk_layout`).
pub fn from_chunks(l: &ChunkLayout, y: Input, dtype: DType) -> Result<CudaStorage> {
    let dev = y.0.device().clone();
    let yv = view::<f32>(y, "from chunks")?;
    let ints = [l.b, l.t, l.h, l.d, l.c, l.width, l.off].map(|v| v as i32);
    let rows = layout_rows(l.b * l.t * l.h)?;
    let vec = layout_vec(l, [0, y.1.start_offset()]);
    let cfg = if vec { layout_vec_config(rows, l.d) } else { layout_config(rows) };
    macro_rules! launch {
        ($ty:ty, $name:expr) => {{
            // SAFETY: the kernel writes every model-layout element.
            let out = unsafe { dev.alloc::<$ty>(l.model_len())? };
            let func = function(&dev, $name)?;
            let stream = dev.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&yv).arg(&out);
            for v in &ints {
                builder.arg(v);
            }
            builder.arg(&rows);
            // SAFETY: argument list matches `from_chunks_*` in chunk_*.cu.
            unsafe { builder.launch(cfg) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }};
    }
    Ok(match vec {
        true => per_dtype!(dtype, "from_chunks_vec", "from chunks", launch),
        false => per_dtype!(dtype, "from_chunks", "from chunks", launch),
    })
}

/// `chunk_join_keys`: the key columns of dqk [rows, 2 dk] gain dki (when given) and diag(e)
/// dkend, in place (see `ops::chunk_recurrence`).
pub fn chunk_join_keys(dqk: &mut CudaStorage, dl: &Layout, dki: Option<Input>, dkend: Input, e: Input) -> Result<()> {
    let what = "chunk keys' gradient";
    let (a, b) = contiguous(dl, what)?;
    let (dkend, e) = (view::<f32>(dkend, what)?, view::<f32>(e, what)?);
    let rows = layout_rows(e.len())?;
    let dki = dki.map(|x| view::<f32>(x, what)).transpose()?;
    let dk = crate::ops::launch::join_width(b - a, dkend.len(), e.len(), dki.as_ref().map(|x| x.len()))?;
    let has_intra = i32::from(dki.is_some());
    // Absent, dki is never read: dkend stands in for its pointer.
    let dki = dki.as_ref().unwrap_or(&dkend);
    let dev = dqk.device().clone();
    let mut out = dqk.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
    let func = function(&dev, "chunk_join_keys")?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    let dk = dk as i32;
    builder.arg(&mut out).arg(dki).arg(&dkend).arg(&e).arg(&rows).arg(&dk).arg(&has_intra);
    // SAFETY: argument list matches `chunk_join_keys` in chunk_*.cu; every length checked above.
    unsafe { builder.launch(layout_config(rows)) }.w()?;
    Ok(())
}

/// The launch grid of the chunk walk: column tiles x heads, 256 threads.
fn walk_config(d: &WalkDims, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (d.dv.div_ceil(TILE) as u32, d.bh as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// `chunk_walk_fwd_f32`: U then every chunk-start state, flat (see `ops::chunk_walk`).
pub fn chunk_walk(d: &WalkDims, wkc: Input, k: Input, extra: Input) -> Result<(CudaStorage, Shape)> {
    if d.dk > MAX_DK || d.c > 64 {
        candle_core::bail!("chunk walk: key width {} or chunk {} above the kernels' 256 and 64", d.dk, d.c);
    }
    let dev = wkc.0.device().clone();
    let (wkc, k, extra) =
        (view::<f32>(wkc, "chunk walk")?, view::<f32>(k, "chunk walk")?, view::<f32>(extra, "chunk walk")?);
    let (w, kc) = (wkc.slice(..d.u_len()), wkc.slice(d.u_len()..));
    let (s0, a, e) = walk_extra(d, &extra);
    // SAFETY: the kernel writes every U element and every state (S_0 included).
    let out = unsafe { dev.alloc::<f32>(d.u_len() + d.states_len())? };
    let (u_out, states) = (out.slice(..d.u_len()), out.slice(d.u_len()..));
    // The state's and U's column tiles, and one chunk's staged keys.
    let smem = d.shared_bytes(walk_tensor(d));
    let func = function(&dev, &walk_kernel("chunk_walk_fwd", d))?;
    shared_memory(&dev, &func, smem, "chunk walk")?;
    let ints = [d.n, d.bh, d.c, d.dk, d.dv, d.delta as usize].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&w).arg(&kc).arg(&k).arg(&e).arg(&s0).arg(&a).arg(&u_out).arg(&states);
    for v in &ints {
        builder.arg(v);
    }
    // SAFETY: argument list matches `chunk_walk_fwd_f32` in chunk_*.cu; buffers sized by WalkDims.
    unsafe { builder.launch(walk_config(d, smem)) }.w()?;
    let n = d.u_len() + d.states_len();
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// Whether the walk runs on tensor cores: as [`chunk_tensor`], and a key width in whole 16-row
/// tiles.
fn walk_tensor(d: &WalkDims) -> bool {
    chunk_tensor(d.tensor) && d.dk.is_multiple_of(16)
}

/// A walk kernel's name: the float32 form, or the tensor-core form for the key width (`_k64` and
/// `_k128` hold the state product's accumulators for at most that many keys, and so fewer
/// registers than the form for 256).
fn walk_kernel(base: &str, d: &WalkDims) -> String {
    if !walk_tensor(d) {
        return chunk_kernel(base, false);
    }
    let width = match d.dk {
        0..=64 => "_k64",
        65..=128 => "_k128",
        _ => "",
    };
    format!("{}{width}", chunk_kernel(base, true))
}

/// The walk's extra input split into S₀, the per-row decays a and the per-token key scales e.
fn walk_extra<'a>(
    d: &WalkDims,
    extra: &'a CudaView<'a, f32>,
) -> (CudaView<'a, f32>, CudaView<'a, f32>, CudaView<'a, f32>) {
    let (state, rows) = (d.state_len(), d.decays_len());
    (extra.slice(..state), extra.slice(state..state + rows), extra.slice(state + rows..))
}

/// `chunk_walk_bwd_*`: dW, every chunk's end-state gradient, then ds0, flat (see
/// `ops::chunk_walk`); the `_tc` form appends its column tiles' partial sums of da and de, from
/// the walk's output `res` (U and the states).
pub fn chunk_walk_back(
    d: &WalkDims,
    grad: Input,
    wkc: Input,
    k: Input,
    extra: Input,
    res: Input,
) -> Result<(CudaStorage, Shape)> {
    let dev = grad.0.device().clone();
    let grad = view::<f32>(grad, "chunk walk backward")?;
    let (wkc, k, extra) =
        (view::<f32>(wkc, "chunk walk")?, view::<f32>(k, "chunk walk")?, view::<f32>(extra, "chunk walk")?);
    let res = view::<f32>(res, "chunk walk")?;
    let kc = wkc.slice(d.u_len()..);
    let (_, a, e) = walk_extra(d, &extra);
    let (gu, gs) = (grad.slice(..d.u_len()), grad.slice(d.u_len()..));
    let (lu, lg) = (d.u_len(), d.n * d.state_len());
    let tensor = walk_tensor(d);
    let (la, le) = match tensor {
        true => (d.dv.div_ceil(TILE) * d.n * d.bh * d.dk, d.dv.div_ceil(TILE) * d.n * d.bh * d.c),
        false => (0, 0),
    };
    let n = lu + lg + d.state_len() + la + le;
    // SAFETY: the kernel writes all of dW, every chunk's end-state gradient and ds0 (and every
    // partial sum).
    let out = unsafe { dev.alloc::<f32>(n)? };
    let (dw, gend, ds0) = (out.slice(..lu), out.slice(lu..lu + lg), out.slice(lu + lg..lu + lg + d.state_len()));
    let rest = lu + lg + d.state_len();
    let (da, de) = (out.slice(rest..rest + la), out.slice(rest + la..));
    // G's and dU's column tiles, and one chunk's staged keys.
    let smem = d.shared_bytes(walk_tensor(d));
    let func = function(&dev, &walk_kernel("chunk_walk_bwd", d))?;
    shared_memory(&dev, &func, smem, "chunk walk backward")?;
    let ints = [d.n, d.bh, d.c, d.dk, d.dv, d.delta as usize].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&kc).arg(&k).arg(&e).arg(&a).arg(&gu).arg(&gs).arg(&dw).arg(&gend).arg(&ds0);
    for v in &ints {
        builder.arg(v);
    }
    let (u, states) = (res.slice(..d.u_len()), res.slice(d.u_len()..));
    if tensor {
        builder.arg(&u).arg(&states).arg(&da).arg(&de);
    }
    // SAFETY: argument list matches `chunk_walk_bwd_*` in chunk_*.cu; buffers sized above.
    unsafe { builder.launch(walk_config(d, smem)) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// Whether a chunk kernel runs in its `_tc` form: 16-bit inputs (the dims' `tensor`) on a GPU
/// with tensor cores.
fn chunk_tensor(tensor: bool) -> bool {
    cfg!(tensor_cores) && tensor
}

/// A chunk kernel's name in the form [`chunk_tensor`] chose.
fn chunk_kernel(base: &str, tc: bool) -> String {
    format!("{base}_{}", if tc { "tc" } else { "f32" })
}

/// One block of 256 threads per chunk and head (the chunk ops' grid), with `smem` bytes of
/// shared memory; chunks above the kernels' 64 tokens are refused, naming `what`.
fn chunk_config(n: usize, bh: usize, c: usize, smem: usize, what: &str) -> Result<LaunchConfig> {
    if c > 64 {
        candle_core::bail!("{what}: chunks of {c} are above the kernel's 64");
    }
    Ok(LaunchConfig { grid_dim: ((n * bh) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: smem as u32 })
}

/// `chunk_intra_fwd_f32`: W then Kc, flat (see `ops::chunk_intra`).
pub fn chunk_intra(d: &IntraDims, k: Input, v: Input, scal: Input) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = IntraDims::shared_bytes(false, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk solve")?;
    let dev = k.0.device().clone();
    let (k, v, scal) =
        (view::<f32>(k, "chunk solve")?, view::<f32>(v, "chunk solve")?, view::<f32>(scal, "chunk solve")?);
    let (lw, lk) = (d.n * d.bh * d.c * d.dv, d.n * d.bh * d.c * d.dk);
    // SAFETY: the kernel writes every element of W and Kc.
    let out = unsafe { dev.alloc::<f32>(lw + lk)? };
    let (w, kc) = (out.slice(..lw), out.slice(lw..));
    let func = function(&dev, &chunk_kernel("chunk_intra_fwd", tc))?;
    shared_memory(&dev, &func, smem, "chunk solve")?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&k).arg(&v).arg(&scal).arg(&w).arg(&kc).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    // SAFETY: argument list matches `chunk_intra_fwd_f32` in chunk_*.cu; buffers sized by IntraDims.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(lw + lk)))
}

/// `chunk_intra_bwd_f32`: dk, dv, dβ, dγ, flat, from dW, dKc and the sign dKc comes with (see
/// `ops::chunk_intra`).
pub fn chunk_intra_back(
    d: &IntraDims,
    (gw, gkc, kc_sign): (Input, Input, f32),
    k: Input,
    v: Input,
    scal: Input,
) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = IntraDims::shared_bytes(true, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk solve backward")?;
    let dev = gw.0.device().clone();
    let (gw, gkc) = (view::<f32>(gw, "chunk solve backward")?, view::<f32>(gkc, "chunk solve backward")?);
    if gw.len() != d.v_len() || gkc.len() != d.k_len() {
        candle_core::bail!("chunk solve backward: gradients of {} and {} elements", gw.len(), gkc.len());
    }
    let (k, v, scal) =
        (view::<f32>(k, "chunk solve")?, view::<f32>(v, "chunk solve")?, view::<f32>(scal, "chunk solve")?);
    let n = d.n * d.bh * d.c * (d.dk + d.dv + 2);
    // SAFETY: the kernel writes every element of dk, dv, dβ and dγ.
    let out = unsafe { dev.alloc::<f32>(n)? };
    let func = function(&dev, &chunk_kernel("chunk_intra_bwd", tc))?;
    shared_memory(&dev, &func, smem, "chunk solve backward")?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&k).arg(&v).arg(&scal).arg(&gw).arg(&gkc).arg(&out).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&kc_sign);
    // SAFETY: argument list matches `chunk_intra_bwd_f32` in chunk_*.cu; out sized above.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n)))
}

/// `chunk_out_fwd_f32`: O [N,BH,C,dv] (see `ops::chunk_out`).
pub fn chunk_out(d: &OutDims, qk: Input, walked: Input, gamma: Input) -> Result<(CudaStorage, Shape)> {
    let tc = chunk_tensor(d.tensor);
    let smem = OutDims::shared_bytes(false, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk outputs")?;
    let dev = qk.0.device().clone();
    let what = "chunk outputs";
    let (qk, walked, gamma) = (view::<f32>(qk, what)?, view::<f32>(walked, what)?, view::<f32>(gamma, what)?);
    // SAFETY: the kernel writes every element of O.
    let out = unsafe { dev.alloc::<f32>(d.o_len())? };
    let func = function(&dev, &chunk_kernel("chunk_out_fwd", tc))?;
    shared_memory(&dev, &func, smem, "chunk outputs")?;
    let blocks = (d.n * d.bh) as i64;
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&qk).arg(&walked).arg(&gamma).arg(&out).arg(&blocks);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&d.scale);
    // SAFETY: argument list matches `chunk_out_fwd_f32` in chunk_*.cu; out sized by OutDims.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(d.o_len())))
}

/// `chunk_out_bwd_f32`: dqk, dU, the states' gradient, dγ, flat (see `ops::chunk_out`).
pub fn chunk_out_back(
    d: &OutDims,
    grad: Input,
    qk: Input,
    walked: Input,
    gamma: Input,
) -> Result<((CudaStorage, Shape), (CudaStorage, Shape))> {
    let tc = chunk_tensor(d.tensor);
    let smem = OutDims::shared_bytes(true, tc);
    let cfg = chunk_config(d.n, d.bh, d.c, smem, "chunk outputs backward")?;
    let dev = grad.0.device().clone();
    let what = "chunk outputs";
    let grad = view::<f32>(grad, "chunk outputs backward")?;
    let (qk, walked, gamma) = (view::<f32>(qk, what)?, view::<f32>(walked, what)?, view::<f32>(gamma, what)?);
    let n = d.walked_len() + d.scalars();
    // SAFETY: the kernel writes every element of dqk.
    let dqk = unsafe { dev.alloc::<f32>(d.qk_len())? };
    // Zeroed: O does not read the last state, whose gradient the kernel leaves as it is.
    let out = dev.alloc_zeros::<f32>(n)?;
    let func = function(&dev, &chunk_kernel("chunk_out_bwd", tc))?;
    shared_memory(&dev, &func, smem, "chunk outputs backward")?;
    let (blocks, walked_len) = ((d.n * d.bh) as i64, d.walked_len() as i64);
    let ints = [d.c, d.dk, d.dv].map(|v| v as i32);
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(&qk).arg(&walked).arg(&gamma).arg(&grad).arg(&dqk).arg(&out).arg(&blocks).arg(&walked_len);
    for v in &ints {
        builder.arg(v);
    }
    builder.arg(&d.scale);
    // SAFETY: argument list matches `chunk_out_bwd_f32` in chunk_*.cu; dqk and out sized above.
    unsafe { builder.launch(cfg) }.w()?;
    let dqk = CudaStorage::wrap_cuda_slice(dqk, dev.clone());
    Ok(((dqk, Shape::from(d.qk_len())), (CudaStorage::wrap_cuda_slice(out, dev), Shape::from(n))))
}
