//! With `--features cuda`, compile the custom ops' kernels (src/ops/cuda/kernels.cu, which
//! includes the other .cu files there) into a fat binary with machine code for CUDA_COMPUTE_CAP
//! (no JIT at first use) and PTX for newer GPUs. `STATECUT_CUDA_LINEINFO=1` adds line tables
//! (no change to the code), so that a profiler's source view maps instructions to .cu lines.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/ops/cuda");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=STATECUT_CUDA_LINEINFO");
    println!("cargo::rustc-check-cfg=cfg(tensor_cores)");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.fatbin");
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    // The chunk kernels' `_tc` forms use mma.sync on TF32, which needs compute capability 8.0;
    // the binary runs only on GPUs at least as new as the one it was built for.
    if cap.parse::<u32>().is_ok_and(|c| c >= 80) {
        println!("cargo::rustc-cfg=tensor_cores");
    }
    let sass = format!("arch=compute_{cap},code=sm_{cap}");
    let ptx = format!("arch=compute_{cap},code=compute_{cap}");
    let nvcc = env::var("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")).unwrap_or_else(|_| "nvcc".into());
    let mut cmd = Command::new(&nvcc);
    cmd.args(["--fatbin", "-O3", "-std=c++17", "-gencode", &sass, "-gencode", &ptx]);
    if env::var("STATECUT_CUDA_LINEINFO").is_ok_and(|v| v == "1") {
        cmd.arg("-lineinfo");
    }
    let status = cmd
        .args(["src/ops/cuda/kernels.cu", "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("--features cuda needs nvcc ({}): {e}; set CUDA_HOME", nvcc.display()));
    assert!(status.success(), "nvcc failed on src/ops/cuda/kernels.cu");
}
