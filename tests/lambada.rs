//! `statecut eval --task lambada` end to end on first sentences of `eval/wiki.jsonl`: counts,
//! the metrics' definitions, batching, one document's log-likelihood recomputed here from the
//! model's logits, and lm-eval-harness's own scores (`scripts/lambada_reference.py`).

mod common;

use candle_core::{DType, Tensor, D};
use common::{model_dir, shared, statecut};
use statecut::arch::NoObserver;
use std::path::Path;

/// The first sentence of each of the first `n` documents of `wiki.jsonl`.
fn sentences(shared: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(shared.join("data/eval/wiki.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().to_string())
        .map(|t| t.split_once(". ").map_or(t.clone(), |(s, _)| format!("{s}.")))
        .take(n)
        .collect()
}

/// A jsonl with the texts in the field `passage`.
fn write_jsonl(path: &Path, texts: &[String]) {
    let lines: Vec<String> = texts.iter().map(|t| serde_json::json!({ "passage": t }).to_string()).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let (code, out, err) = statecut(args, &[]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

/// log p(target | context) and whether greedy decoding reproduces the target, computed directly:
/// the text cut at its last space, both parts encoded, the target the whole text's extra tokens.
fn direct(dir: &Path, text: &str) -> (f64, bool) {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let (context, _) = text.rsplit_once(' ').unwrap();
    let ids = |s: &str| tok.encode(s, true).unwrap().get_ids().to_vec();
    let (whole, n_ctx) = (ids(text), ids(context).len());
    let model = common::load_cpu(dir);
    let input = Tensor::new(&whole[..whole.len() - 1], &candle_core::Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let logits = model.forward(&input, &mut NoObserver).unwrap().squeeze(0).unwrap().to_dtype(DType::F32).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap().to_vec2::<f32>().unwrap();
    let (mut ll, mut greedy) = (0f64, true);
    for (pos, &t) in whole.iter().enumerate().skip(n_ctx) {
        let row = &logp[pos - 1];
        ll += row[t as usize] as f64;
        let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        greedy &= best == t as usize;
    }
    (ll, greedy)
}

#[test]
fn lambada_counts_metrics_and_loglik() {
    let Some(shared) = shared() else { return };
    let dir = model_dir("delta_net").unwrap();
    let model = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("lambada.jsonl");
    let mut texts = sentences(&shared, 8);
    // No space, and empty: skipped with a count.
    texts.extend(["Unsplittable".to_string(), String::new()]);
    write_jsonl(&data, &texts);
    let data = data.to_str().unwrap();
    let base = ["eval", "-m", model, "--task", "lambada", "--data", data, "--text-column", "passage", "--json"];

    let r = run_json(&[&base[..], &["--batch-size", "3"]].concat());
    assert_eq!((r["total"].as_u64(), r["skipped"].as_u64()), (Some(8), Some(2)), "{r}");
    let (correct, acc) = (r["correct"].as_u64().unwrap(), r["accuracy"].as_f64().unwrap());
    assert!((0.0..=1.0).contains(&acc) && correct <= 8 && acc == correct as f64 / 8.0, "{r}");
    let (ll, ppl) = (r["loglik"].as_f64().unwrap(), r["ppl"].as_f64().unwrap());
    assert!(ll < 0.0 && ((-ll / 8.0).exp() - ppl).abs() <= 1e-9 * ppl, "{r}");

    // Right padding in a batch leaves every document's score as it is alone.
    let one = run_json(&[&base[..], &["--batch-size", "1"]].concat());
    assert_eq!(one["correct"], r["correct"]);
    let ll1 = one["loglik"].as_f64().unwrap();
    assert!((ll1 - ll).abs() <= 1e-4 * ll.abs(), "batch 1: {ll1} vs batch 3: {ll}");

    // The first document alone, against the model's own logits.
    let first = run_json(&[&base[..], &["--limit", "1"]].concat());
    assert_eq!(first["total"], 1);
    let (want, greedy) = direct(&dir, &texts[0]);
    let got = first["loglik"].as_f64().unwrap();
    eprintln!("first document: loglik {got:.6}, direct {want:.6}, greedy {greedy}");
    assert!((got - want).abs() <= 1e-4 * want.abs(), "loglik {got} vs direct {want}");
    assert_eq!(first["correct"], u64::from(greedy));

    // Text output.
    let (code, out, err) = statecut(&base[..base.len() - 1], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("lambada accuracy {acc:.4} ({correct} / 8), ppl ")), "{out}");
    assert!(err.contains("warning: skipped 2 of 10 documents"), "{err}");
}

/// lm-eval's `lambada_openai` protocol on the same documents (`tests/fixtures/lambada/`),
/// including texts that end in a newline or a space or have two spaces before the last word: the
/// same greedy count and the same summed log-likelihood to float32 rounding.
#[test]
fn lambada_matches_lm_eval() {
    let Some(_) = shared() else { return };
    let fixture = common::repo_file("tests/fixtures/lambada");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("lm_eval.json")).unwrap()).unwrap();
    let data = fixture.join("docs.jsonl");
    for (name, want) in reference["models"].as_object().unwrap() {
        let model = model_dir(name).unwrap();
        let args = ["eval", "-m", model.to_str().unwrap(), "--task", "lambada", "--data", data.to_str().unwrap()];
        let r = run_json(&[&args[..], &["--batch-size", "4", "--json"]].concat());
        let lls: Vec<f64> = want["loglik"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let greedy = want["is_greedy"].as_array().unwrap().iter().filter(|v| v.as_bool().unwrap()).count();
        let (got, ll) = (r["loglik"].as_f64().unwrap(), lls.iter().sum::<f64>());
        eprintln!("{name}: loglik {got:.5} vs lm-eval {ll:.5}, ppl {} vs {}", r["ppl"], want["perplexity"]);
        assert_eq!(r["total"].as_u64(), Some(lls.len() as u64), "{name}: {r}");
        assert_eq!(r["correct"].as_u64(), Some(greedy as u64), "{name}: {r}");
        assert!((got - ll).abs() <= 1e-4 * ll.abs(), "{name}: loglik {got} vs lm-eval {ll}");
        let (ppl, want_ppl) = (r["ppl"].as_f64().unwrap(), want["perplexity"].as_f64().unwrap());
        assert!((ppl - want_ppl).abs() <= 1e-3 * want_ppl, "{name}: ppl {ppl} vs lm-eval {want_ppl}");
        // Layer-streamed, the same batches go through layer by layer.
        let streamed = run_json(&[&args[..], &["--batch-size", "4", "--json", "--offload"]].concat());
        assert_eq!(streamed["correct"], r["correct"], "{name}");
        let s = streamed["loglik"].as_f64().unwrap();
        assert!((s - got).abs() <= 1e-6 * got.abs(), "{name}: layer-streamed loglik {s} vs {got}");
    }
}

#[test]
fn lambada_contexts_longer_than_seqlen_are_cut() {
    let Some(shared) = shared() else { return };
    let model = model_dir("mamba2").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("lambada.jsonl");
    let texts = sentences(&shared, 4);
    write_jsonl(&data, &texts);
    // Documents of more than seqlen + 1 tokens: the model reads only their last seqlen.
    let tok = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).unwrap();
    let long = texts.iter().filter(|t| tok.encode(t.as_str(), true).unwrap().len() > 13).count();
    assert!(long > 0);
    let args = ["eval", "-m", model.to_str().unwrap(), "--task", "lambada", "--data", data.to_str().unwrap()];
    let r =
        run_json(&[&args[..], &["--text-column", "passage", "--seqlen", "12", "--batch-size", "4", "--json"]].concat());
    assert_eq!(
        (r["total"].as_u64(), r["truncated"].as_u64(), r["longest_input"].as_u64()),
        (Some(4), Some(long as u64), Some(12))
    );
}

#[test]
fn lambada_without_usable_documents_is_one_error() {
    let Some(_) = shared() else { return };
    let model = model_dir("delta_net").unwrap();
    let model = model.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("words.jsonl");
    write_jsonl(&data, &["Alone".into(), String::new(), " leading".into()]);
    let data = data.to_str().unwrap();
    let (code, out, err) =
        statecut(&["eval", "-m", model, "--task", "lambada", "--data", data, "--text-column", "passage"], &[]);
    assert_eq!((code, out.as_str(), err.lines().count()), (1, "", 1), "{err}");
    assert!(err.contains(data) && err.contains("none of its 3 documents") && err.contains("--text-column"), "{err}");

    let (code, _, err) = statecut(&["eval", "-m", model, "--task", "lambada"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("--task lambada needs --data FILE"), "{err}");
    let (code, _, err) = statecut(&["eval", "-m", model, "--limit", "3"], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("--limit counts lambada documents"), "{err}");
}
