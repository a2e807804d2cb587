//! Mamba-2 configs in both on-disk formats, normalised to one set of sizes.
//!
//! transformers `mamba2` (`hidden_size`, `num_heads`, `state_size`, ...) and mamba_ssm
//! (`d_model`, `n_layer`, `ssm_cfg{d_state, headdim, ngroups, ...}` with the defaults of
//! `mamba_ssm/modules/mamba2.py`). The format is told apart by the config keys.

use crate::arch::config::Limit;
use crate::layers::mamba2::{Mamba2Dims, OutputNorm};
use anyhow::{bail, Result};
use serde::Deserialize;
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
            Format::Hf => Self::from_hf(crate::arch::config::from_value(config)?),
            Format::MambaSsm => Self::from_mamba_ssm(crate::arch::config::from_value(config)?)?,
        };
        if cfg.heads * cfg.head_dim != cfg.d_inner {
            bail!("num_heads {} x head_dim {} != intermediate size {}", cfg.heads, cfg.head_dim, cfg.d_inner);
        }
        if cfg.groups == 0 || !cfg.heads.is_multiple_of(cfg.groups) {
            bail!("num_heads {} is not a multiple of n_groups {}", cfg.heads, cfg.groups);
        }
        Ok(cfg)
    }

    fn from_hf(c: HfConfig) -> Self {
        Self {
            format: Format::Hf,
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            heads: c.num_heads,
            head_dim: c.head_dim,
            state: c.state_size,
            groups: c.n_groups,
            // transformers: intermediate_size = int(expand * hidden_size)
            d_inner: (c.expand * c.hidden_size as f64) as usize,
            conv_kernel: c.conv_kernel,
            conv_bias: c.use_conv_bias,
            bias: c.use_bias,
            eps: c.layer_norm_epsilon,
            tie: c.tie_word_embeddings,
            dt_limit: (c.time_step_limit.0, c.time_step_limit.1),
            rmsnorm: true,
            norm_before_gate: false,
        }
    }

    fn from_mamba_ssm(c: SsmConfig) -> Result<Self> {
        let ssm = c.ssm_cfg;
        match ssm.layer.as_deref() {
            Some("Mamba2") => {}
            other => bail!(
                "mamba_ssm ssm_cfg.layer is {}; only Mamba2 checkpoints are supported",
                other.map_or("missing (Mamba1)".to_string(), |s| format!("\"{s}\""))
            ),
        }
        if c.d_intermediate != 0 {
            bail!("mamba_ssm models with an MLP (d_intermediate > 0) are not supported");
        }
        if !c.attn_layer_idx.is_empty() {
            bail!("hybrid mamba_ssm models (attn_layer_idx) are not supported");
        }
        if !c.rms_norm {
            bail!("mamba_ssm models with LayerNorm (rms_norm = false) are not supported");
        }
        let d_inner = ssm.expand * c.d_model;
        if ssm.d_ssm.is_some_and(|d| d != d_inner) {
            bail!("mamba_ssm ssm_cfg.d_ssm different from expand * d_model is not supported");
        }
        if ssm.headdim == 0 {
            bail!("mamba_ssm ssm_cfg.headdim must be at least 1");
        }
        Ok(Self {
            format: Format::MambaSsm,
            hidden: c.d_model,
            layers: c.n_layer,
            heads: d_inner / ssm.headdim,
            head_dim: ssm.headdim,
            state: ssm.d_state,
            groups: ssm.ngroups,
            d_inner,
            conv_kernel: ssm.d_conv,
            conv_bias: ssm.conv_bias,
            bias: ssm.bias,
            // mamba_ssm hard-codes eps 1e-5 for both the block norms and the gated norm
            eps: c.norm_epsilon,
            tie: c.tie_embeddings,
            dt_limit: (ssm.dt_limit.0, ssm.dt_limit.1),
            rmsnorm: ssm.rmsnorm,
            norm_before_gate: ssm.norm_before_gate,
        })
    }
}

fn d64() -> usize {
    64
}
fn d128() -> usize {
    128
}
fn two_f() -> f64 {
    2.0
}
fn eps() -> f64 {
    1e-5
}

/// transformers `Mamba2Config` (the fields statecut reads, with its defaults).
#[derive(Debug, Deserialize)]
struct HfConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_heads: usize,
    #[serde(default = "d64")]
    head_dim: usize,
    #[serde(default = "d128")]
    state_size: usize,
    #[serde(default = "crate::arch::defaults::one")]
    n_groups: usize,
    #[serde(default = "two_f")]
    expand: f64,
    #[serde(default = "crate::arch::defaults::four")]
    conv_kernel: usize,
    #[serde(default = "crate::arch::defaults::yes")]
    use_conv_bias: bool,
    #[serde(default)]
    use_bias: bool,
    #[serde(default = "eps")]
    layer_norm_epsilon: f64,
    #[serde(default = "crate::arch::defaults::yes")]
    tie_word_embeddings: bool,
    #[serde(default)]
    time_step_limit: Limit,
}

/// mamba_ssm's `MambaConfig` (`mamba_ssm/models/config_mamba.py`).
#[derive(Debug, Deserialize)]
struct SsmConfig {
    d_model: usize,
    n_layer: usize,
    #[serde(default)]
    d_intermediate: usize,
    #[serde(default)]
    attn_layer_idx: Vec<usize>,
    #[serde(default = "crate::arch::defaults::yes")]
    rms_norm: bool,
    #[serde(default = "eps")]
    norm_epsilon: f64,
    #[serde(default = "crate::arch::defaults::yes")]
    tie_embeddings: bool,
    #[serde(default)]
    ssm_cfg: SsmCfg,
}

/// `ssm_cfg`: the mixer's arguments, with the defaults of `mamba_ssm/modules/mamba2.py`.
#[derive(Debug, Deserialize)]
#[serde(default)]
struct SsmCfg {
    layer: Option<String>,
    expand: usize,
    d_ssm: Option<usize>,
    headdim: usize,
    d_state: usize,
    ngroups: usize,
    d_conv: usize,
    conv_bias: bool,
    bias: bool,
    dt_limit: Limit,
    rmsnorm: bool,
    norm_before_gate: bool,
}

impl Default for SsmCfg {
    fn default() -> Self {
        Self {
            layer: None,
            expand: 2,
            d_ssm: None,
            headdim: 64,
            d_state: 128,
            ngroups: 1,
            d_conv: 4,
            conv_bias: true,
            bias: false,
            dt_limit: Limit::default(),
            rmsnorm: true,
            norm_before_gate: false,
        }
    }
}

pub use crate::arch::config::float_of;

/// `time_step_limit` / `dt_limit`: a pair, default (0, inf) (the configs read it as [`Limit`]).
#[cfg(test)]
fn limit(v: Option<&Value>) -> Result<(f64, f64)> {
    let l: Limit = match v {
        None => Limit::default(),
        Some(v) => Limit::deserialize(v).map_err(|e| anyhow::anyhow!("{e}"))?,
    };
    Ok((l.0, l.1))
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

    /// A value of the wrong type is refused with its key, not read as the default.
    #[test]
    fn wrong_types_name_the_key() {
        let err = |c: Value| format!("{:#}", Mamba2Config::from_value(&c).unwrap_err());
        let hf = json!({"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 64,
                        "use_conv_bias": "yes"});
        assert!(err(hf).contains("config key use_conv_bias: invalid type: string \"yes\""));
        let hf = json!({"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "expand": "2"});
        assert!(err(hf).contains("config key expand: "));
        let ssm = json!({"d_model": 64, "n_layer": 2, "ssm_cfg": {"layer": "Mamba2", "conv_bias": 1}});
        assert!(err(ssm).contains("config key ssm_cfg.conv_bias: invalid type: integer"));
        let ssm = json!({"d_model": 64, "n_layer": 2, "rms_norm": "false", "ssm_cfg": {"layer": "Mamba2"}});
        assert!(err(ssm).contains("config key rms_norm: "));
        // null is "not set": the default
        let ssm = json!({"d_model": 64, "n_layer": 2, "ssm_cfg": {"layer": "Mamba2", "d_ssm": null}});
        assert!(Mamba2Config::from_value(&ssm).unwrap().conv_bias);
    }
}
