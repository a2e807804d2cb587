//! Golden parity: statecut's float32 forward against the upstream libraries' own outputs
//! (`golden.safetensors` in each shared reference model).

mod common;

use common::flat;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use statecut::arch::{family_for, LoadOptions, Observer, SliceRole};
use statecut::checkpoint::Checkpoint;

struct Hidden(Vec<Tensor>);
impl Observer for Hidden {
    fn hidden(&mut self, _i: usize, h: &Tensor) -> Result<()> {
        self.0.push(h.clone());
        Ok(())
    }
}

fn check(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    let golden = common::golden(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let mut hidden = Hidden(Vec::new());
    let logits = model.forward(&ids, &mut hidden).unwrap();
    let err = common::rel_err(&flat(&logits), &flat(&golden["logits"]));
    eprintln!("{name}: logits relative error {err:.3e}");
    assert!(err < 1e-3, "{name}: logits relative error {err:.3e} >= 1e-3");
    let gh = &golden["hidden_states"];
    assert_eq!(hidden.0.len(), gh.dim(0).unwrap(), "{name}: number of hidden states");
    for (i, h) in hidden.0.iter().enumerate() {
        let err = common::rel_err(&flat(h), &flat(&gh.get(i).unwrap()));
        eprintln!("{name}: hidden_states[{i}] relative error {err:.3e}");
        assert!(err < 1e-3, "{name}: hidden_states[{i}] relative error {err:.3e} >= 1e-3");
    }
}

#[test]
fn delta_net_matches_fla() {
    check("delta_net");
}

#[test]
fn gated_deltanet_matches_fla() {
    check("gated_deltanet");
}

#[test]
fn mamba2_matches_transformers() {
    check("mamba2");
}

#[test]
fn qwen3_5_matches_transformers() {
    check("qwen3_5");
}

/// With `grad`, each linear layer's key/query projection is a variable named after its
/// checkpoint tensor, and the LM loss has a gradient with respect to it.
fn check_grad(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    let golden = common::golden(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let family = family_for(&ckpt).unwrap();
    let layout = family.layout(&ckpt).unwrap();
    let model = family.load(&ckpt, &LoadOptions { grad: true, ..LoadOptions::cpu_f32() }).unwrap();
    let ids = golden["input_ids"].narrow(1, 0, 17).unwrap().to_dtype(DType::U32).unwrap();
    let (inp, tgt) = (ids.narrow(1, 0, 16).unwrap(), ids.narrow(1, 1, 16).unwrap());
    let logits = model.forward(&inp, &mut statecut::arch::NoObserver).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1).unwrap();
    let loss = logp.gather(&tgt.unsqueeze(2).unwrap(), 2).unwrap().sum_all().unwrap().neg().unwrap();
    let grads = loss.backward().unwrap();
    let mut names: Vec<&str> = model.grad_vars().iter().map(|(n, _)| n.as_str()).collect();
    let mut want: Vec<&str> = layout
        .layers
        .iter()
        .flat_map(|l| l.slices.iter().filter(|s| s.role == SliceRole::KeyProj).map(|s| s.tensor.as_str()))
        .collect();
    names.sort();
    want.sort();
    assert_eq!(names, want, "{name}: gradient variables");
    for (n, var) in model.grad_vars() {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("{name}: no gradient for {n}"));
        let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm.is_finite() && norm > 0.0, "{name}: gradient of {n} has squared norm {norm}");
    }
}

#[test]
fn mamba2_and_qwen3_5_have_projection_gradients() {
    check_grad("mamba2");
    check_grad("qwen3_5");
}

/// Records which layers report what, with which shapes.
#[derive(Default)]
struct Shapes(Vec<(&'static str, usize, Vec<usize>)>);
impl Observer for Shapes {
    fn wants_state(&self) -> bool {
        true
    }
    fn qk_input(&mut self, layer: usize, x: &Tensor) -> Result<()> {
        self.0.push(("input", layer, x.dims().to_vec()));
        Ok(())
    }
    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        assert_eq!(q.dims(), k.dims());
        self.0.push(("qk", layer, q.dims().to_vec()));
        Ok(())
    }
    fn state(&mut self, layer: usize, s: &Tensor) -> Result<()> {
        self.0.push(("state", layer, s.dims().to_vec()));
        Ok(())
    }
}

/// Every layer of the layout, and only those, reports its input, q/k and state in the layout's shapes.
#[test]
fn observers_see_the_layout() {
    for name in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
        let Some(dir) = common::model_dir(name) else { return };
        let ckpt = Checkpoint::open(&dir).unwrap();
        let family = family_for(&ckpt).unwrap();
        let layout = family.layout(&ckpt).unwrap();
        let model = family.load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
        let ids = Tensor::new(&[[5u32, 9, 100, 7, 3]], &Device::Cpu).unwrap();
        let mut seen = Shapes::default();
        model.forward(&ids, &mut seen).unwrap();
        let hidden = ckpt.config.get("hidden_size").or(ckpt.config.get("d_model")).unwrap().as_u64().unwrap() as usize;
        let want: Vec<_> = layout
            .layers
            .iter()
            .flat_map(|l| {
                [
                    ("input", l.layer, vec![1, 5, hidden]),
                    ("qk", l.layer, vec![1, 5, l.key_heads, layout.dk]),
                    ("state", l.layer, vec![1, l.value_heads, layout.dk, l.dv]),
                ]
            })
            .collect();
        assert_eq!(seen.0, want, "{name}");
    }
}

/// bf16 weights: statecut's forward (gates, β, norms and recurrence in float32) stays within 3x of
/// the error the upstream library's own bf16 kernels make against the float32 golden.
#[test]
fn bf16_error_is_upstream_scale() {
    for name in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
        let Some(dir) = common::model_dir(name) else { return };
        let golden = common::golden(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let opts = LoadOptions { dtype: DType::BF16, ..LoadOptions::cpu_f32() };
        let model = family_for(&ckpt).unwrap().load(&ckpt, &opts).unwrap();
        let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
        let logits = model.forward(&ids, &mut statecut::arch::NoObserver).unwrap();
        let err = common::rel_err(&flat(&logits), &flat(&golden["logits"]));
        let upstream = common::rel_err(&flat(&golden["logits_bf16_kernel"]), &flat(&golden["logits"]));
        eprintln!("{name}: bf16 logits relative error {err:.3e} (upstream bf16 kernels {upstream:.3e})");
        assert!(err < 3.0 * upstream.max(1e-3), "{name}: bf16 error {err:.3e} vs upstream {upstream:.3e}");
    }
}

/// An observer that needs no logits gets the final normed hidden state (the last entry of the
/// golden hidden states), and the LM head is skipped.
#[test]
fn no_logits_returns_final_hidden_state() {
    struct NoLogits;
    impl Observer for NoLogits {
        fn needs_logits(&self) -> bool {
            false
        }
    }
    for name in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
        let Some(dir) = common::model_dir(name) else { return };
        let golden = common::golden(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
        let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
        let h = model.forward(&ids, &mut NoLogits).unwrap();
        let gh = &golden["hidden_states"];
        let last = gh.get(gh.dim(0).unwrap() - 1).unwrap();
        assert_eq!(h.dims(), last.dims(), "{name}");
        let err = common::rel_err(&flat(&h), &flat(&last));
        assert!(err < 1e-3, "{name}: final hidden state off by {err:.3e}");
    }
}
