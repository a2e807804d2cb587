//! SSE config (`model_type: "sse"`, fla `fla/models/sse/configuration_sse.py`).

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

fn two() -> usize {
    2
}
fn six() -> usize {
    6
}
fn d256() -> usize {
    256
}
fn one() -> f64 {
    1.0
}
fn gla() -> String {
    "gla".into()
}
fn varlen() -> String {
    "varlen".into()
}

/// The SSE config fields statecut reads, with fla's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct SseConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    #[serde(default = "six")]
    pub num_heads: usize,
    #[serde(default)]
    pub num_v_heads: Option<usize>,
    #[serde(default = "d256")]
    pub head_dim: usize,
    #[serde(default = "one")]
    pub expand_v: f64,
    #[serde(default = "crate::arch::defaults::yes")]
    pub use_output_gate: bool,
    #[serde(default)]
    pub use_short_conv: bool,
    #[serde(default = "crate::arch::defaults::four")]
    pub conv_size: usize,
    #[serde(default = "crate::arch::defaults::four")]
    pub num_sparse_partition: usize,
    #[serde(default = "two")]
    pub num_writer: usize,
    #[serde(default = "two")]
    pub num_reader: usize,
    #[serde(default = "gla")]
    pub linear_attn_type: String,
    #[serde(default = "varlen")]
    pub sse_implementation: String,
    #[serde(default)]
    pub allow_neg_eigval: bool,
    #[serde(default)]
    pub hidden_ratio: Option<f64>,
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    #[serde(default = "crate::arch::defaults::eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The hybrid's attention layers (checked against the sizes by [`SseConfig::attn_config`]).
    #[serde(default)]
    pub attn: Option<AttnConfig>,
}

fn rope_theta() -> f64 {
    10000.0
}

/// fla's `attn` dict: softmax attention layers of hybrid models (SSE-H).
#[derive(Debug, Clone, Deserialize)]
pub struct AttnConfig {
    pub layers: Vec<usize>,
    pub num_heads: usize,
    #[serde(default)]
    pub num_kv_heads: Option<usize>,
    #[serde(default)]
    pub qkv_bias: bool,
    #[serde(default)]
    pub qk_norm: bool,
    #[serde(default)]
    pub window_size: Option<usize>,
    #[serde(default = "rope_theta")]
    pub rope_theta: f64,
}

impl AttnConfig {
    /// The shared attention layer for a model of width `hidden` (fla `Attention`: whole-head
    /// rotary in float32, plain q/k norms, no output bias).
    pub fn spec(&self, hidden: usize, eps: f64) -> crate::layers::attention::AttentionSpec {
        let hd = hidden / self.num_heads;
        crate::layers::attention::AttentionSpec {
            hidden,
            heads: self.num_heads,
            kv_heads: self.num_kv_heads.unwrap_or(self.num_heads),
            head_dim: hd,
            qkv_bias: self.qkv_bias,
            o_bias: false,
            qk_norm: self.qk_norm.then_some((crate::ops::norm::NormWeight::Plain, eps)),
            output_gate: false,
            rope: Some(crate::layers::attention::Rope::full(hd, self.rope_theta)),
            scale: (hd as f64).powf(-0.5),
            window: self.window_size,
        }
    }
}

pub use crate::layers::sse::{Dims, Implementation, Transition};

impl SseConfig {
    /// Read config.json, every value of the wrong type an error naming its key.
    pub fn from_value(config: &Value) -> Result<Self> {
        Ok(crate::arch::config::from_value(config)?)
    }

    /// The hybrid's attention layers, checked against the model's sizes.
    pub fn attn_config(&self) -> Result<Option<AttnConfig>> {
        let Some(a) = self.attn.clone() else { return Ok(None) };
        let kv = a.num_kv_heads.unwrap_or(a.num_heads);
        if a.num_heads == 0
            || !self.hidden_size.is_multiple_of(a.num_heads)
            || kv == 0
            || !a.num_heads.is_multiple_of(kv)
        {
            bail!(
                "attn: num_heads {} must divide hidden_size {} and be a multiple of num_kv_heads {kv}",
                a.num_heads,
                self.hidden_size
            );
        }
        if let Some(&l) = a.layers.iter().find(|&&l| l >= self.num_hidden_layers) {
            bail!("attn: layer {l} is out of range (num_hidden_layers {})", self.num_hidden_layers);
        }
        Ok(Some(a))
    }

    /// Whether layer `i` is a softmax attention layer of a hybrid.
    pub fn is_attention(&self, i: usize) -> bool {
        self.attn.as_ref().is_some_and(|a| a.layers.contains(&i))
    }

    pub fn dims(&self) -> Result<Dims> {
        self.attn_config()?;
        let transition = match self.linear_attn_type.as_str() {
            "gla" => Transition::Gla,
            "gdn" => Transition::Gdn,
            other => bail!("SSE linear_attn_type \"{other}\" is not supported (fla knows \"gla\" and \"gdn\")"),
        };
        if self.num_v_heads.is_some_and(|v| v != self.num_heads) {
            bail!("SSE with num_v_heads != num_heads is not supported yet");
        }
        if self.num_writer != self.num_reader {
            bail!("SSE with num_writer != num_reader is not supported (fla's varlen form requires them equal)");
        }
        if self.num_writer == 0 || self.num_writer >= self.num_sparse_partition {
            bail!("num_writer {} must be in 1..num_sparse_partition ({})", self.num_writer, self.num_sparse_partition);
        }
        let implementation = match self.sse_implementation.as_str() {
            "mask" => Implementation::Mask,
            "varlen" => Implementation::Varlen,
            other => bail!("unknown sse_implementation \"{other}\" (fla knows \"mask\" and \"varlen\")"),
        };
        let dv = (self.head_dim as f64 * self.expand_v) as usize;
        let intermediate = match self.intermediate_size {
            Some(i) => i,
            None => {
                // fla GatedMLP: int(D * hidden_ratio * 2 / 3) rounded up to a multiple of 256
                let i = (self.hidden_size as f64 * self.hidden_ratio.unwrap_or(4.0) * 2.0 / 3.0) as usize;
                i.div_ceil(256).checked_mul(256).context("hidden_ratio gives an MLP width out of range")?
            }
        };
        Ok(Dims {
            hidden: self.hidden_size,
            heads: self.num_heads,
            dk: self.head_dim,
            dv,
            partitions: self.num_sparse_partition,
            topk: self.num_writer,
            intermediate,
            use_output_gate: self.use_output_gate,
            use_short_conv: self.use_short_conv,
            conv_size: self.conv_size,
            implementation,
            transition,
            allow_neg_eigval: self.allow_neg_eigval,
            norm_eps: self.norm_eps,
        })
    }
}
