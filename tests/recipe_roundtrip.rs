//! Provenance of a prune from saved activations: the report and the recipe describe the
//! activations file's calibration (source, sequences, seqlen, rows, sha256), and running the
//! written recipe again reproduces the same checkpoint byte for byte. Runs on the committed
//! SSE fixture and the built-in calibration text.

mod common;

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sse_gla")
}

fn run_ok(args: &[&str]) -> (String, String) {
    let (code, out, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    (out, err)
}

fn calibrate(model: &Path, seed: &str, out: &Path) {
    let m = model.to_str().unwrap();
    let o = out.to_str().unwrap();
    run_ok(&[
        "calibrate",
        "-m",
        m,
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--rows",
        "256",
        "--seed",
        seed,
        "-o",
        o,
        "-q",
    ]);
}

fn report(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("statecut_report.json")).unwrap()).unwrap()
}

/// Kept channels of every head of every layer.
fn kept(r: &Value) -> Vec<Vec<Value>> {
    r["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["heads"].as_array().unwrap().clone())
        .map(|h| h["kept"].as_array().unwrap().clone())
        .collect()
}

#[test]
fn recipe_from_activations_reproduces_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture();
    let m = model.to_str().unwrap();
    let acts = tmp.path().join("acts.safetensors");
    calibrate(&model, "0", &acts);
    let sha = format!("{:x}", Sha256::digest(std::fs::read(&acts).unwrap()));

    // Flags that disagree with the file are ignored, with a warning, and not recorded.
    let first = tmp.path().join("first");
    let a = acts.to_str().unwrap();
    let (stdout, err) = run_ok(&[
        "prune",
        "-m",
        m,
        "--method",
        "drrqr",
        "--ratio",
        "0.5",
        "--activations",
        a,
        "--nsamples",
        "99",
        "-o",
        first.to_str().unwrap(),
    ]);
    assert!(err.contains("warning: --nsamples 99 is ignored"), "{err}");
    assert!(stdout.contains("runs in: "), "{stdout}");

    // The plan describes the activations file's calibration.
    let r = report(&first);
    let plan = &r["plan"];
    assert_eq!(plan["calib"]["source"], "builtin");
    assert_eq!(plan["calib"]["nsamples"], 4);
    assert_eq!(plan["calib"]["seqlen"], 64);
    assert_eq!(plan["calib"]["rows"], 256);
    assert_eq!(plan["activations"]["sha256"], sha.as_str());
    assert_eq!(plan["activations"]["sequences"], 4);
    assert_eq!(plan["activations"]["tokens"], 256);
    assert_eq!(r["calibration"]["seqlen"], 64);
    assert!(r["serving"]["runs_in"].as_str().unwrap().contains("sse_reference.py"));
    let md = std::fs::read_to_string(first.join("statecut_report.md")).unwrap();
    assert!(md.contains(&sha) && md.contains("4 sequences of 64 tokens") && md.contains("## Serving"), "{md}");
    let recipe_path = first.join("statecut_recipe.toml");
    let recipe: toml::Table = std::fs::read_to_string(&recipe_path).unwrap().parse().unwrap();
    assert_eq!(recipe["activations_sha256"].as_str(), Some(sha.as_str()));
    assert_eq!(recipe["nsamples"].as_integer(), Some(4));
    assert_eq!(recipe["seqlen"].as_integer(), Some(64));
    assert_eq!(recipe["rows"].as_integer(), Some(256));
    assert_eq!(recipe["calib"].as_str(), Some("builtin"));
    assert_eq!(Path::new(recipe["activations"].as_str().unwrap()), acts.canonicalize().unwrap());

    // The recipe alone reproduces the checkpoint, from another working directory.
    let second = tmp.path().join("second");
    let (code, _, err) = {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"))
            .args(["prune", "-m", m, "--config", recipe_path.to_str().unwrap(), "-o", second.to_str().unwrap()])
            .current_dir(std::env::temp_dir())
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("warning: --"), "the recipe's own settings must not be ignored: {err}");
    let r2 = report(&second);
    assert_eq!(kept(&r), kept(&r2));
    assert_eq!(r2["plan"]["activations"]["sha256"], sha.as_str());
    for f in ["model.safetensors", "config.json", "statecut_recipe.toml"] {
        assert!(std::fs::read(first.join(f)).unwrap() == std::fs::read(second.join(f)).unwrap(), "{f} differs");
    }

    // Another file under the recipe's path is refused before anything is written.
    calibrate(&model, "1", &tmp.path().join("other.safetensors"));
    std::fs::rename(tmp.path().join("other.safetensors"), &acts).unwrap();
    let third = tmp.path().join("third");
    let (code, _, err) = common::statecut(
        &["prune", "-m", m, "--config", recipe_path.to_str().unwrap(), "-o", third.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
    assert!(err.contains("sha256") && err.contains(&sha), "{err}");
    assert!(!third.exists());
    assert!(std::fs::read_dir(tmp.path()).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".statecut-")));
    // Passing the file explicitly uses it as it is.
    run_ok(&[
        "prune",
        "-m",
        m,
        "--config",
        recipe_path.to_str().unwrap(),
        "--activations",
        a,
        "-o",
        third.to_str().unwrap(),
        "-q",
    ]);
    assert_ne!(report(&third)["plan"]["activations"]["sha256"], sha.as_str());
}
