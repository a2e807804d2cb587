//! What must hold for a pruned checkpoint against its input: the report's width, the config
//! (only the key-width fields change), the geometry statecut reads back, the bytes (sliced
//! tensors hold exactly the input rows of the reported kept channels, every other tensor is
//! identical) and the perplexity of a reload.

use serde_json::Value;
use statecut::arch::{family_for, StateLayout};
use statecut::checkpoint::Checkpoint;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Raw bytes and shape of every tensor of a single-file safetensors checkpoint.
pub fn tensors(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str),
        Some("pt"),
        "{}",
        dir.display()
    );
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect()
}

/// The config keys each family edits to express a new key width.
fn edited_keys(model_type: &str) -> &'static [&'static str] {
    match model_type {
        "delta_net" => &["expand_k"],
        "gated_deltanet" => &["head_dim", "expand_v"],
        "mamba2" => &["state_size"],
        "nemotron_h" => &["ssm_state_size"],
        "granitemoehybrid" | "falcon_h1" => &["mamba_d_state"],
        _ => &["linear_key_head_dim"],
    }
}

/// An unpruned checkpoint, read once.
pub struct Input {
    pub dir: PathBuf,
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    pub config: Value,
    pub layout: StateLayout,
}

impl Input {
    pub fn open(dir: &Path) -> Self {
        let ckpt = Checkpoint::open(dir).unwrap();
        let layout = family_for(&ckpt).unwrap().layout(&ckpt).unwrap();
        Self { dir: dir.to_path_buf(), tensors: tensors(dir), config: read_json(&dir.join("config.json")), layout }
    }
}

/// Checks `out`, pruned from `input` with `method` to `dk` channels per head, and reloads it with
/// `statecut eval` plus `eval_args`, which must reproduce the report's perplexity. Returns the
/// report's perplexity before and after.
pub fn check(input: &Input, out: &Path, method: &str, dk: usize, eval_args: &[&str]) -> (f64, f64) {
    let report = read_json(&out.join("statecut_report.json"));
    assert_eq!(report["dk_after"], dk);
    let ppl = &report["ppl"];
    let (before, after) = (ppl["before"].as_f64().unwrap(), ppl["after"].as_f64().unwrap());
    assert!(after.is_finite() && after > 1.0, "{method}: ppl {after}");

    // Config: only the key-width fields change, and statecut reads back the new geometry
    // with every value width unchanged.
    let cfg = read_json(&out.join("config.json"));
    let edited = edited_keys(input.config["model_type"].as_str().unwrap_or_default());
    for (k, v) in input.config.as_object().unwrap() {
        if !edited.contains(&k.as_str()) {
            assert_eq!(&cfg[k], v, "config key {k} changed");
        }
    }
    let ckpt_out = Checkpoint::open(out).unwrap();
    let layout_out = family_for(&ckpt_out).unwrap().layout(&ckpt_out).unwrap();
    assert_eq!(layout_out.dk, dk);
    for (a, b) in input.layout.layers.iter().zip(&layout_out.layers) {
        assert_eq!((a.layer, a.key_heads, a.value_heads, a.dv), (b.layer, b.key_heads, b.value_heads, b.dv));
    }

    // Bytes: sliced tensors hold exactly the input rows of the reported kept channels
    // (FORMATS.md row formulas), every other tensor is identical.
    let dk_in = input.layout.dk;
    let output = tensors(out);
    assert_eq!(output.keys().collect::<Vec<_>>(), input.tensors.keys().collect::<Vec<_>>());
    let mut dropped: BTreeMap<String, BTreeSet<usize>> = Default::default();
    for (li, l) in input.layout.layers.iter().enumerate() {
        let heads_rep = report["layers"][li]["heads"].as_array().unwrap();
        assert_eq!(report["layers"][li]["layer"], l.layer);
        for s in &l.slices {
            let set = dropped.entry(s.tensor.clone()).or_default();
            for (h, hr) in heads_rep.iter().enumerate() {
                let kept: Vec<usize> =
                    hr["kept"].as_array().unwrap().iter().map(|j| j.as_u64().unwrap() as usize).collect();
                assert_eq!(kept.len(), dk);
                set.extend((0..dk_in).filter(|j| !kept.contains(j)).map(|j| s.offset + h * s.head_stride + j));
            }
        }
    }
    for (t, (shape, bytes)) in &output {
        let (in_shape, in_bytes) = &input.tensors[t];
        match dropped.get(t) {
            None => assert!(shape == in_shape && bytes == in_bytes, "{t} must be byte-identical"),
            Some(drop) => {
                let row = in_bytes.len() / in_shape[0];
                let expect: Vec<u8> = (0..in_shape[0])
                    .filter(|r| !drop.contains(r))
                    .flat_map(|r| in_bytes[r * row..(r + 1) * row].iter().copied())
                    .collect();
                assert_eq!(shape[0], in_shape[0] - drop.len(), "{t}");
                assert_eq!(&shape[1..], &in_shape[1..], "{t}");
                assert!(bytes == &expect, "{t}: rows differ from the reported kept channels");
            }
        }
    }
    if method == "drrqr" {
        let b = &report["rrqr_bounds_hold"];
        assert_eq!(b[0], b[1], "strong-RRQR bounds must hold for every head: {b}");
    }

    // Reload with statecut: perplexity matches what the report says.
    let args = [&["eval", "-m", out.to_str().unwrap()], eval_args, &["--json"]].concat();
    let (code, json, err) = super::statecut(&args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    let reloaded: Value = serde_json::from_str(&json).unwrap();
    assert!((reloaded["ppl"].as_f64().unwrap() - after).abs() < 1e-6 * after, "reloaded ppl differs from the report");
    (before, after)
}
