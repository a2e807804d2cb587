//! What a recurrence is given: its inputs and update rule. Its own module so that the forms that
//! compute it (`delta_rule`: the sequential and fused kernels and the dispatch; `chunked`: the
//! chunked form) read one description without importing each other.

use candle_core::Tensor;

/// Which update rule the recurrence uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// u = β (v − Sᵀk): DeltaNet, Gated DeltaNet.
    Delta,
    /// u = β v: linear attention / SSM (Mamba-2).
    Plain,
}

/// Inputs of the recurrence, all with the value-head count H (repeat key heads first for GVA).
pub struct Recurrence<'a> {
    /// [B, T, H, dk]
    pub q: &'a Tensor,
    /// [B, T, H, dk]
    pub k: &'a Tensor,
    /// [B, T, H, dv]
    pub v: &'a Tensor,
    /// [B, T, H] write strength
    pub beta: &'a Tensor,
    /// [B, T, H] log decay; `None` means no decay
    pub g: Option<&'a Tensor>,
    /// [B, T, H, dk] per-key-channel log decay (GLA): row i of S is scaled by exp(gk[i]);
    /// `None` means none
    pub gk: Option<&'a Tensor>,
    pub scale: f64,
    pub rule: Rule,
    /// State to continue from [B, H, dk, dv] (decoding); zeros when `None`.
    pub initial: Option<&'a Tensor>,
}
