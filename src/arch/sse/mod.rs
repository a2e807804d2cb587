//! Sparse State Expansion (SSE, arXiv 2507.16577): `model_type: "sse"`, GLA and Gated DeltaNet
//! transitions (`linear_attn_type` "gla", "gdn"), and SSE-H hybrids with softmax attention
//! layers where the config's `attn` dict places them.
//!
//! Follows fla `fla/layers/sse.py` (`SSEGLA`, `SSEGDN`) and `fla/models/sse/`. Each layer keeps
//! N routed state partitions plus one always-active shared partition, all [dk, dv] per head and
//! all fed by the same key/query projections (the routed ones through a low-rank correction
//! `lora_*_proj`). Key channel j therefore indexes row j of every partition's state, of
//! `q_proj`/`k_proj`, of the second factor of `lora_q_proj`/`lora_k_proj`, of GLA's per-channel
//! decay projections (`gk_proj.{0,1}.1`, weight and bias; GDN's gates are per head) and of the
//! shared path's short convs: pruning keeps the same index set in all of them, for every
//! partition at once.

mod config;
mod model;

use super::{parse, Family, LayerState, LoadOptions, RowSlice, SliceRole, StateLayout};
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Result};
use serde_json::Value;
use std::collections::BTreeMap;

pub use config::{AttnConfig, Dims, Implementation, SseConfig, Transition};
pub use model::{open, sse_stack};

pub struct SseFamily;

impl Family for SseFamily {
    fn model_types(&self) -> &'static [&'static str] {
        &["sse"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let cfg: SseConfig = parse(ckpt, &ckpt.config)?;
        // dims() checks the attention layers, which is_attention then reads
        let d = cfg.dims()?;
        let mut layers = Vec::new();
        // Hybrids (SSE-H) list only their SSE layers: attention layers keep no recurrent state.
        for i in (0..cfg.num_hidden_layers).filter(|&i| !cfg.is_attention(i)) {
            let p = format!("model.layers.{i}.attn.");
            let slice =
                |name: &str, role| RowSlice { tensor: format!("{p}{name}"), offset: 0, head_stride: d.dk, role };
            let mut slices =
                vec![slice("q_proj.weight", SliceRole::QueryProj), slice("k_proj.weight", SliceRole::KeyProj)];
            // GDN's decays and write strengths are per head: only GLA has per-channel gates.
            let gla_gates: &[&str] = match d.transition {
                Transition::Gla => {
                    &["gk_proj.0.1.weight", "gk_proj.0.1.bias", "gk_proj.1.1.weight", "gk_proj.1.1.bias"]
                }
                Transition::Gdn => &[],
            };
            for name in ["lora_q_proj.1.weight", "lora_k_proj.1.weight"].iter().chain(gla_gates) {
                slices.push(slice(name, SliceRole::Channel));
            }
            if cfg.use_short_conv {
                for name in
                    ["q_conv1d_shared.weight", "k_conv1d_shared.weight", "q_conv1d_shared.bias", "k_conv1d_shared.bias"]
                {
                    if ckpt.tensors.contains_key(&format!("{p}{name}")) {
                        slices.push(slice(name, SliceRole::Conv));
                    }
                }
            }
            // One state per (head, partition), head-major: state j belongs to key head j / (N+1).
            layers.push(LayerState {
                layer: i,
                key_heads: d.heads,
                value_heads: d.heads * (d.partitions + 1),
                dv: d.dv,
                slices,
            });
        }
        Ok(StateLayout { family: "SSE".into(), dk: d.dk, layers, num_layers: cfg.num_hidden_layers })
    }

    fn layers(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        vb: candle_nn::VarBuilder<'static>,
    ) -> Result<Box<dyn super::layered::Layers>> {
        Ok(Box::new(sse_stack(ckpt, opts, vb, None)?))
    }

    fn set_key_width(&self, config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()> {
        // fla: head_v_dim = int(head_dim * expand_v); keep d_v (and the LoRA / output-gate rank,
        // which is head_v_dim too) by rescaling expand_v.
        let dv = layout.layers.first().map_or(0, |l| l.dv);
        config["head_dim"] = Value::from(dk);
        config["expand_v"] = Value::from(super::fla::float_for_product(dv, dk));
        Ok(())
    }

    fn keep_partitions(
        &self,
        config: &mut Value,
        keep: &BTreeMap<usize, Vec<usize>>,
    ) -> Result<Vec<(String, Vec<usize>)>> {
        let cfg = SseConfig::from_value(config)?;
        let (n, topk) = (cfg.num_sparse_partition, cfg.num_writer);
        let Some(count) = keep.values().next().map(Vec::len) else { return Ok(Vec::new()) };
        if keep.values().any(|k| k.len() != count) {
            bail!("every layer must keep the same number of partitions");
        }
        if count <= topk || count >= n {
            bail!(
                "--prune-partitions {count}: must be more than num_writer ({topk}, which fla requires) and less than \
                 num_sparse_partition ({n}, which keeping them all leaves unchanged)"
            );
        }
        if keep.values().flatten().any(|&p| p >= n) {
            bail!("partition index out of range (num_sparse_partition {n})");
        }
        config["num_sparse_partition"] = Value::from(count);
        // The router is the only tensor with a row per partition: the states live at run time.
        Ok(keep.iter().map(|(l, k)| (format!("model.layers.{l}.attn.e_proj.weight"), k.clone())).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> Value {
        json!({"model_type": "sse", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 64,
               "num_sparse_partition": 4, "num_writer": 2, "num_reader": 2})
    }

    /// Partition pruning reads the config as loading does: a value of the wrong type is an
    /// error naming it, not fla's default.
    #[test]
    fn keep_partitions_refuses_wrong_types() {
        let keep: BTreeMap<usize, Vec<usize>> = [(0, vec![0, 1, 3]), (1, vec![0, 1, 2])].into();
        let mut c = config();
        SseFamily.keep_partitions(&mut c, &keep).unwrap();
        assert_eq!(c["num_sparse_partition"], json!(3));
        for (key, bad) in [("num_writer", json!("2")), ("num_sparse_partition", json!(4.5))] {
            let mut c = config();
            c[key] = bad;
            let e = format!("{:#}", SseFamily.keep_partitions(&mut c, &keep).unwrap_err());
            assert!(e.contains(&format!("config key {key}: invalid type")), "{e}");
        }
    }

    /// The hybrid's `attn` dict is read with the rest: a bad field names its key.
    #[test]
    fn attn_fields_name_their_key() {
        let mut c = config();
        c["attn"] = json!({"layers": [1], "num_heads": 4, "qk_norm": "yes"});
        let e = SseConfig::from_value(&c).unwrap_err().to_string();
        assert!(e.contains("config key attn.qk_norm: invalid type"), "{e}");
        c["attn"] = json!({"layers": [1], "num_heads": 4, "rope_theta": "1e4"});
        let e = SseConfig::from_value(&c).unwrap_err().to_string();
        assert!(e.contains("config key attn.rope_theta: invalid type"), "{e}");
        c["attn"] = json!({"layers": [1], "num_heads": 4});
        let cfg = SseConfig::from_value(&c).unwrap();
        assert!(cfg.dims().is_ok() && cfg.is_attention(1) && !cfg.is_attention(0));
    }
}
