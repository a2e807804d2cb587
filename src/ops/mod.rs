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

/// `lin` on x [.., in]. Off the CPU the leading dimensions are folded into one, so a batch
/// of single tokens is one matrix product that reads the weight once, not one product per
/// sequence; the CPU keeps candle's own path, the reference.
pub fn linear(lin: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    use candle_nn::Module;
    let dims = x.dims();
    if x.device().is_cpu() || dims.len() < 3 {
        return lin.forward(x);
    }
    let (lead, last) = dims.split_at(dims.len() - 1);
    let y = lin.forward(&x.reshape((lead.iter().product::<usize>(), last[0]))?)?;
    let mut out = lead.to_vec();
    out.push(y.dim(1)?);
    y.reshape(out)
}

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
