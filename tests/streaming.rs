//! Layer-streamed runs equal resident ones: on every reference model and the Qwen3.5 MoE
//! fixtures, with a device-memory
//! budget so small that every layer streams, prune keeps the same channels and measures the
//! same perplexity, and eval and inspect agree; a budget below one layer is one clear error.

mod common;

use serde_json::Value;
use std::path::Path;

const MODELS: [&str; 4] = ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"];

/// The reference models, then the committed Qwen3.5 MoE fixtures (wrapper and flat export).
fn models(shared: &Path) -> Vec<(String, std::path::PathBuf)> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let reference = MODELS.iter().map(|n| (n.to_string(), shared.join("models").join(n)));
    let moe = ["qwen3_5_moe", "qwen3_5_moe_text"].into_iter().map(|n| (n.to_string(), fixtures.join(n)));
    reference.chain(moe).collect()
}

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    out
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: streamed {a} vs resident {b}");
}

/// Kept channels per layer and head, from a prune report.
fn kept(report: &Value) -> Vec<Vec<Value>> {
    report["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["heads"].as_array().unwrap().iter().map(|h| h["kept"].clone()).collect())
        .collect()
}

/// Every number of two JSON values within 1e-5 relative (inspect reports), everything else equal.
fn same_json(a: &Value, b: &Value, at: &str) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-12), "{at}: streamed {x} vs resident {y}");
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{at}");
            x.iter().zip(y).enumerate().for_each(|(i, (x, y))| same_json(x, y, &format!("{at}[{i}]")));
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "{at}");
            x.iter().for_each(|(k, v)| same_json(v, &y[k], &format!("{at}.{k}")));
        }
        _ => assert_eq!(a, b, "{at}"),
    }
}

/// The bytes one layer needs, as the too-small-budget error states them.
fn one_layer_bytes(err: &str) -> u64 {
    let at = err.find(" bytes)").expect("the error states the bytes");
    let start = err[..at].rfind('(').unwrap() + 1;
    err[start..at].parse().unwrap()
}

#[test]
fn prune_streamed_equals_resident() {
    let Some(shared) = common::shared() else { return };
    let calib = shared.join("data/calib/wiki.jsonl");
    let eval = shared.join("data/eval/wiki.jsonl");
    let tmp = tempfile::tempdir().unwrap();
    for (name, model) in models(&shared) {
        let prune = |out: &Path, extra: &[&str]| -> (i32, String) {
            let mut args = vec![
                "prune",
                "-m",
                model.to_str().unwrap(),
                "--method",
                "drrqr",
                "--ratio",
                "0.5",
                "--calib",
                calib.to_str().unwrap(),
                "--nsamples",
                "4",
                "--seqlen",
                "128",
                "--rows",
                "600",
                "--eval",
                eval.to_str().unwrap(),
                "--eval-windows",
                "3",
                "--eval-seqlen",
                "128",
                "-o",
                out.to_str().unwrap(),
                "-q",
            ];
            args.extend_from_slice(extra);
            let (code, _, err) = common::statecut(&args, &[]);
            (code, err)
        };
        let resident = tmp.path().join(format!("{name}-resident"));
        let (code, err) = prune(&resident, &[]);
        assert_eq!(code, 0, "{name}: {err}");

        // A budget below the largest stage: one error line saying what one layer needs.
        let small = tmp.path().join(format!("{name}-small"));
        let (code, err) = prune(&small, &["--max-device-memory", "1KiB"]);
        assert_ne!(code, 0);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(lines[0].starts_with("error: --max-device-memory 1.0 KiB is smaller than one layer"), "{err}");
        assert!(!small.exists(), "{name}: nothing is written");
        let need = one_layer_bytes(&err);

        // Exactly one stage's worth: every layer streams.
        let streamed = tmp.path().join(format!("{name}-streamed"));
        let (code, err) = prune(&streamed, &["--max-device-memory", &need.to_string()]);
        assert_eq!(code, 0, "{name}: {err}");
        let (a, b) =
            (read_json(&streamed.join("statecut_report.json")), read_json(&resident.join("statecut_report.json")));
        assert_eq!(a["memory"]["streamed"], true, "{name}");
        assert_eq!(b["memory"]["streamed"], false, "{name}");
        assert!(a["memory"]["peak_bytes"].as_u64().unwrap() > 0);
        assert_eq!(kept(&a), kept(&b), "{name}: kept channels");
        for k in ["before", "after"] {
            close(a["ppl"][k].as_f64().unwrap(), b["ppl"][k].as_f64().unwrap(), &format!("{name} ppl {k}"));
        }
        // The pruned checkpoints are the same bytes.
        for f in ["model.safetensors", "config.json"] {
            assert!(std::fs::read(streamed.join(f)).unwrap() == std::fs::read(resident.join(f)).unwrap(), "{name} {f}");
        }
    }
}

#[test]
fn eval_and_inspect_streamed_equal_resident() {
    let Some(shared) = common::shared() else { return };
    let eval = shared.join("data/eval/wiki.jsonl");
    for (name, model) in models(&shared) {
        let m = model.to_str().unwrap();
        let e = eval.to_str().unwrap();
        let ev = |extra: &[&str]| -> Value {
            let mut args = vec!["eval", "-m", m, "--data", e, "--windows", "4", "--seqlen", "96", "--batch-size", "2"];
            args.extend_from_slice(extra);
            args.push("--json");
            serde_json::from_str(&run_ok(&args)).unwrap()
        };
        let (res, st) = (ev(&[]), ev(&["--offload"]));
        close(st["ppl"].as_f64().unwrap(), res["ppl"].as_f64().unwrap(), &format!("{name} eval"));
        assert_eq!(st["tokens"], res["tokens"]);

        let ins = |extra: &[&str]| -> Value {
            let mut args = vec!["inspect", "-m", m, "--data", e, "--nsamples", "3", "--seqlen", "64", "--rows", "300"];
            args.extend_from_slice(extra);
            args.push("--json");
            serde_json::from_str(&run_ok(&args)).unwrap()
        };
        same_json(&ins(&["--offload"]), &ins(&[]), &format!("{name} inspect"));
    }
}

#[test]
fn gradients_are_refused_when_streaming() {
    let Some(shared) = common::shared() else { return };
    let model = shared.join("models/delta_net");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("acts.safetensors");
    let (code, _, err) = common::statecut(
        &["calibrate", "-m", model.to_str().unwrap(), "--grad", "--offload", "--nsamples", "1", "--seqlen", "32", "-o"]
            .into_iter()
            .chain([out.to_str().unwrap()])
            .collect::<Vec<_>>(),
        &[],
    );
    assert_ne!(code, 0);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: --grad / --method grad needs a backward pass"), "{err}");
    assert!(!out.exists());
}
