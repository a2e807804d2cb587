//! The tiled sequential recurrence (src/ops/cuda/recurrence.cu) runs on the host, with no GPU,
//! through the emulation of tests/kernels/emulation.h: tests/kernels/recurrence_kernels.cpp holds
//! every block shape the launcher may pick (8 or 4 warps, one or two state columns a thread) at
//! five key widths, with each decay and both rules, to a float64 sequential reference. What this
//! checks is the kernel's logic (which thread holds which rows and columns, the staged steps,
//! the columns past dv); the GPU's numerics are `tests/gpu_parity.rs`'s.

use std::path::Path;

include!("kernels/harness.rs");

#[test]
fn recurrence_block_shapes_match_float64_on_the_host() {
    let report = run_checking_harness(
        "recurrence_kernels.cpp",
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("recurrence_kernels"),
    );
    // 5 widths x 3 decays x 2 rules x 2 block widths x 2 column counts, outputs and state.
    assert_eq!(report.lines().count(), 5 * 3 * 2 * 2 * 2 * 2, "{report}");
    for case in
        ["t32_4_2 cols 2 warps 4 dk 128 dv 80 T 13 delta state", "t32_8_0 cols 2 warps 8 dk 256 dv 48 T 1 plain"]
    {
        assert!(report.contains(case), "the harness did not report {case:?}:\n{report}");
    }
}
