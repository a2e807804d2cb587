//! End to end: calibrate a reference model once, prune it with every selector at two ratios,
//! reload the output, check shapes, config, untouched bytes and perplexity.

mod common;

use common::pruned;
use std::path::PathBuf;
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
fn fixture(name: &'static str) -> Option<&'static Fixture> {
    static CELLS: [(&str, OnceLock<Option<Fixture>>); 4] = [
        ("delta_net", OnceLock::new()),
        ("gated_deltanet", OnceLock::new()),
        ("mamba2", OnceLock::new()),
        ("qwen3_5", OnceLock::new()),
    ];
    let cell = &CELLS.iter().find(|(n, _)| *n == name).expect("known model").1;
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

fn check_model(name: &'static str) {
    let Some(f) = fixture(name) else { return };
    let input = pruned::Input::open(&f.model);
    let dk_in = input.layout.dk;
    for method in METHODS {
        for (ratio, dk) in [("0.5", dk_in / 2), ("0.75", dk_in / 4)] {
            let out = prune(f, method, ratio);
            let eval = ["--data", &f.eval, "--windows", "4", "--seqlen", "256"];
            let (before, after) = pruned::check(&input, &out, method, dk, &eval);
            eprintln!("{name} {method} {ratio}: ppl {before:.2} -> {after:.2}");
            // Ten checkpoints per model at once would fill a small temp disk.
            std::fs::remove_dir_all(&out).unwrap();
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

#[test]
fn mamba2_every_method_two_ratios() {
    check_model("mamba2");
}

#[test]
fn qwen3_5_every_method_two_ratios() {
    check_model("qwen3_5");
}
