// The harness's build, shared by tests/kernels_on_host.rs and src/ops/host_kernels.rs (each
// `include!`s this file), so that both compile the kernels with the same compiler and flags.

/// Builds tests/kernels/chunk_kernels.cpp into `out` with the host's C++ compiler (`CXX`, else
/// `c++`), with TF32 operands in the emulated products or float32 ones.
#[allow(dead_code)] // tests/norm_kernels_on_host.rs includes this file for build_kernels_cpp alone
fn build_harness(out: &std::path::Path, tf32: bool) {
    build_kernels_cpp("chunk_kernels.cpp", out, tf32);
}

/// Builds tests/kernels/`source` into `out` (see [`build_harness`]).
fn build_kernels_cpp(source: &str, out: &std::path::Path, tf32: bool) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = std::process::Command::new(&cxx);
    cmd.args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-I"])
        .arg(root.join("tests/kernels/include"))
        .arg(root.join("tests/kernels").join(source))
        .arg("-o")
        .arg(out);
    if tf32 {
        cmd.arg("-DEMULATE_TF32");
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "this test compiles tests/kernels with a C++20 compiler: `{cxx}` did not run ({e}); install g++ or set CXX"
        )
    });
    assert!(status.success(), "{cxx} failed on tests/kernels/{source}");
}

/// Builds tests/kernels/`source` (float32 operands) into `out` and runs it with no arguments, for
/// the harnesses that check their kernels themselves: its report (stdout), or a failure with its
/// stderr and report where it exits non-zero.
#[allow(dead_code)] // tests/kernels_on_host.rs and src/ops/host_kernels.rs run theirs by shape
fn run_checking_harness(source: &str, out: &std::path::Path) -> String {
    build_kernels_cpp(source, out, false);
    let run = std::process::Command::new(out).output().unwrap_or_else(|e| panic!("{source}'s harness runs: {e}"));
    let report = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "{}\n{report}", String::from_utf8_lossy(&run.stderr));
    report
}
