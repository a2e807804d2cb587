//! RMS and L2 normalisation, computed in float32 whatever the weight dtype.

use candle_core::{DType, Result, Tensor, D};

/// How a norm applies its weight: fla/mamba use `x̂·w`, Qwen3.5 decoder norms `x̂·(1+w)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    Plain,
    OnePlus,
}

/// RMSNorm over the last dimension.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64, kind: NormWeight) -> Result<Self> {
        let weight = weight.to_dtype(DType::F32)?;
        let weight = match kind {
            NormWeight::Plain => weight,
            NormWeight::OnePlus => (weight + 1.0)?,
        };
        Ok(Self { weight, eps })
    }

    pub fn load(vb: candle_nn::VarBuilder, size: usize, eps: f64, kind: NormWeight) -> Result<Self> {
        Self::new(vb.get(size, "weight")?, eps, kind)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let y = x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.broadcast_mul(&self.weight)?;
        y.to_dtype(dtype)
    }

    /// Gated form used by fla `FusedRMSNormGated` and Qwen3.5: norm(x)·w·silu(gate).
    pub fn forward_gated(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?;
        (self.forward(&x.to_dtype(DType::F32)?)? * g)?.to_dtype(x.dtype())
    }
}

/// x / sqrt(Σx² + eps) over the last dimension (fla's l2norm puts eps inside the sqrt).
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let n = (x.sqr()?.sum_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&n)?.to_dtype(dtype)
}
