//! The delta-rule recurrence alone on one device, forward and forward + backward, in each of
//! statecut's forms: the fused sequential kernel (forward only), the fused op's chunked form on
//! tensor cores (`fused-chunks`, forward only), the chunked form in candle ops, and the chunked
//! form on statecut's chunk kernels. One JSON line per form and pass.
//!
//!   recurrence [--shape B,T,H,DK,DV] [--decay none|head|channel] [--rule delta|plain]
//!              [--dtype bf16|f32] [--device cuda|cpu] [--iterations N] [--forms LIST]
//!              [--grad sum|seed] [--checksum]
//!
//! Keys are L2-normalised and β ∈ (0, 1) before the clock starts, as a model's mixer feeds them;
//! the time is the recurrence's, from its inputs to its output (and back to their gradients),
//! synchronised, the median of `--iterations` after one untimed run. The backward starts from
//! a random output gradient w: `--grad sum` (the default) differentiates sum(o · w) in float32
//! through candle's ops, `--grad seed` hands w to o directly (`ops::seed_gradient`), as
//! PyTorch's `o.backward(w)` does, so that the time is the recurrence's alone.
//!
//! The forward + backward line also gives `graph_mib`: the memory the output and its graph hold
//! between the forward and the backward, what a trained layer keeps for its backward. On CUDA it
//! is read from statecut's memory pool, on the CPU from this program's heap.
//!
//! `--checksum` draws the inputs from a seeded generator on the host and adds `checksum` to each
//! line: a hash of the bits of the output and of every input's gradient in the untimed run, so
//! that two builds run on one device can be compared bit for bit (the host emulation of the
//! chunk kernels, `scripts/kernels_bit_identity.sh`, cannot see how the device compiler fuses
//! multiply-adds).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};
use statecut::ops::delta_rule::{Kernel, Recurrence, Rule};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The system allocator, counting the bytes live on the heap: on the CPU, tensors' storage.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            LIVE.fetch_add(new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes in use on `dev` after its queued work: statecut's pool on CUDA, the heap on the CPU.
fn in_use(dev: &Device) -> Option<usize> {
    match dev {
        Device::Cpu => Some(LIVE.load(Ordering::Relaxed)),
        _ => statecut::device::in_use(dev).map(|(now, _)| now),
    }
}

struct Opts {
    shape: [usize; 5],
    decay: String,
    rule: Rule,
    dtype: DType,
    device: Device,
    iterations: usize,
    forms: Vec<String>,
    seed: bool,
    checksum: bool,
}

fn opts() -> Result<Opts> {
    let mut o = Opts {
        shape: [16, 2048, 16, 128, 128],
        decay: "none".into(),
        rule: Rule::Delta,
        dtype: DType::BF16,
        device: Device::Cpu,
        iterations: 5,
        forms: ["chunked-kernels", "chunked", "fused"].map(String::from).to_vec(),
        seed: false,
        checksum: false,
    };
    let mut device = "cuda".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        // `cargo bench` passes --bench to every bench target.
        if a == "--bench" {
            continue;
        }
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--shape" => {
                let v: Vec<usize> = val()?.split(',').map(str::parse).collect::<Result<_, _>>()?;
                o.shape = v.try_into().map_err(|_| anyhow::anyhow!("--shape takes B,T,H,DK,DV"))?;
            }
            "--decay" => o.decay = val()?,
            "--rule" => {
                o.rule = match val()?.as_str() {
                    "delta" => Rule::Delta,
                    "plain" => Rule::Plain,
                    r => bail!("--rule {r}: delta or plain"),
                }
            }
            "--dtype" => {
                o.dtype = match val()?.as_str() {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    d => bail!("--dtype {d}: bf16 or f32"),
                }
            }
            "--device" => device = val()?,
            "--iterations" => o.iterations = val()?.parse()?,
            "--forms" => o.forms = val()?.split(',').map(String::from).collect(),
            "--grad" => {
                o.seed = match val()?.as_str() {
                    "sum" => false,
                    "seed" => true,
                    g => bail!("--grad {g}: sum or seed"),
                }
            }
            "--checksum" => o.checksum = true,
            "--help" | "-h" => {
                println!("{}", include_str!("recurrence.rs").lines().take(13).collect::<Vec<_>>().join("\n"));
                std::process::exit(0);
            }
            _ => bail!("unknown argument {a} (see --help)"),
        }
    }
    if !["none", "head", "channel"].contains(&o.decay.as_str()) {
        bail!("--decay {}: none, head or channel", o.decay);
    }
    // Opened as statecut's commands open it (its memory pool settings included).
    o.device = if device == "cpu" { Device::Cpu } else { statecut::device::DeviceSpec::Cuda(0).open()? };
    Ok(o)
}

fn kernel(form: &str) -> Result<Kernel> {
    Ok(match form {
        "chunked-kernels" => Kernel::ChunkedKernels,
        "chunked" => Kernel::Chunked,
        "fused" => Kernel::Fused,
        "fused-chunks" => Kernel::FusedChunks,
        "sequential" => Kernel::Sequential,
        f => bail!("unknown form {f}"),
    })
}

/// FNV-1a over the float32 bits of every element of each tensor, in order (bf16 and f16 widen
/// exactly), as 16 hex digits.
fn checksum(ts: &[Tensor]) -> Result<String> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in ts {
        for x in t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    Ok(format!("{h:016x}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let o = opts()?;
    let [b, t, h, dk, dv] = o.shape;
    let dev = &o.device;
    // Seeded on the host for --checksum: the CPU's generator cannot be seeded, and the same
    // inputs must reach every build.
    let host_rng = std::cell::RefCell::new(StdRng::seed_from_u64(0x5eed));
    let rand = |shape: &[usize]| -> candle_core::Result<Tensor> {
        if !o.checksum {
            return Tensor::randn(0f32, 1f32, shape, dev);
        }
        let n = shape.iter().product();
        let mut rng = host_rng.borrow_mut();
        // Box-Muller: a standard normal from two uniforms in (0, 1].
        let mut normal = || {
            let (u, v): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        };
        let v: Vec<f32> = (0..n).map(|_| normal()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)?.to_device(dev)
    };
    let k = rand(&[b, t, h, dk])?;
    let k = k.broadcast_div(&k.sqr()?.sum_keepdim(3)?.sqrt()?)?;
    let q = rand(&[b, t, h, dk])?;
    let q = q.broadcast_div(&q.sqr()?.sum_keepdim(3)?.sqrt()?)?;
    let inputs = [
        q.to_dtype(o.dtype)?,
        k.to_dtype(o.dtype)?,
        rand(&[b, t, h, dv])?.to_dtype(o.dtype)?,
        candle_nn::ops::sigmoid(&rand(&[b, t, h])?)?.to_dtype(o.dtype)?,
        (candle_nn::ops::sigmoid(&rand(&[b, t, h])?)? * -0.1)?,
        (candle_nn::ops::sigmoid(&rand(&[b, t, h, dk])?)? * -0.1)?,
    ];
    let w = rand(&[b, t, h, dv])?;
    // The seeded gradient in the values' dtype, which o takes, cast before the clock starts.
    let w_seed = w.to_dtype(o.dtype)?;
    for form in &o.forms {
        let kernel = kernel(form)?;
        for backward in [false, true] {
            if backward && matches!(kernel, Kernel::Fused | Kernel::FusedChunks) {
                continue;
            }
            let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<candle_core::Result<_>>()?;
            // What the output and its graph held before the backward, in the untimed run.
            let held = std::cell::Cell::new(None);
            let sum = std::cell::RefCell::new(None);
            let run = || -> Result<()> {
                let before = in_use(dev);
                let x: Vec<Tensor> =
                    if backward { vars.iter().map(|v| v.as_tensor().clone()).collect() } else { inputs.to_vec() };
                let rec = Recurrence {
                    q: &x[0],
                    k: &x[1],
                    v: &x[2],
                    beta: &x[3],
                    g: (o.decay == "head").then_some(&x[4]),
                    gk: (o.decay == "channel").then_some(&x[5]),
                    scale: 1.0 / (dk as f64).sqrt(),
                    rule: o.rule,
                    initial: None,
                };
                let out = Kernel::scoped(kernel, || rec.forward())?;
                let mut grads = None;
                if backward {
                    if held.get().is_none() {
                        held.set(before.zip(in_use(dev)).map(|(a, b)| b.saturating_sub(a)));
                    }
                    let g = match o.seed {
                        true => statecut::ops::seed_gradient(&out, &w_seed)?.backward()?,
                        // Summed by rows first: candle's whole-tensor sum runs in one block, which
                        // would time the loss (6 ms at 16 x 2048 x 16 x 128) rather than the rule.
                        false => (out.to_dtype(DType::F32)? * &w)?.sum(3)?.sum_all()?.backward()?,
                    };
                    // The gradients are computed once they exist; reading one keeps them alive.
                    g.get(vars[0].as_tensor()).context("no gradient reached q")?;
                    grads = Some(g);
                }
                if o.checksum && sum.borrow().is_none() {
                    let mut all = vec![out.clone()];
                    if let Some(g) = &grads {
                        all.extend(vars.iter().filter_map(|v| g.get(v.as_tensor()).cloned()));
                    }
                    *sum.borrow_mut() = Some(checksum(&all)?);
                }
                drop(grads);
                dev.synchronize()?;
                Ok(())
            };
            run()?;
            let mut times = Vec::with_capacity(o.iterations);
            for _ in 0..o.iterations {
                let t0 = Instant::now();
                run()?;
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            let line = serde_json::json!({
                "form": form, "pass": if backward { "forward+backward" } else { "forward" },
                "ms": median(times.clone()), "runs_ms": times,
                "b": b, "t": t, "h": h, "dk": dk, "dv": dv, "decay": o.decay,
                "rule": format!("{:?}", o.rule).to_lowercase(), "dtype": format!("{:?}", o.dtype).to_lowercase(),
                "grad": if o.seed { "seed" } else { "sum" },
                "graph_mib": held.get().map(|b| b as f64 / (1 << 20) as f64),
                "checksum": sum.borrow().clone(),
            });
            println!("{line}");
        }
    }
    // STATECUT_PROFILE=1: where the timed runs went, stage by stage (synchronised marks).
    if let Some(table) = statecut::profile::report() {
        eprintln!("{table}");
    }
    Ok(())
}
