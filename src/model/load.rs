//! How a model is loaded.

use candle_core::{DType, Device};

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub dtype: DType,
    pub device: Device,
    /// Load the key/query projection weights as variables so the LM loss can be differentiated.
    pub grad: bool,
}

impl LoadOptions {
    pub fn cpu_f32() -> Self {
        Self { dtype: DType::F32, device: Device::Cpu, grad: false }
    }
}
