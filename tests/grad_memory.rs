//! `calibrate --grad` holds one pass's autograd graph at a time: its peak memory does not grow
//! with the number of calibration sequences. (The observer used to keep tensors that still
//! tracked gradients, so every sequence's whole graph stayed alive until the end.)
#![cfg(target_os = "linux")]

mod common;

use std::process::{Command, Stdio};

/// Peak resident set (bytes) of `statecut calibrate --grad` over `nsamples` sequences, read from
/// the child's own resource usage.
// The child is reaped by `wait4`, which also returns its resource usage.
#[allow(clippy::zombie_processes)]
fn peak_rss(nsamples: usize, dir: &std::path::Path) -> u64 {
    let model = common::embedded_model();
    let out = dir.join(format!("acts-{nsamples}.safetensors"));
    let n = nsamples.to_string();
    let child = Command::new(env!("CARGO_BIN_EXE_statecut"))
        .args(["calibrate", "-m", model.to_str().unwrap(), "--grad", "--nsamples", &n, "--seqlen", "512", "-q"])
        .args(["--calib", common::repo_file("assets/train.txt").to_str().unwrap(), "-o", out.to_str().unwrap()])
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.txt")).unwrap())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: plain libc call on our own child's pid with valid out-pointers.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    let err = std::fs::read_to_string(dir.join("stderr.txt")).unwrap_or_default();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "calibrate --grad --nsamples {n} failed:\n{err}"
    );
    assert!(out.is_file());
    usage.ru_maxrss as u64 * 1024
}

#[test]
fn grad_calibration_memory_does_not_grow_with_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let few = peak_rss(2, dir.path());
    let many = peak_rss(12, dir.path());
    eprintln!("peak RSS: {:.0} MB at 2 sequences, {:.0} MB at 12", few as f64 / 1e6, many as f64 / 1e6);
    // Each kept graph of 512 tokens costs tens of MB here: ten more would add hundreds.
    assert!(
        many < few + few / 5,
        "peak memory grew with the sequences: {} MB at 2, {} MB at 12",
        few / 1_000_000,
        many / 1_000_000
    );
}
