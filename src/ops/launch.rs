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
#[cfg(feature = "cuda")]
pub(crate) const TILE: usize = 32;
/// The widest key the GPU kernels take: a block holds its tile of the state and of G in shared
/// memory.
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
