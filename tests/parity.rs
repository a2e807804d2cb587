//! Golden parity: statecut's float32 forward against the upstream libraries' own outputs
//! (`golden.safetensors` in each shared reference model).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use statecut::arch::{family_for, LoadOptions, Observer};
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
    let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let mut hidden = Hidden(Vec::new());
    let logits = model.forward(&ids, &mut hidden).unwrap();
    let flat = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
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
