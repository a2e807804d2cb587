//! The CUDA chunk kernels (src/ops/cuda/chunk_*.cu) run on the host, with no GPU: each
//! tensor-core kernel against its float32 twin on the same inputs (tests/kernels/chunk_kernels.cpp,
//! through tests/kernels/emulation.h: one OS thread per CUDA thread, barriers for
//! `__syncthreads` and warp shuffles). What this checks is the kernels' logic: which thread
//! reads and writes which element, the tiling, the padding of short chunks and partial column
//! tiles, where the block synchronises. The GPU's own numerics are `tests/gpu_parity.rs`'s.
//!
//! With float32 operands in the emulated products, the two forms differ only in the order of
//! their sums; with TF32 operands (the hardware's) by their rounding.

use std::path::{Path, PathBuf};
use std::process::Command;

include!("kernels/harness.rs");

/// The harness with TF32 operands or float32 ones, in this test's scratch directory.
fn build(tf32: bool) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(if tf32 { "chunk_kernels_tf32" } else { "chunk_kernels" });
    build_harness(&out, tf32);
    out
}

/// Runs the harness on one shape (chunks, sequences x heads, chunk length, dk, dv): every output's
/// largest difference between the two forms, relative to the float32 form's largest magnitude.
fn run(bin: &Path, shape: [usize; 5]) -> Vec<(String, f64)> {
    let out = Command::new(bin).args(shape.map(|x| x.to_string())).output().expect("the harness runs");
    assert!(out.status.success(), "harness failed on {shape:?}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8 report");
    let rows: Vec<(String, f64)> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "report line {l:?}");
            (format!("{} {}", f[0], f[1]), f[2].parse().expect("a number"))
        })
        .collect();
    // The solve (2 + 4 outputs), the outputs (1 + 4), and the walk (2 + 5, for the delta rule and
    // the plain one) in each tensor-core form that takes dk (`_k64`, `_k128` and the form for 256).
    let walks = [64, 128, 256].iter().filter(|&&w| shape[3] <= w).count();
    assert_eq!(rows.len(), 11 + 2 * 7 * walks, "{text}");
    rows
}

/// Shapes: the pruned DeltaNet's head (dk 64, dv 128); pruned widths with partial column tiles
/// and a half chunk (48, 40, 32); the widest keys (256, the walk's eight tiles a warp); a
/// sixteen-token chunk narrower than one tile; dk 96 (the walk's `_k128` form, and the wider one).
const SHAPES: [[usize; 5]; 5] =
    [[3, 2, 64, 64, 128], [2, 3, 32, 48, 40], [2, 1, 64, 256, 64], [1, 2, 16, 16, 20], [2, 2, 64, 96, 72]];

fn check(tf32: bool, bound: f64) {
    let bin = build(tf32);
    for shape in SHAPES {
        for (what, diff) in run(&bin, shape) {
            assert!(diff <= bound, "{what} at {shape:?}: the tensor-core form is {diff:.3e} from the float32 one");
        }
    }
}

/// Float32 operands: the forms agree to float32 rounding of sums taken in other orders.
#[test]
fn tensor_core_kernels_match_float32_kernels_on_the_host() {
    check(false, 1e-5);
}

/// TF32 operands, as the GPU reads them: within their rounding (10-bit mantissas, 2^-11 each;
/// the walk compounds it over its chunks).
#[test]
fn tensor_core_kernels_with_tf32_operands_stay_near_float32() {
    check(true, 1e-2);
}
