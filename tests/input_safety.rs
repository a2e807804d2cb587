//! The input is never touched and nothing is lost: one regression check per case of the
//! "input is never touched" report (numbered as there), each on a copy of the embedded model
//! (or an SSE fixture), checking the input's sha256 before and after, the exit code, the single
//! `error:` line, and that no output, staging or created directory is left.
//!
//! `STATECUT_BIN` runs the checks against another build of the binary (to see them fail on
//! an older one).
#![cfg(unix)]

mod common;

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn bin() -> PathBuf {
    std::env::var_os("STATECUT_BIN").map(PathBuf::from).unwrap_or_else(|| env!("CARGO_BIN_EXE_statecut").into())
}

/// Run statecut; (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin())
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running statecut");
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), s(&out.stdout), s(&out.stderr))
}

fn run_ok(args: &[&str]) -> String {
    let (code, out, err) = run(args);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    out
}

/// A failed run: exit 1 and exactly one `error:` line, which is returned.
fn run_err(args: &[&str]) -> String {
    let (code, _, err) = run(args);
    assert_eq!(code, 1, "statecut {args:?}: expected exit 1, got {code}:\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "statecut {args:?}: expected one error line:\n{err}");
    lines[0].to_string()
}

/// Every file under `dir` (recursively, links followed) by relative path, as sha256.
fn digest(dir: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                out.insert(rel + "/", String::new());
                walk(root, &p, out);
            } else {
                out.insert(rel, format!("{:x}", Sha256::digest(std::fs::read(&p).unwrap())));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Names under `dir` (recursively) that are statecut staging or moved-aside outputs.
fn staging_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.contains(".statecut-tmp-") || name.contains(".statecut-old-") {
            out.push(p.display().to_string());
        } else if p.is_dir() && !p.is_symlink() {
            out.extend(staging_under(&p));
        }
    }
    out
}

/// A copy of a model directory at `to`.
fn copy_model(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() && p.file_name().unwrap() != "golden.safetensors" {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    to.to_path_buf()
}

fn moby(to: &Path) -> PathBuf {
    copy_model(&common::embedded_model(), to)
}

/// An SSE fixture (routed partitions) with its tokenizer.
fn sse(to: &Path) -> PathBuf {
    copy_model(&common::fixture("sse_gla"), to)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// An SSE fixture with an extra 64 MiB tensor that no layer reads: writing its output takes long
/// enough to be interrupted.
fn padded_sse(to: &Path) -> PathBuf {
    let model = sse(to);
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let pad: Vec<u8> = (0..64 << 20).map(|i| (i % 251) as u8).collect();
    let mut tensors = st.tensors();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![pad.len()], &pad).unwrap();
    tensors.push(("statecut_test.padding".into(), view));
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(meta), &model.join("model.safetensors.new")).unwrap();
    std::fs::rename(model.join("model.safetensors.new"), model.join("model.safetensors")).unwrap();
    model
}

/// A short evaluation text.
fn text(dir: &Path) -> PathBuf {
    let p = dir.join("eval.txt");
    let line = "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse, \
                I thought I would sail about a little and see the watery part of the world.\n";
    std::fs::write(&p, line.repeat(20)).unwrap();
    p
}

const CAL: [&str; 6] = ["--nsamples", "2", "--seqlen", "16", "--rows", "32"];

fn calibrate_args<'a>(model: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["calibrate", "-q", "-m", s(model), "-o", s(out), "--save-every", "1"];
    a.extend(CAL);
    a.extend(extra);
    a
}

fn sweep_args<'a>(model: &'a Path, out: &'a Path, eval: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["sweep", "-q", "-m", s(model), "--methods", "l1", "--ratios", "0.5", "--eval", s(eval)];
    a.extend(["--eval-windows", "1", "--eval-seqlen", "16", "-o", s(out)]);
    a.extend(CAL);
    a.extend(extra);
    a
}

/// The message names both paths.
fn names_both(line: &str, a: &Path, b: &Path) {
    assert!(line.contains(s(a)) && line.contains(s(b)), "{line} should name {} and {}", a.display(), b.display());
}

/// Case 1: `prune -m P/model -o P --overwrite` would replace P, and the model inside it.
#[test]
fn case01_output_containing_the_input_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("p");
    let model = moby(&parent.join("model"));
    let before = digest(&parent);
    let e =
        run_err(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&parent), "--overwrite"]);
    names_both(&e, &parent, &model);
    assert_eq!(digest(&parent), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 2: `prune -m M -o M/model.safetensors --overwrite`.
#[test]
fn case02_output_on_the_weights_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    let w = model.join("model.safetensors");
    let e = run_err(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&w), "--overwrite"]);
    names_both(&e, &w, &model);
    // Also through a symlink to the weights file, from outside the model.
    let link = tmp.path().join("link.safetensors");
    std::os::unix::fs::symlink(&w, &link).unwrap();
    let e =
        run_err(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&link), "--overwrite"]);
    names_both(&e, &link, &model);
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 3: `calibrate -m M --resume -o M/model.safetensors`.
#[test]
fn case03_calibrate_resume_onto_the_weights_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    let w = model.join("model.safetensors");
    let e = run_err(&calibrate_args(&model, &w, &["--resume"]));
    names_both(&e, &w, &model);
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 4: `calibrate --resume -o A`, A a complete file made with other settings, is refused and A
/// kept; so is a partial file of another model or of other settings.
#[test]
fn case04_resume_only_continues_its_own_partial_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    let a = tmp.path().join("a.safetensors");
    run_ok(&calibrate_args(&model, &a, &[]));
    let kept = digest(tmp.path());
    let e = run_err(&calibrate_args(&model, &a, &["--resume", "--seed", "7"]));
    assert!(e.contains("already exists") && e.contains("complete activations file"), "{e}");
    assert_eq!(digest(tmp.path()), kept);

    // A partial file made with other settings.
    let b = tmp.path().join("b.safetensors");
    let partial = tmp.path().join("b.partial.safetensors");
    std::fs::copy(&a, &partial).unwrap();
    let e = run_err(&calibrate_args(&model, &b, &["--resume"]));
    assert!(e.contains("marked complete"), "{e}");
    // A partial file of a same-shaped model with other weights.
    let other = moby(&tmp.path().join("other"));
    perturb_key_weight(&other);
    let c = tmp.path().join("c.safetensors");
    std::fs::remove_file(&partial).unwrap();
    interrupted_partial(&other, &tmp.path().join("c.safetensors"));
    let e = run_err(&calibrate_args(&model, &c, &["--resume"]));
    assert!(e.contains("another model of the same shape"), "{e}");
    // Of other settings.
    let e = run_err(&calibrate_args(&other, &c, &["--resume", "--seed", "3"]));
    assert!(e.contains("other settings"), "{e}");
    assert!(!c.exists() && !b.exists());
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// A partial activations file for `out`: a calibration of `model` interrupted by SIGINT.
fn interrupted_partial(model: &Path, out: &Path) {
    let partial = out.with_extension("partial.safetensors");
    let mut args = calibrate_args(model, out, &[]);
    let i = args.iter().position(|a| *a == "2").unwrap();
    args[i] = "64";
    for _ in 0..20 {
        let mut child = Command::new(bin()).args(&args).stderr(Stdio::null()).spawn().unwrap();
        while !partial.exists() && child.try_wait().unwrap().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        signal(&child, libc::SIGINT);
        let status = child.wait().unwrap();
        if partial.exists() && !out.exists() {
            assert_eq!(status.code(), Some(130));
            return;
        }
        let _ = std::fs::remove_file(out);
        let _ = std::fs::remove_file(&partial);
    }
    panic!("no calibration could be interrupted");
}

fn signal(child: &std::process::Child, sig: i32) {
    // SAFETY: a signal to a child this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

/// Scale one key projection weight of a model copy: the same shapes, other weights.
fn perturb_key_weight(model: &Path) {
    let path = model.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    let name = t.keys().find(|k| k.contains("k_proj.weight")).expect("a key projection").clone();
    let w = (t[&name].clone() * 1.5).unwrap();
    t.insert(name, w);
    candle_core::safetensors::save(&t, &path).unwrap();
}

/// Case 5: Outputs inside the input directory: prune, calibrate, sweep (with and without --write),
/// inspect --plot.
#[test]
fn case05_writes_into_the_input_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let eval = text(tmp.path());
    let before = digest(&model);
    let pruned = model.join("pruned");
    let e = run_err(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&pruned)]);
    names_both(&e, &pruned, &model);
    let acts = model.join("acts.safetensors");
    names_both(&run_err(&calibrate_args(&model, &acts, &[])), &acts, &model);
    for write in [&[][..], &["--write"][..]] {
        names_both(&run_err(&sweep_args(&model, &model, &eval, write)), &model, &model);
        let sub = model.join("sweep");
        names_both(&run_err(&sweep_args(&model, &sub, &eval, write)), &sub, &model);
    }
    let plots = model.join("plots");
    let e = run_err(&["inspect", "-q", "-m", s(&model), "--nsamples", "1", "--seqlen", "16", "--plot", s(&plots)]);
    names_both(&e, &plots, &model);
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// `--overwrite` replaces only a previous statecut output.
#[test]
fn overwrite_replaces_only_statecut_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let mine = tmp.path().join("photos");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("a.jpg"), b"not statecut's").unwrap();
    let before = digest(tmp.path());
    let e =
        run_err(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&mine), "--overwrite"]);
    assert!(e.contains("statecut did not write"), "{e}");
    assert_eq!(digest(tmp.path()), before);
    // A previous prune output is replaced.
    let out = tmp.path().join("out");
    run_ok(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&out)]);
    run_ok(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.25", "-o", s(&out), "--overwrite"]);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 6: A sweep with a bad evaluation or recall setting fails before calibrating, and the
/// corrected command then runs in the same folder.
#[test]
fn case06_bad_sweep_settings_fail_first_and_block_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let eval = text(tmp.path());
    let before = digest(&model);
    let out = tmp.path().join("sweep");
    for bad in [
        &["--eval-seqlen", "0"][..],
        &["--eval-seqlen", "1000000000000"],
        &["--recall", "mqar", "--context-len", "10000000000"],
        &["--eval-seqlen", "100000"],
    ] {
        let mut a = sweep_args(&model, &out, &eval, &[]);
        // The later flag wins: the bad value replaces the good one.
        let i = a.iter().position(|x| *x == "--eval-seqlen").unwrap();
        a.drain(i..i + 2);
        a.extend(bad);
        run_err(&a);
        assert!(!out.exists(), "{bad:?} left {}", out.display());
    }
    // A sweep that fails after its settings are saved (here: a calibration text too short)
    // leaves a folder the corrected command reuses.
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    run_err(&sweep_args(&model, &out, &eval, &["--calib", s(&short)]));
    run_ok(&sweep_args(&model, &out, &eval, &[]));
    assert!(out.join("sweep.json").is_file());
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 7: SIGINT and SIGTERM during prune remove its staging (exit 130, 143); stale staging of dead
/// processes in a sweep folder is removed.
#[test]
fn case07_signals_leave_no_staging() {
    let tmp = tempfile::tempdir().unwrap();
    let model = padded_sse(&tmp.path().join("m"));
    let before = digest(&model);
    // In directories the run creates: removed with its staging.
    let x = tmp.path().join("x");
    let out = x.join("a/out");
    let args = ["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&out)];
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let mut landed = false;
        for _ in 0..10 {
            let mut child = Command::new(bin()).args(args).stderr(Stdio::piped()).spawn().unwrap();
            let staging = x.join(format!("a/.out.statecut-tmp-{}", child.id()));
            while !staging.exists() && child.try_wait().unwrap().is_none() {
                std::thread::yield_now();
            }
            signal(&child, sig);
            let done = child.wait_with_output().unwrap();
            if out.exists() {
                std::fs::remove_dir_all(&x).unwrap();
                continue;
            }
            assert_eq!(done.status.code(), Some(code), "{}", String::from_utf8_lossy(&done.stderr));
            let err = String::from_utf8_lossy(&done.stderr);
            assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
            landed = true;
            break;
        }
        assert!(landed, "every run finished before the signal");
        assert!(staging_under(tmp.path()).is_empty(), "{:?}", staging_under(tmp.path()));
        assert!(!x.exists(), "{} left", x.display());
    }
    // Stale staging of a dead process inside a sweep folder.
    let eval = text(tmp.path());
    let sweep = tmp.path().join("sweep");
    let moby = moby(&tmp.path().join("moby"));
    run_ok(&sweep_args(&moby, &sweep, &eval, &[]));
    let dead = {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    for p in [
        sweep.join(format!(".sweep.json.statecut-tmp-{dead}")),
        sweep.join(format!("cells/.l1-0.5.json.statecut-tmp-{dead}")),
    ] {
        std::fs::write(p, b"partial").unwrap();
    }
    run_ok(&sweep_args(&moby, &sweep, &eval, &[]));
    assert!(staging_under(tmp.path()).is_empty(), "{:?}", staging_under(tmp.path()));
    assert_eq!(digest(&model), before);
}

/// Case 8: `calibrate --resume -o DIR.safetensors` with a directory there fails before calibrating
/// and leaves nothing; a failed `prune -o X/a/b/out` removes the directories it created.
#[test]
fn case08_failures_leave_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    let d = tmp.path().join("d.safetensors");
    std::fs::create_dir(&d).unwrap();
    let listing = digest(tmp.path());
    let mut a = calibrate_args(&model, &d, &["--resume"]);
    a.retain(|x| *x != "-q");
    let (code, _, err) = run(&a);
    assert_eq!(code, 1);
    assert_eq!(err.lines().count(), 1, "failed only after calibrating: {err}");
    assert!(err.starts_with("error:") && err.contains("is a directory"), "{err}");
    assert_eq!(digest(tmp.path()), listing);

    // The prune fails after its output directory's parents were made.
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let x = tmp.path().join("x");
    let out = x.join("a/b/out");
    let e = run_err(&[
        "prune",
        "-q",
        "-m",
        s(&model),
        "--method",
        "l1",
        "--ratio",
        "0.5",
        "--eval",
        s(&short),
        "-o",
        s(&out),
    ]);
    assert!(e.contains("--eval-seqlen"), "{e}");
    assert!(!x.exists(), "left {}", x.display());
    assert_eq!(digest(&model), before);
}

/// Case 9: mqar with a huge context or sample count is refused at once, not an abort or an
/// unbounded run.
#[test]
fn case09_recall_sizes_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    for bad in [["--context-len", "100000000"], ["--samples", "1000000000000"], ["--gap", "99999999999"]] {
        let mut a = vec!["eval", "-q", "-m", s(&model), "--task", "mqar", "--pairs", "4"];
        a.extend(bad);
        let e = run_err(&a);
        assert!(e.contains(bad[0]) && e.contains("whole number"), "{e}");
    }
    // Within the bounds, but more logits than any memory holds: refused before loading.
    let big = moby(&tmp.path().join("big-vocab"));
    let cfg_path = big.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["vocab_size"] = 200_000.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = run_err(&["eval", "-q", "-m", s(&big), "--task", "mqar", "--pairs", "4", "--context-len", "1000000"]);
    assert!(e.contains("GiB of logits") && e.contains("--context-len"), "{e}");
    std::fs::remove_dir_all(&big).unwrap();
    assert_eq!(digest(tmp.path()).len(), before.len() + 1);
    assert_eq!(digest(&model), before);
}

/// Case 10: `--prune-partitions`: refused above and at the partition count, refused on a model
/// without partitions before calibrating, and kept in the recipe.
#[test]
fn case10_prune_partitions_is_checked_and_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = sse(&tmp.path().join("sse"));
    let before = digest(&model);
    let out = tmp.path().join("out");
    for n in ["4", "5", "2"] {
        let mut a = vec!["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&out)];
        a.extend(["--prune-partitions", n]);
        let e = run_err(&a);
        assert!(e.contains("less than num_sparse_partition (4"), "{e}");
        assert!(!out.exists());
    }
    // A model without partitions: refused before the model loads (no "loaded" line).
    let moby = moby(&tmp.path().join("moby"));
    let a = ["prune", "-m", s(&moby), "--method", "drrqr", "--ratio", "0.5", "--prune-partitions", "3", "-o", s(&out)];
    let (code, _, err) = run(&a);
    assert_eq!(code, 1);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no routed state partitions"), "{err}");

    // The recipe replays the run.
    let mut a = vec!["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "--nsamples", "2"];
    a.extend(["--seqlen", "32", "--prune-partitions", "3", "-o", s(&out)]);
    run_ok(&a);
    let recipe = out.join("statecut_recipe.toml");
    assert!(std::fs::read_to_string(&recipe).unwrap().contains("prune_partitions = 3"));
    let again = tmp.path().join("again");
    run_ok(&["prune", "-q", "-m", s(&model), "--config", s(&recipe), "-o", s(&again)]);
    let w = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(w(&out) == w(&again), "replaying the recipe wrote another checkpoint");
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// Case 11: Activations are byte-identical for identical inputs, and a same-shaped model with other
/// weights refuses them.
#[test]
fn case11_activations_are_reproducible_and_tied_to_their_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    let before = digest(&model);
    let (a, b) = (tmp.path().join("a.safetensors"), tmp.path().join("b.safetensors"));
    run_ok(&calibrate_args(&model, &a, &[]));
    run_ok(&calibrate_args(&model, &b, &[]));
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "two identical calibrations differ");
    // prune --config replays a recipe that names the activations by sha256.
    let out = tmp.path().join("out");
    run_ok(&[
        "prune",
        "-q",
        "-m",
        s(&model),
        "--method",
        "swanda",
        "--ratio",
        "0.5",
        "--activations",
        s(&a),
        "-o",
        s(&out),
    ]);
    std::fs::remove_file(&a).unwrap();
    run_ok(&calibrate_args(&model, &a, &[]));
    let again = tmp.path().join("again");
    run_ok(&["prune", "-q", "-m", s(&model), "--config", s(&out.join("statecut_recipe.toml")), "-o", s(&again)]);

    let other = moby(&tmp.path().join("other"));
    perturb_key_weight(&other);
    let o = tmp.path().join("o");
    let e = run_err(&[
        "prune",
        "-q",
        "-m",
        s(&other),
        "--method",
        "swanda",
        "--ratio",
        "0.5",
        "--activations",
        s(&a),
        "-o",
        s(&o),
    ]);
    assert!(e.contains("another model of the same shape"), "{e}");
    assert!(!o.exists());
    assert_eq!(digest(&model), before);
    assert!(staging_under(tmp.path()).is_empty());
}

/// The smaller items: copied files keep their mode, an unpruned pytorch_model.bin is not carried
/// over, recipe errors keep their cause, the sweep's prune command keeps --tokenizer.
#[test]
fn smaller_items() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let model = moby(&tmp.path().join("m"));
    std::fs::set_permissions(model.join("tokenizer.json"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(model.join("pytorch_model.bin"), b"unpruned weights").unwrap();
    let out = tmp.path().join("out");
    run_ok(&["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&out)]);
    let mode = std::fs::metadata(out.join("tokenizer.json")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
    assert!(!out.join("pytorch_model.bin").exists());

    let recipe = tmp.path().join("r.toml");
    std::fs::write(&recipe, "method = \"l1\"\nratio = 0.5\nfrobnicate = 1\n").unwrap();
    let e = run_err(&["prune", "-q", "-m", s(&model), "--config", s(&recipe), "-o", s(&tmp.path().join("o2"))]);
    assert!(e.contains("unknown field `frobnicate`"), "{e}");

    let eval = text(tmp.path());
    let tok = common::embedded_model().join("tokenizer.json");
    let sweep = tmp.path().join("sweep");
    run_ok(&sweep_args(&model, &sweep, &eval, &["--tokenizer", s(&tok), "--budget", "1000%"]));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sweep.join("sweep.json")).unwrap()).unwrap();
    let cmd = report["recommendation"]["command"].as_str().expect("a recommendation");
    assert!(cmd.contains(&format!("--tokenizer {}", s(&tok))), "{cmd}");
    // The recipe names the tokenizer too.
    let out = tmp.path().join("with-tok");
    let mut a = vec!["prune", "-q", "-m", s(&model), "--method", "l1", "--ratio", "0.5", "-o", s(&out)];
    a.extend(["--tokenizer", s(&tok)]);
    run_ok(&a);
    let recipe = std::fs::read_to_string(out.join("statecut_recipe.toml")).unwrap();
    assert!(recipe.contains(&format!("tokenizer = \"{}\"", s(&tok.canonicalize().unwrap()))), "{recipe}");
}
