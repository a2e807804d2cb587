//! Mamba-2 (`mamba2`): transformers `Mamba2ForCausalLM` checkpoints and mamba_ssm
//! `MambaLMHeadModel` ones (config without `model_type`, weights in `pytorch_model.bin`).
//!
//! Follows mamba `mamba_ssm/modules/mamba2.py` and transformers `modeling_mamba2.py`. The SSM is
//! the plain linear-attention recurrence with k = B, q = C, v = x, β = dt, g = dt·A, so groups
//! play the part of key heads and N = `d_state` is the key width.

mod config;
mod model;

#[cfg(test)]
use super::SliceRole;
use super::{Family, LayerState, LoadOptions, StateLayout};
use crate::checkpoint::Checkpoint;
use crate::layers::mamba2::Mamba2Dims;
use anyhow::{Context, Result};
use serde_json::Value;

pub use config::{float_of, Format, Mamba2Config};
pub use model::mamba2_stack;

fn config(ckpt: &Checkpoint) -> Result<Mamba2Config> {
    Mamba2Config::from_value(&ckpt.config)
        .with_context(|| format!("{}/config.json does not match the Mamba-2 format", ckpt.dir.display()))
}

/// Layout of a Mamba-2 model (FORMATS.md §2a pruning recipe): B and C rows of `in_proj` and
/// channels of `conv1d`, each group owning N consecutive rows.
pub fn layout_of(cfg: &Mamba2Config, has_tensor: impl Fn(&str) -> bool) -> StateLayout {
    let mixers = (0..cfg.layers).map(|l| (l, format!("backbone.layers.{l}.mixer.")));
    mixer_layout(&cfg.dims(), "Mamba2", mixers, cfg.layers, has_tensor)
}

/// The state layout of a model of `num_layers` layers whose recurrent ones are the Mamba-2
/// mixers `mixers` of sizes `dims` (decoder layer, tensor prefix `…mixer.`); `has_tensor` says
/// whether a mixer stores its optional conv bias.
pub fn mixer_layout(
    dims: &Mamba2Dims,
    family: &str,
    mixers: impl IntoIterator<Item = (usize, String)>,
    num_layers: usize,
    has_tensor: impl Fn(&str) -> bool,
) -> StateLayout {
    let layers = mixers
        .into_iter()
        .map(|(layer, p)| LayerState {
            layer,
            key_heads: dims.groups,
            value_heads: dims.heads,
            dv: dims.head_dim,
            slices: dims.slices(&p, has_tensor(&format!("{p}conv1d.bias"))),
        })
        .collect();
    StateLayout { family: family.into(), dk: dims.state, layers, num_layers }
}

pub struct Mamba2Family;

impl Family for Mamba2Family {
    fn model_types(&self) -> &'static [&'static str] {
        &["mamba2"]
    }

    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        Ok(layout_of(&config(ckpt)?, |t| ckpt.tensors.contains_key(t)))
    }

    fn layers(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        vb: candle_nn::VarBuilder<'static>,
    ) -> Result<Box<dyn super::layered::Layers>> {
        Ok(Box::new(mamba2_stack(ckpt, &config(ckpt)?, opts, vb)?))
    }

    fn set_key_width(&self, config: &mut Value, _layout: &StateLayout, dk: usize) -> Result<()> {
        match Format::detect(config) {
            Format::Hf => config["state_size"] = Value::from(dk),
            Format::MambaSsm => {
                let ssm = config.as_object_mut().context("config.json is not an object")?;
                let ssm = ssm.entry("ssm_cfg").or_insert_with(|| Value::Object(Default::default()));
                ssm.as_object_mut().context("ssm_cfg is not an object")?.insert("d_state".into(), Value::from(dk));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hf() -> Value {
        json!({"model_type": "mamba2", "hidden_size": 256, "num_heads": 8, "head_dim": 64, "state_size": 64,
               "n_groups": 2, "expand": 2, "num_hidden_layers": 3, "vocab_size": 4096,
               "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    }

    #[test]
    fn layout_rows() {
        let cfg = Mamba2Config::from_value(&hf()).unwrap();
        let l = layout_of(&cfg, |_| true);
        assert_eq!((l.dk, l.layers.len()), (64, 3));
        let s = &l.layers[2];
        assert_eq!((s.key_heads, s.value_heads, s.dv), (2, 8, 64));
        let rows: Vec<_> = s.slices.iter().map(|r| (r.tensor.as_str(), r.offset, r.head_stride, r.role)).collect();
        let p = "backbone.layers.2.mixer.";
        assert_eq!(
            rows,
            [
                (&*format!("{p}in_proj.weight"), 1024, 64, SliceRole::KeyProj),
                (&*format!("{p}in_proj.weight"), 1024 + 128, 64, SliceRole::QueryProj),
                (&*format!("{p}conv1d.weight"), 512, 64, SliceRole::Conv),
                (&*format!("{p}conv1d.weight"), 512 + 128, 64, SliceRole::Conv),
                (&*format!("{p}conv1d.bias"), 512, 64, SliceRole::Conv),
                (&*format!("{p}conv1d.bias"), 512 + 128, 64, SliceRole::Conv),
            ]
        );
        // the dt rows follow C: in_proj has 2·d_inner + 2·G·N + H rows
        assert_eq!(cfg.in_proj_dim(), 1024 + 256 + 8);
        assert_eq!(layout_of(&cfg, |_| false).layers[0].slices.len(), 4);
    }

    #[test]
    fn set_key_width_hf_and_mamba_ssm() {
        let mut c = hf();
        let layout = layout_of(&Mamba2Config::from_value(&c).unwrap(), |_| true);
        Mamba2Family.set_key_width(&mut c, &layout, 48).unwrap();
        assert_eq!(c["state_size"], 48);
        assert_eq!(Mamba2Config::from_value(&c).unwrap().state, 48);

        // mamba_ssm: the key is added when ssm_cfg relies on the default
        let mut c = json!({"d_model": 256, "n_layer": 2, "vocab_size": 4096, "ssm_cfg": {"layer": "Mamba2"}});
        Mamba2Family.set_key_width(&mut c, &layout, 40).unwrap();
        assert_eq!(c["ssm_cfg"], json!({"layer": "Mamba2", "d_state": 40}));
        let mut c = json!({"d_model": 256, "n_layer": 2, "ssm_cfg": {"layer": "Mamba2", "d_state": 64}});
        Mamba2Family.set_key_width(&mut c, &layout, 32).unwrap();
        assert_eq!(Mamba2Config::from_value(&c).unwrap().state, 32);
    }
}
