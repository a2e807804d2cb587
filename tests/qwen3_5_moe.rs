//! Qwen3.5/3.6 MoE: the released wrapper (`qwen3_5_moe`) and the flat text export
//! (`qwen3_5_moe_text`), saved by transformers (scripts/make_qwen3_5_moe_fixtures.py), against
//! transformers' own float32 outputs, in both expert storage layouts, decoded step by step, and
//! pruned end to end. Needs nothing outside the repository.

mod common;

use candle_core::{DType, Tensor};
use common::{fixture, flat, golden_ids, load_cpu, rel_err, Hidden};
use serde_json::Value;
use statecut::arch::{family_for, DecodeCache, NoObserver};
use statecut::checkpoint::Checkpoint;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 2] = ["qwen3_5_moe", "qwen3_5_moe_text"];

/// Stored tensors of a single-file checkpoint: name -> (dtype, shape, bytes).
type Tensors = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(dir: &Path) -> Tensors {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

/// A copy of the checkpoint `src` in `dst` whose weights are `edit(tensors of src)`.
fn copy_with(src: &Path, dst: &Path, edit: impl FnOnce(Tensors) -> Tensors) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_owned();
        if name != "model.safetensors" {
            std::fs::copy(&p, dst.join(name)).unwrap();
        }
    }
    let out = edit(read_tensors(src));
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &dst.join("model.safetensors")).unwrap();
}

/// The decoder layers' fused experts split into `experts.{e}.{gate,up,down}_proj.weight`, as
/// re-exports (and transformers' save_pretrained) store them.
fn unfuse(t: Tensors) -> Tensors {
    let mut out = Tensors::new();
    for (name, (d, s, b)) in t {
        let (prefix, gate_up) = match (name.strip_suffix(".gate_up_proj"), name.strip_suffix(".down_proj")) {
            (Some(p), _) if p.ends_with("mlp.experts") => (p.to_string(), true),
            (_, Some(p)) if p.ends_with("mlp.experts") => (p.to_string(), false),
            _ => {
                out.insert(name, (d, s, b));
                continue;
            }
        };
        let (e, rows, cols) = (s[0], s[1], s[2]);
        let per = b.len() / e;
        for x in 0..e {
            let block = &b[x * per..(x + 1) * per];
            if gate_up {
                let half = block.len() / 2;
                out.insert(format!("{prefix}.{x}.gate_proj.weight"), (d, vec![rows / 2, cols], block[..half].to_vec()));
                out.insert(format!("{prefix}.{x}.up_proj.weight"), (d, vec![rows / 2, cols], block[half..].to_vec()));
            } else {
                out.insert(format!("{prefix}.{x}.down_proj.weight"), (d, vec![rows, cols], block.to_vec()));
            }
        }
    }
    out
}

#[test]
fn logits_and_hidden_states_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(name);
        let golden = common::golden(&dir);
        let model = load_cpu(&dir);
        let mut hidden = Hidden(Vec::new());
        let logits = model.forward(&golden_ids(&dir), &mut hidden).unwrap();
        let pos = golden["logit_positions"].to_dtype(DType::U32).unwrap();
        let logits = logits.index_select(&pos, 1).unwrap();
        let err = rel_err(&flat(&logits), &flat(&golden["logits"]));
        eprintln!("{name}: logits relative error {err:.3e}");
        assert!(err < 1e-5, "{name}: logits relative error {err:.3e}");
        let gh = &golden["hidden_states"];
        assert_eq!(hidden.0.len(), gh.dim(0).unwrap(), "{name}: number of hidden states");
        for (i, h) in hidden.0.iter().enumerate() {
            let err = rel_err(&flat(h), &flat(&gh.get(i).unwrap()));
            eprintln!("{name}: hidden_states[{i}] relative error {err:.3e}");
            assert!(err < 1e-5, "{name}: hidden_states[{i}] relative error {err:.3e}");
        }
    }
}

#[test]
fn fused_and_per_expert_layouts_agree() {
    for name in FIXTURES {
        let dir = fixture(name);
        let stored = read_tensors(&dir);
        assert!(stored.keys().any(|k| k.ends_with("layers.0.mlp.experts.gate_up_proj")), "{name} is fused");
        let tmp = tempfile::tempdir().unwrap();
        let split = tmp.path().join("split");
        copy_with(&dir, &split, unfuse);
        assert!(read_tensors(&split).keys().any(|k| k.ends_with("layers.0.mlp.experts.7.down_proj.weight")));
        let ids = golden_ids(&dir);
        let a = flat(&load_cpu(&dir).forward(&ids, &mut NoObserver).unwrap());
        let b = flat(&load_cpu(&split).forward(&ids, &mut NoObserver).unwrap());
        let err = rel_err(&b, &a);
        eprintln!("{name}: per-expert vs fused logits relative error {err:.3e}");
        assert!(err < 1e-6, "{name}: {err}");
    }
}

#[test]
fn decode_matches_forward() {
    for name in FIXTURES {
        let dir = fixture(name);
        let model = load_cpu(&dir);
        let ids = golden_ids(&dir).narrow(1, 0, 48).unwrap();
        let full = model.forward(&ids, &mut NoObserver).unwrap();
        let mut cache = DecodeCache::default();
        let mut parts = vec![model.forward_cached(&ids.narrow(1, 0, 40).unwrap(), &mut cache).unwrap()];
        for t in 40..48 {
            parts.push(model.forward_cached(&ids.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
        }
        let err = rel_err(&flat(&Tensor::cat(&parts, 1).unwrap()), &flat(&full));
        eprintln!("{name}: decode vs full forward relative error {err:.2e}");
        assert!(err < 1e-5, "{name}: {err}");
    }
}

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    out
}

/// Text for calibration and evaluation that ships with the repository.
fn repo_text(dir: &Path) -> PathBuf {
    let p = dir.join("text.txt");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let text = ["README.md", "docs/RESULTS.md", "docs/GPU.md"]
        .iter()
        .map(|f| std::fs::read_to_string(root.join(f)).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn prune_reload_keeps_everything_else() {
    for name in FIXTURES {
        let dir = fixture(name);
        let tmp = tempfile::tempdir().unwrap();
        let text = repo_text(tmp.path());
        let text = text.to_str().unwrap();
        let input = read_tensors(&dir);
        let cfg_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        for (ratio, dk) in [("0.5", 64), ("0.75", 32)] {
            let out = tmp.path().join(format!("out-{ratio}"));
            #[rustfmt::skip]
            run_ok(&[
                "prune", "-m", dir.to_str().unwrap(), "--method", "swanda", "--ratio", ratio,
                "--calib", text, "--nsamples", "4", "--seqlen", "128",
                "--eval", text, "--eval-windows", "4", "--eval-seqlen", "128", "-o", out.to_str().unwrap(), "-q",
            ]);
            let report: Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("statecut_report.json")).unwrap()).unwrap();
            assert_eq!(report["dk_after"], dk);
            let after = report["ppl"]["after"].as_f64().unwrap();
            eprintln!("{name} swanda {ratio}: ppl {} -> {after}", report["ppl"]["before"]);
            assert!(after.is_finite() && after > 1.0);

            // config.json: the input's bytes, key order included, with only the key width edited
            let want = cfg_text.replace("\"linear_key_head_dim\": 128", &format!("\"linear_key_head_dim\": {dk}"));
            assert_ne!(want, cfg_text);
            assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), want, "{name} {ratio}");

            // Only the q/k rows of the linear-attention in_proj_qkv and conv1d change; experts,
            // full attention, visual and mtp tensors are byte-identical.
            let output = read_tensors(&out);
            assert_eq!(output.keys().collect::<Vec<_>>(), input.keys().collect::<Vec<_>>());
            for (t, (d, shape, bytes)) in &output {
                let (d0, shape0, bytes0) = &input[t];
                assert_eq!(d, d0, "{t}");
                if t.ends_with("linear_attn.in_proj_qkv.weight") || t.ends_with("linear_attn.conv1d.weight") {
                    // 1 key head: q and k lose 128 - dk rows each
                    assert_eq!(shape[0], shape0[0] - 2 * (128 - dk), "{t}");
                    assert_eq!(shape[1..], shape0[1..], "{t}");
                } else {
                    assert!(shape == shape0 && bytes == bytes0, "{t} must be byte-identical");
                }
            }
            let ckpt = Checkpoint::open(&out).unwrap();
            assert_eq!(family_for(&ckpt).unwrap().layout(&ckpt).unwrap().dk, dk);

            // Reloaded, statecut computes the reported perplexity.
            let json = run_ok(&[
                "eval",
                "-m",
                out.to_str().unwrap(),
                "--data",
                text,
                "--windows",
                "4",
                "--seqlen",
                "128",
                "--json",
                "-q",
            ]);
            let ppl = serde_json::from_str::<Value>(&json).unwrap()["ppl"].as_f64().unwrap();
            eprintln!("{name} {ratio}: reloaded ppl {ppl}");
            assert!((ppl - after).abs() < 1e-6 * after, "reloaded ppl {ppl} vs report {after}");
        }
    }
}

/// `statecut` on `model` must exit 1 with one `error:` line containing every `expect`, and
/// leave `out` unwritten.
fn fails_cleanly(model: &Path, expect: &[&str]) {
    let out = model.with_file_name("never");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    for args in [
        vec!["prune", "-m", m, "--method", "swanda", "--ratio", "0.5", "--nsamples", "1", "--seqlen", "16", "-o", o],
        vec!["inspect", "-m", m, "--nsamples", "1", "--seqlen", "16"],
    ] {
        let (code, _, err) = common::statecut(&args, &[]);
        assert_eq!(code, 1, "{args:?}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].starts_with("error: "), "{err}");
        for e in expect {
            assert!(lines[0].contains(e), "expected {e:?} in: {err}");
        }
        assert!(!out.exists(), "output written");
    }
}

#[test]
fn bad_expert_shapes_and_configs() {
    let tmp = tempfile::tempdir().unwrap();
    // fused: one expert short
    let bad = tmp.path().join("fused");
    copy_with(&fixture("qwen3_5_moe_text"), &bad, |mut t| {
        let (_, s, b) = t.get_mut("model.layers.2.mlp.experts.down_proj").unwrap();
        s[0] -= 1;
        b.truncate(b.len() / 8 * 7);
        t
    });
    fails_cleanly(&bad, &["model.layers.2.mlp.experts.down_proj", "expected: [8, 16, 12]", "got: [7, 16, 12]"]);

    // per expert: one projection transposed
    let bad = tmp.path().join("split");
    copy_with(&fixture("qwen3_5_moe"), &bad, |t| {
        let mut t = unfuse(t);
        let (_, s, _) = t.get_mut("model.language_model.layers.1.mlp.experts.5.up_proj.weight").unwrap();
        s.reverse();
        t
    });
    fails_cleanly(
        &bad,
        &["model.language_model.layers.1.mlp.experts.5.up_proj.weight", "expected: [12, 16]", "got: [16, 12]"],
    );

    // a wrapper config without text_config, and an output gate Qwen3.5 does not have
    let edit_config = |dir: &str, f: &dyn Fn(&mut Value)| {
        let d = tmp.path().join(dir);
        copy_with(&fixture("qwen3_5_moe"), &d, |t| t);
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        f(&mut cfg);
        std::fs::write(d.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
        d
    };
    let d = edit_config("no_text_config", &|c| {
        c.as_object_mut().unwrap().remove("text_config");
    });
    fails_cleanly(&d, &["qwen3_5_moe config.json has no text_config"]);
    let d = edit_config("gate", &|c| c["text_config"]["output_gate_type"] = "sigmoid".into());
    fails_cleanly(&d, &["output_gate_type \"sigmoid\" is not supported"]);
}

/// A config.json written by hand in the released files' style (keys not sorted: `rope_parameters`
/// and `mamba_ssm_dtype` last, 4-space indent, Python's `1e-06`) comes back from a prune with
/// exactly its own bytes except the edited width.
#[test]
fn pruned_config_keeps_key_order_and_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("unsorted");
    copy_with(&fixture("qwen3_5_moe"), &src, |t| t);
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    // reversed key order at every level, the last-written keys of the releases moved to the end
    fn reorder(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().rev().collect();
                keys.sort_by_key(|k| ["rope_parameters", "mamba_ssm_dtype"].contains(&k.as_str()));
                Value::Object(keys.into_iter().map(|k| (k.clone(), reorder(&m[k]))).collect())
            }
            other => other.clone(),
        }
    }
    let mut text_config = reorder(&cfg["text_config"]);
    text_config["mamba_ssm_dtype"] = "float32".into();
    let mut top = reorder(&cfg);
    top["text_config"] = text_config;
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    serde::Serialize::serialize(&top, &mut serde_json::Serializer::with_formatter(&mut buf, fmt)).unwrap();
    let text = String::from_utf8(buf).unwrap().replace("1e-6", "1e-06") + "\n";
    assert!(text.contains("\"rms_norm_eps\": 1e-06") && text.contains("\"pad_token_id\": null"));
    assert!(text.rfind("\"vocab_size\"").unwrap() < text.rfind("\"rope_parameters\"").unwrap());
    std::fs::write(src.join("config.json"), &text).unwrap();

    let out = tmp.path().join("out");
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    run_ok(&["prune", "-m", s, "--method", "l1", "--ratio", "0.75", "-o", o, "-q"]);
    let want = text.replace("\"linear_key_head_dim\": 128", "\"linear_key_head_dim\": 32");
    assert_ne!(want, text);
    assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), want);
}
