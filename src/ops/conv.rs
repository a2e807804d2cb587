//! Depthwise causal short convolution (fla `ShortConvolution`, Mamba-2 and Qwen3.5 `conv1d`).

use candle_core::{Result, Tensor};

/// A depthwise causal conv over [B, T, C] with weight [C, 1, K] and an optional bias [C]:
/// y_t[c] = Σ_i w[c, i] · x_{t-K+1+i}[c] (+ b[c]), zero history.
#[derive(Debug, Clone)]
pub struct ShortConv {
    /// [C, K]
    weight: Tensor,
    bias: Option<Tensor>,
}

impl ShortConv {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (c, _, k) = weight.dims3()?;
        Ok(Self { weight: weight.reshape((c, k))?, bias })
    }

    pub fn load(vb: candle_nn::VarBuilder, channels: usize, kernel: usize, bias: bool) -> Result<Self> {
        let weight = vb.get((channels, 1, kernel), "weight")?;
        let bias = if bias { Some(vb.get(channels, "bias")?) } else { None };
        Self::new(weight, bias)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_cached(x, None)?.0)
    }

    /// Forward continuing from `prev`, the last K-1 inputs [B, K-1, C] of earlier calls (zeros
    /// when `None`); returns the output and the new last K-1 inputs, for step-by-step decoding.
    pub fn forward_cached(&self, x: &Tensor, prev: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (_, t, _) = x.dims3()?;
        let k = self.weight.dim(1)?;
        let padded = match prev {
            Some(p) => Tensor::cat(&[p, x], 1)?,
            None => x.pad_with_zeros(1, k - 1, 0)?,
        };
        let mut y: Option<Tensor> = None;
        for i in 0..k {
            let w = self.weight.narrow(1, i, 1)?.squeeze(1)?;
            let term = padded.narrow(1, i, t)?.broadcast_mul(&w)?;
            y = Some(match y {
                None => term,
                Some(acc) => (acc + term)?,
            });
        }
        let y = y.expect("kernel size is at least 1");
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let state = padded.narrow(1, padded.dim(1)? - (k - 1), k - 1)?;
        Ok((y, state))
    }
}
