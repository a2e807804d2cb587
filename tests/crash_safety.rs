//! `prune` killed with SIGKILL at any point, including in the middle of writing the weights,
//! leaves either no output or the complete previous one (byte for byte), never a partial one;
//! the next run removes what the killed one left, but never a running process's staging
//! directory. Runs on the committed SSE fixture, padded with one large tensor so that writing
//! the weights takes long enough to be interrupted.
#![cfg(unix)]

mod common;

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Bytes of the padding tensor: the weight file is written for tens of milliseconds.
const PADDING: usize = 64 << 20;

/// The SSE fixture with an extra tensor that no layer reads (carried through byte for byte).
fn padded_model(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sse_gla");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let pad: Vec<u8> = (0..PADDING).map(|i| (i % 251) as u8).collect();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![PADDING], &pad).unwrap();
    tensors.push(("statecut_test.padding".into(), view));
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(meta), &model.join("model.safetensors")).unwrap();
    model
}

fn args<'a>(model: &'a Path, out: &'a Path, ratio: &'a str, overwrite: bool) -> Vec<&'a str> {
    let mut a = vec!["prune", "-m", model.to_str().unwrap(), "--method", "l1", "--ratio", ratio];
    a.extend(["-o", out.to_str().unwrap(), "-q"]);
    if overwrite {
        a.push("--overwrite");
    }
    a
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_statecut"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn run_ok(args: &[&str]) -> String {
    let (code, _, err) = common::statecut(args, &[]);
    assert_eq!(code, 0, "statecut {args:?} failed:\n{err}");
    err
}

/// A directory's files by name, as sha256; None if it does not exist. The report's timings and
/// peak memory differ between runs: the JSON report is only checked to be complete JSON, and the
/// Markdown report is hashed without its peak-memory line.
fn contents(dir: &Path) -> Option<BTreeMap<String, String>> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut out = BTreeMap::new();
    for e in entries {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&p).unwrap();
        let digest = if name == "statecut_report.json" {
            serde_json::from_slice::<serde_json::Value>(&bytes).expect("a complete report");
            "report".to_string()
        } else if name == "statecut_report.md" {
            let text = String::from_utf8(bytes).expect("a UTF-8 report");
            let kept: Vec<&str> = text.split_inclusive('\n').filter(|l| !l.starts_with("| peak memory |")).collect();
            format!("{:x}", Sha256::digest(kept.concat().as_bytes()))
        } else {
            format!("{:x}", Sha256::digest(&bytes))
        };
        out.insert(name, digest);
    }
    Some(out)
}

/// Hidden statecut siblings (staging or moved-aside outputs) in `dir`.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".statecut-"))
        .collect()
}

/// The moment a run is killed.
#[derive(Debug, Clone, Copy)]
enum At {
    /// Right after the process starts.
    Start,
    /// Once its staging directory exists.
    Staging,
    /// Once this many bytes of the weight file are written.
    WeightBytes(u64),
    /// Once config.json (written after every weight file) exists.
    WeightsDone,
    /// Once the report (written just before the rename) exists.
    Report,
}

/// How a killed run ended: the size of the weight file it left in staging, if any.
struct Killed {
    weights: Option<u64>,
}

/// Start `args` and SIGKILL it at `at`; None when it finished first.
fn kill_at(args: &[&str], out: &Path, at: At) -> Option<Killed> {
    let mut child = spawn(args);
    let name = out.file_name().unwrap().to_string_lossy();
    let staging = out.with_file_name(format!(".{name}.statecut-tmp-{}", child.id()));
    let weights = staging.join("model.safetensors");
    loop {
        let now = match at {
            At::Start => true,
            At::Staging => staging.exists(),
            At::WeightBytes(n) => std::fs::metadata(&weights).is_ok_and(|m| m.len() >= n),
            At::WeightsDone => staging.join("config.json").exists(),
            At::Report => staging.join("statecut_report.json").exists(),
        };
        if now {
            child.kill().unwrap();
            break;
        }
        if child.try_wait().unwrap().is_some() {
            return None;
        }
        std::thread::yield_now();
    }
    child.wait().unwrap();
    Some(Killed { weights: std::fs::metadata(&weights).ok().map(|m| m.len()) })
}

/// Kill points, each tried until it lands before the run finishes; `full` is the size of the
/// complete weight file.
fn points(full: u64) -> Vec<At> {
    let mut v = vec![At::Start, At::Staging];
    v.extend([0.1, 0.5, 0.9].map(|f| At::WeightBytes((full as f64 * f) as u64)));
    v.extend([At::WeightsDone, At::Report]);
    v
}

/// Run `kill_at` until the kill lands before the run ends (up to 5 tries; the last moments
/// before the rename are short), then call `check`. Returns how many kills landed while the
/// weight file was partly written.
fn each_kill(args: &[&str], out: &Path, full: u64, mut reset: impl FnMut(), mut check: impl FnMut(At)) -> usize {
    let mut mid_write = 0;
    for at in points(full) {
        for attempt in 0.. {
            reset();
            match kill_at(args, out, at) {
                Some(k) => {
                    eprintln!("killed at {at:?}: weight file {:?} of {full} bytes", k.weights);
                    mid_write += usize::from(k.weights.is_some_and(|w| w < full));
                    check(at);
                    break;
                }
                None if attempt < 5 => continue,
                None => {
                    eprintln!("{at:?}: every run finished before the kill");
                    check(at);
                    break;
                }
            }
        }
    }
    mid_write
}

#[test]
fn killed_prune_leaves_nothing_or_the_previous_output() {
    let tmp = tempfile::tempdir().unwrap();
    let model = padded_model(tmp.path());
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let out = work.join("out");

    // Complete outputs of the two settings, to compare against.
    run_ok(&args(&model, &out, "0.5", false));
    let old = contents(&out).unwrap();
    let old_copy = tmp.path().join("old");
    std::fs::rename(&out, &old_copy).unwrap();
    run_ok(&args(&model, &out, "0.25", false));
    let new = contents(&out).unwrap();
    // The killed runs write the 0.25 output: its weight file's size.
    let full = std::fs::metadata(out.join("model.safetensors")).unwrap().len();
    std::fs::remove_dir_all(&out).unwrap();
    assert_ne!(old["model.safetensors"], new["model.safetensors"]);
    assert!(full > PADDING as u64);

    // No previous output: after the kill there is none; the next run cleans up and completes.
    let fresh = args(&model, &out, "0.25", false);
    let mid = each_kill(
        &fresh,
        &out,
        full,
        || {
            if out.exists() {
                std::fs::remove_dir_all(&out).unwrap();
            }
        },
        |at| {
            let after = contents(&out);
            assert!(after.is_none() || after.as_ref() == Some(&new), "{at:?}: partial output {after:?}");
            if after.is_some() {
                // The run got past the rename before the kill.
                std::fs::remove_dir_all(&out).unwrap();
            }
            run_ok(&fresh);
            assert_eq!(contents(&out).as_ref(), Some(&new), "{at:?}");
            assert!(leftovers(&work).is_empty(), "{at:?}: {:?} left behind", leftovers(&work));
        },
    );

    // A complete previous output replaced with --overwrite: after the kill it is there byte for
    // byte (or the new one is, complete, if the kill came after the replacement).
    let replace = args(&model, &out, "0.25", true);
    let mid_overwrite = each_kill(
        &replace,
        &out,
        full,
        || {
            if out.exists() {
                std::fs::remove_dir_all(&out).unwrap();
            }
            copy_dir(&old_copy, &out);
        },
        |at| {
            let after = contents(&out);
            assert!(after.as_ref() == Some(&old) || after.as_ref() == Some(&new), "{at:?}: {after:?}");
            run_ok(&replace);
            assert_eq!(contents(&out).as_ref(), Some(&new), "{at:?}");
            assert!(leftovers(&work).is_empty(), "{at:?}: {:?} left behind", leftovers(&work));
        },
    );
    eprintln!("kills while the weight file was partly written: {mid} fresh, {mid_overwrite} replacing");
    assert!(mid + mid_overwrite > 0, "no kill landed during the weight write");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn a_running_process_keeps_its_staging_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let model = padded_model(tmp.path());
    let out = tmp.path().join("out");
    let a = args(&model, &out, "0.5", false);
    // Process A is stopped while it writes (retried if it finishes first); B runs to the same
    // output meanwhile.
    let (mut child, staging) = (0..5)
        .find_map(|_| {
            let mut child = spawn(&a);
            let staging = out.with_file_name(format!(".out.statecut-tmp-{}", child.id()));
            while !staging.exists() {
                if child.try_wait().unwrap().is_some() {
                    let _ = std::fs::remove_dir_all(&out);
                    return None;
                }
                std::thread::yield_now();
            }
            // SAFETY: a signal to the child this test started.
            assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) }, 0);
            if staging.exists() {
                return Some((child, staging));
            }
            child.kill().unwrap();
            child.wait().unwrap();
            let _ = std::fs::remove_dir_all(&out);
            None
        })
        .expect("every run finished before it could be stopped");
    run_ok(&a);
    assert!(staging.exists(), "a running process's staging directory was removed");
    assert!(contents(&out).is_some());
    child.kill().unwrap();
    child.wait().unwrap();
    // Now that A is gone, the next run removes what it left and says so.
    let err = run_ok(&args(&model, &out, "0.5", true));
    assert!(!staging.exists(), "stale staging directory kept");
    assert!(err.contains("left by interrupted process"), "{err}");
}
