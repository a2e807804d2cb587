//! The model that ships in the repository (`assets/models/gdn-moby`, made by
//! `scripts/train_embedded_model.py`): everything here runs on any machine, with no reference
//! data and no network. Its golden outputs and perplexity come from the training script's own
//! PyTorch forward (`tests/fixtures/gdn_moby`).

mod common;

use common::{flat, pruned};
use serde_json::Value;
use statecut::arch::{family_for, LoadOptions, Observer};
use statecut::checkpoint::Checkpoint;
use std::path::Path;

const EVAL: &str = "assets/eval.txt";

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    out
}

fn fixture() -> std::path::PathBuf {
    common::repo_file("tests/fixtures/gdn_moby")
}

struct Hidden(Vec<candle_core::Tensor>);
impl Observer for Hidden {
    fn hidden(&mut self, _i: usize, h: &candle_core::Tensor) -> anyhow::Result<()> {
        self.0.push(h.clone());
        Ok(())
    }
}

/// statecut's float32 forward reproduces the training script's logits and hidden states.
#[test]
fn forward_matches_training_script() {
    let golden = common::golden(&fixture());
    let ckpt = Checkpoint::open(&common::embedded_model()).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = golden["input_ids"].to_dtype(candle_core::DType::U32).unwrap();
    let mut hidden = Hidden(Vec::new());
    let logits = model.forward(&ids, &mut hidden).unwrap();
    let err = common::rel_err(&flat(&logits), &flat(&golden["logits"]));
    eprintln!("gdn-moby: logits relative error {err:.3e}");
    assert!(err < 1e-5, "logits relative error {err:.3e} >= 1e-5");
    let gh = &golden["hidden_states"];
    assert_eq!(hidden.0.len(), gh.dim(0).unwrap(), "number of hidden states");
    for (i, h) in hidden.0.iter().enumerate() {
        let err = common::rel_err(&flat(h), &flat(&gh.get(i).unwrap()));
        assert!(err < 1e-5, "hidden_states[{i}] relative error {err:.3e} >= 1e-5");
    }
}

/// `statecut eval` on the held-out text, default protocol (64 windows of 512 tokens), gives the
/// perplexity the training script measured.
#[test]
fn eval_matches_training_script() {
    let reference = pruned::read_json(&fixture().join("reference.json"));
    let want = reference["eval_ppl_f32_512x64"].as_f64().unwrap();
    let model = common::embedded_model();
    let eval = common::repo_file(EVAL);
    let json = run_ok(&["eval", "-m", model.to_str().unwrap(), "--data", eval.to_str().unwrap(), "--json"]);
    let r: Value = serde_json::from_str(&json).unwrap();
    assert_eq!((r["windows"].as_u64(), r["tokens"].as_u64()), (Some(64), Some(64 * 512)));
    let got = r["ppl"].as_f64().unwrap();
    eprintln!("gdn-moby: ppl {got:.4} vs training script {want:.4}");
    assert!((got - want).abs() / want < 1e-4, "ppl {got} vs training script {want}");
}

/// Prune with the built-in calibration text, as the README's main command does.
fn prune(method: &str, out: &Path) {
    let model = common::embedded_model();
    let eval = common::repo_file(EVAL);
    run_ok(&[
        "prune",
        "-m",
        model.to_str().unwrap(),
        "--method",
        method,
        "--ratio",
        "0.5",
        "--nsamples",
        "4",
        "--seqlen",
        "512",
        "--eval",
        eval.to_str().unwrap(),
        "--eval-windows",
        "4",
        "--eval-seqlen",
        "256",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ]);
}

/// Full prune -> reload -> eval: every selector's output passes the checks of a pruned
/// checkpoint (report, config, geometry, bytes, reloaded perplexity), pruning costs perplexity,
/// the selectors choose differently, and the input is not touched.
#[test]
fn prune_reload_eval_every_method() {
    let model = common::embedded_model();
    let weights_before = std::fs::read(model.join("model.safetensors")).unwrap();
    let input = pruned::Input::open(&model);
    assert_eq!(input.layout.dk, 64);
    let eval = common::repo_file(EVAL);
    let eval_args = ["--data", eval.to_str().unwrap(), "--windows", "4", "--seqlen", "256"];
    let tmp = tempfile::tempdir().unwrap();
    let mut ppl = Vec::new();
    for method in ["drrqr", "l1", "rand"] {
        let out = tmp.path().join(method);
        prune(method, &out);
        let (before, after) = pruned::check(&input, &out, method, 32, &eval_args);
        eprintln!("gdn-moby {method} 0.5: ppl {before:.2} -> {after:.2}");
        assert!(after > before, "{method}: pruning half the key channels cannot be free ({before} -> {after})");
        for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"] {
            assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(model.join(f)).unwrap(), "{f}");
        }
        ppl.push((method, after));
    }
    for (i, (a, pa)) in ppl.iter().enumerate() {
        for (b, pb) in &ppl[i + 1..] {
            assert!((pa - pb).abs() > 1e-3 * pa, "{a} and {b} give the same perplexity {pa}");
        }
    }
    assert_eq!(std::fs::read(model.join("model.safetensors")).unwrap(), weights_before, "input weights changed");
}

/// `inspect` reports every layer and head with utilizations in (0, 1].
#[test]
fn inspect_reports_every_head() {
    let model = common::embedded_model();
    let json =
        run_ok(&["inspect", "-m", model.to_str().unwrap(), "--nsamples", "2", "--seqlen", "256", "--json", "-q"]);
    let r: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(r["dk"], 64);
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4);
    for l in layers {
        let heads = l["heads"].as_array().unwrap();
        assert_eq!(heads.len(), 2);
        for h in heads {
            let u = h["utilization"].as_f64().unwrap();
            assert!(u > 0.0 && u <= 1.0 + 1e-9, "utilization {u}");
            assert!(h["kappa"].as_f64().unwrap() >= 1.0);
        }
    }
}
