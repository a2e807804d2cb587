//! The CUDA chunk kernels' float32 forms, run on the host with no GPU (tests/kernels: each CUDA
//! thread an OS thread), against the CPU ops that are their reference: the intra-chunk solve,
//! the outputs and the walk, forward and backward, on the harness's random inputs.
//! tests/kernels_on_host.rs holds the tensor-core forms to these float32 ones, so the two tie
//! every chunk kernel to the CPU's math in `cargo test`.

use super::{chunk_intra, chunk_out, chunk_walk, seed_gradient};
use candle_core::{Device, Result, Tensor, Var};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

include!("../../tests/kernels/harness.rs");

/// The harness (float32 operands), built once per test process.
fn harness() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = Path::new(env!("OUT_DIR")).join("chunk_kernels_host");
        build_harness(&out, false);
        out
    })
}

/// What the harness wrote for one shape: its inputs (`in.*`) and each kernel's float32 outputs.
struct Dump {
    dir: tempfile::TempDir,
    n: usize,
    bh: usize,
    c: usize,
    dk: usize,
    dv: usize,
}

impl Dump {
    /// Runs the harness on chunks N, sequences x heads BH, chunk length C, widths dk and dv.
    fn run([n, bh, c, dk, dv]: [usize; 5]) -> Dump {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let out = Command::new(harness())
            .args([n, bh, c, dk, dv].map(|x| x.to_string()))
            .arg("--dump")
            .arg(dir.path())
            .output()
            .expect("the harness runs");
        assert!(out.status.success(), "harness failed: {}", String::from_utf8_lossy(&out.stderr));
        Dump { dir, n, bh, c, dk, dv }
    }

    /// File `name` as a float32 tensor of `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Tensor {
        let bytes = std::fs::read(self.dir.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let x: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Tensor::from_vec(x, shape, &Device::Cpu).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// A kernel's float32 output `what` (`<kernel>.<what>.f32`), flat.
    fn kernel(&self, kernel: &str, what: &str) -> Tensor {
        let name = format!("{kernel}.{what}.f32");
        let len = std::fs::metadata(self.dir.path().join(&name)).unwrap_or_else(|e| panic!("{name}: {e}")).len();
        self.get(&name, &[len as usize / 4])
    }
}

/// max |got − want| / max |want|, which must stay within `bound`.
fn close(what: &str, got: &Tensor, want: &Tensor, bound: f64) -> Result<()> {
    let (got, want) = (got.flatten_all()?, want.flatten_all()?);
    assert_eq!(got.dims(), want.dims(), "{what}: lengths");
    let diff = (&got - &want)?.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let scale = want.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    assert!(scale > 0.0, "{what}: the reference is all zeros");
    let rel = diff / scale;
    assert!(rel <= bound, "{what}: the kernel is {rel:.3e} from the CPU op (bound {bound:.0e})");
    Ok(())
}

/// Float32 sums in other orders (the kernels' blocked products against the CPU's loops).
const BOUND: f64 = 1e-5;

/// The pruned DeltaNet's head with three chunks; pruned widths with partial column tiles and a
/// half chunk; a sixteen-token chunk narrower than one tile. (The tensor-core test's fourth
/// shape, dk 256, adds nothing the float32 forms do differently.)
const SHAPES: [[usize; 5]; 3] = [[3, 2, 64, 64, 128], [2, 3, 32, 48, 40], [1, 2, 16, 16, 20]];

fn intra(d: &Dump) -> Result<()> {
    let (n, bh, c, dk, dv) = (d.n, d.bh, d.c, d.dk, d.dv);
    let k = d.get("in.intra.k", &[n, bh, c, dk]);
    let v = d.get("in.intra.v", &[n, bh, c, dv]);
    let scal = d.get("in.intra.scal", &[2, n, bh, c]);
    let (beta, gamma) = (scal.get(0)?, scal.get(1)?);
    let flat = chunk_intra::solve_flat(&k, &v, &beta, Some(&gamma), false)?;
    let lw = n * bh * c * dv;
    close("solve W", &flat.narrow(0, 0, lw)?, &d.kernel("chunk_intra_fwd", "w"), BOUND)?;
    close("solve Kc", &flat.narrow(0, lw, n * bh * c * dk)?, &d.kernel("chunk_intra_fwd", "kc"), BOUND)?;

    // The harness passes dKc with the sign the walk's backward gives it (−1).
    let (op, scal) = chunk_intra::op(&k, &v, &beta, Some(&gamma), false)?;
    let gw = d.get("in.intra.gw", &[n, bh, c, dv]);
    let gkc = d.get("in.intra.gkc", &[n, bh, c, dk]);
    let (gk, gv, gs) = op.grads(&k, &v, &scal, &gw, &gkc, -1.0)?;
    close("solve dK", &gk, &d.kernel("chunk_intra_bwd", "dk"), BOUND)?;
    close("solve dV", &gv, &d.kernel("chunk_intra_bwd", "dv"), BOUND)?;
    close("solve dβ", &gs.get(0)?, &d.kernel("chunk_intra_bwd", "dbeta"), BOUND)?;
    close("solve dγ", &gs.get(1)?, &d.kernel("chunk_intra_bwd", "dgamma"), BOUND)
}

fn outputs(d: &Dump) -> Result<()> {
    let (n, bh, c, dk, dv) = (d.n, d.bh, d.c, d.dk, d.dv);
    let qk = Var::from_tensor(&d.get("in.out.qk", &[n, bh, c, 2 * dk]))?;
    let lw = n * bh * c * dv + (n + 1) * bh * dk * dv;
    let walked = Var::from_tensor(&d.get("in.out.walked", &[lw]))?;
    let gamma = Var::from_tensor(&d.get("in.out.gamma", &[n, bh, c]))?;
    let scale = 1.0 / (dk as f32).sqrt();
    let o = chunk_out::output(&qk, &walked, Some(&gamma), scale, dv, false)?;
    close("outputs O", &o, &d.kernel("chunk_out_fwd", "o"), BOUND)?;

    let grads = seed_gradient(&o, &d.get("in.out.grad", &[n, bh, c, dv]))?.backward()?;
    let of = |v: &Var| grads.get(v.as_tensor()).cloned().expect("a gradient");
    let dwalked = of(&walked);
    let lu = n * bh * c * dv;
    close("outputs dqk", &of(&qk), &d.kernel("chunk_out_bwd", "dqk"), BOUND)?;
    close("outputs dU", &dwalked.narrow(0, 0, lu)?, &d.kernel("chunk_out_bwd", "du"), BOUND)?;
    close("outputs dS", &dwalked.narrow(0, lu, lw - lu)?, &d.kernel("chunk_out_bwd", "dstates"), BOUND)?;
    close("outputs dγ", &of(&gamma), &d.kernel("chunk_out_bwd", "dgamma"), BOUND)
}

fn walk(d: &Dump) -> Result<()> {
    let (n, bh, c, dk, dv) = (d.n, d.bh, d.c, d.dk, d.dv);
    let w = d.get("in.walk.w", &[n, bh, c, dv]);
    let kc = d.get("in.walk.kc", &[n, bh, c, dk]);
    let wkc = Var::from_tensor(&chunk_walk::pack(&w, Some(&kc))?)?;
    let k = d.get("in.walk.k", &[n, bh, c, dk]);
    let e = d.get("in.walk.e", &[n, bh, c]);
    let s0 = Var::from_tensor(&d.get("in.walk.s0", &[bh, dk, dv]))?;
    let a = d.get("in.walk.a", &[n, bh, dk]);
    let x = chunk_walk::WalkIn { wkc: &wkc, delta: true, k: &k, e: &e, s0: &s0, a: &a, tensor: false };
    let (out, _) = chunk_walk::walk_flat(&x)?;
    let lu = n * bh * c * dv;
    close("walk U", &out.narrow(0, 0, lu)?, &d.kernel("chunk_walk_fwd", "u"), BOUND)?;
    close("walk states", &out.narrow(0, lu, out.dim(0)? - lu)?, &d.kernel("chunk_walk_fwd", "states"), BOUND)?;

    // The kernel's backward is the sequential part: dW (= dU) and dS₀ among what it writes.
    let seed = Tensor::cat(&[d.get("in.walk.gu", &[lu]), d.get("in.walk.gs", &[(n + 1) * bh * dk * dv])], 0)?;
    let grads = seed_gradient(&out, &seed)?.backward()?;
    let dwkc = grads.get(wkc.as_tensor()).expect("a gradient of W | Kc");
    close("walk dW", &dwkc.narrow(0, 0, lu)?, &d.kernel("chunk_walk_bwd", "dw"), BOUND)?;
    let ds0 = grads.get(s0.as_tensor()).expect("a gradient of S₀");
    close("walk dS₀", ds0, &d.kernel("chunk_walk_bwd", "ds0"), BOUND)
}

#[test]
fn float32_chunk_kernels_match_the_cpu_ops() -> Result<()> {
    for shape in SHAPES {
        let d = Dump::run(shape);
        intra(&d).map_err(|e| e.context(format!("{shape:?}")))?;
        outputs(&d).map_err(|e| e.context(format!("{shape:?}")))?;
        walk(&d).map_err(|e| e.context(format!("{shape:?}")))?;
    }
    Ok(())
}
