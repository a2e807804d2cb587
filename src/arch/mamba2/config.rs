//! Mamba-2 configs in both on-disk formats, normalised to one set of sizes.
//!
//! transformers `mamba2` (`hidden_size`, `num_heads`, `state_size`, ...) and mamba_ssm
//! (`d_model`, `n_layer`, `ssm_cfg{d_state, headdim, ngroups, ...}` with the defaults of
//! `mamba_ssm/modules/mamba2.py`). The format is told apart by the config keys.

use crate::arch::keys::{bool_of, usize_of};
use crate::layers::mamba2::{Mamba2Dims, OutputNorm};
use anyhow::{bail, Result};
use serde_json::Value;

/// Which library wrote the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// transformers `Mamba2ForCausalLM`
    Hf,
    /// mamba_ssm `MambaLMHeadModel`
    MambaSsm,
}

impl Format {
    pub fn detect(config: &Value) -> Format {
        if config.get("ssm_cfg").is_some() || config.get("d_model").is_some() {
            Format::MambaSsm
        } else {
            Format::Hf
        }
    }

    /// Name of the embedding table (transformers renames mamba_ssm's `embedding` on load).
    pub fn embedding(self) -> &'static str {
        match self {
            Format::Hf => "backbone.embeddings.weight",
            Format::MambaSsm => "backbone.embedding.weight",
        }
    }
}

/// Sizes and switches of a Mamba-2 LM, whichever format it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Mamba2Config {
    pub format: Format,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// N: per-group width of B and C (the key width of the state).
    pub state: usize,
    pub groups: usize,
    pub d_inner: usize,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    /// bias of in_proj / out_proj
    pub bias: bool,
    pub eps: f64,
    pub tie: bool,
    /// dt clamp (min, max); (0, inf) means none.
    pub dt_limit: (f64, f64),
    /// Gated RMSNorm on the output (mamba_ssm `rmsnorm`); otherwise y·silu(z).
    pub rmsnorm: bool,
    pub norm_before_gate: bool,
}

impl Mamba2Config {
    /// The mixer's sizes for the shared Mamba-2 layer.
    pub fn dims(&self) -> Mamba2Dims {
        Mamba2Dims {
            hidden: self.hidden,
            heads: self.heads,
            head_dim: self.head_dim,
            state: self.state,
            groups: self.groups,
            d_inner: self.d_inner,
            conv_kernel: self.conv_kernel,
            conv_bias: self.conv_bias,
            in_bias: self.bias,
            out_bias: self.bias,
            eps: self.eps,
            dt_limit: self.dt_limit,
            norm: if self.rmsnorm {
                OutputNorm::Gated { groups: self.groups, before_gate: self.norm_before_gate }
            } else {
                OutputNorm::None
            },
            in_scale: 1.0,
            segment_scales: [1.0; 5],
        }
    }

    /// The `in_proj` output width: [z | x | B | C | dt].
    pub fn in_proj_dim(&self) -> usize {
        self.dims().in_proj_dim()
    }

    /// Channels of the short conv: [x | B | C].
    pub fn conv_dim(&self) -> usize {
        self.dims().conv_dim()
    }

    pub fn from_value(config: &Value) -> Result<Self> {
        let cfg = match Format::detect(config) {
            Format::Hf => Self::from_hf(config)?,
            Format::MambaSsm => Self::from_mamba_ssm(config)?,
        };
        if cfg.heads * cfg.head_dim != cfg.d_inner {
            bail!("num_heads {} x head_dim {} != intermediate size {}", cfg.heads, cfg.head_dim, cfg.d_inner);
        }
        if cfg.groups == 0 || !cfg.heads.is_multiple_of(cfg.groups) {
            bail!("num_heads {} is not a multiple of n_groups {}", cfg.heads, cfg.groups);
        }
        Ok(cfg)
    }

    fn from_hf(c: &Value) -> Result<Self> {
        let hidden = usize_of(c, "hidden_size", None)?;
        let expand = c.get("expand").and_then(Value::as_f64).unwrap_or(2.0);
        Ok(Self {
            format: Format::Hf,
            hidden,
            layers: usize_of(c, "num_hidden_layers", None)?,
            heads: usize_of(c, "num_heads", None)?,
            head_dim: usize_of(c, "head_dim", Some(64))?,
            state: usize_of(c, "state_size", Some(128))?,
            groups: usize_of(c, "n_groups", Some(1))?,
            // transformers: intermediate_size = int(expand * hidden_size)
            d_inner: (expand * hidden as f64) as usize,
            conv_kernel: usize_of(c, "conv_kernel", Some(4))?,
            conv_bias: bool_of(c, "use_conv_bias", true),
            bias: bool_of(c, "use_bias", false),
            eps: c.get("layer_norm_epsilon").and_then(Value::as_f64).unwrap_or(1e-5),
            tie: bool_of(c, "tie_word_embeddings", true),
            dt_limit: limit(c.get("time_step_limit"))?,
            rmsnorm: true,
            norm_before_gate: false,
        })
    }

    fn from_mamba_ssm(c: &Value) -> Result<Self> {
        let empty = Value::Object(Default::default());
        let ssm = c.get("ssm_cfg").unwrap_or(&empty);
        match ssm.get("layer").and_then(Value::as_str) {
            Some("Mamba2") => {}
            other => bail!(
                "mamba_ssm ssm_cfg.layer is {}; only Mamba2 checkpoints are supported",
                other.map_or("missing (Mamba1)".to_string(), |s| format!("\"{s}\""))
            ),
        }
        if c.get("d_intermediate").and_then(Value::as_u64).unwrap_or(0) != 0 {
            bail!("mamba_ssm models with an MLP (d_intermediate > 0) are not supported");
        }
        if c.get("attn_layer_idx").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            bail!("hybrid mamba_ssm models (attn_layer_idx) are not supported");
        }
        if !bool_of(c, "rms_norm", true) {
            bail!("mamba_ssm models with LayerNorm (rms_norm = false) are not supported");
        }
        let hidden = usize_of(c, "d_model", None)?;
        let d_inner = usize_of(ssm, "expand", Some(2))? * hidden;
        if ssm.get("d_ssm").and_then(Value::as_u64).is_some_and(|d| d as usize != d_inner) {
            bail!("mamba_ssm ssm_cfg.d_ssm different from expand * d_model is not supported");
        }
        let head_dim = usize_of(ssm, "headdim", Some(64))?;
        if head_dim == 0 {
            bail!("mamba_ssm ssm_cfg.headdim must be at least 1");
        }
        Ok(Self {
            format: Format::MambaSsm,
            hidden,
            layers: usize_of(c, "n_layer", None)?,
            heads: d_inner / head_dim,
            head_dim,
            state: usize_of(ssm, "d_state", Some(128))?,
            groups: usize_of(ssm, "ngroups", Some(1))?,
            d_inner,
            conv_kernel: usize_of(ssm, "d_conv", Some(4))?,
            conv_bias: bool_of(ssm, "conv_bias", true),
            bias: bool_of(ssm, "bias", false),
            // mamba_ssm hard-codes eps 1e-5 for both the block norms and the gated norm
            eps: c.get("norm_epsilon").and_then(Value::as_f64).unwrap_or(1e-5),
            tie: bool_of(c, "tie_embeddings", true),
            dt_limit: limit(ssm.get("dt_limit"))?,
            rmsnorm: bool_of(ssm, "rmsnorm", true),
            norm_before_gate: bool_of(ssm, "norm_before_gate", false),
        })
    }
}

/// A float that Python may have written as `Infinity`, `"inf"` or `{"__float__": "Infinity"}`.
pub fn float_of(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "infinity" | "inf" | "+infinity" | "+inf" => Some(f64::INFINITY),
            "-infinity" | "-inf" => Some(f64::NEG_INFINITY),
            "nan" => Some(f64::NAN),
            s => s.parse().ok(),
        },
        Value::Object(o) => o.get("__float__").and_then(float_of),
        _ => None,
    }
}

/// `time_step_limit` / `dt_limit`: a pair, default (0, inf).
pub(crate) fn limit(v: Option<&Value>) -> Result<(f64, f64)> {
    match v {
        None | Some(Value::Null) => Ok((0.0, f64::INFINITY)),
        Some(Value::Array(a)) if a.len() == 2 => match (float_of(&a[0]), float_of(&a[1])) {
            (Some(lo), Some(hi)) => Ok((lo, hi)),
            _ => bail!("time step limit {} is not a pair of numbers", Value::Array(a.clone())),
        },
        Some(v) => bail!("time step limit {v} is not a pair of numbers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_python_infinities() {
        for inf in [json!({"__float__": "Infinity"}), json!("Infinity"), json!("inf")] {
            assert_eq!(limit(Some(&json!([0.0, inf]))).unwrap(), (0.0, f64::INFINITY));
        }
        assert_eq!(limit(None).unwrap(), (0.0, f64::INFINITY));
        assert_eq!(limit(Some(&json!([0.001, 0.1]))).unwrap(), (0.001, 0.1));
    }

    #[test]
    fn mamba_ssm_defaults() {
        let c = json!({"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {"layer": "Mamba2"}});
        let m = Mamba2Config::from_value(&c).unwrap();
        assert_eq!(m.format, Format::MambaSsm);
        assert_eq!((m.d_inner, m.heads, m.head_dim, m.state, m.groups), (1536, 24, 64, 128, 1));
        assert_eq!((m.conv_kernel, m.conv_bias, m.bias, m.tie), (4, true, false, true));
        // FORMATS.md: d_model 1024 gives 4384 in_proj rows and 2304 conv channels
        let c = json!({"d_model": 1024, "n_layer": 48, "ssm_cfg": {"layer": "Mamba2"}});
        let m = Mamba2Config::from_value(&c).unwrap();
        assert_eq!((m.in_proj_dim(), m.conv_dim()), (4384, 2304));
    }

    #[test]
    fn rejects_mamba1() {
        let c = json!({"d_model": 768, "n_layer": 24, "ssm_cfg": {}});
        let e = Mamba2Config::from_value(&c).unwrap_err().to_string();
        assert!(e.contains("Mamba1"), "{e}");
    }
}
