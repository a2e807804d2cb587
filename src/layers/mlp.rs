//! Feed-forward blocks: SwiGLU (with Falcon-H1's muP multipliers) and Nemotron-H's squared ReLU.

use super::linear::Linear;
use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

/// down(silu(gate(x)) · up(x)) (fla `GatedMLP`, Qwen3.5 `Qwen3_5MLP`).
#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Off the CPU, gate and up stacked in one matrix (`gate` and `up` are views of its halves,
    /// so it costs no memory): one matmul and one `ops::mlp::Swiglu` kernel instead of two and
    /// three.
    stacked: Option<Linear>,
}

impl SwiGlu {
    /// The projections (off the CPU, gate and up are views of the stacked one).
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.gate, &self.up, &self.down]
    }

    pub fn new(gate: Linear, up: Linear, down: Linear) -> Self {
        Self { gate, up, down, stacked: None }
    }

    /// `gate_proj`, `up_proj`, `down_proj` under `vb`, without biases.
    pub fn load(vb: VarBuilder, hidden: usize, intermediate: usize) -> Result<Self> {
        let lin = |name: &str, inp: usize, out: usize| Linear::load(vb.pp(name), inp, out, false);
        let gate = lin("gate_proj", hidden, intermediate)?;
        let up = lin("up_proj", hidden, intermediate)?;
        let down = lin("down_proj", intermediate, hidden)?;
        if vb.device().is_cpu() {
            return Ok(Self::new(gate, up, down));
        }
        let stacked = Linear::new(Tensor::cat(&[gate.weight(), up.weight()], 0)?, None);
        Self::stacked(stacked, down)
    }

    /// Gate and up as the two halves [2I, H] (gate first) of one projection: row views of it.
    pub fn stacked(gate_up: Linear, down: Linear) -> Result<Self> {
        let i = gate_up.weight().dim(0)? / 2;
        let (gate, up) = (gate_up.rows(0, i)?, gate_up.rows(i, i)?);
        Ok(Self { gate, up, down, stacked: Some(gate_up) })
    }

    /// The stacked gate|up and down weights where x [.., hidden] may take the frozen MLP's op
    /// (`ops::mlp::frozen_swiglu_mlp`): off the CPU, with no adapter, bias or gradient on any
    /// weight, contiguous rows.
    pub fn frozen(&self, x: &Tensor) -> Option<(&Tensor, &Tensor)> {
        let s = self.stacked.as_ref()?;
        let plain = [&self.gate, &self.up].iter().all(|l| l.adapter().is_none());
        let frozen = plain
            && !x.device().is_cpu()
            && [s, &self.down].iter().all(|l| l.bias().is_none() && l.is_plain())
            && crate::ops::untracked(&[s.weight(), self.down.weight()])
            && [s.weight(), self.down.weight()].iter().all(|w| w.is_contiguous());
        frozen.then(|| (s.weight(), self.down.weight()))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // The fused kernel reads the stacked base weight only: not with an adapter on it.
        let fused = self
            .stacked
            .as_ref()
            .filter(|s| s.adapter().is_none() && crate::ops::fusable(&[x, s.weight(), self.down.weight()]));
        if let Some(s) = fused {
            return Ok(crate::ops::linear(&self.down, &crate::ops::mlp::swiglu(&crate::ops::linear(s, x)?)?)?);
        }
        // With gradients on a GPU (frozen stacked weights, a tracked input): one product and the
        // activation's own backward, not two products and candle's ops; with the down
        // projection frozen too, the whole MLP is one op (see `ops::mlp::frozen_swiglu_mlp`).
        if let Some((gate_up, down)) = self.frozen(x) {
            return Ok(crate::ops::mlp::frozen_swiglu_mlp(x, gate_up, down)?);
        }
        let plain = [&self.gate, &self.up].iter().all(|l| l.adapter().is_none());
        if let Some(s) = self.stacked.as_ref().filter(|s| plain && s.adapter().is_none() && !x.device().is_cpu()) {
            return Ok(crate::ops::linear(&self.down, &crate::ops::mlp::swiglu_grad(&crate::ops::linear(s, x)?)?)?);
        }
        let h = (candle_nn::ops::silu(&self.gate.forward(x)?)? * self.up.forward(x)?)?;
        Ok(self.down.forward(&h)?)
    }
}

pub enum Mlp {
    /// down(silu(gate(x)) · up(x))
    SwiGlu(SwiGlu),
    /// down(up(x) · silu(gate(x) · gate_scale)) · down_scale (Falcon-H1 `mlp_multipliers`)
    ScaledSwiGlu { gate: Linear, up: Linear, down: Linear, gate_scale: f64, down_scale: f64 },
    /// down(relu(up(x))²)
    Relu2 { up: Linear, down: Linear },
}

impl Mlp {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Mlp::SwiGlu(m) => m.linears(),
            Mlp::ScaledSwiGlu { gate, up, down, .. } => vec![gate, up, down],
            Mlp::Relu2 { up, down } => vec![up, down],
        }
    }

    /// SwiGLU whose gate and up rows are stacked in one tensor [2I, H] (gate first), as
    /// Granite's `input_linear` and the fused expert tensors store them; views, no copy.
    pub fn swiglu_stacked(gate_up: &Tensor, down: Tensor) -> Result<Self> {
        let i = gate_up.dim(0)? / 2;
        let gate_up = Linear::new(gate_up.clone(), None);
        Ok(Mlp::SwiGlu(SwiGlu::new(gate_up.rows(0, i)?, gate_up.rows(i, i)?, Linear::new(down, None))))
    }

    /// `up_proj` / `down_proj` under `vb` with a squared ReLU between them.
    pub fn relu2(vb: VarBuilder, hidden: usize, intermediate: usize, bias: bool) -> Result<Self> {
        Ok(Mlp::Relu2 {
            up: Linear::load(vb.pp("up_proj"), hidden, intermediate, bias)?,
            down: Linear::load(vb.pp("down_proj"), intermediate, hidden, bias)?,
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
