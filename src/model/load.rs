//! How a model is loaded, and the projection loader that registers gradient variables.

use anyhow::Result;
use candle_core::{DType, Device, Var};
use candle_nn::{Linear, VarBuilder};

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

/// A linear layer `name` under `vb`. With `grad` its weight is a variable, registered in `vars`
/// under its checkpoint name, so that the LM loss can be differentiated with respect to it.
pub(crate) fn projection(
    vb: &VarBuilder,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
    grad: bool,
    vars: &mut Vec<(String, Var)>,
) -> Result<Linear> {
    if !grad {
        return Ok(candle_nn::linear_b(inp, out, bias, vb.pp(name))?);
    }
    let vb = vb.pp(name);
    let var = Var::from_tensor(&vb.get((out, inp), "weight")?)?;
    let b = if bias { Some(vb.get(out, "bias")?) } else { None };
    vars.push((format!("{}.weight", vb.prefix()), var.clone()));
    Ok(Linear::new(var.as_tensor().clone(), b))
}
