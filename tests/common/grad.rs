//! Gradient parity against PyTorch autograd's goldens (`scripts/grad_reference.py`,
//! `tests/fixtures/grad/`), on any device: used by `grad_parity` (CPU) and `gpu_parity` (CUDA).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use statecut::arch::{family_for, CausalLm, LoadOptions, NoObserver};
use statecut::checkpoint::Checkpoint;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

/// Mean cross-entropy of predicting token t+1 from tokens ..=t, in float32.
fn mean_loss(logits: &Tensor, ids: &Tensor) -> Tensor {
    let t = ids.dim(1).unwrap();
    let logits = logits.narrow(1, 0, t - 1).unwrap().to_dtype(DType::F32).unwrap().squeeze(0).unwrap();
    let targets = ids.narrow(1, 1, t - 1).unwrap().squeeze(0).unwrap();
    candle_nn::loss::cross_entropy(&logits, &targets).unwrap()
}

/// The rows the golden kept of a gradient (all of them without `rows.NAME`), as a flat vector.
pub fn sampled(g: &Tensor, rows: Option<&Tensor>) -> Vec<f32> {
    let g = g.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap();
    let g = match rows {
        Some(r) => {
            let last = g.dim(D::Minus1).unwrap();
            g.reshape(((), last)).unwrap().index_select(&r.to_dtype(DType::U32).unwrap(), 0).unwrap()
        }
        None => g,
    };
    super::flat(&g)
}

/// PyTorch's loss and gradients for `name` (`tests/fixtures/grad/NAME.safetensors`).
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    let path = super::repo_file(&format!("tests/fixtures/grad/{name}.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The loss of `model` on the golden tokens of `golden_dir`, checked against PyTorch's, and its
/// gradients.
fn loss_and_grads(
    name: &str,
    model: &dyn CausalLm,
    golden_dir: &Path,
    reference: &HashMap<String, Tensor>,
) -> GradStore {
    let ids = super::golden_ids(golden_dir).to_device(model.device()).unwrap();
    let loss = mean_loss(&model.forward(&ids, &mut NoObserver).unwrap(), &ids);
    let want = reference["loss"].to_vec1::<f64>().unwrap()[0];
    let got = loss.to_scalar::<f32>().unwrap() as f64;
    assert!((got - want).abs() <= 1e-4 * want.abs(), "{name}: loss {got} vs PyTorch {want}");
    loss.backward().unwrap()
}

/// Compare the gradients of `vars` (checkpoint name, variable) with PyTorch's; every name in
/// `expected` must be among them.
fn compare(
    name: &str,
    grads: &GradStore,
    vars: &BTreeMap<String, Var>,
    expected: &[String],
    reference: &HashMap<String, Tensor>,
    tolerance: f64,
) {
    let mut worst = (0.0, String::new());
    let mut failures = Vec::new();
    for n in expected {
        let Some(var) = vars.get(n) else {
            failures.push(format!("{n}: not loaded as a variable"));
            continue;
        };
        let want = super::flat(&reference[&format!("grad.{n}")]);
        let Some(g) = grads.get(var.as_tensor()) else {
            failures.push(format!("{n}: no gradient (PyTorch's has norm {:.3e})", norm(&want)));
            continue;
        };
        let got = sampled(g, reference.get(&format!("rows.{n}")));
        let err = super::rel_err(&got, &want);
        if err.is_nan() || err > tolerance {
            failures.push(format!("{n}: relative error {err:.3e}"));
        }
        if err > worst.0 {
            worst = (err, n.clone());
        }
    }
    let n = expected.len();
    assert!(
        failures.is_empty(),
        "{name}: {} of {n} gradients differ from PyTorch's:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("{name}: {n} gradients, largest relative error {:.2e} ({})", worst.0, worst.1);
}

/// Every stored gradient of `name` (model directory `dir`, golden tokens in `golden_dir`), with
/// each of those tensors loaded as a variable in float32 on `device`: ||statecut - PyTorch|| /
/// ||PyTorch|| at most `tolerance`.
pub fn check(name: &str, dir: &Path, golden_dir: &Path, device: &Device, tolerance: f64) {
    let reference = reference(name);
    let names: Vec<String> = reference.keys().filter_map(|k| k.strip_prefix("grad.")).map(String::from).collect();
    let ckpt = Checkpoint::open(dir).unwrap();
    let wanted = names.clone();
    let select = Arc::new(move |n: &str| wanted.iter().any(|w| w == n));
    let opts = LoadOptions { device: device.clone(), ..LoadOptions::cpu_f32() };
    let (model, set) = family_for(&ckpt).unwrap().load_trainable(&ckpt, &opts, select).unwrap();
    let grads = loss_and_grads(name, model.as_ref(), golden_dir, &reference);
    compare(name, &grads, &set.vars(), &names, &reference, tolerance);
}

/// The Grad selector's own path (`LoadOptions::grad`: the key/query projections it scores as
/// variables) against the same goldens.
pub fn check_selector(name: &str, dir: &Path, golden_dir: &Path, device: &Device, tolerance: f64) {
    let reference = reference(name);
    let ckpt = Checkpoint::open(dir).unwrap();
    let opts = LoadOptions { device: device.clone(), grad: true, ..LoadOptions::cpu_f32() };
    let model = family_for(&ckpt).unwrap().load(&ckpt, &opts).unwrap();
    let vars: BTreeMap<String, Var> = model.grad_vars().iter().cloned().collect();
    assert!(!vars.is_empty(), "{name}: the selector scores no tensor");
    let grads = loss_and_grads(name, model.as_ref(), golden_dir, &reference);
    compare(name, &grads, &vars, &vars.keys().cloned().collect::<Vec<_>>(), &reference, tolerance);
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt()
}
