//! The norm kernels (src/ops/cuda/norm.cu) run on the host, with no GPU, through the emulation of
//! tests/kernels/emulation.h: tests/kernels/norm_kernels.cpp holds each path of the gated norm,
//! its backward, the residual add with the norm and the packed add to a float64 reference on the
//! same inputs, in float32 and bf16 (see that file), and fails naming the check that is off.
//! What this checks is the kernels' logic (which lanes take which rows and columns, the partial
//! dw's paths and the block's adds); the GPU's numerics are `tests/gpu_parity.rs`'s.

use std::path::Path;

include!("kernels/harness.rs");

#[test]
fn norm_kernels_match_float64_on_the_host() {
    let report = run_checking_harness("norm_kernels.cpp", &Path::new(env!("CARGO_TARGET_TMPDIR")).join("norm_kernels"));
    // Every path ran: the register and memory paths of the backward in both dtypes among them.
    for check in [
        "rms_bwd f32 n 256 registers dw",
        "rms_bwd bf16 n 2048 res registers dw",
        "rms_bwd bf16 n 128 gated res memory dw",
        "gated_rms bf16 n 128 gated vec 1 lanes 16",
        "sums bf16 37 x 2048 bit for bit",
    ] {
        assert!(report.contains(check), "the harness did not report {check:?}:\n{report}");
    }
}
