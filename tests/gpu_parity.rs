//! The CUDA path against the CPU path on the shared reference models (needs a GPU and
//! `--features cuda`; see docs/GPU.md for the command): float32 and bf16 logits, the
//! key-projection gradients of the Grad selector, step-by-step decoding, and calibration rows;
//! the CUDA recurrence kernels against the CPU kernel on random inputs of many shapes; and the
//! optimizer's update.
#![cfg(feature = "cuda")]

mod common;

use common::flat;

use candle_core::{DType, Device, Tensor};
use statecut::arch::{family_for, CausalLm, DecodeCache, LoadOptions, NoObserver};
use statecut::calib::{CalibSettings, Calibration};
use statecut::checkpoint::Checkpoint;
use statecut::graph_decode::GraphDecoder;
use statecut::ops::delta_rule::{Kernel, Recurrence, Rule, FUSED_CHUNKS_FROM_TOKENS};
use statecut::ops::fused_block::with_fused_block;

/// The device as `--device cuda` opens it, gradients summed as the binary sums them.
fn gpu() -> Device {
    statecut::ops::add::use_for_gradients();
    statecut::device::DeviceSpec::Cuda(0).open().expect("a CUDA device (these tests need a GPU)")
}

fn load(ckpt: &Checkpoint, device: &Device, dtype: DType, grad: bool) -> Box<dyn CausalLm> {
    family_for(ckpt).unwrap().load(ckpt, &LoadOptions { dtype, device: device.clone(), grad }).unwrap()
}

fn grads(model: &dyn CausalLm, ids: &Tensor) -> Vec<Vec<f32>> {
    let n = ids.dim(1).unwrap();
    let (inp, tgt) = (ids.narrow(1, 0, n - 1).unwrap(), ids.narrow(1, 1, n - 1).unwrap());
    let logits = model.forward(&inp, &mut NoObserver).unwrap().to_dtype(DType::F32).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
    let loss = logp.gather(&tgt.unsqueeze(2).unwrap(), 2).unwrap().sum_all().unwrap().neg().unwrap();
    let store = loss.backward().unwrap();
    model.grad_vars().iter().map(|(_, v)| flat(store.get(v.as_tensor()).unwrap())).collect()
}

fn check(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    check_dir(name, &dir);
}

/// A checkpoint saved by transformers in the repository (the hybrids' fixtures).
fn check_fixture(name: &str) {
    check_dir(name, &common::repo_file(&format!("tests/fixtures/{name}")));
}

fn check_dir(name: &str, dir: &std::path::Path) {
    let golden = common::golden(dir);
    let ckpt = Checkpoint::open(dir).unwrap();
    let (cpu, gpu) = (Device::Cpu, gpu());
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let reference = flat(&load(&ckpt, &cpu, DType::F32, false).forward(&ids, &mut NoObserver).unwrap());

    let f32_model = load(&ckpt, &gpu, DType::F32, false);
    let ids_gpu = ids.to_device(&gpu).unwrap();
    // Both GPU recurrences: the fused kernel (the default without gradients) and the chunked
    // form (the default with them).
    for kernel in [Kernel::Fused, Kernel::Chunked] {
        let logits = Kernel::scoped(kernel, || f32_model.forward(&ids_gpu, &mut NoObserver)).unwrap();
        let err = common::rel_err(&flat(&logits), &reference);
        eprintln!("{name}: cuda f32 ({kernel:?}) vs cpu f32 logits relative error {err:.3e}");
        assert!(err < 1e-4, "{name}: cuda f32 logits ({kernel:?}) differ from the CPU's by {err:.3e}");
    }
    // Fixtures store the golden logits at `logit_positions` only.
    let at_golden = |logits: Vec<f32>| match golden.get("logit_positions") {
        Some(pos) => {
            let t = Tensor::from_vec(logits, (1, ids.dim(1).unwrap(), ()), &cpu).unwrap();
            flat(&t.index_select(&pos.to_dtype(DType::U32).unwrap(), 1).unwrap())
        }
        None => logits,
    };
    let golden_err = common::rel_err(&at_golden(reference.clone()), &flat(&golden["logits"]));
    assert!(golden_err < 1e-3, "{name}: CPU reference drifted from the golden ({golden_err:.3e})");

    let bf16 = load(&ckpt, &gpu, DType::BF16, false);
    // The upstream library's own bf16 forward (its kernels for the shared models, transformers'
    // bf16 CPU forward for the fixtures) sets the scale of an acceptable bf16 error.
    let upstream = golden
        .get("logits_bf16_kernel")
        .or(golden.get("logits_bf16"))
        .map(|up| common::rel_err(&flat(up), &flat(&golden["logits"])));
    // The default kernels (the fused op, in chunks on tensor cores from 64 tokens), the fused op's
    // sequential kernel, then the chunk kernels on tensor cores that long sequences of few
    // sequences take.
    for (label, kernel) in [
        ("", None),
        (" on the sequential kernel", Some(Kernel::Fused)),
        (" on the chunk kernels", Some(Kernel::ChunkedKernels)),
    ] {
        let run = || bf16.forward(&ids_gpu, &mut NoObserver);
        let logits = match kernel {
            Some(k) => Kernel::scoped(k, run),
            None => run(),
        };
        let err = common::rel_err(&at_golden(flat(&logits.unwrap())), &at_golden(reference.clone()));
        match upstream {
            Some(upstream) => {
                eprintln!("{name}: cuda bf16{label} vs cpu f32 logits relative error {err:.3e} (upstream bf16: {upstream:.3e})");
                assert!(
                    err < 3.0 * upstream.max(1e-3),
                    "{name}: cuda bf16 logits{label} differ from float32 by {err:.3e}"
                );
            }
            None => eprintln!(
                "{name}: cuda bf16{label} vs cpu f32 logits relative error {err:.3e} (no bf16 golden to bound it)"
            ),
        }
    }

    // Step-by-step decoding on the GPU reproduces the GPU's full forward.
    let short = ids_gpu.narrow(1, 0, 24).unwrap();
    let full = flat(&f32_model.forward(&short, &mut NoObserver).unwrap());
    let mut cache = DecodeCache::default();
    let mut parts = vec![f32_model.forward_cached(&short.narrow(1, 0, 20).unwrap(), &mut cache).unwrap()];
    for t in 20..24 {
        parts.push(f32_model.forward_cached(&short.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
    }
    let err = common::rel_err(&flat(&Tensor::cat(&parts, 1).unwrap()), &full);
    eprintln!("{name}: cuda decode vs full forward relative error {err:.3e}");
    assert!(err < 1e-4, "{name}: cuda decode differs from the full forward by {err:.3e}");
    // The same in bf16 over two sequences at once (the fused single-token step where the family
    // has one), against the float32 forward, at the scale of the upstream bf16 error.
    let two = Tensor::cat(&[&short, &ids_gpu.narrow(1, 24, 24).unwrap()], 0).unwrap();
    let full = f32_model.forward(&two, &mut NoObserver).unwrap();
    let mut cache = DecodeCache::default();
    let mut steps = Vec::new();
    bf16.forward_cached(&two.narrow(1, 0, 20).unwrap(), &mut cache).unwrap();
    for t in 20..24 {
        steps.push(bf16.forward_cached(&two.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
    }
    let steps = flat(&Tensor::cat(&steps, 1).unwrap());
    let err = common::rel_err(&steps, &flat(&full.narrow(1, 20, 4).unwrap()));
    let bound = 3.0 * upstream.unwrap_or(1e-2).max(1e-3);
    eprintln!("{name}: cuda bf16 decode (batch 2) vs f32 full forward relative error {err:.3e} (bound {bound:.3e})");
    assert!(err < bound, "{name}: cuda bf16 decode differs from the float32 forward by {err:.3e}");
    // A prompt on the chunk kernels hands the fused decoding step its state and conv history.
    let mut cache = DecodeCache::default();
    Kernel::scoped(Kernel::ChunkedKernels, || bf16.forward_cached(&two.narrow(1, 0, 20).unwrap(), &mut cache)).unwrap();
    let mut after_chunks = Vec::new();
    for t in 20..24 {
        after_chunks.push(bf16.forward_cached(&two.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
    }
    let err = common::rel_err(&flat(&Tensor::cat(&after_chunks, 1).unwrap()), &flat(&full.narrow(1, 20, 4).unwrap()));
    eprintln!("{name}: cuda bf16 decode after a chunk-kernel prompt vs f32 full forward relative error {err:.3e}");
    assert!(err < bound, "{name}: cuda bf16 decode after a chunk-kernel prompt differs by {err:.3e}");
    // The same steps replayed from a CUDA graph give the eager steps' logits where every layer
    // is recurrent (the fused delta-rule step and Mamba-2's general one, both in place);
    // elsewhere the decoder refuses, saying why.
    let mut cache = DecodeCache::default();
    bf16.forward_cached(&two.narrow(1, 0, 20).unwrap(), &mut cache).unwrap();
    match GraphDecoder::new(bf16.as_ref(), &cache, &two.narrow(1, 20, 1).unwrap()) {
        Ok((mut graph, first)) => {
            let mut replayed = vec![first];
            for t in 21..24 {
                replayed.push(graph.step(&two.narrow(1, t, 1).unwrap()).unwrap().copy().unwrap());
            }
            let err = common::rel_err(&flat(&Tensor::cat(&replayed, 1).unwrap()), &steps);
            eprintln!("{name}: bf16 decode replayed from a CUDA graph vs eager steps relative error {err:.3e}");
            assert!(err < 1e-6, "{name}: the replayed decoding step differs from the eager one by {err:.3e}");
        }
        Err(e) => {
            eprintln!("{name}: no CUDA-graph decoding: {e:#}");
            assert!(!matches!(name, "delta_net" | "gated_deltanet" | "mamba2"), "{name}: {e:#}");
        }
    }

    // Gradients for the Grad selector: autograd through the chunked form on the GPU against
    // the CPU kernel's backward.
    let ids_g = ids.narrow(1, 0, 128).unwrap();
    let g_cpu = grads(load(&ckpt, &cpu, DType::F32, true).as_ref(), &ids_g);
    let g_gpu = grads(load(&ckpt, &gpu, DType::F32, true).as_ref(), &ids_g.to_device(&gpu).unwrap());
    assert!(!g_cpu.is_empty() && g_cpu.len() == g_gpu.len());
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let err = common::rel_err(a, b);
        assert!(err < 1e-3, "{name}: gradient {i} on cuda differs from the CPU's by {err:.3e}");
    }
    eprintln!("{name}: cuda gradients of {} projections match the CPU's", g_cpu.len());

    // Calibration on the GPU (rows picked on the device, batched) samples what the CPU samples.
    let family = family_for(&ckpt).unwrap();
    let layout = family.layout(&ckpt).unwrap();
    let seqs: Vec<Vec<u32>> = (0..3).map(|i| flat_ids(&ids.narrow(1, i * 30, 64).unwrap())).collect();
    let settings = CalibSettings { nsamples: 3, seqlen: 64, seed: 1, rows: 200, grad: false, source: "golden".into() };
    let calibrate = |model: &dyn CausalLm, batch: usize| {
        let mut cal = Calibration::new(settings.clone(), &layout, 0);
        cal.run(model, &seqs, Some(batch), None, true).unwrap();
        cal
    };
    let (on_cpu, on_gpu) =
        (calibrate(load(&ckpt, &cpu, DType::F32, false).as_ref(), 1), calibrate(f32_model.as_ref(), 3));
    for (l, a) in &on_cpu.collector.layers {
        let b = &on_gpu.collector.layers[l];
        let err = common::rel_err(&b.keys.rows, &a.keys.rows).max(common::rel_err(&b.queries.rows, &a.queries.rows));
        assert!(err < 1e-4, "{name}: layer {l}: calibration rows on cuda differ by {err:.3e}");
    }
    eprintln!("{name}: cuda calibration rows match the CPU's");
}

fn flat_ids(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<u32>().unwrap()
}

#[test]
fn delta_net_gpu_matches_cpu() {
    check("delta_net");
}

#[test]
fn gated_deltanet_gpu_matches_cpu() {
    check("gated_deltanet");
}

#[test]
fn mamba2_gpu_matches_cpu() {
    check("mamba2");
}

#[test]
fn nemotron_h_gpu_matches_cpu() {
    check_fixture("nemotron_h");
}

#[test]
fn granite_h_gpu_matches_cpu() {
    check_fixture("granite_h");
}

#[test]
fn falcon_h1_gpu_matches_cpu() {
    check_fixture("falcon_h1");
}

/// Kimi Delta Attention: the gradients go through the chunked per-key-channel-decay form.
#[test]
fn kimi_linear_gpu_matches_cpu() {
    check_fixture("kimi_linear");
}

/// Qwen3.5/3.6 MoE (flat export): the Qwen projection layout of the shared linear-attention
/// mixer and the MoE block on the GPU.
#[test]
fn qwen3_5_moe_text_gpu_matches_cpu() {
    check_fixture("qwen3_5_moe_text");
}

#[test]
fn qwen3_5_gpu_matches_cpu() {
    check("qwen3_5");
}

/// Every CUDA recurrence instance (tiled for 16/24/32 rows per thread and 1..32 threads per
/// column, in each block shape it has, the general kernel otherwise), with no / per-step /
/// per-channel decay, both rules, one step and many (crossing the staged chunks), from a given
/// state, and the fused op's chunked form: outputs and final state against the CPU's sequential
/// kernel.
#[test]
fn recurrence_kernels_match_cpu_on_random_shapes() {
    let gpu = gpu();
    let cpu = Device::Cpu;
    let (b, h) = (2, 3);
    // (dk, dv): tiled 32x2, 32x4, 32x8, 24x4 (dv not a multiple of the block's columns), 24x2,
    // 32x1, 16x1, 32x16, 32x32; general kernel for 25 and 20 rows and for 8.
    let shapes = [
        (64, 64),
        (128, 128),
        (256, 512),
        (96, 80),
        (48, 40),
        (32, 16),
        (16, 24),
        (512, 8),
        (1024, 4),
        (100, 30),
        (20, 20),
        (8, 8),
    ];
    let (mut worst_bf16, mut worst_fused_chunks) = (0f64, 0f64);
    for (dk, dv) in shapes {
        for t in [1, 77] {
            // decay 0: none, 1: per step, 2: per step and per key channel, 3: per key channel only
            for decay in 0..4 {
                for rule in [Rule::Delta, Rule::Plain] {
                    let rand = |shape: &[usize]| Tensor::randn(0f32, 1f32, shape, &cpu).unwrap();
                    let k = rand(&[b, t, h, dk]);
                    let k = k.broadcast_div(&k.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap()).unwrap();
                    let q = rand(&[b, t, h, dk]);
                    let v = rand(&[b, t, h, dv]);
                    let beta = candle_nn::ops::sigmoid(&rand(&[b, t, h])).unwrap();
                    let g = (candle_nn::ops::sigmoid(&rand(&[b, t, h])).unwrap() * -0.5).unwrap();
                    let gk = (candle_nn::ops::sigmoid(&rand(&[b, t, h, dk])).unwrap() * -0.3).unwrap();
                    let s0 = (rand(&[b, h, dk, dv]) * 0.1).unwrap();
                    // `vdt`: the values' dtype (bf16 values take the chunk kernels' tensor-core form).
                    let run_as = |dev: &Device, kernel: Kernel, (q, k, v): (&Tensor, &Tensor, &Tensor), vdt: DType| {
                        let on = |x: &Tensor| x.to_device(dev).unwrap();
                        let v = on(v).to_dtype(vdt).unwrap();
                        let (q, k, beta, g, gk, s0) = (on(q), on(k), on(&beta), on(&g), on(&gk), on(&s0));
                        let rec = Recurrence {
                            q: &q,
                            k: &k,
                            v: &v,
                            beta: &beta,
                            g: (decay == 1 || decay == 2).then_some(&g),
                            gk: (decay >= 2).then_some(&gk),
                            scale: 0.37,
                            rule,
                            initial: Some(&s0),
                        };
                        let (o, s) = Kernel::scoped(kernel, || rec.forward_with_state()).unwrap();
                        (flat(&o), flat(&s))
                    };
                    let run = |dev: &Device, kernel: Kernel| run_as(dev, kernel, (&q, &k, &v), DType::F32);
                    let (o_ref, s_ref) = run(&cpu, Kernel::Sequential);
                    let what = format!("dk {dk} dv {dv} T {t} decay {decay} {rule:?}");
                    // The launcher's block, then each block shape the tiled kernel has.
                    let (o, s) = run(&gpu, Kernel::Fused);
                    let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                    assert!(eo < 1e-5 && es < 1e-5, "{what}: outputs differ by {eo:.3e}, state by {es:.3e}");
                    for block in [(8, 1), (8, 2), (4, 1), (4, 2)] {
                        let (o, s) = with_fused_block(block, || run(&gpu, Kernel::Fused));
                        let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                        assert!(
                            eo < 1e-5 && es < 1e-5,
                            "{what} fused in blocks {block:?}: outputs differ by {eo:.3e}, state by {es:.3e}"
                        );
                    }
                    // The fused op's chunked form (16-bit models' passes): TF32 products where it
                    // has the shape (keys up to 256 wide, a decay per step or none, enough steps),
                    // else the sequential kernel's float32 result.
                    let (o, s) = run(&gpu, Kernel::FusedChunks);
                    let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                    let in_chunks = dk <= 256 && decay <= 1 && t >= FUSED_CHUNKS_FROM_TOKENS;
                    let bound = if in_chunks { 4e-3 } else { 1e-5 };
                    assert!(
                        eo < bound && es < bound,
                        "{what} fused in chunks ({in_chunks}): outputs differ by {eo:.3e}, state by {es:.3e}"
                    );
                    if in_chunks {
                        worst_fused_chunks = worst_fused_chunks.max(eo).max(es);
                    }
                    // the chunked form (the Grad selector's) on the GPU, per-channel decays included
                    let (o, s) = run(&gpu, Kernel::Chunked);
                    let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                    assert!(eo < 1e-4 && es < 1e-4, "{what} chunked: outputs differ by {eo:.3e}, state by {es:.3e}");
                    if dk <= 256 {
                        let (o, s) = run(&gpu, Kernel::ChunkedKernels);
                        let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                        assert!(
                            eo < 1e-5 && es < 1e-5,
                            "{what} chunk kernels: outputs differ by {eo:.3e}, state by {es:.3e}"
                        );
                        // bf16 inputs: the products on tensor cores (TF32 operands), against the
                        // CPU's kernel on the same rounded inputs, within half a bf16 step.
                        let round = |x: &Tensor| x.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
                        let qkv = (&round(&q), &round(&k), &round(&v));
                        let (o_ref, s_ref) = run_as(&cpu, Kernel::Sequential, qkv, DType::F32);
                        let (o, s) = run_as(&gpu, Kernel::ChunkedKernels, qkv, DType::BF16);
                        let (eo, es) = (common::rel_err(&o, &o_ref), common::rel_err(&s, &s_ref));
                        assert!(
                            eo < 4e-3 && es < 4e-3,
                            "{what} chunk kernels, bf16 values: outputs differ by {eo:.3e}, state by {es:.3e}"
                        );
                        worst_bf16 = worst_bf16.max(eo).max(es);
                    }
                }
            }
        }
        eprintln!("recurrence dk {dk} dv {dv}: cuda fused and chunked forms (and chunk kernels) match the cpu kernel");
    }
    eprintln!("chunk kernels with bf16 values: largest relative difference {worst_bf16:.2e}");
    eprintln!("the fused op in chunks: largest relative difference {worst_fused_chunks:.2e}");
}

/// The chunk kernels' gradients on the GPU (float32 and bf16 inputs) against the composed
/// chunked form's on the CPU (its solve in float64), for every input, the initial state
/// included: ragged and single-step lengths, pruned widths, dk ≠ dv, each decay kind, both rules.
#[test]
fn chunk_kernel_gradients_match_cpu() {
    use candle_core::Var;
    let (gpu, cpu) = (gpu(), Device::Cpu);
    let (b, h) = (2, 3);
    for (dk, dv, t) in [(48, 64, 130), (96, 128, 64), (128, 96, 1), (64, 64, 200), (256, 40, 70)] {
        for decay in 0..4 {
            for rule in [Rule::Delta, Rule::Plain] {
                let rand = |shape: &[usize]| Tensor::randn(0f32, 1f32, shape, &cpu).unwrap();
                let k = rand(&[b, t, h, dk]);
                let k = k.broadcast_div(&k.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap()).unwrap();
                let inputs = [
                    rand(&[b, t, h, dk]),
                    k,
                    rand(&[b, t, h, dv]),
                    candle_nn::ops::sigmoid(&rand(&[b, t, h])).unwrap(),
                    (candle_nn::ops::sigmoid(&rand(&[b, t, h])).unwrap() * -0.5).unwrap(),
                    (candle_nn::ops::sigmoid(&rand(&[b, t, h, dk])).unwrap() * -0.3).unwrap(),
                    (rand(&[b, h, dk, dv]) * 0.1).unwrap(),
                ];
                let (wo, ws) = (rand(&[b, t, h, dv]), rand(&[b, h, dk, dv]));
                for dtype in [DType::F32, DType::BF16] {
                    let run = |dev: &Device, kernel: Kernel| -> Vec<Vec<f32>> {
                        let vars: Vec<Var> = inputs
                            .iter()
                            .map(|x| Var::from_tensor(&x.to_dtype(dtype).unwrap().to_device(dev).unwrap()).unwrap())
                            .collect();
                        let x: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
                        let rec = Recurrence {
                            q: x[0],
                            k: x[1],
                            v: x[2],
                            beta: x[3],
                            g: (decay == 1 || decay == 2).then_some(x[4]),
                            gk: (decay >= 2).then_some(x[5]),
                            scale: 0.37,
                            rule,
                            initial: Some(x[6]),
                        };
                        let (o, s) = Kernel::scoped(kernel, || rec.forward_with_state()).unwrap();
                        let on = |w: &Tensor| w.to_device(dev).unwrap();
                        let loss = ((o.to_dtype(DType::F32).unwrap() * on(&wo)).unwrap().sum_all().unwrap()
                            + (s * on(&ws)).unwrap().sum_all().unwrap())
                        .unwrap();
                        let store = loss.backward().unwrap();
                        vars.iter().map(|v| store.get(v.as_tensor()).map(flat).unwrap_or_default()).collect()
                    };
                    let want = run(&cpu, Kernel::Chunked);
                    let got = run(&gpu, Kernel::ChunkedKernels);
                    // The recurrence runs in float32 either way; bf16 gradients are rounded to bf16
                    // (a relative step of 2^-8) after it.
                    let bound = if dtype == DType::F32 { 1e-4 } else { 1e-2 };
                    for (name, (g, w)) in ["q", "k", "v", "beta", "g", "gk", "s0"].iter().zip(got.iter().zip(&want)) {
                        assert_eq!(g.len(), w.len(), "d{name}: presence");
                        if w.is_empty() {
                            continue;
                        }
                        let e = common::rel_err(g, w);
                        let what = format!("dk {dk} dv {dv} T {t} decay {decay} {rule:?} {dtype:?}: d{name}");
                        assert!(e < bound, "{what} differs from the CPU's by {e:.3e}");
                    }
                }
            }
        }
        eprintln!("chunk kernels dk {dk} dv {dv} T {t}: gradients match the cpu's composed form");
    }
}

/// The fused decoding step's kernels (step inputs, output norm, SwiGLU) against their CPU
/// halves, on row views of one stacked projection output, for one and two value heads per key
/// head, with and without gates, in float32 and bf16.
#[test]
fn decode_step_kernels_match_cpu() {
    use statecut::ops::decode::{OutNorm, StepDims, StepInputs};
    use statecut::ops::norm::NormWeight;
    let (gpu, cpu) = (gpu(), Device::Cpu);
    let rand = |shape: &[usize], s: f32| Tensor::randn(0f32, s, shape, &cpu).unwrap();
    for (heads, v_heads, dk, dv, b) in
        [(8, 8, 256, 256, 3), (16, 32, 128, 128, 2), (4, 4, 100, 60, 5), (2, 2, 64, 128, 1)]
    {
        for dtype in [DType::F32, DType::BF16] {
            for gated in [false, true] {
                let d = StepDims { b, heads, v_heads, dk, dv, kernel: 4 };
                let c = d.channels();
                let y = rand(&[b, 1, c + v_heads * dv + 2 * v_heads + 3], 1.0).to_dtype(dtype).unwrap();
                let history = rand(&[b, 3, c], 1.0).to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let weight = rand(&[c, 4], 0.5).to_dtype(dtype).unwrap();
                let bias = rand(&[c], 0.5).to_dtype(dtype).unwrap();
                let neg_a = rand(&[v_heads], 1.0).exp().unwrap().neg().unwrap();
                let dt_bias = rand(&[v_heads], 1.0);
                let norm_w = (rand(&[dv], 0.1) + 1.0).unwrap();
                let res_w = (rand(&[v_heads * dv], 0.1) + 1.0).unwrap();
                let run = |dev: &Device| {
                    let on = |t: &Tensor| t.to_device(dev).unwrap();
                    let y = on(&y);
                    let (z, bv, av) = (
                        y.narrow(2, c, v_heads * dv).unwrap(),
                        y.narrow(2, c + v_heads * dv, v_heads).unwrap(),
                        y.narrow(2, c + v_heads * dv + v_heads, v_heads).unwrap(),
                    );
                    let op = StepInputs {
                        dims: d,
                        history: on(&history),
                        weight: on(&weight),
                        bias: gated.then(|| on(&bias)),
                        b: gated.then(|| bv.clone()),
                        a: gated.then(|| av.clone()),
                        neg_a: gated.then(|| on(&neg_a)),
                        dt_bias: gated.then(|| on(&dt_bias)),
                        beta_scale: 2.0,
                        eps: 1e-6,
                        in_place: false,
                    };
                    let s = op.run(&y.narrow(2, 0, c).unwrap()).unwrap();
                    let o = (s.v.clone() * 3.0).unwrap();
                    let norm = OutNorm { weight: on(&norm_w), gate: gated.then(|| z.clone()), dtype, eps: 1e-5 };
                    let normed = o.apply_op1_no_bwd(&norm).unwrap();
                    let act = y.narrow(2, 0, 2 * (c / 2)).unwrap().contiguous().unwrap();
                    let act = act.apply_op1_no_bwd(&statecut::ops::mlp::Swiglu).unwrap();
                    let g = s.g.as_ref().map(flat).unwrap_or_default();
                    // residual add + norm: one kernel on the GPU, two ops on the CPU
                    let rms = statecut::ops::norm::RmsNorm::new(on(&res_w), 1e-6, NormWeight::Plain).unwrap();
                    let (h, x) = rms.add_forward(&normed, &normed.sqr().unwrap()).unwrap();
                    [
                        flat(&s.q),
                        flat(&s.k),
                        flat(&s.v),
                        flat(&s.beta),
                        g,
                        flat(&s.history),
                        flat(&normed),
                        flat(&act),
                        flat(&h),
                        flat(&x),
                    ]
                };
                let (want, got) = (run(&cpu), run(&gpu));
                let what = format!("h {heads}/{v_heads} dk {dk} dv {dv} b {b} {dtype:?} gated {gated}");
                let names = ["q", "k", "v", "beta", "g", "history", "output norm", "swiglu", "residual", "add + norm"];
                for ((w, g), name) in want.iter().zip(&got).zip(names) {
                    assert_eq!(w.len(), g.len(), "{what}: {name} sizes");
                    if w.is_empty() {
                        continue; // no decay without gates
                    }
                    // bf16 values may land one rounding step apart where the float32 math differs
                    // in its last bit (expf, summation order)
                    let tol = if dtype == DType::BF16 { 5e-3 } else { 1e-5 };
                    let err = common::rel_err(g, w);
                    assert!(err < tol, "{what}: {name} differs from the CPU's by {err:.3e}");
                }
            }
        }
    }
    eprintln!("decode step kernels match their cpu halves");
}

/// The in-place halves of the step's kernels (what a replayed step runs) against their
/// out-of-place runs: the same outputs, and the history and state they overwrite equal to the
/// ones the out-of-place runs return. Two value heads per key head is the case where blocks
/// share history channels.
#[test]
fn in_place_step_kernels_match_out_of_place() {
    use statecut::ops::decode::{StepDims, StepInputs};
    let gpu = gpu();
    let rand = |shape: &[usize], s: f32| Tensor::randn(0f32, s, shape, &gpu).unwrap();
    for (heads, v_heads, dk, dv, b) in [(6, 6, 256, 512, 3), (4, 8, 128, 128, 2), (3, 3, 100, 60, 1)] {
        let d = StepDims { b, heads, v_heads, dk, dv, kernel: 4 };
        let c = d.channels();
        let x = rand(&[b, 1, c + 2 * v_heads], 1.0).to_dtype(DType::BF16).unwrap();
        let history = rand(&[b, 3, c], 1.0);
        let (weight, neg_a, dt_bias) = (
            rand(&[c, 4], 0.5).to_dtype(DType::BF16).unwrap(),
            rand(&[v_heads], 1.0).exp().unwrap().neg().unwrap(),
            rand(&[v_heads], 1.0),
        );
        let op = |history: Tensor, in_place: bool| StepInputs {
            dims: d,
            history,
            weight: weight.clone(),
            bias: None,
            b: Some(x.narrow(2, c, v_heads).unwrap()),
            a: Some(x.narrow(2, c + v_heads, v_heads).unwrap()),
            neg_a: Some(neg_a.clone()),
            dt_bias: Some(dt_bias.clone()),
            beta_scale: 1.0,
            eps: 1e-6,
            in_place,
        };
        let out_of_place = op(history.clone(), false);
        let in_place = op(history.copy().unwrap(), true);
        let qkv = x.narrow(2, 0, c).unwrap();
        let (a, bb) = (out_of_place.run(&qkv).unwrap(), in_place.run(&qkv).unwrap());
        let what = format!("h {heads}/{v_heads} dk {dk} dv {dv} b {b}");
        for (name, u, v) in [("q", &a.q, &bb.q), ("k", &a.k, &bb.k), ("v", &a.v, &bb.v), ("beta", &a.beta, &bb.beta)] {
            assert_eq!(flat(u), flat(v), "{what}: in-place {name}");
        }
        assert_eq!(flat(&a.history), flat(&in_place.history), "{what}: the history overwritten in place");
        assert_ne!(flat(&history), flat(&in_place.history), "{what}: the in-place step left the history as it was");

        let state = rand(&[b, v_heads, dk, dv], 0.1);
        let rec = |initial| Recurrence {
            q: &a.q,
            k: &a.k,
            v: &a.v,
            beta: &a.beta,
            g: a.g.as_ref(),
            gk: None,
            scale: (dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial,
        };
        let (o, next) = rec(Some(&state)).fused_with_state().unwrap();
        let own = state.copy().unwrap();
        let o_in_place = rec(Some(&own)).fused_in_place().unwrap();
        assert_eq!(flat(&o), flat(&o_in_place), "{what}: in-place recurrence output");
        assert_eq!(flat(&next), flat(&own), "{what}: the state overwritten in place");
        // A state the op would have to convert first cannot take the write.
        let bf16_state = state.to_dtype(DType::BF16).unwrap();
        assert!(rec(Some(&bf16_state)).fused_in_place().is_err(), "{what}: in place over a bf16 state");
    }
    eprintln!("in-place step kernels match their out-of-place runs");
}

/// The prefill's fused kernels against their CPU halves (or, for the conv, the CPU's candle
/// ops) on shapes that cross their tiles: the short conv on a column slice of a wider matrix
/// (K within and beyond the kernel's register window), the recurrence inputs (one and two value
/// heads per key head, a width that is not a multiple of 32), the column sums of squares over
/// several chunks, the output norm over many tokens, and SwiGLU over many rows.
#[test]
fn prefill_kernels_match_cpu() {
    use statecut::ops::conv::ShortConv;
    use statecut::ops::decode::OutNorm;
    use statecut::ops::prep::{column_sums_of_squares, QkvPrep};
    let (gpu, cpu) = (gpu(), Device::Cpu);
    let rand = |shape: &[usize], s: f32| Tensor::randn(0f32, s, shape, &cpu).unwrap();
    let tol = |dtype| if dtype == DType::BF16 { 5e-3 } else { 1e-5 };
    let both = |f: &dyn Fn(&Device) -> Tensor| (flat(&f(&cpu)), flat(&f(&gpu)));
    for dtype in [DType::F32, DType::BF16] {
        // Columns 4.. of rows 79 wide take the scalar kernel; 8.. of rows 88 wide (16-byte
        // aligned) the vectorised one, which takes K <= 4.
        for (k, t, col, c, width) in
            [(4, 37, 4, 70, 79), (2, 16, 4, 70, 79), (10, 5, 4, 70, 79), (4, 37, 8, 72, 88), (3, 5, 8, 72, 88)]
        {
            let wide = rand(&[3, t, width], 1.0).to_dtype(dtype).unwrap();
            let conv_w = rand(&[c, 1, k], 0.5).to_dtype(dtype).unwrap();
            let bias = rand(&[c], 0.5).to_dtype(dtype).unwrap();
            // The CPU's candle ops run in float32 on the same values and round once, as the
            // kernel does (bf16 ops would round after every tap).
            let (want, got) = both(&|dev| {
                let on = |t: &Tensor| {
                    let t = t.to_device(dev).unwrap();
                    if dev.is_cpu() {
                        t.to_dtype(DType::F32).unwrap()
                    } else {
                        t
                    }
                };
                let conv = ShortConv::new(on(&conv_w), Some(on(&bias))).unwrap();
                let x = on(&wide).narrow(2, col, c).unwrap();
                conv.forward_silu_cached(&x, None).unwrap().0.to_dtype(dtype).unwrap()
            });
            let err = common::rel_err(&got, &want);
            assert!(err < tol(dtype), "conv k {k} t {t} column {col} {dtype:?}: {err:.3e}");
        }
        for (heads, v_heads, dk, dv) in [(4, 4, 128, 128), (2, 4, 100, 60)] {
            let p = QkvPrep { heads, v_heads, dk, dv, eps: 1e-6 };
            let c = 2 * heads * dk + v_heads * dv;
            let wide = rand(&[2, 33, c + 5], 1.0).to_dtype(dtype).unwrap();
            let (want, got) = both(&|dev| {
                let (q, k, v) = p.run(&wide.to_device(dev).unwrap().narrow(2, 5, c).unwrap()).unwrap();
                Tensor::cat(&[q.flatten_all().unwrap(), k.flatten_all().unwrap(), v.flatten_all().unwrap()], 0).unwrap()
            });
            let err = common::rel_err(&got, &want);
            assert!(err < 1e-6, "recurrence inputs h {heads}/{v_heads} dk {dk} {dtype:?}: {err:.3e}");
        }
        let wide = rand(&[3, 700, 130], 1.0).to_dtype(dtype).unwrap();
        let (want, got) =
            both(&|dev| column_sums_of_squares(&wide.to_device(dev).unwrap().narrow(2, 1, 128).unwrap()).unwrap());
        let err = common::rel_err(&got, &want);
        assert!(err < 1e-6, "column sums {dtype:?}: {err:.3e}");
        let (b, t, hv, dv) = (2, 19, 3, 96);
        let o = rand(&[b, t, hv, dv], 1.0);
        let z = rand(&[b, t, hv * dv + 7], 1.0).to_dtype(dtype).unwrap();
        let w = (rand(&[dv], 0.1) + 1.0).unwrap();
        for gated in [false, true] {
            let (want, got) = both(&|dev| {
                let gate = gated.then(|| z.to_device(dev).unwrap().narrow(2, 7, hv * dv).unwrap());
                let norm = OutNorm { weight: w.to_device(dev).unwrap(), gate, dtype, eps: 1e-5 };
                o.to_device(dev).unwrap().apply_op1_no_bwd(&norm).unwrap()
            });
            let err = common::rel_err(&got, &want);
            assert!(err < tol(dtype), "output norm over {t} tokens, gated {gated}, {dtype:?}: {err:.3e}");
        }
        // The residual add and norm: a warp a row from 256 rows on (width 128), a block a row
        // below (2 x 19 rows) or where a row is not a multiple of 16 bytes (width 100).
        for (rows, n) in [(300, 128), (19, 128), (300, 100)] {
            let a = rand(&[2, rows, n], 1.0).to_dtype(dtype).unwrap();
            let b = rand(&[2, rows, n], 1.0).to_dtype(dtype).unwrap();
            let w = (rand(&[n], 0.1) + 1.0).unwrap();
            let (want, got) = both(&|dev| {
                let norm = statecut::ops::norm::RmsNorm::new(
                    w.to_device(dev).unwrap(),
                    1e-6,
                    statecut::ops::norm::NormWeight::Plain,
                )
                .unwrap();
                let on = |t: &Tensor| t.to_device(dev).unwrap();
                let (h, x) = norm.add_forward(&on(&a), &on(&b)).unwrap();
                Tensor::cat(&[h.flatten_all().unwrap(), x.flatten_all().unwrap()], 0).unwrap()
            });
            let err = common::rel_err(&got, &want);
            assert!(err < tol(dtype), "add and norm over {rows} x {n} {dtype:?}: {err:.3e}");
        }
        let x = rand(&[4, 33, 2 * 300], 1.0).to_dtype(dtype).unwrap();
        let (want, got) = both(&|dev| x.to_device(dev).unwrap().apply_op1_no_bwd(&statecut::ops::mlp::Swiglu).unwrap());
        let err = common::rel_err(&got, &want);
        assert!(err < tol(dtype), "swiglu {dtype:?}: {err:.3e}");
    }
    eprintln!("prefill kernels match their cpu halves");
}

/// The short conv and the RMS norms with gradients (statecut's ops with their own backward on
/// the GPU) against the CPU's candle ops: outputs and the gradients of the input, the gate, the
/// weights and the bias, over more than one block of channels and of steps, the conv's input
/// read as a column slice; the ops that have a CPU half of their own (the MLP step) against it.
/// In bf16 the GPU runs in bf16 and the CPU in float32 over the same rounded values (candle's
/// bf16 ops on the CPU would also sum in bf16).
#[test]
fn conv_and_norm_gradients_match_cpu() {
    use candle_core::Var;
    use statecut::ops::conv::ShortConv;
    use statecut::ops::norm::{NormWeight, RmsNorm};
    type Model<'a> = &'a dyn Fn(&[Tensor], DType) -> Tensor;
    let (cpu, gpu) = (Device::Cpu, gpu());
    let rand = |shape: &[usize], seed: u64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0).collect();
        Tensor::from_vec(v, shape, &cpu).unwrap()
    };
    // f's output and the gradients of <f, g> for every input, on a device in a dtype.
    let run = |dev: &Device, dtype: DType, inputs: &[Tensor], g: &Tensor, f: Model| {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&t.to_device(dev).unwrap()).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts, dtype).to_dtype(DType::F32).unwrap();
        let store = (&y * g.to_device(dev).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
        let mut out = vec![flat(&y)];
        out.extend(vars.iter().map(|v| flat(store.get(v.as_tensor()).unwrap())));
        out
    };
    // The GPU's relative errors against the CPU's float32, output first, then each gradient.
    let errors = |what: &str, dtype: DType, inputs: &[Tensor], g: &Tensor, f: Model| -> Vec<f64> {
        let rounded: Vec<Tensor> =
            inputs.iter().map(|t| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()).collect();
        let (on_gpu, on_cpu) = (run(&gpu, dtype, &rounded, g, f), run(&cpu, DType::F32, &rounded, g, f));
        let errs: Vec<f64> = on_gpu.iter().zip(&on_cpu).map(|(a, want)| common::rel_err(a, want)).collect();
        for (i, err) in errs.iter().enumerate() {
            eprintln!("{what} {dtype:?} output/gradient {i}: relative error {err:.3e}");
        }
        errs
    };
    let compare = |what: &str, dtype: DType, inputs: &[Tensor], g: &Tensor, f: Model| {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for (i, err) in errors(what, dtype, inputs, g, f).into_iter().enumerate() {
            assert!(err < tol, "{what} {dtype:?}: output/gradient {i} differs from the CPU's by {err:.3e}");
        }
    };
    for dtype in [DType::F32, DType::BF16] {
        // Conv: x a slice of a wider matrix, weight [C,1,K] and bias [C] trained; at column 3
        // the scalar forward, at column 8 (16-byte aligned rows) the vectorised one. The
        // backward walks a four-step window for K <= 4 and an eight-step one above.
        for (col, c, k) in [(3, 300, 4), (8, 296, 3), (3, 300, 6)] {
            let (b, l) = (2, 150);
            let conv = |t: &[Tensor], dt: DType| {
                let x = t[0].to_dtype(dt).unwrap().narrow(2, col, c).unwrap();
                let conv = ShortConv::new(t[1].to_dtype(dt).unwrap(), Some(t[2].to_dtype(dt).unwrap())).unwrap();
                conv.forward_silu_cached(&x, None).unwrap().0
            };
            let inputs = [rand(&[b, l, c + 16], 1), rand(&[c, 1, k], 2), rand(&[c], 3)];
            compare(&format!("conv at column {col}, K {k}"), dtype, &inputs, &rand(&[b, l, c], 4), &conv);
        }
        // Norms: plain (block norms, 1 + w) and gated (the recurrent mixers' output norm), 16
        // bytes a lane (widths 2048, 256; 128 and 64 take two to eight rows a warp in bf16) and
        // element by element (130).
        for (n, gated, kind) in [
            (2048, false, NormWeight::OnePlus),
            (130, true, NormWeight::Plain),
            (256, false, NormWeight::Plain),
            (128, true, NormWeight::Plain),
            (64, false, NormWeight::Plain),
        ] {
            let norm = |t: &[Tensor], dt: DType| {
                let norm = RmsNorm::new(t[t.len() - 1].clone(), 1e-6, kind).unwrap();
                let x = t[0].to_dtype(dt).unwrap();
                match gated {
                    true => norm.forward_gated(&x, &t[1].to_dtype(dt).unwrap()).unwrap(),
                    false => norm.forward(&x).unwrap(),
                }
            };
            let mut inputs = vec![rand(&[3, 70, n], 5)];
            if gated {
                inputs.push(rand(&[3, 70, n], 6));
            }
            inputs.push(rand(&[n], 7));
            compare(&format!("norm n {n} gated {gated} {kind:?}"), dtype, &inputs, &rand(&[3, 70, n], 8), &norm);
        }
        // The gated norm per head, the gate [.., heads·n] as the projection gives it and the
        // output laid out as the gate (the recurrent mixers' output norm with gradients); the
        // CPU takes the ops and a reshape.
        let heads = |t: &[Tensor], dt: DType| {
            let norm = RmsNorm::new(t[2].clone(), 1e-6, NormWeight::Plain).unwrap();
            norm.forward_gated_heads(&t[0].to_dtype(dt).unwrap(), &t[1].to_dtype(dt).unwrap()).unwrap()
        };
        let inputs = [rand(&[3, 70, 4, 96], 30), rand(&[3, 70, 4 * 96], 31), rand(&[96], 32)];
        compare("gated norm by heads", dtype, &inputs, &rand(&[3, 70, 4 * 96], 33), &heads);
        // Ungated (DeltaNet's output norm), the output laid out [.., heads·n] all the same.
        let plain_heads = |t: &[Tensor], dt: DType| {
            let norm = RmsNorm::new(t[1].clone(), 1e-6, NormWeight::Plain).unwrap();
            norm.forward_heads(&t[0].to_dtype(dt).unwrap()).unwrap()
        };
        let inputs = [rand(&[3, 70, 4, 96], 40), rand(&[96], 41)];
        compare("norm by heads", dtype, &inputs, &rand(&[3, 70, 4 * 96], 42), &plain_heads);
        // The output norm and a frozen output projection as one op (`RmsNorm::project_heads`,
        // recovery's mixers), gated and not, against the norm and the product on the CPU.
        for gated in [false, true] {
            let projected = move |t: &[Tensor], dt: DType| {
                let dev = t[0].device();
                let proj = (rand(&[50, 4 * 96], 43) * 0.1).unwrap().to_dtype(dt).unwrap().to_device(dev).unwrap();
                let norm = RmsNorm::new(t[t.len() - 1].clone(), 1e-6, NormWeight::Plain).unwrap();
                let x = t[0].to_dtype(dt).unwrap();
                let gate = gated.then(|| t[1].to_dtype(dt).unwrap());
                if let Some(y) = norm.project_heads(&x, gate.as_ref(), &proj).unwrap() {
                    return y;
                }
                assert!(dev.is_cpu(), "a pass with gradients on the GPU takes the one op");
                let normed = match &gate {
                    Some(g) => norm.forward_gated_heads(&x, g).unwrap(),
                    None => norm.forward_heads(&x).unwrap(),
                };
                normed.broadcast_matmul(&proj.t().unwrap()).unwrap()
            };
            let mut inputs = vec![rand(&[3, 70, 4, 96], 45)];
            if gated {
                inputs.push(rand(&[3, 70, 4 * 96], 46));
            }
            inputs.push(rand(&[96], 47));
            let what = format!("norm by heads into a projection, gated {gated}");
            compare(&what, dtype, &inputs, &rand(&[3, 70, 50], 48), &projected);
        }
        // A residual step over a frozen SwiGLU MLP as one op (recovery's MLP steps): h and the
        // norm's weight trained, the norm's backward adding the step's output gradient. In bf16
        // it is three products deep, so it is held to the ops it replaces (the norm's op, the
        // frozen MLP's and the sum) on the same GPU: as close to the CPU's float32 as they are.
        for n in [96, 90] {
            let step = |composed: bool| {
                move |t: &[Tensor], dt: DType| {
                    let dev = t[0].device();
                    let w =
                        |shape: &[usize], seed| (rand(shape, seed) * 0.2).unwrap().to_dtype(dt).unwrap().to_device(dev);
                    let d = t[0].dim(2).unwrap();
                    let (gate_up, down) = (w(&[2 * n, d], 34).unwrap(), w(&[d, n], 35).unwrap());
                    let h = t[0].to_dtype(dt).unwrap();
                    // With a third input, the last step's output y pending: the step runs on h + y.
                    let y = t.get(2).map(|y| y.to_dtype(dt).unwrap());
                    if !composed || dev.is_cpu() {
                        return statecut::ops::mlp::frozen_mlp_step(&h, y.as_ref(), &t[1], 1e-6, &gate_up, &down)
                            .unwrap();
                    }
                    let h = match &y {
                        Some(y) => (&h + y).unwrap(),
                        None => h,
                    };
                    let x = RmsNorm::new(t[1].clone(), 1e-6, NormWeight::Plain).unwrap().forward(&h).unwrap();
                    (&h + statecut::ops::mlp::frozen_swiglu_mlp(&x, &gate_up, &down).unwrap()).unwrap()
                }
            };
            // d = 64 takes the sums 16 bytes a thread; d = 60 (rows not a multiple of 16 bytes
            // in bf16) candle's add and the norm op.
            for (d, pending) in [(64, false), (64, true), (60, true)] {
                let mut inputs = vec![rand(&[3, 70, d], 36), (rand(&[d], 37) + 1.0).unwrap()];
                if pending {
                    inputs.push(rand(&[3, 70, d], 39));
                }
                let g = rand(&[3, 70, d], 38);
                let what = format!("mlp step n {n} d {d} pending {pending}");
                let errs = errors(&what, dtype, &inputs, &g, &step(false));
                let ops = errors(&format!("{what}, its ops"), dtype, &inputs, &g, &step(true));
                for (i, (e, o)) in errs.iter().zip(&ops).enumerate() {
                    let bound = if dtype == DType::F32 { 1e-5 } else { 1.5 * o + 1e-3 };
                    assert!(*e < bound, "{what} {dtype:?}: output/gradient {i} off by {e:.3e} (its ops: {o:.3e})");
                }
            }
        }
        // L2 norms of q and k (float32 rows, full and pruned widths).
        for n in [128, 48] {
            let l2 = |t: &[Tensor], _: DType| statecut::ops::norm::l2_norm(&t[0], 1e-6).unwrap();
            compare(&format!("l2 norm n {n}"), dtype, &[rand(&[3, 70, 4, n], 13)], &rand(&[3, 70, 4, n], 14), &l2);
        }
        // SwiGLU over a stacked gate | up projection (frozen, as in recovery), the input trained:
        // a width the kernels take 16 bytes at a time and one they take element by element.
        for n in [96, 90] {
            let mlp = |t: &[Tensor], dt: DType| {
                use statecut::layers::{linear::Linear, mlp::SwiGlu};
                let dev = t[0].device();
                let w = |shape: &[usize], seed| (rand(shape, seed) * 0.2).unwrap().to_dtype(dt).unwrap().to_device(dev);
                let gate_up = Linear::new(w(&[2 * n, 64], 10).unwrap(), None);
                let down = Linear::new(w(&[64, n], 11).unwrap(), None);
                SwiGlu::stacked(gate_up, down).unwrap().forward(&t[0].to_dtype(dt).unwrap()).unwrap()
            };
            compare(&format!("swiglu n {n}"), dtype, &[rand(&[3, 70, 64], 9)], &rand(&[3, 70, 64], 12), &mlp);
        }
        // A frozen projection (a row view of a wider weight) on a trained input, with a bias.
        let proj = |t: &[Tensor], dt: DType| {
            let dev = t[0].device();
            let w = (rand(&[50, 96], 15) * 0.2).unwrap().narrow(0, 3, 40).unwrap();
            let b = rand(&[40], 16);
            let lin = statecut::layers::linear::Linear::new(
                w.to_dtype(dt).unwrap().to_device(dev).unwrap(),
                Some(b.to_dtype(dt).unwrap().to_device(dev).unwrap()),
            );
            candle_core::Module::forward(&lin, &t[0].to_dtype(dt).unwrap()).unwrap()
        };
        compare("frozen projection", dtype, &[rand(&[3, 70, 96], 17)], &rand(&[3, 70, 40], 18), &proj);
        // The recurrence's inputs from the conv's rows (a column slice): q/k-style heads (L2-normed
        // into float32, repeated for two value heads, a pruned width) and v-style (copied); even
        // widths and offsets take the kernels' column pairs, the odd ones single columns.
        for (off, heads, d, rep, norm) in
            [(4, 3, 48, 2, Some(1e-6f32)), (100, 2, 40, 1, None), (5, 2, 47, 1, Some(1e-6))]
        {
            let f = move |t: &[Tensor], dt: DType| {
                let rows = t[0].to_dtype(dt).unwrap().narrow(2, 2, 196).unwrap();
                statecut::ops::prep::Heads { off, heads, d, rep, norm }.run(&rows).unwrap()
            };
            let out = [3, 70, heads * rep, d];
            compare(&format!("heads d {d} norm {norm:?}"), dtype, &[rand(&[3, 70, 200], 22)], &rand(&out, 23), &f);
        }
        // The three parts with one gradient edge into the rows (q, k at a pruned width, two
        // value heads per key head, v copied), their outputs flattened side by side.
        let grouped = |t: &[Tensor], dt: DType| {
            use statecut::ops::prep::Heads;
            let rows = t[0].to_dtype(dt).unwrap().narrow(2, 2, 196).unwrap();
            let (q, k, v) = statecut::ops::prep::heads_qkv(
                &rows,
                Heads { off: 0, heads: 2, d: 48, rep: 2, norm: Some(1e-6) },
                Heads { off: 96, heads: 2, d: 48, rep: 2, norm: Some(1e-6) },
                Heads { off: 192, heads: 4, d: 1, rep: 1, norm: None },
            )
            .unwrap();
            let flat = |x: Tensor| x.to_dtype(DType::F32).unwrap().flatten_from(2).unwrap();
            Tensor::cat(&[flat(q), flat(k), flat(v)], 2).unwrap()
        };
        let out = [3, 70, 2 * 192 + 4];
        compare("grouped heads", dtype, &[rand(&[3, 70, 200], 24)], &rand(&out, 25), &grouped);
        // q and k normed straight into the chunk kernels' layout (70 steps: the last chunk
        // padded), the keys alone and v beside them, flattened; an even width (column pairs)
        // and an odd one at odd offsets (single columns). Then the same with the short conv
        // inside the ops (recovery's mixers with a conv): its weight and bias trained.
        for conv in [false, true] {
            for (off, d) in [(0, 48), (5, 47)] {
                let chunked = move |t: &[Tensor], dt: DType| {
                    use statecut::ops::prep::{conv_heads_qk_chunks, heads_qk_chunks, Heads};
                    let rows = t[0].to_dtype(dt).unwrap().narrow(2, 2, 196).unwrap();
                    let q = Heads { off, heads: 2, d, rep: 2, norm: Some(1e-6) };
                    let k = Heads { off: off + 2 * d, ..q };
                    let v = Heads { off: 192, heads: 4, d: 1, rep: 1, norm: None };
                    let (qk, keys, v) = match conv {
                        false => heads_qk_chunks(&rows, q, k, v, 64),
                        true => {
                            let (w, bias) = (t[1].to_dtype(dt).unwrap(), t[2].to_dtype(dt).unwrap());
                            conv_heads_qk_chunks(&rows, &w, &bias, q, k, v, 64)
                        }
                    }
                    .unwrap();
                    let flat = |x: Tensor| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    Tensor::cat(&[flat(qk), flat(keys), flat(v)], 0).unwrap()
                };
                let n = 2 * 12 * 64 * 3 * d + 3 * 70 * 4;
                let (what, seed) = match conv {
                    false => (format!("heads in chunks d {d}"), 26),
                    true => (format!("conv and heads in chunks d {d}"), 28),
                };
                let mut inputs = vec![rand(&[3, 70, 200], seed)];
                if conv {
                    inputs.extend([(rand(&[196, 4], 29) * 0.5).unwrap(), rand(&[196], 30)]);
                }
                compare(&what, dtype, &inputs, &rand(&[n], seed + 1 + 2 * conv as u64), &chunked);
            }
        }
        // A trained projection (recovery's adapted weights): the input and the weight trained.
        let trained = |t: &[Tensor], dt: DType| {
            let lin = statecut::layers::linear::Linear::new(t[1].to_dtype(dt).unwrap(), None);
            candle_core::Module::forward(&lin, &t[0].to_dtype(dt).unwrap()).unwrap()
        };
        let inputs = [rand(&[3, 70, 96], 19), (rand(&[40, 96], 20) * 0.2).unwrap()];
        compare("trained projection", dtype, &inputs, &rand(&[3, 70, 40], 21), &trained);
    }
}

/// The recovery loss's per-row op (cross-entropy and distillation KL) and its student
/// gradient on the GPU against the CPU's, with and without a teacher, float32 and bf16, at a
/// real vocabulary (not a multiple of the block) and a target at each end of it.
#[test]
fn kd_rows_match_cpu() {
    use candle_core::Var;
    use statecut::ops::distill::kd_rows;
    let (cpu, gpu) = (Device::Cpu, gpu());
    let (r, v) = (37, 50_257);
    let ids: Vec<u32> = (0..r as u32)
        .map(|i| {
            if i == 0 {
                0
            } else if i == 1 {
                v as u32 - 1
            } else {
                i * 7919 % v as u32
            }
        })
        .collect();
    let y = Tensor::new(ids.as_slice(), &cpu).unwrap();
    let w = Tensor::new(&[[1.3f32, 0.7]], &cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        for kd in [true, false] {
            let logits = |seed: u64| {
                let x: Vec<f32> = (0..r * v)
                    .map(|i| (((i as u64 * 2654435761 + seed * 97) % 10007) as f32 / 10007.0 - 0.5) * 12.0)
                    .collect();
                Tensor::from_vec(x, (r, v), &cpu).unwrap().to_dtype(dtype).unwrap()
            };
            let (s, t) = (logits(1), logits(2));
            let run = |dev: &Device| {
                let sv = Var::from_tensor(&s.to_device(dev).unwrap()).unwrap();
                let t = t.to_device(dev).unwrap();
                let rows = kd_rows(sv.as_tensor(), kd.then_some(&t), &y.to_device(dev).unwrap(), 2.0).unwrap();
                let g = rows.broadcast_mul(&w.to_device(dev).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
                let ds = g.get(sv.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
                (flat(&rows), flat(&ds))
            };
            let ((rg, dg), (rc, dc)) = (run(&gpu), run(&cpu));
            let (err_rows, err_ds) = (common::rel_err(&rg, &rc), common::rel_err(&dg, &dc));
            eprintln!("kd rows {dtype:?} kd {kd}: rows {err_rows:.3e}, d student {err_ds:.3e}");
            assert!(err_rows < 1e-5, "{dtype:?} kd {kd}: rows differ from the CPU's by {err_rows:.3e}");
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            assert!(err_ds < tol, "{dtype:?} kd {kd}: d student differs from the CPU's by {err_ds:.3e}");
        }
    }
}

/// Gradients through the GPU path (float32 weights, the chunked recurrence and unfused ops)
/// against PyTorch autograd's goldens, every model that has them.
#[test]
fn gradients_match_pytorch() {
    let dev = gpu();
    let mut models: Vec<(&str, std::path::PathBuf, std::path::PathBuf)> = Vec::new();
    for name in ["qwen3_5_moe", "nemotron_h", "granite_h", "falcon_h1", "kimi_linear", "sse_gla", "sse_gdn", "sse_h"] {
        models.push((name, common::fixture(name), common::fixture(name)));
    }
    models.push(("gdn_moby", common::embedded_model(), common::fixture("gdn_moby")));
    for name in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
        if let Some(dir) = common::model_dir(name).filter(|d| d.is_dir()) {
            models.push((name, dir.clone(), dir));
        }
    }
    let failed: Vec<&str> = models
        .iter()
        .filter(|(name, dir, golden)| {
            let run = || common::grad::check(name, dir, golden, &dev, 2e-3);
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err()
        })
        .map(|(name, ..)| *name)
        .collect();
    assert!(failed.is_empty(), "gradients differ from PyTorch's on the GPU: {failed:?}");
}

/// The in-place AdamW update on the GPU against its CPU half, bit for bit (both spell out the
/// same float32 roundings), with and without clipping, at sizes around the launch's blocks.
#[test]
fn adamw_update_matches_cpu_bit_for_bit() {
    use statecut::ops::adamw::{update, Update};
    let dev = gpu();
    for (n, t, clip) in [(1, 1, None), (255, 3, Some(0.25)), (70_001, 40, None), (65_536, 1000, Some(1.0))] {
        let cpu = Device::Cpu;
        let p = Tensor::randn(0f32, 1.0, n, &cpu).unwrap();
        let m = (Tensor::randn(0f32, 1.0, n, &cpu).unwrap() * 1e-3).unwrap();
        let v = (Tensor::randn(0f32, 1.0, n, &cpu).unwrap().sqr().unwrap() * 1e-6).unwrap();
        let g = (Tensor::randn(0f32, 1.0, n, &cpu).unwrap() * 3.0).unwrap();
        let u = Update::new(0.9, 0.95, 1e-15, t, 3e-4, 0.1, clip);
        let on_cpu = Tensor::cat(&[&p, &m, &v], 0).unwrap();
        update(&on_cpu, &g, u).unwrap();
        // From p, m and v again: the CPU update wrote over its own buffer.
        let on_gpu = Tensor::cat(&[&p, &m, &v], 0).unwrap().to_device(&dev).unwrap();
        update(&on_gpu, &g.to_device(&dev).unwrap(), u).unwrap();
        let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(&on_gpu.to_device(&cpu).unwrap()), bits(&on_cpu), "n {n}, t {t}, clip {clip:?}");
    }
}

/// The add op (16 bytes a thread where counts and offsets allow) against candle's add on the
/// GPU, bit for bit, in every dtype: counts with and without a whole last pack, inputs at an
/// offset, strided inputs. And a backward that sums gradients (with `grad_sum`, as `gpu()` installs) gives the
/// same bits as the one candle's add makes on the CPU.
#[test]
fn add_matches_candles_add_bit_for_bit() {
    use statecut::ops::add::{add, grad_sum};
    let dev = gpu();
    let cpu = Device::Cpu;
    // Every dtype here widens to float64 exactly.
    let bits = |t: &Tensor| {
        let t = t.to_device(&cpu).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap();
        t.to_vec1::<f64>().unwrap().into_iter().map(f64::to_bits).collect::<Vec<_>>()
    };
    // Float64 has no add_packs kernel: candle's add takes it (the composed per-key-channel
    // recurrence's gradients are float64 sums).
    for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for n in [8, 1000, 4096 * 3 + 5, 1 << 20] {
            let a = Tensor::randn(0f32, 3.0, n, &cpu).unwrap().to_dtype(dt).unwrap();
            let b = Tensor::randn(0f32, 1e-3, n, &cpu).unwrap().to_dtype(dt).unwrap();
            let (ga, gb) = (a.to_device(&dev).unwrap(), b.to_device(&dev).unwrap());
            let want = bits(&(&ga + &gb).unwrap());
            assert_eq!(bits(&add(&ga, &gb).unwrap()), want, "{dt:?} n {n}");
            assert_eq!(bits(&grad_sum(&ga, &gb).unwrap()), want, "{dt:?} n {n}");
            assert_eq!(bits(&(&a + &b).unwrap()), want, "{dt:?} n {n}: CPU");
            // One element in: offsets that are not a whole pack.
            let (oa, ob) = (ga.narrow(0, 1, n - 1).unwrap(), gb.narrow(0, 1, n - 1).unwrap());
            assert_eq!(bits(&add(&oa, &ob).unwrap()), bits(&(&oa + &ob).unwrap()), "{dt:?} n {n} at 1");
        }
        let a = Tensor::randn(0f32, 1.0, (64, 96), &dev).unwrap().to_dtype(dt).unwrap().t().unwrap();
        let b = Tensor::randn(0f32, 1.0, (64, 96), &dev).unwrap().to_dtype(dt).unwrap().t().unwrap();
        assert_eq!(bits(&add(&a, &b).unwrap()), bits(&(&a + &b).unwrap()), "{dt:?} strided");
    }
    // x reaches the loss three ways, so its gradient is a sum of three; each term is a product
    // rounded once, the same bits on either device, and so are the sums.
    for dt in [DType::BF16, DType::F64] {
        let rand = || Tensor::randn(0f32, 1.0, (512, 384), &cpu).unwrap().to_dtype(dt).unwrap();
        let (x, w, v) = (rand(), rand(), rand());
        let grad_of_x = |d: &Device| {
            let x = candle_core::Var::from_tensor(&x.to_device(d).unwrap()).unwrap();
            let (w, v) = (w.to_device(d).unwrap(), v.to_device(d).unwrap());
            let y = ((x.as_tensor() * &w).unwrap() + x.as_tensor().sqr().unwrap()).unwrap();
            let loss = (y + (x.as_tensor() * &v).unwrap()).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap();
            loss.backward().unwrap().get(x.as_tensor()).unwrap().clone()
        };
        let (on_gpu, on_cpu) = (grad_of_x(&dev), grad_of_x(&cpu));
        assert_eq!(bits(&on_gpu), bits(&on_cpu), "{dt:?}: a sum of three gradients");
    }
}

/// Calibration's copy of GPU buffers to the host through page-locked staging (buffers of
/// different lengths taking turns in two staging buffers, leading-row views among them) equals
/// candle's cast to float32 and copy, bit for bit, in each dtype; mixed dtypes and float64 are
/// left to the caller.
#[test]
fn rows_to_host_match_candles_copy() {
    let gpu = gpu();
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let bufs: Vec<Tensor> = [(2500, 96), (7, 96), (1300, 40), (1, 1)]
            .iter()
            .map(|&(r, w)| {
                Tensor::randn(0f32, 3f32, (r + 5, w), &gpu).unwrap().to_dtype(dt).unwrap().narrow(0, 0, r).unwrap()
            })
            .collect();
        let got = statecut::ops::gpu_to_host_f32(&bufs).unwrap().expect("GPU buffers of one dtype");
        assert_eq!(got.len(), bufs.len());
        for (g, b) in got.iter().zip(&bufs) {
            let want = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(g.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()) && g.len() == want.len(), "{dt:?}");
        }
    }
    let mixed = [Tensor::zeros(4, DType::BF16, &gpu).unwrap(), Tensor::zeros(4, DType::F32, &gpu).unwrap()];
    assert!(statecut::ops::gpu_to_host_f32(&mixed).unwrap().is_none());
    assert!(statecut::ops::gpu_to_host_f32(&[Tensor::zeros(4, DType::F64, &gpu).unwrap()]).unwrap().is_none());
    assert!(statecut::ops::gpu_to_host_f32(&[Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()]).unwrap().is_none());
}
