//! SwiGLU MLP: down(silu(gate(x)) * up(x)) (fla `GatedMLP`, Qwen3.5 `Qwen3_5MLP`).

use candle_core::{Result, Tensor};
use candle_nn::{linear_no_bias, Linear, Module, VarBuilder};

#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl SwiGlu {
    pub fn new(gate: Linear, up: Linear, down: Linear) -> Self {
        Self { gate, up, down }
    }

    pub fn load(vb: VarBuilder, hidden: usize, intermediate: usize) -> Result<Self> {
        Ok(Self {
            gate: linear_no_bias(hidden, intermediate, vb.pp("gate_proj"))?,
            up: linear_no_bias(hidden, intermediate, vb.pp("up_proj"))?,
            down: linear_no_bias(intermediate, hidden, vb.pp("down_proj"))?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (candle_nn::ops::silu(&self.gate.forward(x)?)? * self.up.forward(x)?)?;
        self.down.forward(&h)
    }
}
