//! End to end: calibrate a reference model once, prune it with every selector at two ratios,
//! reload the output, check shapes, config, untouched bytes and perplexity.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const METHODS: [&str; 5] = ["l1", "swanda", "grad", "rand", "drrqr"];

struct Fixture {
    _tmp: tempfile::TempDir,
    acts: PathBuf,
    out: PathBuf,
    model: PathBuf,
    eval: String,
}

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    out
}

/// One calibration (with gradients) per model, shared by the tests of this file.
fn fixture(name: &'static str) -> Option<&'static Fixture> {
    static CELLS: [(&str, OnceLock<Option<Fixture>>); 4] = [
        ("delta_net", OnceLock::new()),
        ("gated_deltanet", OnceLock::new()),
        ("mamba2", OnceLock::new()),
        ("qwen3_5", OnceLock::new()),
    ];
    let cell = &CELLS.iter().find(|(n, _)| *n == name).expect("known model").1;
    cell.get_or_init(|| {
        let model = common::model_dir(name)?;
        let shared = common::shared()?;
        let tmp = tempfile::tempdir().unwrap();
        let acts = tmp.path().join("acts.safetensors");
        let calib = shared.join("data/calib/wiki.jsonl");
        run_ok(&[
            "calibrate",
            "-m",
            model.to_str().unwrap(),
            "--calib",
            calib.to_str().unwrap(),
            "--nsamples",
            "8",
            "--seqlen",
            "256",
            "--rows",
            "1000",
            "--grad",
            "-o",
            acts.to_str().unwrap(),
            "-q",
        ]);
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let eval = shared.join("data/eval/wiki.jsonl").to_string_lossy().into_owned();
        Some(Fixture { _tmp: tmp, acts, out, model, eval })
    })
    .as_ref()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn prune(f: &Fixture, method: &str, ratio: &str) -> PathBuf {
    let out = f.out.join(format!("{method}-{ratio}"));
    run_ok(&[
        "prune",
        "-m",
        f.model.to_str().unwrap(),
        "--method",
        method,
        "--ratio",
        ratio,
        "--activations",
        f.acts.to_str().unwrap(),
        "--eval",
        &f.eval,
        "--eval-windows",
        "4",
        "--eval-seqlen",
        "256",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ]);
    out
}

/// Raw bytes and shape of every tensor of a single-file safetensors checkpoint.
fn tensors(dir: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
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
fn edited_keys(name: &str) -> &'static [&'static str] {
    match name {
        "delta_net" => &["expand_k"],
        "gated_deltanet" => &["head_dim", "expand_v"],
        "mamba2" => &["state_size"],
        _ => &["linear_key_head_dim"],
    }
}

fn check_model(name: &'static str) {
    use statecut::arch::family_for;
    use statecut::checkpoint::Checkpoint;
    let Some(f) = fixture(name) else { return };
    let input = tensors(&f.model);
    let cfg_in = read_json(&f.model.join("config.json"));
    let ckpt_in = Checkpoint::open(&f.model).unwrap();
    let layout_in = family_for(&ckpt_in).unwrap().layout(&ckpt_in).unwrap();
    let dk_in = layout_in.dk;
    for method in METHODS {
        for (ratio, dk) in [("0.5", dk_in / 2), ("0.75", dk_in / 4)] {
            let out = prune(f, method, ratio);
            let report = read_json(&out.join("statecut_report.json"));
            assert_eq!(report["dk_after"], dk);
            let ppl = &report["ppl"];
            let (before, after) = (ppl["before"].as_f64().unwrap(), ppl["after"].as_f64().unwrap());
            assert!(after.is_finite() && after > 1.0, "{method} {ratio}: ppl {after}");
            eprintln!("{name} {method} {ratio}: ppl {before:.2} -> {after:.2}");

            // Config: only the key-width fields change, and statecut reads back the new geometry
            // with every value width unchanged.
            let cfg = read_json(&out.join("config.json"));
            for (k, v) in cfg_in.as_object().unwrap() {
                if !edited_keys(name).contains(&k.as_str()) {
                    assert_eq!(&cfg[k], v, "config key {k} changed");
                }
            }
            let ckpt_out = Checkpoint::open(&out).unwrap();
            let layout_out = family_for(&ckpt_out).unwrap().layout(&ckpt_out).unwrap();
            assert_eq!(layout_out.dk, dk);
            for (a, b) in layout_in.layers.iter().zip(&layout_out.layers) {
                assert_eq!((a.layer, a.key_heads, a.value_heads, a.dv), (b.layer, b.key_heads, b.value_heads, b.dv));
            }

            // Bytes: sliced tensors hold exactly the input rows of the reported kept channels
            // (FORMATS.md row formulas), every other tensor is identical.
            let output = tensors(&out);
            assert_eq!(output.keys().collect::<Vec<_>>(), input.keys().collect::<Vec<_>>());
            let mut dropped: std::collections::BTreeMap<String, std::collections::BTreeSet<usize>> = Default::default();
            for (li, l) in layout_in.layers.iter().enumerate() {
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
                let (in_shape, in_bytes) = &input[t];
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
            let json = run_ok(&[
                "eval",
                "-m",
                out.to_str().unwrap(),
                "--data",
                &f.eval,
                "--windows",
                "4",
                "--seqlen",
                "256",
                "--json",
            ]);
            let reloaded: Value = serde_json::from_str(&json).unwrap();
            assert!(
                (reloaded["ppl"].as_f64().unwrap() - after).abs() < 1e-6 * after,
                "reloaded ppl differs from the report"
            );
            // Ten checkpoints per model at once would fill a small temp disk.
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
}

#[test]
fn delta_net_every_method_two_ratios() {
    check_model("delta_net");
}

#[test]
fn gated_deltanet_every_method_two_ratios() {
    check_model("gated_deltanet");
}

#[test]
fn mamba2_every_method_two_ratios() {
    check_model("mamba2");
}

#[test]
fn qwen3_5_every_method_two_ratios() {
    check_model("qwen3_5");
}
