//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod grad;
pub mod pruned;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The reference data directory: `$STATECUT_TEST_DATA`, default `../shared` beside the checkout.
/// Returns None when it is missing, after saying which test is skipped (see [`missing_data`]).
pub fn shared() -> Option<PathBuf> {
    let p = std::env::var("STATECUT_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared"));
    if p.join("models").is_dir() {
        Some(p)
    } else {
        missing_data(&p);
        None
    }
}

/// A test cannot run because `path` (reference data) is missing. Under CI
/// (`STATECUT_REQUIRE_DATA=1`, set by `.ci/run`) that is a failure; elsewhere the test is skipped
/// and says so by name, on the real stderr so that the line shows even for a passing test.
pub fn missing_data(path: &Path) {
    let test = format!("{}::{}", env!("CARGO_CRATE_NAME"), std::thread::current().name().unwrap_or("<unnamed>"));
    if std::env::var("STATECUT_REQUIRE_DATA").is_ok_and(|v| v == "1") {
        panic!(
            "{test}: STATECUT_REQUIRE_DATA=1 and the reference data is missing at {} \
             (set STATECUT_TEST_DATA to the shared/ folder)",
            path.display()
        );
    }
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: reference data not found at {} (set STATECUT_TEST_DATA to the shared/ folder)",
        path.display()
    );
}

/// The small trained model that ships in the repository (`scripts/train_embedded_model.py`).
pub fn embedded_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/models/gdn-moby")
}

/// A file of the repository, by its path from the root.
pub fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)
}

pub fn model_dir(name: &str) -> Option<PathBuf> {
    shared().map(|s| s.join("models").join(name))
}

/// A checkpoint committed under `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    repo_file("tests/fixtures").join(name)
}

/// The model of `dir`, loaded on the CPU in float32.
pub fn load_cpu(dir: &Path) -> Box<dyn statecut::arch::CausalLm> {
    let ckpt = statecut::checkpoint::Checkpoint::open(dir).unwrap();
    statecut::arch::family_for(&ckpt).unwrap().load(&ckpt, &statecut::arch::LoadOptions::cpu_f32()).unwrap()
}

/// The golden token ids [1, T] of `dir`, as u32.
pub fn golden_ids(dir: &Path) -> candle_core::Tensor {
    golden(dir)["input_ids"].to_dtype(candle_core::DType::U32).unwrap()
}

/// An observer that keeps every hidden state it is shown, in order.
pub struct Hidden(pub Vec<candle_core::Tensor>);

impl statecut::arch::Observer for Hidden {
    fn hidden(&mut self, _index: usize, h: &candle_core::Tensor) -> anyhow::Result<()> {
        self.0.push(h.clone());
        Ok(())
    }
}

/// The golden tensors of a reference model directory (`golden.safetensors`), on the CPU.
pub fn golden(dir: &Path) -> HashMap<String, candle_core::Tensor> {
    candle_core::safetensors::load(dir.join("golden.safetensors"), &candle_core::Device::Cpu).unwrap()
}

/// A tensor's values, as float32, in row-major order.
pub fn flat(t: &candle_core::Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// ||a - b|| / ||b||
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Run the statecut binary; returns (exit code, stdout, stderr).
pub fn statecut(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"));
    cmd.args(args).env("HF_HUB_OFFLINE", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running statecut");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
