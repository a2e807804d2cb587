//! The GPU's recurrences without gradients run on the host, with no GPU, through the emulation of
//! tests/kernels/emulation.h: tests/kernels/recurrence_kernels.cpp holds every block shape the
//! launcher may pick for the tiled sequential kernel (src/ops/cuda/recurrence.cu: 8 or 4 warps,
//! one or two state columns a thread) at five key widths, with each decay and both rules, and
//! each instance of the chunked form (src/ops/cuda/chunk_fused.cu) at six shapes, with no decay
//! and one per step and both rules, to a float64 sequential reference. What this checks is the
//! kernels' logic (which thread holds which rows and columns, the staged steps and chunks, the
//! padded keys, the columns past dv, the chunk's solve); the GPU's numerics (TF32 products
//! included) are `tests/gpu_parity.rs`'s.

use std::path::Path;

include!("kernels/harness.rs");

#[test]
fn recurrence_block_shapes_match_float64_on_the_host() {
    let report = run_checking_harness(
        "recurrence_kernels.cpp",
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("recurrence_kernels"),
    );
    // Sequential: 5 widths x 3 decays x 2 rules x 2 block widths x 2 column counts; chunked: 6
    // shapes x 2 decays x 2 rules; outputs and state of each.
    assert_eq!(report.lines().count(), (5 * 3 * 2 * 2 * 2 + 6 * 2 * 2) * 2, "{report}");
    for case in [
        "t32_4_2 cols 2 warps 4 dk 128 dv 80 T 13 delta state",
        "t32_8_0 cols 2 warps 8 dk 256 dv 48 T 1 plain",
        "chunks128 dk 128 dv 80 T 150 decay 1 delta outputs",
        "chunks64 dk 64 dv 64 T 70 decay 1 delta in place state",
        "chunks32 dk 30 dv 36 T 33 decay 0 plain outputs",
        "chunks256 dk 256 dv 48 T 45 decay 1 delta state",
    ] {
        assert!(report.contains(case), "the harness did not report {case:?}:\n{report}");
    }
}
