//! The hybrid families, each from a checkpoint saved by its transformers class
//! (scripts/make_hybrid_fixtures.py): logits and hidden states against transformers' own float32
//! outputs, step-by-step decoding against the full forward and against transformers' decode,
//! prune -> reload with every selector at two ratios (untouched bytes, config, perplexity), and
//! the bad-input errors. Needs nothing outside the repository.

mod common;

use candle_core::{DType, Tensor};
use common::{fixture, flat, golden_ids, load_cpu, pruned, rel_err, Hidden};
use serde_json::Value;
use statecut::arch::{family_for, DecodeCache, NoObserver};
use statecut::checkpoint::Checkpoint;
use std::path::{Path, PathBuf};

/// Every hybrid fixture: the per-family test matrix is this list.
const FIXTURES: [&str; 5] = ["nemotron_h", "granite_h", "granite_h_dense", "falcon_h1", "kimi_linear"];
/// Those whose library can load a pruned checkpoint (Kimi Linear's config has one width for
/// keys and values: `kimi_prune_is_refused_before_any_work`).
const PRUNABLE: [&str; 4] = ["nemotron_h", "granite_h", "granite_h_dense", "falcon_h1"];

#[test]
fn logits_and_hidden_states_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let golden = common::golden(&dir);
        let mut hidden = Hidden(Vec::new());
        let logits = load_cpu(&dir).forward(&golden_ids(&dir), &mut hidden).unwrap();
        let pos = golden["logit_positions"].to_dtype(DType::U32).unwrap();
        let err = rel_err(&flat(&logits.index_select(&pos, 1).unwrap()), &flat(&golden["logits"]));
        eprintln!("{name}: logits relative error {err:.3e}");
        assert!(err < 1e-4, "{name}: logits relative error {err:.3e}");
        let gh = &golden["hidden_states"];
        assert_eq!(hidden.0.len(), gh.dim(0).unwrap(), "{name}: number of hidden states");
        for (i, h) in hidden.0.iter().enumerate() {
            let err = rel_err(&flat(h), &flat(&gh.get(i).unwrap()));
            assert!(err < 1e-4, "{name}: hidden_states[{i}] relative error {err:.3e}");
        }
    }
}

/// A 64-token prefill then one token at a time equals the full forward, and at the golden
/// positions transformers' own step-by-step decode.
#[test]
fn decode_matches_forward_and_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let golden = common::golden(&dir);
        let model = load_cpu(&dir);
        let ids = golden_ids(&dir);
        let n = ids.dim(1).unwrap();
        let full = model.forward(&ids, &mut NoObserver).unwrap();
        let mut cache = DecodeCache::default();
        let mut parts = vec![model.forward_cached(&ids.narrow(1, 0, 64).unwrap(), &mut cache).unwrap()];
        for t in 64..n {
            parts.push(model.forward_cached(&ids.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
        }
        let stepped = Tensor::cat(&parts, 1).unwrap();
        let err = rel_err(&flat(&stepped), &flat(&full));
        eprintln!("{name}: decode vs full forward relative error {err:.2e}");
        assert!(err < 1e-5, "{name}: {err}");
        let pos: Vec<u32> = flat(&golden["logit_positions"]).iter().map(|&p| p as u32).filter(|&p| p >= 64).collect();
        let all: Vec<u32> = flat(&golden["logit_positions"]).iter().map(|&p| p as u32).collect();
        let rows: Vec<u32> = (0..all.len() as u32).filter(|&i| all[i as usize] >= 64).collect();
        let ours = stepped.index_select(&Tensor::new(pos.as_slice(), stepped.device()).unwrap(), 1).unwrap();
        let theirs = golden["logits_decode"].index_select(&Tensor::new(rows.as_slice(), ours.device()).unwrap(), 1);
        let err = rel_err(&flat(&ours), &flat(&theirs.unwrap()));
        eprintln!("{name}: decode vs transformers' decode relative error {err:.2e}");
        assert!(err < 1e-4, "{name}: {err}");
    }
}

fn text() -> String {
    common::repo_file("assets/train.txt").to_str().unwrap().to_string()
}

#[test]
fn prune_reload_every_selector() {
    let text = text();
    let eval = ["--data", text.as_str(), "--windows", "2", "--seqlen", "64"];
    for name in PRUNABLE {
        let dir = fixture(name);
        let input = pruned::Input::open(&dir);
        let dk_in = input.layout.dk;
        let tmp = tempfile::tempdir().unwrap();
        for method in ["l1", "swanda", "grad", "rand", "drrqr"] {
            for (ratio, dk) in [("0.5", dk_in / 2), ("0.75", dk_in / 4)] {
                let out = tmp.path().join(format!("{method}-{ratio}"));
                #[rustfmt::skip]
                let args = [
                    "prune", "-m", dir.to_str().unwrap(), "--method", method, "--ratio", ratio,
                    "--calib", &text, "--nsamples", "2", "--seqlen", "64",
                    "--eval", &text, "--eval-windows", "2", "--eval-seqlen", "64", "-o", out.to_str().unwrap(), "-q",
                ];
                let (code, _, err) = common::statecut(&args, &[]);
                assert_eq!(code, 0, "{name} {method} {ratio}: {err}");
                let (before, after) = pruned::check(&input, &out, method, dk, &eval);
                eprintln!("{name} {method} {ratio}: d_k {dk_in} -> {dk}, ppl {before:.3} -> {after:.3}");
            }
        }
    }
}

#[test]
fn inspect_reports_every_mamba_layer() {
    let text = text();
    for name in FIXTURES {
        let dir = fixture(name);
        let args = [
            "inspect",
            "-m",
            dir.to_str().unwrap(),
            "--data",
            &text,
            "--nsamples",
            "1",
            "--seqlen",
            "64",
            "--json",
            "-q",
        ];
        let (code, out, err) = common::statecut(&args, &[]);
        assert_eq!(code, 0, "{name}: {err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let layout = family_for(&ckpt).unwrap().layout(&ckpt).unwrap();
        let layers = v["layers"].as_array().unwrap();
        let want: Vec<u64> = layout.layers.iter().map(|l| l.layer as u64).collect();
        let got: Vec<u64> = layers.iter().map(|l| l["layer"].as_u64().unwrap()).collect();
        assert_eq!(got, want, "{name}");
    }
}

/// A copy of fixture `name` with `edit` applied to its config.json.
fn with_config(tmp: &Path, name: &str, edit: impl Fn(&mut Value)) -> PathBuf {
    let d = tmp.join(format!("{name}-edited"));
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(d.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    d
}

fn fails_cleanly(model: &Path, expect: &str) {
    let out = model.with_file_name("never");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    let text = text();
    for args in [
        vec!["prune", "-m", m, "--method", "l1", "--ratio", "0.5", "--calib", &text, "--nsamples", "1", "-o", o],
        vec!["inspect", "-m", m, "--data", &text, "--nsamples", "1", "--seqlen", "16"],
    ] {
        let (code, _, err) = common::statecut(&args, &[]);
        assert_eq!(code, 1, "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(expect), "expected {expect:?} in: {err}");
        assert!(!out.exists(), "output written");
    }
}

#[test]
fn kimi_prune_is_refused_before_any_work() {
    let dir = fixture("kimi_linear");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never");
    let text = text();
    for dry in [false, true] {
        let mut args = vec!["prune", "-m", dir.to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "--calib", &text];
        args.extend(["--nsamples", "1", "-o", out.to_str().unwrap()]);
        if dry {
            args.push("--dry-run");
        }
        let (code, _, err) = common::statecut(&args, &[]);
        assert_eq!(code, 1, "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].contains("kimi_linear checkpoints cannot be pruned"), "{err}");
        assert!(!out.exists(), "output written");
    }
}

#[test]
fn bad_patterns_and_layer_lists() {
    let tmp = tempfile::tempdir().unwrap();
    let d = with_config(tmp.path(), "nemotron_h", |c| c["hybrid_override_pattern"] = "M-M*E".into());
    fails_cleanly(&d, "names 5 layers but num_hidden_layers is 6");
    let d = with_config(tmp.path(), "nemotron_h", |c| c["hybrid_override_pattern"] = "M-M*XM".into());
    fails_cleanly(&d, "has 'X' at position 4");
    let d = with_config(tmp.path(), "granite_h", |c| c["layer_types"][1] = "conv".into());
    fails_cleanly(&d, "layer_types[1] is \"conv\"");
    let d = with_config(tmp.path(), "granite_h", |c| c["num_hidden_layers"] = 4.into());
    fails_cleanly(&d, "layer_types names 5 layers but num_hidden_layers is 4");
    let d = with_config(tmp.path(), "falcon_h1", |c| c["mamba_d_ssm"] = 50.into());
    fails_cleanly(&d, "4 heads x head_dim 12 != inner width 50");
    let d = with_config(tmp.path(), "kimi_linear", |c| {
        c["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 6])
    });
    fails_cleanly(&d, "layers are numbered 1..=5");
    let d =
        with_config(tmp.path(), "kimi_linear", |c| c["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2]));
    fails_cleanly(&d, "layer 4 is in neither kda_layers nor full_attn_layers");
}

/// A value of the wrong type is an error naming the key and the file, never the default.
#[test]
fn wrong_types_name_the_key_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, key, bad) in [
        ("falcon_h1", "mamba_conv_bias", Value::from("yes")),
        ("falcon_h1", "rope_theta", Value::from("1e11")),
        ("falcon_h1", "mlp_multipliers", serde_json::json!([1.0])),
        ("granite_h_dense", "rope_theta", Value::from("1e4")),
        ("granite_h", "mamba_conv_bias", Value::from(1)),
        ("nemotron_h", "use_conv_bias", Value::from("yes")),
        ("nemotron_h", "layer_norm_epsilon", Value::from("1e-5")),
    ] {
        let d = with_config(tmp.path(), name, |c| c[key] = bad.clone());
        fails_cleanly(&d, &d.join("config.json").display().to_string());
        fails_cleanly(&d, &format!("config key {key}: invalid "));
    }
    // Kimi Linear refuses pruning before it reads the config: load it instead
    let d = with_config(tmp.path(), "kimi_linear", |c| c["linear_attn_config"]["num_heads"] = "2".into());
    let ckpt = Checkpoint::open(&d).unwrap();
    let e = family_for(&ckpt).unwrap().load(&ckpt, &statecut::arch::LoadOptions::cpu_f32()).err().unwrap();
    let e = format!("{e:#}");
    assert!(e.contains("config.json") && e.contains("config key linear_attn_config.num_heads: invalid type"), "{e}");
}
