//! Feed-forward blocks: SwiGLU (with Falcon-H1's muP multipliers) and Nemotron-H's squared ReLU.

use crate::ops::mlp::SwiGlu;
use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::{linear_b, Linear, VarBuilder};

pub enum Mlp {
    /// down(silu(gate(x)) · up(x))
    SwiGlu(SwiGlu),
    /// down(up(x) · silu(gate(x) · gate_scale)) · down_scale (Falcon-H1 `mlp_multipliers`)
    ScaledSwiGlu { gate: Linear, up: Linear, down: Linear, gate_scale: f64, down_scale: f64 },
    /// down(relu(up(x))²)
    Relu2 { up: Linear, down: Linear },
}

impl Mlp {
    /// SwiGLU whose gate and up rows are stacked in one tensor [2I, H] (gate first), as
    /// Granite's `input_linear` and the fused expert tensors store them; views, no copy.
    pub fn swiglu_stacked(gate_up: &Tensor, down: Tensor) -> Result<Self> {
        let i = gate_up.dim(0)? / 2;
        let lin = |t: Tensor| Linear::new(t, None);
        Ok(Mlp::SwiGlu(SwiGlu::new(lin(gate_up.narrow(0, 0, i)?), lin(gate_up.narrow(0, i, i)?), lin(down))))
    }

    /// `up_proj` / `down_proj` under `vb` with a squared ReLU between them.
    pub fn relu2(vb: VarBuilder, hidden: usize, intermediate: usize, bias: bool) -> Result<Self> {
        Ok(Mlp::Relu2 {
            up: linear_b(hidden, intermediate, bias, vb.pp("up_proj"))?,
            down: linear_b(intermediate, hidden, bias, vb.pp("down_proj"))?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Mlp::SwiGlu(m) => m.forward(x)?,
            Mlp::ScaledSwiGlu { gate, up, down, gate_scale, down_scale } => {
                let g = candle_nn::ops::silu(&(gate.forward(x)? * *gate_scale)?)?;
                (down.forward(&(up.forward(x)? * g)?)? * *down_scale)?
            }
            Mlp::Relu2 { up, down } => down.forward(&up.forward(x)?.relu()?.sqr()?)?,
        })
    }
}
