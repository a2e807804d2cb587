//! `statecut sweep` end to end: a cell's perplexity equals a separate `prune` + `eval` run, the
//! grid resumes from saved cells, bad grids fail with one line, and an unmeetable budget
//! recommends none; `--write` writes a cell's checkpoint as `prune` would. Recall tasks
//! (`eval --task`) run on every family.

mod common;

use common::{embedded_model, model_dir, pruned, repo_file, shared, statecut};
use std::collections::BTreeMap;
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

/// Every file under `dir`, by its path relative to `dir`, with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(s(p.strip_prefix(root).unwrap()), std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `sweep --write` on the shipped model (no reference data needed): the cell's checkpoint under
/// `out/models/<method>-<ratio>` reloads with the perplexity the cell reports, its config has
/// the pruned key width, the tensors it does not slice are byte-identical to the input, the
/// sliced ones keep input rows in order, and the input directory is not touched.
#[test]
fn sweep_write_checkpoint_reloads_with_the_cells_perplexity() {
    let model_path = embedded_model();
    let model = s(&model_path);
    let before = snapshot(&model_path);
    let input = pruned::Input::open(&model_path);
    assert_eq!(input.layout.dk, 64);
    let eval = s(&repo_file("assets/eval.txt"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let o = s(&out);
    #[rustfmt::skip]
    let args = [
        "sweep", "-m", &model, "--methods", "drrqr", "--ratios", "0.5", "--nsamples", "2", "--seqlen", "256",
        "--eval", &eval, "--eval-windows", "2", "--eval-seqlen", "256", "--write", "-o", &o, "-q",
    ];
    let (code, stdout, stderr) = statecut(&args, &[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("cells"), "{stdout}");
    let report = json(&out.join("sweep.json"));
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 1);
    let cell = &cells[0];
    assert_eq!(cell["method"], "drrqr");
    assert_eq!(cell["ratio"], 0.5);
    assert_eq!(cell["dk"], 32);
    let sweep_ppl = cell["ppl"][0].as_f64().unwrap();
    let unpruned = report["unpruned"]["ppl"][0].as_f64().unwrap();
    assert!(sweep_ppl.is_finite() && sweep_ppl > unpruned, "pruned {sweep_ppl} vs unpruned {unpruned}");

    let written = out.join("models/drrqr-0.5");
    assert!(written.join("statecut_recipe.toml").exists(), "no recipe in {}", written.display());
    let (code, stdout, stderr) =
        statecut(&["eval", "-m", &s(&written), "--data", &eval, "--windows", "2", "--seqlen", "256", "--json"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let reloaded = serde_json::from_str::<serde_json::Value>(&stdout).unwrap()["ppl"].as_f64().unwrap();
    assert!((reloaded - sweep_ppl).abs() <= 1e-6 * sweep_ppl, "written {reloaded} vs sweep cell {sweep_ppl}");

    // Config: the key width is the cell's, d_v is kept (fla: head_dim * expand_v), nothing else changes.
    let cfg = pruned::read_json(&written.join("config.json"));
    assert_eq!(cfg["head_dim"], 32);
    assert_eq!(cfg["expand_v"].as_f64().unwrap() * 32.0, input.config["expand_v"].as_f64().unwrap() * 64.0);
    for (k, v) in input.config.as_object().unwrap() {
        if k != "head_dim" && k != "expand_v" {
            assert_eq!(&cfg[k], v, "config key {k} changed");
        }
    }

    // Tensors: those with no key/query rows are byte-identical; the sliced ones lose
    // (64 - 32) rows per key head and slice, and keep the rest of the input rows, in order.
    let mut sliced: BTreeMap<&str, usize> = BTreeMap::new();
    for l in &input.layout.layers {
        for sl in &l.slices {
            *sliced.entry(sl.tensor.as_str()).or_default() += l.key_heads * (64 - 32);
        }
    }
    assert!(!sliced.is_empty());
    let output = pruned::tensors(&written);
    assert_eq!(output.keys().collect::<Vec<_>>(), input.tensors.keys().collect::<Vec<_>>());
    for (t, (shape, bytes)) in &output {
        let (in_shape, in_bytes) = &input.tensors[t];
        let Some(drop) = sliced.get(t.as_str()) else {
            assert!(shape == in_shape && bytes == in_bytes, "{t} must be byte-identical");
            continue;
        };
        assert_eq!((shape[0], &shape[1..]), (in_shape[0] - drop, &in_shape[1..]), "{t}");
        let row = in_bytes.len() / in_shape[0];
        let mut input_rows = in_bytes.chunks(row);
        for r in bytes.chunks(row) {
            assert!(input_rows.any(|x| x == r), "{t}: a row that is not an input row, or out of order");
        }
    }
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"] {
        assert_eq!(std::fs::read(written.join(f)).unwrap(), before[f], "{f}");
    }
    assert!(snapshot(&model_path) == before, "the input checkpoint directory changed");

    // A finished sweep resumed with --write writes the checkpoints it had not written.
    std::fs::remove_dir_all(&written).unwrap();
    let (code, _, stderr) = statecut(&args, &[]);
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, stderr) =
        statecut(&["eval", "-m", &s(&written), "--data", &eval, "--windows", "2", "--seqlen", "256", "--json"], &[]);
    assert_eq!(code, 0, "{stderr}");
    let again = serde_json::from_str::<serde_json::Value>(&stdout).unwrap()["ppl"].as_f64().unwrap();
    assert_eq!(again, reloaded, "the rewritten checkpoint differs");
    // The recommendation line of sweep.md is one paragraph (no line starting with "; recall").
    assert!(!std::fs::read_to_string(out.join("sweep.md")).unwrap().contains("\n;"));
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

/// The grid's flags are typed as `prune`'s are: an unknown selector or --score-on, a ratio
/// outside (0, 1) and --round-to 0 each end in one line naming the flag, before anything runs.
#[test]
fn sweep_flags_validate_like_prune() {
    let model = s(&embedded_model());
    let eval = s(&repo_file("assets/eval.txt"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sweep");
    let cases: [(&[&str], &str); 6] = [
        (&["--methods", "drrqr,magic"], "--methods magic"),
        (&["--methods", ""], "--methods"),
        (&["--score-on", "kk"], "--score-on kk"),
        (&["--ratios", "0.5,1.5"], "--ratios 1.5"),
        (&["--ratios", "0.5,nan"], "--ratios nan"),
        (&["--round-to", "0"], "--round-to 0"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["sweep", "-m", &model, "--eval", &eval, "-o", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (code, _, stderr) = statecut(&args, &[]);
        assert_eq!(code, 1, "{extra:?}");
        assert_eq!(stderr.trim().lines().count(), 1, "{extra:?}: {stderr}");
        assert!(stderr.starts_with("error: ") && stderr.contains(want), "{extra:?}: {stderr}");
        assert!(!out.exists());
    }
}
