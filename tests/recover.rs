//! `statecut recover` end to end on the embedded model: the merged output is W + (α/r)·B·A with
//! every other tensor byte for byte, a seeded run is repeatable and `--resume` continues it
//! exactly, recovery closes part of the pruning gap, and bad input fails in one line with
//! nothing written.

mod common;

use common::pruned::{read_json, tensors};
use common::{embedded_model, repo_file, statecut};
use half::bf16;
use std::path::{Path, PathBuf};

/// `prune` of the embedded model to half its key width (L1) into `out`, with `extra` flags.
fn prune(out: &Path, extra: &[&str]) -> (i32, String, String) {
    let model = embedded_model();
    let mut args = vec![
        "prune",
        "-m",
        model.to_str().unwrap(),
        "--method",
        "l1",
        "--ratio",
        "0.5",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ];
    args.extend_from_slice(extra);
    statecut(&args, &[])
}

/// The embedded model pruned to half its key width, into `dir/pruned`.
fn pruned(dir: &Path) -> PathBuf {
    let out = dir.join("pruned");
    let (code, _, err) = prune(&out, &[]);
    assert_eq!(code, 0, "{err}");
    out
}

/// Recover `student` into `out` with a small budget and `extra` flags (which win over the
/// small-budget defaults), distilled from the embedded model.
fn recover(student: &Path, out: &Path, extra: &[&str]) -> (i32, String, String) {
    recover_from(student, &embedded_model(), out, extra)
}

/// [`recover`] with another teacher.
fn recover_from(student: &Path, teacher: &Path, out: &Path, extra: &[&str]) -> (i32, String, String) {
    let train = repo_file("assets/train.txt");
    let mut args = vec![
        "recover",
        "-m",
        student.to_str().unwrap(),
        "--teacher",
        teacher.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "-q",
    ];
    let defaults = [
        ("--data", train.to_str().unwrap()),
        ("--batch-size", "2"),
        ("--seqlen", "64"),
        ("--lora-rank", "4"),
        ("--lr", "2e-3"),
    ];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    statecut(&args, &[])
}

fn bf16s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn merged_output_is_the_base_plus_the_adapters_and_nothing_else_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let student = pruned(tmp.path());
    let out = tmp.path().join("recovered");
    let eval = repo_file("assets/eval.txt");
    let (code, stdout, err) = recover(
        &student,
        &out,
        &[
            "--steps",
            "6",
            "--save-adapters",
            "--eval",
            eval.to_str().unwrap(),
            "--eval-windows",
            "8",
            "--eval-seqlen",
            "128",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("recovered") && stdout.contains("in 6 steps"), "{stdout}");
    let report = read_json(&out.join("statecut_recover.json"));
    assert_eq!(report["steps"], 6);
    assert_eq!(report["history"].as_array().unwrap().len(), 6);
    let ppl = &report["ppl"];
    for k in ["teacher", "pruned", "recovered"] {
        assert!(ppl[k].as_f64().unwrap().is_finite(), "{ppl}");
    }
    for f in ["statecut_recover.md", "statecut_recover_loss.svg", "statecut_recipe.toml", "tokenizer.json"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    assert_eq!(
        std::fs::read(student.join("config.json")).unwrap(),
        std::fs::read(out.join("config.json")).unwrap(),
        "the config changed"
    );

    let (before, after) = (tensors(&student), tensors(&out));
    assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    let adapted: Vec<String> =
        report["trained"]["adapted"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    let whole: Vec<String> =
        report["trained"]["whole"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert!(
        adapted.iter().any(|n| n.ends_with("q_proj.weight")) && adapted.iter().any(|n| n.ends_with("v_proj.weight"))
    );
    assert!(whole.iter().any(|n| n.contains("conv1d")), "{whole:?}");
    for (name, (shape, bytes)) in &before {
        let (s2, b2) = &after[name];
        assert_eq!(shape, s2, "{name}");
        if !adapted.contains(name) && !whole.contains(name) {
            assert_eq!(bytes, b2, "{name} is not trained but changed");
        }
    }
    // Updates below a bf16 step can round away on a small tensor, but not everywhere.
    assert!(whole.iter().any(|n| before[n].1 != after[n].1), "no tensor trained whole changed");
    assert!(adapted.iter().all(|n| before[n].1 != after[n].1), "an adapted tensor did not change");

    // Every adapted tensor is the stored weight plus (alpha / r)·B·A, rounded once to bf16.
    let adapters = tensors_of(&out.join("adapters/adapter_model.safetensors"));
    let cfg = read_json(&out.join("adapters/adapter_config.json"));
    let scale = cfg["lora_alpha"].as_f64().unwrap() / cfg["r"].as_f64().unwrap();
    assert_eq!(cfg["r"], 4);
    for name in &adapted {
        let module = name.strip_suffix(".weight").unwrap();
        let (a_shape, a) = &adapters[&format!("base_model.model.{module}.lora_A.weight")];
        let (b_shape, b) = &adapters[&format!("base_model.model.{module}.lora_B.weight")];
        let (a, b) = (f32s(a), f32s(b));
        let (r, cols, rows) = (a_shape[0], a_shape[1], b_shape[0]);
        assert!(b.iter().any(|x| *x != 0.0), "{name}: B never moved");
        let (shape, base) = &before[name];
        assert_eq!(shape, &vec![rows, cols]);
        let (base, merged) = (bf16s(base), bf16s(&after[name].1));
        for i in 0..rows {
            for j in 0..cols {
                let delta: f32 = (0..r).map(|k| b[i * r + k] * a[k * cols + j]).sum::<f32>() * scale as f32;
                let want = bf16::from_f32(base[i * cols + j] + delta).to_f32();
                let got = merged[i * cols + j];
                // One bf16 step of slack for the float32 summation order.
                assert!((got - want).abs() <= want.abs() * 2f32.powi(-7) + 1e-8, "{name}[{i},{j}]: {got} vs {want}");
            }
        }
    }
}

fn tensors_of(file: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect()
}

#[test]
fn seeded_runs_repeat_and_resume_continues_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let student = pruned(tmp.path());
    let (whole, split) = (tmp.path().join("whole"), tmp.path().join("split"));
    let (code, _, err) = recover(&student, &whole, &["--steps", "4", "--seed", "7"]);
    assert_eq!(code, 0, "{err}");
    let (code, stdout, err) = recover(&student, &split, &["--steps", "4", "--seed", "7", "--stop-after", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("--resume") && !split.exists(), "{stdout}");
    let state = tmp.path().join("split.recover-state.safetensors");
    assert!(state.is_file());
    // A resume with other settings is refused and keeps the state.
    let (code, _, err) = recover(&student, &split, &["--steps", "4", "--seed", "8", "--resume"]);
    assert_ne!(code, 0);
    assert!(err.contains("other settings"), "{err}");
    assert!(state.is_file() && !split.exists());
    let (code, _, err) = recover(&student, &split, &["--steps", "4", "--seed", "7", "--resume"]);
    assert_eq!(code, 0, "{err}");
    assert!(!state.exists(), "the training state outlived the run it belonged to");
    assert_eq!(
        std::fs::read(whole.join("model.safetensors")).unwrap(),
        std::fs::read(split.join("model.safetensors")).unwrap(),
        "a resumed run differs from an uninterrupted one"
    );
    let losses = |d: &Path| -> Vec<f64> {
        read_json(&d.join("statecut_recover.json"))["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(losses(&whole), losses(&split));
    // Another seed draws other adapters and data.
    let other = tmp.path().join("other");
    let (code, _, err) = recover(&student, &other, &["--steps", "4", "--seed", "8"]);
    assert_eq!(code, 0, "{err}");
    assert_ne!(
        std::fs::read(whole.join("model.safetensors")).unwrap(),
        std::fs::read(other.join("model.safetensors")).unwrap()
    );
}

/// Each bad input ends in one line and a non-zero exit, and writes nothing.
#[test]
fn bad_input_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let student = pruned(tmp.path());
    let out = tmp.path().join("out");
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "too short for a batch").unwrap();
    // A teacher whose MLP differs: not the model the student came from.
    let other = tmp.path().join("other-teacher");
    copy_dir(&embedded_model(), &other);
    let file = other.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["model.layers.2.mlp.down_proj.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--steps", "0"], "--steps"),
        (vec!["--lora-rank", "0"], "--lora-rank"),
        (vec!["--lora-rank", "300", "--steps", "1"], "above the width"),
        (vec!["--data", short.to_str().unwrap(), "--steps", "1"], "fewer than one batch"),
        (vec!["--train", "lora:no_such_tensor", "--steps", "1"], "no_such_tensor"),
        (vec!["--train", "full:embeddings", "--steps", "1"], "embeddings"),
        (vec!["--resume", "--steps", "1"], "no saved training state"),
        (vec!["--train-memory", "45GiB", "--recompute", "all", "--steps", "1"], "--train-memory bounds"),
        (vec!["--train-memory", "lots", "--steps", "1"], "--train-memory"),
        (vec!["--kd-weight", "0", "--lm-weight", "0", "--steps", "1"], "leave no loss to train on"),
        // Weights blown up by an absurd rate: every step is skipped, then the run stops.
        (
            vec!["--lr", "1e6", "--warmup", "0", "--max-bad-steps", "2", "--steps", "12"],
            "2 steps in a row had a non-finite loss",
        ),
    ];
    for (extra, want) in cases {
        let (code, _, err) = recover(&student, &out, &extra);
        assert_ne!(code, 0, "{extra:?} succeeded");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?} left an output");
    }
    let teacher_cases = [
        (other.clone(), "model.layers.2.mlp.down_proj.weight differs"),
        (repo_file("tests/fixtures/sse_gla"), "distil from the model the student was pruned from"),
    ];
    for (teacher, want) in teacher_cases {
        let (code, _, err) = recover_from(&student, &teacher, &out, &["--steps", "1"]);
        assert_ne!(code, 0);
        assert!(err.contains(want), "{}: {err}", teacher.display());
        assert!(!out.exists());
    }
    // The same unrelated teacher is accepted when asked for.
    let (code, _, err) = recover_from(
        &student,
        &other,
        &out,
        &["--steps", "1", "--batch-size", "1", "--seqlen", "32", "--allow-unrelated-teacher"],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.join("model.safetensors").is_file());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// `prune --recover` is `prune` followed by `recover` in one command: the same checkpoint byte
/// for byte, both reports in the output, and nothing of the pruned intermediate left behind.
#[test]
fn prune_then_recover_in_one_command() {
    let tmp = tempfile::tempdir().unwrap();
    let student = pruned(tmp.path());
    let apart = tmp.path().join("apart");
    let (code, _, err) = recover(&student, &apart, &["--steps", "3", "--seed", "5"]);
    assert_eq!(code, 0, "{err}");
    let train = repo_file("assets/train.txt");
    let one = tmp.path().join("one");
    let prune = |out: &Path, extra: &[&str]| prune(out, &[&["--seed", "5"], extra].concat());
    let recipe = [
        "--data",
        train.to_str().unwrap(),
        "--train-batch-size",
        "2",
        "--train-seqlen",
        "64",
        "--lora-rank",
        "4",
        "--lr",
        "2e-3",
        "--steps",
        "3",
    ];
    let (code, stdout, err) = prune(&one, &[&["--recover"], &recipe[..]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.trim().lines().last().unwrap().starts_with("recovered "), "{stdout}");
    assert_eq!(
        std::fs::read(apart.join("model.safetensors")).unwrap(),
        std::fs::read(one.join("model.safetensors")).unwrap(),
        "prune --recover differs from prune, then recover"
    );
    let report = read_json(&one.join("statecut_recover.json"));
    assert_eq!(report["pruning"]["method"], "l1");
    assert_eq!(report["pruning"]["dk_after"], 32);
    assert_eq!(read_json(&one.join("statecut_report.json"))["dk_after"], 32);
    for f in ["statecut_recover.md", "statecut_recipe.toml", "statecut_prune_recipe.toml", "config.json"] {
        assert!(one.join(f).is_file(), "{f} missing");
    }
    let leftovers = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect()
    };
    assert!(leftovers(tmp.path()).is_empty(), "{:?}", leftovers(tmp.path()));

    // Recovery flags without --recover, adapters that would outlive their base, and a failure
    // after pruning: one line each, no output, no intermediate left.
    let out = tmp.path().join("bad");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--steps", "3"], "only with --recover"),
        ([&["--recover", "--save-adapters"], &recipe[..]].concat(), "--save-adapters"),
        ([&["--recover", "--train-seqlen", "400000"], &recipe[..2]].concat(), "--train-seqlen"),
        ([&["--recover", "--train", "full:embeddings"], &recipe[..]].concat(), "embeddings"),
    ];
    for (extra, want) in cases {
        let (code, _, err) = prune(&out, &extra);
        assert_ne!(code, 0, "{extra:?} succeeded");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
        assert!(!out.exists(), "{extra:?} left an output");
        assert!(leftovers(tmp.path()).is_empty(), "{extra:?}: {:?}", leftovers(tmp.path()));
    }
}

/// What trains is what is written: the output, reloaded, has the perplexity of the trained
/// model in memory, for the layers of every family. Layers make values from stored tensors when
/// they load (float32 copies, 1 + w, -exp(A_log), joined convs); those must follow a tensor that
/// trains. bf16, so that the float32 copies exist; norms and A_log trained too.
#[test]
fn the_written_checkpoint_is_the_trained_model() {
    let mut models: Vec<(PathBuf, &str)> = vec![
        (embedded_model(), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/qwen3_5_moe_text"), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/nemotron_h"), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/granite_h"), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/falcon_h1"), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/kimi_linear"), "mixers,full:norm,full:A_log"),
        (repo_file("tests/fixtures/sse_gla"), "mixers,full:norm"),
    ];
    if let Some(shared) = common::shared() {
        models.push((shared.join("models/delta_net"), "mixers,full:norm"));
        models.push((shared.join("models/mamba2"), "mixers,full:norm,full:A_log"));
        models.push((shared.join("models/qwen3_5"), "mixers,full:norm,full:A_log"));
    }
    let tmp = tempfile::tempdir().unwrap();
    let eval = repo_file("assets/eval.txt");
    for (model, train) in models {
        let out = tmp.path().join(model.file_name().unwrap());
        let (code, _, err) = recover_from(
            &model,
            &model,
            &out,
            &[
                "--steps",
                "3",
                "--lr",
                "1e-2",
                "--warmup",
                "0",
                "--train",
                train,
                "--dtype",
                "bf16",
                "--eval",
                eval.to_str().unwrap(),
                "--eval-windows",
                "2",
                "--eval-seqlen",
                "64",
            ],
        );
        assert_eq!(code, 0, "{}: {err}", model.display());
        let p = &read_json(&out.join("statecut_recover.json"))["ppl"];
        let (teacher, trained, written) =
            (p["teacher"].as_f64().unwrap(), p["trained"].as_f64().unwrap(), p["recovered"].as_f64().unwrap());
        assert!((trained / teacher - 1.0).abs() > 1e-3, "{}: training changed nothing", model.display());
        assert!((written / trained - 1.0).abs() < 1e-3, "{}: trained {trained}, written {written}", model.display());
    }
}
