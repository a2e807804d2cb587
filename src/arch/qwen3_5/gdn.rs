//! Qwen3.5 / Qwen3-Next Gated DeltaNet layers (transformers `Qwen3_5GatedDeltaNet`,
//! `Qwen3NextGatedDeltaNet`): their tensor names and sizes on the shared linear-attention mixer.

use super::config::TextConfig;
use crate::layers::linear::Linear;
use crate::layers::linear_attention::{Decay, LinearAttention, LinearDims, OutputGate, Projections};
use crate::ops::conv::ShortConv;
use crate::ops::derived::Derived;
use crate::ops::norm::{NormWeight, RmsNorm};
use anyhow::Result;
use candle_core::DType;
use candle_nn::VarBuilder;

/// Linear-attention sizes.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Dims {
    pub fn new(c: &TextConfig) -> Self {
        Self {
            hidden: c.hidden_size,
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
        }
    }

    /// Value heads per key head.
    pub fn r(&self) -> usize {
        self.hv / self.hk
    }

    /// Conv channels [q all | k all | v all].
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    /// Rows of one key-head group of Qwen3-Next's `in_proj_qkvz`: [q_g | k_g | v_g | z_g].
    pub fn fused_block(&self) -> usize {
        2 * self.dk + 2 * self.r() * self.dv
    }
}

/// The Qwen3.5 / Qwen3-Next Gated DeltaNet layer under `vb` (`…linear_attn`) as the shared
/// linear-attention mixer; `fused` is Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` layout.
pub fn load(vb: VarBuilder, c: &TextConfig, fused: bool, layer: usize, grad: bool) -> Result<LinearAttention> {
    let d = Dims::new(c);
    let proj = if fused {
        Projections::QwenFused {
            qkvz: Linear::load_trainable(&vb, "in_proj_qkvz", d.hidden, d.hk * d.fused_block(), false, grad)?,
            ba: Linear::load(vb.pp("in_proj_ba"), d.hidden, 2 * d.hv, false)?,
        }
    } else {
        Projections::QwenSplit {
            qkv: Linear::load_trainable(&vb, "in_proj_qkv", d.hidden, d.conv_dim(), false, grad)?,
            z: Linear::load(vb.pp("in_proj_z"), d.hidden, d.hv * d.dv, false)?,
            b: Linear::load(vb.pp("in_proj_b"), d.hidden, d.hv, false)?,
            a: Linear::load(vb.pp("in_proj_a"), d.hidden, d.hv, false)?,
        }
        .stacked()?
    };
    Ok(LinearAttention {
        dims: LinearDims { hidden: d.hidden, heads: d.hk, v_heads: d.hv, dk: d.dk, dv: d.dv },
        layer,
        proj,
        conv: Some(ShortConv::load(vb.pp("conv1d"), d.conv_dim(), c.linear_conv_kernel_dim, false)?),
        decay: Decay::PerHead {
            neg_a: Derived::new(vb.get(d.hv, "A_log")?, |t| t.to_dtype(DType::F32)?.exp()?.neg())?,
            dt_bias: Derived::new(vb.get(d.hv, "dt_bias")?, |t| t.to_dtype(DType::F32))?,
        },
        gate: OutputGate::Silu,
        beta_scale: 1.0,
        // norm before gate with a plain weight (Qwen3NextRMSNormGated)
        norm: RmsNorm::load(vb.pp("norm"), d.dv, c.rms_norm_eps, NormWeight::Plain)?,
        o_proj: Linear::load(vb.pp("out_proj"), d.hv * d.dv, d.hidden, false)?,
    })
}
