//! `statecut sweep` end to end: a cell's perplexity equals a separate `prune` + `eval` run, the
//! grid resumes from saved cells, bad grids fail with one line, and an unmeetable budget
//! recommends none. Recall tasks (`eval --task`) run on every family.

mod common;

use common::{model_dir, shared, statecut};
use std::path::Path;

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn sweep_cell_matches_prune_then_eval() {
    let Some(data) = shared() else { return };
    let model = s(&model_dir("gated_deltanet").unwrap());
    let calib = s(&data.join("data/calib/wiki.jsonl"));
    let eval = s(&data.join("data/eval/wiki.jsonl"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let cal = ["--calib", &calib, "--nsamples", "4", "--seqlen", "256", "--rows", "512"];
    let mut args = vec!["sweep", "-m", &model, "--methods", "drrqr,l1", "--ratios", "0.5,0.75"];
    args.extend(cal);
    let o = s(&out);
    args.extend(["--eval", &eval, "--eval-windows", "4", "--eval-seqlen", "256", "-o", &o, "-q"]);
    let (code, stdout, stderr) = statecut(&args, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("cells"), "{stdout}");
    let report = json(&out.join("sweep.json"));
    for f in ["sweep.md", "ppl_0_wiki.svg", "layers.svg"] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let cell =
        report["cells"].as_array().unwrap().iter().find(|c| c["method"] == "drrqr" && c["ratio"] == 0.5).unwrap();
    let sweep_ppl = cell["ppl"][0].as_f64().unwrap();
    assert_eq!(cell["dk"], 32);
    assert!(!cell["layers"].as_array().unwrap().is_empty());

    // The same cell by prune, then eval of the written checkpoint.
    let pruned = s(&tmp.path().join("pruned"));
    let mut p = vec!["prune", "-m", &model, "--method", "drrqr", "--ratio", "0.5", "-o", &pruned, "-q"];
    p.extend(cal);
    let (code, _, stderr) = statecut(&p, &[]);
    assert_eq!(code, 0, "{stderr}");
    let ev = |m: &str| -> f64 {
        let (code, stdout, stderr) =
            statecut(&["eval", "-m", m, "--data", &eval, "--windows", "4", "--seqlen", "256", "--json"], &[]);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()["ppl"].as_f64().unwrap()
    };
    let separate = ev(&pruned);
    assert!((sweep_ppl - separate).abs() <= 1e-6 * separate, "sweep {sweep_ppl} vs prune+eval {separate}");
    let base = ev(&model);
    let unpruned = report["unpruned"]["ppl"][0].as_f64().unwrap();
    assert!((unpruned - base).abs() <= 1e-6 * base, "sweep unpruned {unpruned} vs eval {base}");

    // Rerun with the same settings: every cell is reused, the numbers are the same; a budget no
    // ratio meets recommends none.
    let mut again = args.clone();
    again.pop();
    again.extend(["--budget", "0%"]);
    let (code, stdout, stderr) = statecut(&again, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("reusing 5 finished cells"), "{stderr}");
    assert!(stdout.contains("recommended: none"), "{stdout}");
    let r2 = json(&out.join("sweep.json"));
    assert!(r2["recommendation"].is_null());
    assert_eq!(r2["cells_evaluated"], 0);
    assert_eq!(r2["cells"], report["cells"]);
    assert!(std::fs::read_to_string(out.join("sweep.md")).unwrap().contains("**none**"));

    // A generous budget recommends the largest ratio, with the command that makes it.
    let mut wide = args.clone();
    wide.extend(["--budget", "1000%"]);
    let (code, stdout, _) = statecut(&wide, &[]);
    assert_eq!(code, 0);
    let rec = &json(&out.join("sweep.json"))["recommendation"];
    assert_eq!(rec["ratio"], 0.75, "{stdout}");
    assert!(rec["command"].as_str().unwrap().starts_with("statecut prune -m "), "{rec}");

    // Other settings in the same directory: one error instead of mixing results.
    let mut other = args.clone();
    let at = other.iter().position(|a| *a == "256").unwrap();
    other[at] = "128";
    let (code, _, stderr) = statecut(&other, &[]);
    assert_eq!(code, 1);
    assert!(stderr.contains("holds a sweep with other settings"), "{stderr}");
}

#[test]
fn sweep_rejects_a_ratio_that_leaves_no_channels() {
    let Some(data) = shared() else { return };
    let model = s(&model_dir("gated_deltanet").unwrap());
    let eval = s(&data.join("data/eval/wiki.jsonl"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let (code, _, stderr) =
        statecut(&["sweep", "-m", &model, "--ratios", "0.5,0.999", "--eval", &eval, "-o", &s(&out)], &[]);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: --ratios 0.999 leaves 0 of 64 key channels"), "{stderr}");
    assert!(!out.exists(), "nothing is written for a bad grid");
    let (code, _, stderr) =
        statecut(&["sweep", "-m", &model, "--eval", &eval, "--budget", "lots", "-o", &s(&out)], &[]);
    assert_eq!(code, 1);
    assert!(stderr.starts_with("error: --budget lots"), "{stderr}");
}

#[test]
fn recall_tasks_run_on_every_family_and_are_seeded() {
    if shared().is_none() {
        return;
    }
    for family in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
        let model = s(&model_dir(family).unwrap());
        let run = |task: &[&str]| -> serde_json::Value {
            let mut a = vec!["eval", "-m", &model, "--json"];
            a.extend(task);
            let (code, stdout, stderr) = statecut(&a, &[]);
            assert_eq!(code, 0, "{family}: {stderr}");
            serde_json::from_str(&stdout).unwrap()
        };
        let mqar = ["--task", "mqar", "--pairs", "4", "--context-len", "48", "--samples", "3"];
        let r = run(&mqar);
        assert_eq!(r["total"], 12, "{family}: {r}");
        assert_eq!(r["buckets"].as_array().unwrap().len(), 8);
        assert_eq!(run(&mqar)["correct"], r["correct"], "{family}: seeded");
        let pk = ["--task", "passkey", "--lengths", "200,300", "--depths", "0,1", "--samples", "2"];
        let r = run(&pk);
        assert_eq!(r["total"], 8, "{family}: {r}");
        assert_eq!(r["buckets"].as_array().unwrap().len(), 4);
    }
}

#[test]
fn recall_longer_than_the_context_is_one_error() {
    if shared().is_none() {
        return;
    }
    // Qwen3.5 has rotary attention layers: max_position_embeddings (32768 here) is a hard limit.
    let model = s(&model_dir("qwen3_5").unwrap());
    let (code, _, stderr) = statecut(&["eval", "-m", &model, "--task", "passkey", "--lengths", "4096,40000"], &[]);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("passkey needs 40000 tokens but the model's context is 32768"), "{stderr}");
    let (code, _, stderr) =
        statecut(&["eval", "-m", &model, "--task", "mqar", "--pairs", "40", "--context-len", "64"], &[]);
    assert_eq!(code, 1);
    assert!(stderr.contains("too short for 40 pairs"), "{stderr}");
}
