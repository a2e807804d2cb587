//! The block of the fused (sequential) GPU recurrence (`recurrence_tiled` in
//! src/ops/cuda/recurrence.cu): its warps, and the state columns each thread holds; and the
//! length from which the fused op takes its chunked form instead, and that form's instance.
//!
//! A thread reads a step's q and k from shared memory once for all its columns, and those reads
//! bound the kernel: two columns a thread read half as much a column, at twice the registers of
//! state. Measured on an H100 (docs/BENCHMARKS.md, "The fused recurrence with two state columns
//! a thread"), two columns took a quarter off the forward at dk 256 and an eighth at dk 128 with
//! 16 sequences, and matched one column at dk 128 with 8; four columns, and blocks of 4 warps,
//! were slower or no faster at every shape timed. So blocks have 8 warps, and their threads two
//! columns where the block's columns are no more than dv (and the kernel has that form: r ≤ 8
//! threads a column, keys up to 256 wide), else one.

use candle_core::Result;
use std::cell::Cell;
use std::sync::OnceLock;

/// Passes of at least this many tokens take the fused op's chunked form where a layer asks for
/// it (`Kernel::FusedChunks`, src/ops/cuda/chunk_fused.cu); shorter ones, and decoding steps,
/// walk their tokens in turn on the sequential kernel whose block this module picks.
pub const FUSED_CHUNKS_FROM_TOKENS: usize = 64;

/// Tokens a chunk of the chunked form (`CF_C` in chunk_fused.cu).
pub const CHUNKED_TOKENS: usize = 32;
/// State columns a block of the chunked form holds (`CF_TV`).
pub const CHUNKED_COLUMNS: usize = 64;

/// The shared memory of `chunk_fused_fwd_{width}` in floats (`ChunkFused<DK, C>`).
pub fn chunked_floats(width: usize) -> usize {
    let c = CHUNKED_TOKENS;
    let (lk, ls, lc) = (width + 4, CHUNKED_COLUMNS + 8, c + 4);
    2 * c * lk + width * ls + 2 * c * ls + 3 * c * lc + 2 * c
}

/// The key width of the chunked form's instance for `t` steps of keys `dk` wide (dk padded up to
/// 32, 64, 128 or 256), if that form applies: no per-channel decay, at least
/// [`FUSED_CHUNKS_FROM_TOKENS`] steps, and the instance's shared memory within the bytes a block
/// may have on the GPU, `smem()` (else the sequential kernel, e.g. for keys 256 wide on an A100),
/// asked only once the rest holds: decoding steps pass here every token.
pub fn chunked_width(dk: usize, t: usize, per_channel: bool, smem: impl FnOnce() -> usize) -> Option<usize> {
    if per_channel || t < FUSED_CHUNKS_FROM_TOKENS {
        return None;
    }
    let width = [32, 64, 128, 256].into_iter().find(|&w| dk <= w)?;
    (4 * chunked_floats(width) <= smem()).then_some(width)
}

/// Warps a block and state columns a thread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Block {
    pub warps: usize,
    pub cols: usize,
}

thread_local! {
    static SCOPED: Cell<Option<Block>> = const { Cell::new(None) };
}

/// Run `f` with every fused GPU recurrence this thread launches in blocks of `warps` warps (8
/// or 4) whose threads hold `cols` state columns each (1 or 2), where the kernel has that form,
/// instead of the block [`chosen`] picks: for checking each form.
pub fn with_fused_block<R>((warps, cols): (usize, usize), f: impl FnOnce() -> R) -> R {
    let before = SCOPED.with(|c| c.replace(Some(Block { warps, cols })));
    let out = f();
    SCOPED.with(|c| c.set(before));
    out
}

/// The block for `dv` value columns and `r` threads a column: [`with_fused_block`]'s on this
/// thread, else `STATECUT_RECURRENCE_BLOCK` = "W,C" (for timing the forms), else [`pick`]'s.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn chosen(dv: usize, r: usize) -> Result<Block> {
    let Some(b) = SCOPED.with(|c| c.get()).or_else(from_env) else {
        return Ok(pick(dv, r));
    };
    if !matches!(b.warps, 8 | 4) || !matches!(b.cols, 1 | 2) {
        candle_core::bail!("recurrence: no block of {} warps with {} columns a thread", b.warps, b.cols);
    }
    Ok(Block { cols: if r <= 8 { b.cols } else { 1 }, ..b })
}

/// The block the launcher picks (see the module's comment).
fn pick(dv: usize, r: usize) -> Block {
    let fills = 8 * (32 / r) * 2 <= dv.next_multiple_of(32 / r);
    Block { warps: 8, cols: if r <= 8 && fills { 2 } else { 1 } }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn from_env() -> Option<Block> {
    static BLOCK: OnceLock<Option<Block>> = OnceLock::new();
    *BLOCK.get_or_init(|| {
        let v = std::env::var("STATECUT_RECURRENCE_BLOCK").ok()?;
        let (w, c) = v.split_once(',')?;
        Some(Block { warps: w.trim().parse().ok()?, cols: c.trim().parse().ok()? })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instances of keys up to 128 wide are launched two a multiprocessor
    /// (`__launch_bounds__(256, 2)`): two blocks' shared memory, each with the 1 KiB the driver
    /// reserves, fit an H100's 228 KiB; keys 256 wide fit one.
    #[test]
    fn narrow_chunked_instances_fit_two_a_multiprocessor() {
        for w in [32, 64, 128] {
            assert!(2 * (4 * chunked_floats(w) + 1024) <= 228 * 1024, "width {w}");
        }
        assert!(4 * chunked_floats(256) <= 227 * 1024);
    }

    /// The narrowest instance that holds the keys; one that needs more shared memory than a block
    /// may have leaves the pass to the sequential kernel, as do per-channel decays and short passes.
    #[test]
    fn chunked_instances_by_key_width_and_shared_memory() {
        let (h100, a100, small) = (|| 227 * 1024, || 163 * 1024, || 99 * 1024);
        assert_eq!(chunked_width(256, 2048, false, h100), Some(256));
        assert_eq!(chunked_width(256, 2048, false, a100), None);
        assert_eq!(chunked_width(96, 2048, false, a100), Some(128));
        assert_eq!(chunked_width(128, 2048, false, small), None);
        assert_eq!(chunked_width(48, 2048, false, small), Some(64));
        assert_eq!(chunked_width(30, 2048, false, small), Some(32));
        assert_eq!(chunked_width(512, 2048, false, h100), None, "keys wider than 256");
        assert_eq!(chunked_width(128, 2048, true, h100), None, "per-channel decay");
        assert_eq!(chunked_width(128, FUSED_CHUNKS_FROM_TOKENS - 1, false, h100), None, "a short pass");
    }

    #[test]
    fn two_columns_a_thread_where_the_block_fills_dv() {
        let pick = |dk: usize, dv| pick(dv, dk.div_ceil(32).next_power_of_two());
        let two = Block { warps: 8, cols: 2 };
        let one = Block { warps: 8, cols: 1 };
        // DeltaNet's 128 x 128 heads: 8 warps of 8 columns (four threads each), two a thread.
        assert_eq!(pick(128, 128), two);
        // Gated DeltaNet's 256 x 256, and pruned to 128 x 256.
        assert_eq!(pick(256, 256), two);
        assert_eq!(pick(128, 256), two);
        // Pruned DeltaNet (dk 64, two threads a column): two columns would leave half the
        // block's 256 without a column.
        assert_eq!(pick(64, 128), one);
        // dv 80 at dk 128: the block's 128 columns are past 80.
        assert_eq!(pick(128, 80), one);
        // Keys wider than 256 have the one form.
        assert_eq!(pick(512, 1024), one);
    }

    #[test]
    fn a_scoped_block_overrides_the_pick_and_unknown_ones_are_refused() {
        assert_eq!(with_fused_block((4, 2), || chosen(128, 4)).unwrap(), Block { warps: 4, cols: 2 });
        // Keys wider than 256 have no two-column form: the scoped block keeps its warps.
        assert_eq!(with_fused_block((4, 2), || chosen(128, 16)).unwrap(), Block { warps: 4, cols: 1 });
        assert!(with_fused_block((8, 4), || chosen(128, 4)).is_err());
        assert!(with_fused_block((16, 1), || chosen(128, 4)).is_err());
        // The scope ends with `f`.
        assert_eq!(chosen(128, 128usize.div_ceil(32)).unwrap().warps, 8);
    }
}
