//! Math shared by every architecture adapter: written once, reused.

pub mod chunked;
pub mod conv;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decode;
pub mod delta_rule;
pub mod mlp;
pub mod norm;

use candle_core::{Layout, Result, Tensor};

/// softplus(x) = max(x, 0) + log(1 + exp(-|x|)), stable for large |x|.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// Repeat heads `r` times consecutively along dim 2: head j of the result is head j / r.
pub fn repeat_heads(x: &Tensor, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    let (b, t, h, d) = x.dims4()?;
    x.unsqueeze(3)?.broadcast_as((b, t, h, r, d))?.reshape((b, t, h * r, d))
}

/// Whether one of this module's fused custom ops may stand in for separate candle ops on
/// `inputs` (the first decides the device): never on the CPU, where the separate ops are the
/// path and the fused ops' reference, nor when a gradient must flow through any input, as the
/// fused ops have no backward.
pub(crate) fn fusable(inputs: &[&Tensor]) -> bool {
    inputs.first().is_some_and(|x| !x.device().is_cpu()) && !inputs.iter().any(|t| t.track_op())
}

/// The storage range of a contiguous layout, for the custom ops' CPU and CUDA halves; an error
/// naming `what` otherwise.
pub(crate) fn contiguous(layout: &Layout, what: &str) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what}: input must be contiguous")))
}
