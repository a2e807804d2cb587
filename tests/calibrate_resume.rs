//! An interrupted calibration resumed from its partial file ends exactly where an uninterrupted
//! run ends, batching sequences changes nothing, and the CLI refuses to resume with other settings.

mod common;

use statecut::arch::{family_for, LoadOptions};
use statecut::calib::{CalibSettings, Calibration};
use statecut::checkpoint::Checkpoint;
use statecut::data::{TextSource, TextTokenizer};

#[test]
fn resumed_calibration_equals_uninterrupted() {
    let (Some(dir), Some(shared)) = (common::model_dir("delta_net"), common::shared()) else { return };
    let ckpt = Checkpoint::open(&dir).unwrap();
    let family = family_for(&ckpt).unwrap();
    let layout = family.layout(&ckpt).unwrap();
    let model = family.load(&ckpt, &LoadOptions { grad: true, ..LoadOptions::cpu_f32() }).unwrap();
    let tok = TextTokenizer::load(&dir, None, &ckpt.config).unwrap();
    let src = TextSource::parse(Some(shared.join("data/calib/wiki.jsonl").to_str().unwrap()), "text").unwrap();
    let seqs = statecut::commands::sequences(&tok, &src, 4, 128, true).unwrap();
    let settings = CalibSettings { nsamples: 4, seqlen: 128, seed: 3, rows: 300, grad: true, source: "wiki".into() };

    let mut whole = Calibration::new(settings.clone(), &layout, 256);
    whole.run(model.as_ref(), &seqs, Some(1), None, true).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let partial = tmp.path().join("acts.partial.safetensors");
    let mut first = Calibration::new(settings, &layout, 256);
    first.run(model.as_ref(), &seqs[..2], Some(1), None, true).unwrap();
    first.save(&partial, false).unwrap();
    let (mut resumed, complete) = Calibration::load(&partial, &layout).unwrap();
    assert!(!complete);
    assert_eq!(resumed.sequences_done, 2);
    resumed.run(model.as_ref(), &seqs, Some(1), None, true).unwrap();

    assert_eq!((resumed.sequences_done, resumed.tokens), (whole.sequences_done, whole.tokens));
    for (l, a) in &whole.collector.layers {
        let b = &resumed.collector.layers[l];
        assert_eq!(a.keys.rows, b.keys.rows, "layer {l} keys");
        assert_eq!(a.queries.rows, b.queries.rows, "layer {l} queries");
        assert_eq!(a.input_count, b.input_count);
        for (x, y) in a.input_sq.iter().zip(&b.input_sq) {
            assert!((x - y).abs() <= 1e-9 * x.abs().max(1.0));
        }
    }
    for (name, g) in &whole.grad_sum {
        let d = (g - &resumed.grad_sum[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let m = g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d <= 1e-5 * m, "{name}: gradients differ by {d}");
    }

    // Three sequences per forward pass (then one): the same rows are sampled, the same gradients
    // summed, up to the rounding of batched matmuls.
    let mut batched = Calibration::new(whole.settings.clone(), &layout, 256);
    batched.run(model.as_ref(), &seqs, Some(3), None, true).unwrap();
    assert_eq!((batched.sequences_done, batched.tokens), (whole.sequences_done, whole.tokens));
    for (l, a) in &whole.collector.layers {
        let b = &batched.collector.layers[l];
        for (x, y) in [(&a.keys.rows, &b.keys.rows), (&a.queries.rows, &b.queries.rows)] {
            assert_eq!(x.len(), y.len(), "layer {l}: number of rows");
            let err = common::rel_err(y, x);
            assert!(err < 1e-5, "layer {l}: batched rows differ by {err:.2e}");
        }
    }
    for (name, g) in &whole.grad_sum {
        let (a, b) = (g.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &batched.grad_sum[name]);
        let err = common::rel_err(&b.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &a);
        assert!(err < 1e-4, "{name}: batched gradients differ by {err:.2e}");
    }
}

#[test]
fn cli_resume_continues_and_refuses_other_settings() {
    let Some(dir) = common::model_dir("delta_net") else { return };
    let ckpt = Checkpoint::open(&dir).unwrap();
    let family = family_for(&ckpt).unwrap();
    let layout = family.layout(&ckpt).unwrap();
    let model = family.load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let tok = TextTokenizer::load(&dir, None, &ckpt.config).unwrap();
    let seqs = statecut::commands::sequences(&tok, &TextSource::Builtin, 4, 64, true).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("acts.safetensors");
    // An interrupted run: the partial file the CLI saves every --save-every sequences.
    let settings =
        CalibSettings { nsamples: 4, seqlen: 64, seed: 0, rows: 5000, grad: false, source: "builtin".into() };
    let mut cal = Calibration::new(settings, &layout, 256);
    cal.fingerprint_weights(&ckpt).unwrap();
    cal.run(model.as_ref(), &seqs[..2], Some(1), None, true).unwrap();
    cal.save(&tmp.path().join("acts.partial.safetensors"), false).unwrap();
    let (m, o) = (dir.to_str().unwrap(), out.to_str().unwrap());

    let (code, _, err) =
        common::statecut(&["calibrate", "-m", m, "--nsamples", "4", "--seqlen", "128", "--resume", "-o", o], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("other settings"), "{err}");
    assert!(!out.exists());

    let (code, _, err) =
        common::statecut(&["calibrate", "-m", m, "--nsamples", "4", "--seqlen", "64", "--resume", "-o", o], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming after 2 of 4"), "{err}");
    let (done, complete) = Calibration::load(&out, &layout).unwrap();
    assert!(complete && done.sequences_done == 4);
    assert!(!tmp.path().join("acts.partial.safetensors").exists(), "the partial file is removed at the end");

    let (code, _, err) = common::statecut(&["calibrate", "-m", m, "--nsamples", "4", "--seqlen", "64", "-o", o], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("already exists"), "{err}");
}
