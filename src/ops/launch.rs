//! The sizes an op and its CUDA kernel agree on: each op's module computes with them, and
//! `cuda` launches its kernels from them, so neither imports the other.

/// Sizes of one step: `b` sequences, `heads` key heads of width `dk`, `v_heads` value heads of
/// width `dv`, a short conv of `kernel` taps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDims {
    pub b: usize,
    pub heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub kernel: usize,
}

/// Head counts and widths of [`QkvPrep`]'s input [.., 2·heads·dk + v_heads·dv] = [q | k | v].
#[derive(Debug, Clone, Copy)]
pub struct QkvPrep {
    pub heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// inside the square root: x / sqrt(Σx² + eps), as fla's `l2norm`
    pub eps: f32,
}

/// Heads read from columns of a layer's stacked rows (see `ops::prep::Heads`): `heads` heads of
/// width `d` from column `off`, each written `rep` times, L2-normed into float32 when `norm`
/// holds an eps (x / sqrt(Σx² + eps)), else copied in the input's dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heads {
    pub off: usize,
    pub heads: usize,
    pub d: usize,
    pub rep: usize,
    pub norm: Option<f32>,
}

/// Where [`Heads`] write their output (and read its gradient): rows of heads [rows, heads·rep, d]
/// by default; with `Some`, the chunked recurrence's layout [N, B·heads·rep, c, w] at column
/// `col`, rows b·t + i being position i % c of chunk i / c (see `heads_at` in cuda/prep.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadsDst {
    /// Steps per sequence.
    pub t: usize,
    /// Steps per chunk.
    pub c: usize,
    /// Columns per chunk row.
    pub w: usize,
    pub col: usize,
}

impl HeadsDst {
    /// Element where row `row` (of `rows`) has head copy `hr` (of `hr_n`), each `d` wide, under
    /// `dst` (rows of heads without one).
    pub(crate) fn at(dst: Option<&HeadsDst>, row: usize, hr: usize, hr_n: usize, d: usize, rows: usize) -> usize {
        match dst {
            None => (row * hr_n + hr) * d,
            Some(o) => {
                let (b, t, nb) = (row / o.t, row % o.t, rows / o.t);
                (((t / o.c) * nb + b) * hr_n + hr) * o.c * o.w + (t % o.c) * o.w + o.col
            }
        }
    }

    /// The kernels' arguments: (c, t, w, col), all zero for rows of heads.
    #[cfg(feature = "cuda")]
    pub(crate) fn args(dst: Option<&HeadsDst>) -> (i32, i64, i32, i32) {
        dst.map_or((0, 0, 0, 0), |o| (o.c as i32, o.t as i64, o.w as i32, o.col as i32))
    }
}

/// State columns per GPU block (see `chunk_walk_*` in cuda/chunk_walk.cu).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const TILE: usize = 32;
/// The widest key the GPU kernels take: a block holds its tile of the state and of G in shared
/// memory.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const MAX_DK: usize = 256;

/// Columns per row of the distillation loss op's output (ce, kl, then the log-sum-exps of the
/// student at 1 and at T and of the teacher at T; see `ops::distill` and `kd_rows` in
/// cuda/distill.cu).
pub(crate) const KD_STATS: usize = 5;

/// Sizes of one walk: N chunks of C steps for BH heads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalkDims {
    pub n: usize,
    pub bh: usize,
    pub c: usize,
    pub dk: usize,
    pub dv: usize,
    /// Whether a Kc term is subtracted (the delta rule); the plain rule has none.
    pub delta: bool,
    /// Whether the GPU may run the products on tensor cores (TF32 operands, float32 sums): the
    /// recurrence's inputs were bf16 or f16, so their rounding already exceeds TF32's.
    pub tensor: bool,
}

/// Row stride of the tensor-core walk's state tiles (`TC_SW` in chunk_*.cu).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TC_STATE_STRIDE: usize = 40;

/// A [64, `TC_TB`] tile of the tensor-core kernels, for tiles a loop reads only by rows as B.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const TC_B_TILE: usize = 64 * 40;

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl WalkDims {
    /// A walk kernel's shared memory in bytes, in its tensor-core form (`tc`) or its float32 one:
    /// the state's (G's) and U's (dU's) column tiles, then one chunk's staged keys (from a 16-byte
    /// boundary; on tensor cores 64 rows of Kc and of K, each at its own padded stride, dk + 4 and
    /// dk + 8, then their 64 scales; the backward's [64, 4] row sums sit in dU's padding).
    pub fn shared_bytes(&self, tc: bool) -> usize {
        if tc {
            return ((self.dk + 64) * TC_STATE_STRIDE + 64 * (2 * self.dk + 12) + 64) * 4;
        }
        (((self.dk + self.c) * (TILE + 1)).next_multiple_of(4) + self.c * self.kk_width()) * 4
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl IntraDims {
    /// The intra-chunk solve's shared memory in bytes: its [c, c] matrices at row stride 65 (two
    /// forward, four backward), one or two column tiles, and its per-token scalars (three, five).
    /// On tensor cores the strides are 68 and 36 or 40 (`TC_TB`, for tiles read by rows as B),
    /// with two tiles each way and three backward matrices, the backward's third in room for two
    /// more tiles.
    pub fn shared_bytes(backward: bool, tc: bool) -> usize {
        let (sq, tile) = if tc { (64 * 68, 64 * 36) } else { (64 * 65, 64 * 33) };
        match (backward, tc) {
            (true, true) => 4 * (2 * sq + (tile + TC_B_TILE).max(sq) + tile + TC_B_TILE + 5 * 64),
            (true, false) => 4 * (4 * sq + 2 * tile + 5 * 64),
            (false, true) => 4 * (2 * sq + 2 * TC_B_TILE + 3 * 64),
            (false, false) => 4 * (2 * sq + tile + 3 * 64),
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl OutDims {
    /// The chunk outputs' shared memory in bytes: P (and the backward's E ∘ D) at row stride 65,
    /// two column tiles, and one (three) per-token scalars. On tensor cores the strides are 68 and
    /// 36 or 40 (`TC_TB`), with a second forward scalar and a second pair of tiles: the forward's B
    /// tiles and all the backward's at 40.
    pub fn shared_bytes(backward: bool, tc: bool) -> usize {
        let (sq, tile) = if tc { (64 * 68, 64 * 36) } else { (64 * 65, 64 * 33) };
        4 * match (backward, tc) {
            (true, true) => 2 * sq + 4 * TC_B_TILE + 3 * 64,
            (false, true) => sq + 2 * tile + 2 * TC_B_TILE + 2 * 64,
            (true, false) => 2 * sq + 2 * tile + 3 * 64,
            (false, false) => sq + 2 * tile + 64,
        }
    }
}

/// Whether the chunk kernels for keys `dk` wide (chunks of 64) fit blocks of `limit` bytes of
/// shared memory, in every form the build has (`tc`: the tensor-core forms too): the delta rule's
/// walk, whose staged keys are twice the plain rule's, the solve and the outputs. Keys 256 wide
/// need 186 KB in the walk's tensor-core form, past an A100's 163 KiB; up to 128 wide they fit
/// the 99 KiB of most other GPUs.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn chunk_kernels_fit(dk: usize, tc: bool, limit: usize) -> bool {
    let walk = WalkDims { n: 1, bh: 1, c: 64, dk, dv: TILE, delta: true, tensor: tc };
    // The backward's blocks hold more than the forward's; the walk's tensor-core form needs keys
    // in whole 16-row tiles, else it runs in float32.
    let need = |form: bool| {
        let walked = walk.shared_bytes(form && dk.is_multiple_of(16));
        walked.max(IntraDims::shared_bytes(true, form)).max(OutDims::shared_bytes(true, form))
    };
    dk <= MAX_DK && need(false) <= limit && (!tc || need(true) <= limit)
}

/// Sizes of one intra-chunk solve: N chunks of C tokens for BH heads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IntraDims {
    pub n: usize,
    pub bh: usize,
    pub c: usize,
    pub dk: usize,
    pub dv: usize,
    /// Whether the GPU may run the products on tensor cores (TF32 operands, float32 sums): the
    /// recurrence's inputs were bf16 or f16, so their rounding already exceeds TF32's.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub tensor: bool,
}

/// Sizes of one chunk-outputs op: N chunks of C tokens for BH heads, and the query scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutDims {
    pub n: usize,
    pub bh: usize,
    pub c: usize,
    pub dk: usize,
    pub dv: usize,
    pub scale: f32,
    /// Whether the GPU may run the products on tensor cores (TF32 operands, float32 sums): the
    /// recurrence's inputs were bf16 or f16, so their rounding already exceeds TF32's.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub tensor: bool,
}

/// Where a model-layout tensor [B,T,H,d] sits in a chunk-layout one [N,B·H,C,width] (N = ⌈T/C⌉,
/// T zero-padded): at columns off..off+d.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ChunkLayout {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub c: usize,
    pub d: usize,
    pub width: usize,
    pub off: usize,
}

impl ChunkLayout {
    pub fn n(&self) -> usize {
        self.t.div_ceil(self.c)
    }
    /// Elements of the chunk-layout tensor.
    pub fn chunk_len(&self) -> usize {
        self.n() * self.b * self.h * self.c * self.width
    }
    /// Elements of the model-layout tensor.
    pub fn model_len(&self) -> usize {
        self.b * self.t * self.h * self.d
    }
}

/// The key width of the chunked recurrence's join of the keys' gradient (`ops::chunk_recurrence`)
/// from its operands' lengths: dqk [rows, 2dk], dkend and the solve's dK [rows, dk], one scale a
/// row. The op's CPU half and its CUDA launcher both check their operands here.
pub(crate) fn join_width(dqk: usize, dkend: usize, scales: usize, solve: Option<usize>) -> candle_core::Result<usize> {
    let dk = dkend / scales.max(1);
    if scales == 0 || dkend != scales * dk || dqk != 2 * dkend || solve.is_some_and(|s| s != dkend) {
        candle_core::bail!(
            "chunk keys' gradient: {dqk} elements of dqk, {dkend} of dkend, {scales} scales, {solve:?} of dK"
        );
    }
    Ok(dk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blocks' shared memory a GPU allows (opt-in): H100/H200, A100, most others.
    const H100: usize = 227 * 1024;
    const A100: usize = 163 * 1024;
    const SMALL: usize = 99 * 1024;

    #[test]
    fn chunk_kernels_fit_the_gpus_they_can() {
        for tc in [true, false] {
            assert!(chunk_kernels_fit(256, tc, H100), "keys 256 wide on an H100 (tensor cores: {tc})");
            assert!(!chunk_kernels_fit(256, tc, A100), "keys 256 wide need more than an A100 gives");
            assert!(chunk_kernels_fit(128, tc, A100) && chunk_kernels_fit(128, tc, SMALL));
            assert!(chunk_kernels_fit(48, tc, SMALL));
            assert!(!chunk_kernels_fit(64, tc, 64 * 1024), "the solve's backward needs more than 64 KiB");
            assert!(!chunk_kernels_fit(MAX_DK + 16, tc, usize::MAX));
        }
        // The largest block, the walk's tensor-core form at 256 keys: 186 KB.
        let walk = WalkDims { n: 1, bh: 1, c: 64, dk: 256, dv: TILE, delta: true, tensor: true };
        assert_eq!(walk.shared_bytes(true), 185_600);
    }
}
