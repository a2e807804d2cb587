//! Bad input ends in one clear error line and a non-zero exit.

mod common;

use std::path::Path;

fn one_error_line(args: &[&str], expect: &str) {
    let (code, _out, err) = common::statecut(args, &[]);
    assert_eq!(code, 1, "expected failure for {args:?}");
    let lines: Vec<&str> = err.trim().lines().collect();
    assert_eq!(lines.len(), 1, "expected one error line, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(expect), "error should mention {expect:?}: {err}");
}

/// A copy of a reference model directory with `edit` applied.
fn copy_model(name: &str, tmp: &Path, edit: impl FnOnce(&Path)) -> Option<String> {
    let src = common::model_dir(name)?;
    let dst = tmp.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    edit(&dst);
    Some(dst.to_string_lossy().into_owned())
}

#[test]
fn missing_directory() {
    one_error_line(&["eval", "-m", "/no/such/model/dir"], "does not exist");
    one_error_line(&["inspect", "-m", "no_such_dir"], "does not exist");
}

#[test]
fn unknown_model_type() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(dir) = copy_model("delta_net", tmp.path(), |d| {
        let p = d.join("config.json");
        let s = std::fs::read_to_string(&p).unwrap().replace("\"delta_net\"", "\"llama_linear\"");
        std::fs::write(p, s).unwrap();
    }) else {
        return;
    };
    one_error_line(&["eval", "-m", &dir], "unsupported model_type \"llama_linear\"");
}

#[test]
fn truncated_safetensors_header() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(dir) = copy_model("delta_net", tmp.path(), |d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..200]).unwrap();
    }) else {
        return;
    };
    one_error_line(&["eval", "-m", &dir], "truncated");
}

#[test]
fn tensor_of_wrong_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(dir) = copy_model("delta_net", tmp.path(), |d| {
        let p = d.join("model.safetensors");
        let mut ts = candle_core::safetensors::load(&p, &candle_core::Device::Cpu).unwrap();
        let w = ts["model.norm.weight"].narrow(0, 0, 128).unwrap();
        ts.insert("model.norm.weight".into(), w);
        candle_core::safetensors::save(&ts, &p).unwrap();
    }) else {
        return;
    };
    one_error_line(&["eval", "-m", &dir], "model.norm.weight");
}

#[test]
fn bad_flags() {
    let Some(dir) = common::model_dir("delta_net") else { return };
    let dir = dir.to_string_lossy().into_owned();
    one_error_line(&["eval", "-m", &dir, "--device", "tpu"], "--device tpu");
    one_error_line(&["eval", "-m", &dir, "--data", "/no/such/file.jsonl"], "does not exist");
}
