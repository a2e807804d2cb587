//! flash-linear-attention families: DeltaNet (`delta_net`) and Gated DeltaNet (`gated_deltanet`).
//!
//! Follows fla `fla/layers/{delta_net,gated_deltanet}.py` and `fla/models/*/modeling_*.py`.

mod model;

use super::layered::Layers;
use super::{parse, Family, LayerState, LoadOptions, RowSlice, SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use candle_nn::VarBuilder;
use serde::Deserialize;
use serde_json::Value;

pub use model::{fla_stack, StackShape};

/// Which of the two fla layers a config describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    DeltaNet,
    GatedDeltaNet,
}

fn ratio() -> f64 {
    4.0
}
fn l2() -> String {
    "l2".into()
}
fn silu() -> String {
    "silu".into()
}

/// The union of the DeltaNet and Gated DeltaNet config fields statecut reads.
#[derive(Debug, Clone, Deserialize)]
pub struct FlaConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_heads: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub expand_k: Option<f64>,
    #[serde(default)]
    pub expand_v: Option<f64>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub num_v_heads: Option<usize>,
    #[serde(default)]
    pub use_gate: Option<bool>,
    #[serde(default = "crate::arch::defaults::yes")]
    pub use_short_conv: bool,
    #[serde(default = "crate::arch::defaults::four")]
    pub conv_size: usize,
    #[serde(default)]
    pub conv_bias: bool,
    #[serde(default = "crate::arch::defaults::yes")]
    pub use_beta: bool,
    #[serde(default)]
    pub allow_neg_eigval: bool,
    #[serde(default = "l2")]
    pub qk_norm: String,
    #[serde(default = "silu")]
    pub qk_activation: String,
    #[serde(default = "ratio")]
    pub hidden_ratio: f64,
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    #[serde(default = "crate::arch::defaults::eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attn: Option<Value>,
}

/// Sizes derived from a config exactly as fla derives them.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub kind: Kind,
    pub hidden: usize,
    pub heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub use_gate: bool,
    pub intermediate: usize,
}

impl FlaConfig {
    pub fn dims(&self, kind: Kind) -> Result<Dims> {
        if self.attn.as_ref().is_some_and(|a| !a.is_null()) {
            bail!("hybrid fla models (config `attn` set) are not supported yet");
        }
        if self.qk_norm != "l2" {
            bail!("qk_norm \"{}\" is not supported (only \"l2\")", self.qk_norm);
        }
        if self.qk_activation != "silu" {
            bail!("qk_activation \"{}\" is not supported (only \"silu\")", self.qk_activation);
        }
        let h = self.num_heads;
        if h == 0 {
            bail!("num_heads must be at least 1");
        }
        let (dk, dv, v_heads, use_gate) = match kind {
            Kind::DeltaNet => {
                // fla: key_dim = int(hidden_size * expand_k), head_k_dim = key_dim // num_heads
                let key_dim = (self.hidden_size as f64 * self.expand_k.unwrap_or(1.0)) as usize;
                let value_dim = (self.hidden_size as f64 * self.expand_v.unwrap_or(1.0)) as usize;
                if !key_dim.is_multiple_of(h) || !value_dim.is_multiple_of(h) {
                    bail!("key_dim {key_dim} / value_dim {value_dim} not divisible by num_heads {h}");
                }
                (key_dim / h, value_dim / h, h, self.use_gate.unwrap_or(false))
            }
            Kind::GatedDeltaNet => {
                // fla: head_v_dim = int(head_dim * expand_v)
                let dk = self.head_dim.unwrap_or(256);
                let dv = (dk as f64 * self.expand_v.unwrap_or(2.0)) as usize;
                let hv = self.num_v_heads.unwrap_or(h);
                if !hv.is_multiple_of(h) {
                    bail!("num_v_heads {hv} must be a multiple of num_heads {h}");
                }
                (dk, dv, hv, self.use_gate.unwrap_or(true))
            }
        };
        let intermediate = match self.intermediate_size {
            Some(i) => i,
            None => {
                // fla GatedMLP: int(D * hidden_ratio * 2 / 3) rounded up to a multiple of 256
                let i = (self.hidden_size as f64 * self.hidden_ratio * 2.0 / 3.0) as usize;
                i.div_ceil(256).checked_mul(256).context("hidden_ratio gives an MLP width out of range")?
            }
        };
        Ok(Dims { kind, hidden: self.hidden_size, heads: h, v_heads, dk, dv, use_gate, intermediate })
    }
}

/// The smallest float e with `int(base * e) == target` in Python semantics, so that a
/// config value read back by fla reproduces `target` exactly (the nudge FORMATS.md §1c asks for).
pub fn float_for_product(target: usize, base: usize) -> f64 {
    let mut e = target as f64 / base as f64;
    while (((base as f64) * e) as usize) < target {
        e = f64::from_bits(e.to_bits() + 1);
    }
    e
}

fn layout(ckpt: &Checkpoint, kind: Kind) -> Result<StateLayout> {
    let cfg: FlaConfig = parse(ckpt, &ckpt.config)?;
    let d = cfg.dims(kind)?;
    let mut layers = Vec::new();
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}.attn.");
        let mut slices = vec![
            RowSlice { tensor: format!("{p}q_proj.weight"), offset: 0, head_stride: d.dk, role: SliceRole::QueryProj },
            RowSlice { tensor: format!("{p}k_proj.weight"), offset: 0, head_stride: d.dk, role: SliceRole::KeyProj },
        ];
        if cfg.use_short_conv {
            for name in ["q_conv1d.weight", "k_conv1d.weight", "q_conv1d.bias", "k_conv1d.bias"] {
                let t = format!("{p}{name}");
                if ckpt.tensors.contains_key(&t) {
                    slices.push(RowSlice { tensor: t, offset: 0, head_stride: d.dk, role: SliceRole::Conv });
                }
            }
        }
        layers.push(LayerState { layer: i, key_heads: d.heads, value_heads: d.v_heads, dv: d.dv, slices });
    }
    Ok(StateLayout { family: format!("{kind:?}"), dk: d.dk, layers, num_layers: cfg.num_hidden_layers })
}

fn layers(ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>, kind: Kind) -> Result<Box<dyn Layers>> {
    let cfg: FlaConfig = parse(ckpt, &ckpt.config)?;
    Ok(Box::new(model::delta_net_stack(vb, &cfg, cfg.dims(kind)?, opts)))
}

pub struct DeltaNetFamily;
pub struct GatedDeltaNetFamily;

impl Family for DeltaNetFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["delta_net"]
    }
    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        layout(ckpt, Kind::DeltaNet)
    }
    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        layers(ckpt, opts, vb, Kind::DeltaNet)
    }
    fn set_key_width(&self, config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()> {
        // fla DeltaNet has no head_dim: key_dim = int(hidden_size * expand_k).
        let hidden = crate::arch::config::from_value::<FlaConfig>(config)?.hidden_size;
        let heads = layout.layers.first().map_or(0, |l| l.key_heads);
        config["expand_k"] = Value::from(float_for_product(heads * dk, hidden));
        Ok(())
    }
}

impl Family for GatedDeltaNetFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["gated_deltanet"]
    }
    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        layout(ckpt, Kind::GatedDeltaNet)
    }
    fn layers(&self, ckpt: &Checkpoint, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Box<dyn Layers>> {
        layers(ckpt, opts, vb, Kind::GatedDeltaNet)
    }
    fn set_key_width(&self, config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()> {
        // fla ties head_v_dim = int(head_dim * expand_v): keep d_v by rescaling expand_v.
        let dv = layout.layers.first().map_or(0, |l| l.dv);
        config["head_dim"] = Value::from(dk);
        config["expand_v"] = Value::from(float_for_product(dv, dk));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::float_for_product;

    #[test]
    fn expand_v_nudge_survives_int_and_json() {
        for dv in [128usize, 256, 512, 1024] {
            for dk in 1..=256usize {
                let e = float_for_product(dv, dk);
                let back: f64 = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
                assert_eq!(((dk as f64) * back) as usize, dv, "dv {dv} dk {dk}");
                assert!(((dk as f64 * back) - dv as f64).abs() <= 1e-5 * dv as f64, "isclose rel_tol 1e-5");
            }
        }
        // The plain quotient fails for some widths, which is why the nudge exists.
        assert!((1..=256usize).any(|dk| ((dk as f64) * (512.0 / dk as f64)) as usize != 512));
    }
}
