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
    /// The applied weight (w or 1 + w) in float32.
    weight: Tensor,
    /// The stored weight when it is the applied one and in a half-precision dtype: a
    /// half-precision input then normalises in one fused kernel with the same result.
    native: Option<Tensor>,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64, kind: NormWeight) -> Result<Self> {
        let native = (kind == NormWeight::Plain && weight.dtype() != DType::F32).then(|| weight.clone());
        let weight = weight.to_dtype(DType::F32)?;
        let weight = match kind {
            NormWeight::Plain => weight,
            NormWeight::OnePlus => (weight + 1.0)?,
        };
        Ok(Self { weight, native, eps })
    }

    pub fn load(vb: candle_nn::VarBuilder, size: usize, eps: f64, kind: NormWeight) -> Result<Self> {
        Self::new(vb.get(size, "weight")?, eps, kind)
    }

    /// x̂·w computed in float32, returned in x's dtype. Off the CPU, when no gradient flows
    /// through it, this is candle's fused kernel (float32 inside), on x directly when the weight
    /// is exact in x's dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle's fused kernel has no backward: the Grad selector's pass takes the ops.
        if x.device().is_cpu() || x.track_op() {
            return self.forward_ops(x);
        }
        let eps = self.eps as f32;
        match &self.native {
            Some(w) if w.dtype() == x.dtype() => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps),
            _ => {
                candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &self.weight, eps)?.to_dtype(x.dtype())
            }
        }
    }

    /// [`Self::forward`] in separate float32 ops (the CPU path, and the reference in tests).
    fn forward_ops(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let y = x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.broadcast_mul(&self.weight)?;
        y.to_dtype(dtype)
    }

    /// Gated form used by fla `FusedRMSNormGated` and Qwen3.5: norm(x)·w·silu(gate), in float32.
    pub fn forward_gated(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?;
        (self.forward(&x.to_dtype(DType::F32)?)? * g)?.to_dtype(x.dtype())
    }
}

/// x / sqrt(Σx² + eps) over the last dimension (fla's l2norm puts eps inside the sqrt),
/// computed in float32 and returned in x's dtype; fused off the CPU unless a gradient flows.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    if x.device().is_cpu() || x.track_op() {
        l2_norm_ops(x, eps)
    } else {
        l2_norm_fused(x, eps)
    }
}

fn l2_norm_ops(x: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let n = (x.sqr()?.sum_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&n)?.to_dtype(dtype)
}

/// The same through candle's fused RMSNorm: with n = width, x·rsqrt(Σx²/n + eps/n)·(1/√n)
/// = x / sqrt(Σx² + eps).
fn l2_norm_fused(x: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let n = x.dim(D::Minus1)?;
    let alpha = Tensor::full((n as f32).sqrt().recip(), n, x.device())?;
    candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &alpha, (eps / n as f64) as f32)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// The fused forms used on GPUs agree with the separate-op forms (candle's fused kernels run
    /// on the CPU too, so this checks the algebra anywhere; tests/gpu_parity.rs checks the GPU).
    #[test]
    fn fused_norms_match_separate_ops() {
        let x = Tensor::randn(0f32, 1.0, (3, 5, 64), &Device::Cpu).unwrap();
        let l2 = l2_norm_fused(&x, 1e-6).unwrap();
        assert!(max_rel(&l2, &l2_norm_ops(&x, 1e-6).unwrap()) < 1e-6);
        let w = Tensor::randn(1f32, 0.1, 64, &Device::Cpu).unwrap();
        let norm = RmsNorm::new(w.clone(), 1e-5, NormWeight::Plain).unwrap();
        let fused = candle_nn::ops::rms_norm(&x, &norm.weight, 1e-5).unwrap();
        assert!(max_rel(&fused, &norm.forward_ops(&x).unwrap()) < 1e-6);
        // A bf16 weight keeps its native copy; a 1 + w weight does not (1 + w rounds in bf16).
        let half = w.to_dtype(DType::BF16).unwrap();
        assert!(RmsNorm::new(half.clone(), 1e-5, NormWeight::Plain).unwrap().native.is_some());
        assert!(RmsNorm::new(half, 1e-5, NormWeight::OnePlus).unwrap().native.is_none());
    }
}
