//! Bad prune input: one clear error line, a non-zero exit, and nothing written.

mod common;

use std::path::Path;

/// Runs statecut expecting failure; checks the message and that `out` was not created and no
/// hidden staging directory was left beside it.
fn fails_cleanly(args: &[&str], expect: &str, out: &Path) {
    let existed = out.exists();
    let (code, _o, err) = common::statecut(args, &[]);
    assert_eq!(code, 1, "expected failure: {args:?}");
    let lines: Vec<&str> = err.trim().lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains(expect), "expected {expect:?} in: {err}");
    assert_eq!(out.exists(), existed, "output directory state changed");
    let parent = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("statecut-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "staging directory left behind");
}

/// `prune --ratio 0.5` from saved activations must fail with `expect`, writing nothing.
fn prune_from_activations_fails(model: &Path, method: &str, acts: &Path, out: &Path, expect: &str) {
    let (m, a, o) = (model.to_str().unwrap(), acts.to_str().unwrap(), out.to_str().unwrap());
    fails_cleanly(&["prune", "-m", m, "--method", method, "--ratio", "0.5", "--activations", a, "-o", o], expect, out);
}

fn calibrate(model: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec![
        "calibrate",
        "-m",
        model.to_str().unwrap(),
        "--nsamples",
        "2",
        "--seqlen",
        "128",
        "-o",
        out.to_str().unwrap(),
        "-q",
    ];
    args.extend_from_slice(extra);
    let (code, _, err) = common::statecut(&args, &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn bad_ratios() {
    let Some(m) = common::model_dir("delta_net") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let (m, o) = (m.to_str().unwrap(), out.to_str().unwrap());
    fails_cleanly(&["prune", "-m", m, "--method", "l1", "--ratio", "1.5", "-o", o], "outside (0, 1)", &out);
    fails_cleanly(&["prune", "-m", m, "--method", "l1", "--ratio", "0", "-o", o], "outside (0, 1)", &out);
    fails_cleanly(&["prune", "-m", m, "--method", "l1", "--ratio", "0.99", "-o", o], "leaves 0 of 64", &out);
    fails_cleanly(
        &["prune", "-m", m, "--method", "l1", "--ratio", "0.5", "--round-to", "64", "-o", o],
        "leaves 0 of 64",
        &out,
    );
    fails_cleanly(&["prune", "-m", m, "--method", "magic", "--ratio", "0.5", "-o", o], "unknown method", &out);
}

#[test]
fn existing_output_needs_overwrite() {
    let Some(m) = common::model_dir("delta_net") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    fails_cleanly(
        &["prune", "-m", m.to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "-o", out.to_str().unwrap()],
        "--overwrite",
        &out,
    );
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "mine");
    // A directory statecut did not write is not replaced, even with --overwrite.
    let mut args = vec!["prune", "-m", m.to_str().unwrap(), "--method", "l1", "--ratio", "0.5"];
    args.extend(["-o", out.to_str().unwrap(), "--overwrite"]);
    fails_cleanly(&args, "statecut did not write", &out);
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "mine");
    // A previous output (it has a report): with --overwrite it is replaced only once the new
    // one is complete.
    std::fs::write(out.join("statecut_report.json"), "{}").unwrap();
    let (code, _, err) = common::statecut(
        &[
            "prune",
            "-m",
            m.to_str().unwrap(),
            "--method",
            "l1",
            "--ratio",
            "0.5",
            "-o",
            out.to_str().unwrap(),
            "--overwrite",
            "-q",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(!out.join("keep.txt").exists() && out.join("model.safetensors").exists());
}

#[test]
fn activations_from_another_model() {
    let (Some(dn), Some(gdn)) = (common::model_dir("delta_net"), common::model_dir("gated_deltanet")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let acts = tmp.path().join("gdn.safetensors");
    calibrate(&gdn, &acts, &[]);
    let out = tmp.path().join("out");
    prune_from_activations_fails(&dn, "drrqr", &acts, &out, "calibrated on another model");
    // Grad needs gradients in the file.
    prune_from_activations_fails(&gdn, "grad", &acts, &out, "--grad");
}

#[test]
fn too_few_rows_for_drrqr() {
    let Some(m) = common::model_dir("delta_net") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let acts = tmp.path().join("acts.safetensors");
    calibrate(&m, &acts, &["--rows", "40"]);
    let out = tmp.path().join("out");
    prune_from_activations_fails(&m, "drrqr", &acts, &out, "fewer calibration rows");
}

#[test]
fn nan_activations() {
    let Some(m) = common::model_dir("delta_net") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let acts = tmp.path().join("acts.safetensors");
    calibrate(&m, &acts, &[]);
    // Poison one key activation, keeping the file's metadata.
    let bytes = std::fs::read(&acts).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    let keys = owned.iter_mut().find(|t| t.0 == "layers.3.keys").unwrap();
    keys.3[40..44].copy_from_slice(&f32::NAN.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, meta.metadata().clone(), &acts).unwrap();
    let out = tmp.path().join("out");
    prune_from_activations_fails(&m, "drrqr", &acts, &out, "NaN");
}
