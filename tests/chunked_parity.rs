//! The chunked recurrence (the GPU path) on the CPU, in both forms (candle ops, and statecut's
//! chunk walk and solve): same goldens as the sequential kernel, and the same key-projection
//! gradients, on every shared reference model.

mod common;

use common::flat;

use candle_core::DType;
use statecut::arch::{family_for, LoadOptions, NoObserver};
use statecut::checkpoint::Checkpoint;
use statecut::ops::delta_rule::Kernel;

fn check(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    let golden = common::golden(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    for kernel in [Kernel::Chunked, Kernel::ChunkedKernels] {
        let logits = Kernel::scoped(kernel, || model.forward(&ids, &mut NoObserver)).unwrap();
        let err = common::rel_err(&flat(&logits), &flat(&golden["logits"]));
        eprintln!("{name}: {kernel:?} logits relative error {err:.3e}");
        assert!(err < 1e-4, "{name}: {kernel:?} logits relative error {err:.3e} >= 1e-4");
    }

    // Gradients through the chunked form (candle autograd) against the sequential kernel's
    // hand-written backward, on the same loss.
    let grad_of = |ckpt: &Checkpoint, kernel: Kernel| {
        let model =
            family_for(ckpt).unwrap().load(ckpt, &LoadOptions { grad: true, ..LoadOptions::cpu_f32() }).unwrap();
        let ids = golden["input_ids"].narrow(1, 0, 97).unwrap().to_dtype(DType::U32).unwrap();
        let (inp, tgt) = (ids.narrow(1, 0, 96).unwrap(), ids.narrow(1, 1, 96).unwrap());
        let logits = Kernel::scoped(kernel, || model.forward(&inp, &mut NoObserver)).unwrap();
        let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
        let loss = logp.gather(&tgt.unsqueeze(2).unwrap(), 2).unwrap().sum_all().unwrap().neg().unwrap();
        let grads = loss.backward().unwrap();
        model.grad_vars().iter().map(|(n, v)| (n.clone(), flat(grads.get(v.as_tensor()).unwrap()))).collect::<Vec<_>>()
    };
    let b = grad_of(&ckpt, Kernel::Sequential);
    for kernel in [Kernel::Chunked, Kernel::ChunkedKernels] {
        let a = grad_of(&ckpt, kernel);
        assert!(!a.is_empty() && a.len() == b.len(), "{name}: gradient variables");
        for ((n, ga), (_, gb)) in a.iter().zip(&b) {
            let err = common::rel_err(ga, gb);
            eprintln!("{name}: gradient of {n}: {kernel:?} vs sequential {err:.3e}");
            assert!(err < 1e-3, "{name}: gradient of {n}: {kernel:?} vs sequential relative error {err:.3e}");
        }
    }
}

#[test]
fn delta_net_chunked() {
    check("delta_net");
}

#[test]
fn gated_deltanet_chunked() {
    check("gated_deltanet");
}

#[test]
fn mamba2_chunked() {
    check("mamba2");
}

#[test]
fn qwen3_5_chunked() {
    check("qwen3_5");
}
