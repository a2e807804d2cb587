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
fn fixture(name: &str) -> Option<&'static Fixture> {
    static DN: OnceLock<Option<Fixture>> = OnceLock::new();
    static GDN: OnceLock<Option<Fixture>> = OnceLock::new();
    let cell = if name == "delta_net" { &DN } else { &GDN };
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

fn check_model(name: &str) {
    let Some(f) = fixture(name) else { return };
    let input = tensors(&f.model);
    let cfg_in = read_json(&f.model.join("config.json"));
    for method in METHODS {
        for (ratio, dk) in [("0.5", 32usize), ("0.75", 16)] {
            let out = prune(f, method, ratio);
            let report = read_json(&out.join("statecut_report.json"));
            assert_eq!(report["dk_after"], dk);
            let ppl = &report["ppl"];
            let (before, after) = (ppl["before"].as_f64().unwrap(), ppl["after"].as_f64().unwrap());
            assert!(after.is_finite() && after > 1.0, "{method} {ratio}: ppl {after}");
            eprintln!("{name} {method} {ratio}: ppl {before:.2} -> {after:.2}");

            // Config: the fields fla reads to rebuild the model, everything else unchanged.
            let cfg = read_json(&out.join("config.json"));
            let (heads, hidden) =
                (cfg["num_heads"].as_u64().unwrap() as usize, cfg["hidden_size"].as_u64().unwrap() as usize);
            match name {
                "delta_net" => {
                    let e = cfg["expand_k"].as_f64().unwrap();
                    assert_eq!(((hidden as f64) * e) as usize, heads * dk);
                }
                _ => {
                    assert_eq!(cfg["head_dim"], dk);
                    let e = cfg["expand_v"].as_f64().unwrap();
                    assert_eq!(((dk as f64) * e) as usize, 128, "d_v must stay 128");
                }
            }
            for (k, v) in cfg_in.as_object().unwrap() {
                if !["expand_k", "expand_v", "head_dim"].contains(&k.as_str()) {
                    assert_eq!(&cfg[k], v, "config key {k} changed");
                }
            }

            // Shapes and bytes: sliced tensors keep exactly the reported rows, the rest is identical.
            let output = tensors(&out);
            assert_eq!(output.keys().collect::<Vec<_>>(), input.keys().collect::<Vec<_>>());
            for (t, (shape, bytes)) in &output {
                let (in_shape, in_bytes) = &input[t];
                let sliced =
                    ["q_proj", "k_proj", "q_conv1d", "k_conv1d"].iter().any(|p| t.contains(&format!("attn.{p}.")));
                if !sliced {
                    assert!(shape == in_shape && bytes == in_bytes, "{t} must be byte-identical");
                    continue;
                }
                assert_eq!(shape[0], heads * dk, "{t}");
                assert_eq!(&shape[1..], &in_shape[1..], "{t}");
                let layer: usize = t.split('.').nth(2).unwrap().parse().unwrap();
                let row = in_bytes.len() / in_shape[0];
                let heads_rep = report["layers"][layer]["heads"].as_array().unwrap();
                let mut expect = Vec::new();
                for (h, hr) in heads_rep.iter().enumerate() {
                    let kept = hr["kept"].as_array().unwrap();
                    assert_eq!(kept.len(), dk);
                    for j in kept {
                        let r = h * 64 + j.as_u64().unwrap() as usize;
                        expect.extend_from_slice(&in_bytes[r * row..(r + 1) * row]);
                    }
                }
                assert!(bytes == &expect, "{t}: rows differ from the reported kept channels");
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
