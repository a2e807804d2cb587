//! The rows a layer reports for its recurrent state's key/query channels: where each channel set
//! lives in the stored tensors. Families gather them into a state layout (`crate::arch`); layers
//! only report them.

use serde::Serialize;

/// Where the rows of one key/query channel set live in one stored tensor (sliced along dim 0).
///
/// Channel `j` of head `h` is row `offset + h * head_stride + j`.
#[derive(Debug, Clone, Serialize)]
pub struct RowSlice {
    pub tensor: String,
    pub offset: usize,
    pub head_stride: usize,
    pub role: SliceRole,
}

/// What a sliced tensor is, so selectors know which rows carry projection weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SliceRole {
    /// rows of the query projection (W_Q, Mamba-2 C)
    QueryProj,
    /// rows of the key projection (W_K, Mamba-2 B)
    KeyProj,
    /// conv weight or bias channels
    Conv,
    /// other tensors with one row per key channel (SSE: the low-rank corrections' second
    /// factors, the per-channel decay projections and their biases)
    Channel,
}
