//! Sparse State Expansion (SSE-GLA): the mask, varlen and token-loop forms agree on random
//! weights, the layout covers every key-channel tensor, and the forward matches the reference
//! script's outputs on the fixture committed under tests/fixtures/sse_gla.

mod common;

use common::flat;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use statecut::arch::sse::{self, Implementation};
use statecut::arch::{family_for, CausalLm, DecodeCache, LoadOptions, NoObserver, Observer, SliceRole};
use statecut::checkpoint::Checkpoint;
use statecut::model::layered::Resident;
use statecut::ops::delta_rule::Kernel;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const HIDDEN: usize = 32;
const HEADS: usize = 2;
const DK: usize = 8;
const DV: usize = 12;
const PARTS: usize = 4;
const VOCAB: usize = 50;

fn config(short_conv: bool, implementation: &str, transition: &str) -> Value {
    json!({
        "model_type": "sse",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_heads": HEADS,
        "num_v_heads": null,
        "head_dim": DK,
        "expand_v": DV as f64 / DK as f64,
        "use_output_gate": true,
        "use_short_conv": short_conv,
        "conv_size": 4,
        "num_sparse_partition": PARTS,
        "num_writer": 2,
        "num_reader": 2,
        "linear_attn_type": transition,
        "sse_implementation": implementation,
        "hidden_ratio": 4,
        "intermediate_size": 48,
        "norm_eps": 1e-6,
        "attn": null,
        "tie_word_embeddings": false,
        "eos_token_id": 2,
        "vocab_size": VOCAB,
    })
}

/// A checkpoint with random weights (fla's tensor names) in `dir`.
fn random_checkpoint(dir: &Path, short_conv: bool, seed: u64) {
    random_checkpoint_of(dir, short_conv, seed, "gla")
}

/// The same for a transition ("gla" or "gdn").
fn random_checkpoint_of(dir: &Path, short_conv: bool, seed: u64, transition: &str) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tensors = HashMap::new();
    let mut put = |name: String, shape: &[usize], scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
        tensors.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    let (kd, vd) = (HEADS * DK, HEADS * DV);
    let lin = |o: usize, i: usize| -> (Vec<usize>, f32) { (vec![o, i], (1.0 / i as f32).sqrt() * 1.7) };
    put("model.embeddings.weight".into(), &[VOCAB, HIDDEN], 1.0, 0.0);
    put("lm_head.weight".into(), &[VOCAB, HIDDEN], 0.3, 0.0);
    put("model.norm.weight".into(), &[HIDDEN], 0.2, 1.0);
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        put(format!("{p}attn_norm.weight"), &[HIDDEN], 0.2, 1.0);
        put(format!("{p}mlp_norm.weight"), &[HIDDEN], 0.2, 1.0);
        let mut linear = |name: &str, o: usize, i: usize| {
            let (shape, s) = lin(o, i);
            put(format!("{p}{name}"), &shape, s, 0.0);
        };
        linear("attn.q_proj.weight", kd, HIDDEN);
        linear("attn.k_proj.weight", kd, HIDDEN);
        linear("attn.v_proj.weight", vd, HIDDEN);
        linear("attn.lora_q_proj.0.weight", DV, HIDDEN);
        linear("attn.lora_q_proj.1.weight", kd, DV);
        linear("attn.lora_k_proj.0.weight", DV, HIDDEN);
        linear("attn.lora_k_proj.1.weight", kd, DV);
        if transition == "gla" {
            linear("attn.gk_proj.0.0.weight", 16, HIDDEN);
            linear("attn.gk_proj.0.1.weight", kd, 16);
            linear("attn.gk_proj.1.0.weight", 16, HIDDEN);
            linear("attn.gk_proj.1.1.weight", kd, 16);
        } else {
            linear("attn.a_proj.weight", 2 * HEADS, HIDDEN);
            linear("attn.b_proj.weight", 2 * HEADS, HIDDEN);
        }
        linear("attn.g_proj.0.weight", DV, HIDDEN);
        linear("attn.g_proj.1.weight", vd, DV);
        linear("attn.o_proj.weight", HIDDEN, vd);
        linear("mlp.gate_proj.weight", 48, HIDDEN);
        linear("mlp.up_proj.weight", 48, HIDDEN);
        linear("mlp.down_proj.weight", HIDDEN, 48);
        // A sharp router, so that top-2 is far from ties.
        put(format!("{p}attn.e_proj.weight"), &[PARTS, HIDDEN], 1.5, 0.0);
        if transition == "gla" {
            put(format!("{p}attn.gk_proj.0.1.bias"), &[kd], 2.0, 1.0);
            put(format!("{p}attn.gk_proj.1.1.bias"), &[kd], 2.0, 1.0);
        } else {
            // decay rates exp(A_log) in (0.4, 2.4), as fla initialises A in (0, 16] (smaller here)
            put(format!("{p}attn.A_log"), &[2 * HEADS], 0.9, -0.2);
            put(format!("{p}attn.dt_bias"), &[2 * HEADS], 1.0, -2.0);
        }
        put(format!("{p}attn.o_norm.weight"), &[DV], 0.2, 1.0);
        if short_conv {
            put(format!("{p}attn.q_conv1d_shared.weight"), &[kd, 1, 4], 0.6, 0.0);
            put(format!("{p}attn.k_conv1d_shared.weight"), &[kd, 1, 4], 0.6, 0.0);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config(short_conv, "varlen", transition).to_string()).unwrap();
}

fn ids(b: usize, t: usize, seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

/// The three forms of the SSE forward (mask, varlen, loop) give the same finite logits for `ids`
/// on the checkpoint in `dir`.
fn assert_forms_agree(dir: &Path, ids: &Tensor) {
    let logits = |imp| flat(&open(dir, imp).forward(ids, &mut NoObserver).unwrap());
    let mask = logits(Implementation::Mask);
    assert!(mask.iter().all(|x| x.is_finite()));
    assert!(common::rel_err(&logits(Implementation::Varlen), &mask) < 1e-5);
    assert!(common::rel_err(&logits(Implementation::Loop), &mask) < 1e-5);
}

fn open(dir: &Path, imp: Implementation) -> Resident {
    sse::open(&Checkpoint::open(dir).unwrap(), &LoadOptions::cpu_f32(), Some(imp)).unwrap()
}

#[test]
fn mask_varlen_and_loop_agree() {
    for (transition, short_conv) in [("gla", false), ("gla", true), ("gdn", false), ("gdn", true)] {
        let tmp = tempfile::tempdir().unwrap();
        random_checkpoint_of(tmp.path(), short_conv, 11, transition);
        let x = ids(2, 45, 5);
        let out = |imp| flat(&open(tmp.path(), imp).forward(&x, &mut NoObserver).unwrap());
        let (mask, varlen, lp) = (out(Implementation::Mask), out(Implementation::Varlen), out(Implementation::Loop));
        let (e1, e2) = (common::rel_err(&varlen, &mask), common::rel_err(&lp, &mask));
        eprintln!("{transition} short_conv {short_conv}: varlen vs mask {e1:.2e}, loop vs mask {e2:.2e}");
        assert!(e1 < 1e-5 && e2 < 1e-5, "{transition}: forms disagree: varlen {e1:.2e}, loop {e2:.2e}");
    }
}

/// Prefill, then one token at a time through the conv and partition-state caches, against the
/// full forward (every form).
fn check_decode(model: &dyn CausalLm, x: &Tensor, prefill: usize, what: &str) {
    let t = x.dim(1).unwrap();
    let full = flat(&model.forward(x, &mut NoObserver).unwrap());
    let mut cache = DecodeCache::default();
    let mut parts = vec![model.forward_cached(&x.narrow(1, 0, prefill).unwrap(), &mut cache).unwrap()];
    for ti in prefill..t {
        parts.push(model.forward_cached(&x.narrow(1, ti, 1).unwrap(), &mut cache).unwrap());
    }
    assert_eq!(cache.pos, t);
    let err = common::rel_err(&flat(&Tensor::cat(&parts, 1).unwrap()), &full);
    eprintln!("{what}: decode vs full forward relative error {err:.2e}");
    assert!(err < 1e-5, "{what}: decode vs full forward relative error {err:.2e}");
}

#[test]
fn decode_matches_forward() {
    for (transition, short_conv) in [("gla", true), ("gdn", true), ("gdn", false)] {
        let tmp = tempfile::tempdir().unwrap();
        random_checkpoint_of(tmp.path(), short_conv, 17, transition);
        let x = ids(2, 30, 6);
        for imp in [Implementation::Varlen, Implementation::Loop] {
            check_decode(&open(tmp.path(), imp), &x, 21, &format!("{transition} short_conv {short_conv} {imp:?}"));
        }
        // The cache holds every partition's state and the shared path's two conv histories.
        let mut cache = DecodeCache::default();
        open(tmp.path(), Implementation::Mask).forward_cached(&x, &mut cache).unwrap();
        let conv = if short_conv { 2 * 2 * 3 * HEADS * DK } else { 0 };
        assert_eq!(cache.elems(), 2 * (2 * HEADS * (PARTS + 1) * DK * DV) + 2 * conv);
    }
    for name in ["sse_gla", "sse_gdn", "sse_h"] {
        let dir = fixture_dir(name);
        let golden = common::golden(&dir);
        let x = golden["input_ids"].to_dtype(DType::U32).unwrap().narrow(1, 0, 48).unwrap();
        check_decode(&open(&dir, Implementation::Varlen), &x, 40, &format!("{name} fixture"));
    }
}

/// Calibration callbacks: shapes of what the model reports.
#[derive(Default)]
struct Shapes {
    qk: Vec<(usize, Vec<usize>, Vec<usize>)>,
    states: Vec<(usize, Tensor)>,
    inputs: usize,
    routing: Vec<Tensor>,
}
impl Observer for Shapes {
    fn wants_state(&self) -> bool {
        true
    }
    fn qk_input(&mut self, _layer: usize, x: &Tensor) -> Result<()> {
        assert_eq!(x.dim(2)?, HIDDEN);
        self.inputs += 1;
        Ok(())
    }
    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        self.qk.push((layer, q.dims().to_vec(), k.dims().to_vec()));
        Ok(())
    }
    fn state(&mut self, layer: usize, s: &Tensor) -> Result<()> {
        self.states.push((layer, s.clone()));
        Ok(())
    }
    fn routing(&mut self, _layer: usize, selected: &Tensor) -> Result<()> {
        self.routing.push(selected.clone());
        Ok(())
    }
}

#[test]
fn observer_sees_shared_qk_and_every_partition_state() {
    let tmp = tempfile::tempdir().unwrap();
    random_checkpoint(tmp.path(), true, 3);
    let model = open(tmp.path(), Implementation::Varlen);
    let x = ids(1, 30, 9);
    let mut obs = Shapes::default();
    let with_state = flat(&model.forward(&x, &mut obs).unwrap());
    let plain = flat(&model.forward(&x, &mut NoObserver).unwrap());
    assert!(common::rel_err(&with_state, &plain) < 1e-5);
    assert_eq!(obs.inputs, 2);
    assert_eq!(obs.qk.len(), 2);
    for (_, q, k) in &obs.qk {
        assert_eq!(q, &[1, 30, HEADS, DK]);
        assert_eq!(k, &[1, 30, HEADS, DK]);
    }
    // Every token selects num_writer = 2 partitions.
    assert_eq!(obs.routing.len(), 2);
    for r in &obs.routing {
        assert_eq!(r.dims(), &[1, 30, PARTS]);
        assert!(flat(&r.sum(2).unwrap()).iter().all(|&c| c == 2.0));
    }
    assert_eq!(obs.states.len(), 2);
    for (_, s) in &obs.states {
        assert_eq!(s.dims(), &[1, HEADS * (PARTS + 1), DK, DV]);
        // The shared partition (index 0 of each head) sees every token: never zero.
        let shared = s.get(0).unwrap().get(0).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(shared > 0.0);
    }
}

#[test]
fn layout_slices_every_key_channel_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    random_checkpoint(tmp.path(), true, 1);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let fam = family_for(&ckpt).unwrap();
    let layout = fam.layout(&ckpt).unwrap();
    assert_eq!(layout.dk, DK);
    assert_eq!(layout.layers.len(), 2);
    for l in &layout.layers {
        assert_eq!((l.key_heads, l.value_heads, l.dv), (HEADS, HEADS * (PARTS + 1), DV));
        let names: Vec<&str> = l.slices.iter().map(|s| s.tensor.as_str()).collect();
        for want in [
            "q_proj.weight",
            "k_proj.weight",
            "lora_q_proj.1.weight",
            "lora_k_proj.1.weight",
            "gk_proj.0.1.weight",
            "gk_proj.0.1.bias",
            "gk_proj.1.1.weight",
            "gk_proj.1.1.bias",
            "q_conv1d_shared.weight",
            "k_conv1d_shared.weight",
        ] {
            assert!(names.iter().any(|n| n.ends_with(&format!("attn.{want}"))), "{want} not sliced");
        }
        for s in &l.slices {
            assert_eq!(ckpt.info(&s.tensor).unwrap().shape[0], HEADS * DK, "{}", s.tensor);
        }
        assert_eq!(l.slices.iter().filter(|s| s.role == SliceRole::QueryProj).count(), 1);
        assert_eq!(l.slices.iter().filter(|s| s.role == SliceRole::KeyProj).count(), 1);
    }
    // A narrower key width rescales expand_v so that head_v_dim stays.
    let mut cfg = ckpt.config.clone();
    fam.set_key_width(&mut cfg, &layout, 5).unwrap();
    assert_eq!(cfg["head_dim"], 5);
    assert_eq!((5.0 * cfg["expand_v"].as_f64().unwrap()) as usize, DV);
}

/// Keep channels `keep` of every head in every sliced tensor, as the prune command does, and
/// check that the reloaded model runs in all three forms alike.
#[test]
fn sliced_checkpoint_reloads_and_forms_agree() {
    for transition in ["gla", "gdn"] {
        sliced_checkpoint_reloads(transition);
    }
}

fn sliced_checkpoint_reloads(transition: &str) {
    let tmp = tempfile::tempdir().unwrap();
    random_checkpoint_of(tmp.path(), true, 21, transition);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let fam = family_for(&ckpt).unwrap();
    let layout = fam.layout(&ckpt).unwrap();
    let keep = [0usize, 2, 3, 6, 7];
    let mut tensors = candle_core::safetensors::load(tmp.path().join("model.safetensors"), &Device::Cpu).unwrap();
    for l in &layout.layers {
        for s in &l.slices {
            let t = &tensors[&s.tensor];
            let rows: Vec<u32> = (0..l.key_heads)
                .flat_map(|h| keep.iter().map(move |&j| (s.offset + h * s.head_stride + j) as u32))
                .collect();
            let idx = Tensor::from_vec(rows.clone(), rows.len(), &Device::Cpu).unwrap();
            let sliced = t.index_select(&idx, 0).unwrap();
            tensors.insert(s.tensor.clone(), sliced);
        }
    }
    let out = tmp.path().join("pruned");
    std::fs::create_dir(&out).unwrap();
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).unwrap();
    let mut cfg = ckpt.config.clone();
    fam.set_key_width(&mut cfg, &layout, keep.len()).unwrap();
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let x = ids(2, 33, 4);
    assert_forms_agree(&out, &x);
    assert_eq!(Checkpoint::open(&out).unwrap().config["head_dim"], keep.len());
}

/// A committed fixture: `sse_gla` (trained, with tokenizer and reference.json), `sse_gdn` or
/// `sse_h` (random weights; `sse_h` a hybrid with softmax attention layers); all written by
/// scripts/sse_reference.py with golden outputs.
fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn fixture() -> PathBuf {
    fixture_dir("sse_gla")
}

/// A number from the fixture's config.json.
fn cfg_usize(dir: &Path, key: &str) -> usize {
    Checkpoint::open(dir).unwrap().config[key].as_u64().unwrap_or_else(|| panic!("config {key}")) as usize
}

/// head_v_dim as fla derives it.
fn cfg_dv(dir: &Path) -> usize {
    let c = Checkpoint::open(dir).unwrap().config;
    (c["head_dim"].as_f64().unwrap() * c["expand_v"].as_f64().unwrap()) as usize
}

struct Hidden(Vec<Tensor>);
impl Observer for Hidden {
    fn hidden(&mut self, _i: usize, h: &Tensor) -> Result<()> {
        self.0.push(h.clone());
        Ok(())
    }
}

/// Golden parity with scripts/sse_reference.py (float32 forward of the stored weights), for
/// each of the three forms.
#[test]
fn fixtures_match_reference_script() {
    for name in ["sse_gla", "sse_gdn", "sse_h"] {
        check_golden(name);
    }
}

fn check_golden(name: &str) {
    let dir = fixture_dir(name);
    let golden = common::golden(&dir);
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(family_for(&ckpt).unwrap().model_types(), &["sse"]);
    for imp in [Implementation::Mask, Implementation::Varlen, Implementation::Loop] {
        let model = sse::open(&ckpt, &LoadOptions::cpu_f32(), Some(imp)).unwrap();
        // The GPU's chunked recurrence (GDN partitions; GLA keeps the sequential kernel) on the
        // masked inputs: zero keys and decays for the tokens a partition does not see.
        let chunked = Kernel::scoped(Kernel::Chunked, || model.forward(&ids, &mut NoObserver)).unwrap();
        let err = common::rel_err(&flat(&chunked), &flat(&golden["logits"]));
        assert!(err < 1e-3, "{name} {imp:?} chunked: logits relative error {err:.3e} >= 1e-3");
        let mut hidden = Hidden(Vec::new());
        let logits = model.forward(&ids, &mut hidden).unwrap();
        let err = common::rel_err(&flat(&logits), &flat(&golden["logits"]));
        eprintln!("{name} {imp:?}: logits relative error {err:.3e}");
        assert!(err < 1e-3, "{name} {imp:?}: logits relative error {err:.3e} >= 1e-3");
        let gh = &golden["hidden_states"];
        assert_eq!(hidden.0.len(), gh.dim(0).unwrap(), "number of hidden states");
        for (i, h) in hidden.0.iter().enumerate() {
            let err = common::rel_err(&flat(h), &flat(&gh.get(i).unwrap()));
            eprintln!("{name} {imp:?}: hidden_states[{i}] relative error {err:.3e}");
            assert!(err < 1e-3, "{name} {imp:?}: hidden_states[{i}] relative error {err:.3e} >= 1e-3");
        }
    }
    // The script's own varlen and loop forms agree with its mask form (final norm outputs).
    let gh = golden["hidden_states"].dim(0).unwrap();
    let last = flat(&golden["hidden_states"].get(gh - 1).unwrap());
    for key in ["last_hidden_varlen", "last_hidden_loop"] {
        assert!(common::rel_err(&flat(&golden[key]), &last) < 1e-5, "{name}: {key}");
    }
}

/// The prune command on the fixture (a selector that needs no calibration text): the output
/// reloads, its three forms agree, and `inspect` reports partition usage.
#[test]
fn prune_and_inspect_commands_on_fixture() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let args = ["prune", "-m", dir.to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "-o", out.to_str().unwrap()];
    let (code, _, err) = common::statecut(&[&args[..], &["-q"]].concat(), &[]);
    assert_eq!(code, 0, "prune failed:\n{err}");
    let (dk, dv) = (cfg_usize(&dir, "head_dim"), cfg_dv(&dir));
    assert_eq!(cfg_usize(&out, "head_dim"), dk / 2);
    assert_eq!(cfg_dv(&out), dv);
    assert_forms_agree(&out, &common::golden(&dir)["input_ids"].to_dtype(DType::U32).unwrap());

    let (code, json, err) = common::statecut(
        &["inspect", "-m", dir.to_str().unwrap(), "--nsamples", "2", "--seqlen", "64", "--rows", "200", "--json", "-q"],
        &[],
    );
    assert_eq!(code, 0, "inspect failed:\n{err}");
    let report: Value = serde_json::from_str(&json).unwrap();
    let (n, topk, heads) =
        (cfg_usize(&dir, "num_sparse_partition"), cfg_usize(&dir, "num_writer"), cfg_usize(&dir, "num_heads"));
    for l in report["layers"].as_array().unwrap() {
        let usage: Vec<f64> = l["partition_usage"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(usage.len(), n);
        assert!((usage.iter().sum::<f64>() - topk as f64).abs() < 1e-9, "{usage:?}");
        assert_eq!(l["heads"].as_array().unwrap().len(), heads * (n + 1));
        assert_eq!(l["near_zero_keys"]["partitions"].as_array().unwrap().len(), n);
        let rf = &l["receptive_field"];
        for span in [&rf["shared"], &rf["routed"]] {
            let mean = span["mean"].as_f64().unwrap();
            assert!((1.0..=64.0).contains(&mean), "{rf}");
        }
    }
}

/// With `grad`, the LM loss reaches both key/query projections (through the shared and the
/// routed paths).
#[test]
fn loss_gradients_reach_query_and_key_projections() {
    let tmp = tempfile::tempdir().unwrap();
    random_checkpoint(tmp.path(), true, 8);
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let opts = LoadOptions { grad: true, ..LoadOptions::cpu_f32() };
    let model = sse::open(&ckpt, &opts, None).unwrap();
    assert_eq!(model.grad_vars().len(), 4);
    let x = ids(1, 20, 2);
    let logits = model.forward(&x, &mut NoObserver).unwrap().squeeze(0).unwrap();
    let targets = x.squeeze(0).unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits, &targets).unwrap();
    let grads = loss.backward().unwrap();
    for (name, var) in model.grad_vars() {
        let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{name}: gradient norm {norm}");
    }
}

/// `--prune-partitions`: the router keeps the rows of the most used partitions, the config says
/// how many remain, and the reloaded model's three forms agree.
#[test]
fn prune_partitions_keeps_router_rows() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let (code, _, err) = common::statecut(
        &[
            "prune",
            "-m",
            dir.to_str().unwrap(),
            "--method",
            "l1",
            "--ratio",
            "0.25",
            "--prune-partitions",
            &(cfg_usize(&dir, "num_sparse_partition") - 1).to_string(),
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "-o",
            out.to_str().unwrap(),
            "-q",
        ],
        &[],
    );
    assert_eq!(code, 0, "prune failed:\n{err}");
    let ckpt = Checkpoint::open(&out).unwrap();
    let c = |key: &str| cfg_usize(&dir, key);
    let (n, heads, layers) = (c("num_sparse_partition"), c("num_heads"), c("num_hidden_layers"));
    let dk = cfg_usize(&out, "head_dim");
    assert_eq!(cfg_usize(&out, "num_sparse_partition"), n - 1);
    assert!(dk < c("head_dim"), "--ratio 0.25 keeps {dk} of {} channels", c("head_dim"));
    assert_eq!(ckpt.info("model.layers.0.attn.e_proj.weight").unwrap().shape, vec![n - 1, c("hidden_size")]);
    let layout = family_for(&ckpt).unwrap().layout(&ckpt).unwrap();
    assert_eq!(layout.layers[0].value_heads, heads * n);
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("statecut_report.json")).unwrap()).unwrap();
    assert_eq!(report["state_elems_after"], layers * heads * n * dk * cfg_dv(&dir));
    assert_forms_agree(&out, &common::golden(&dir)["input_ids"].to_dtype(DType::U32).unwrap());

    // Too few partitions for top-2 routing is an error.
    let (code, _, err) = common::statecut(
        &[
            "prune",
            "-m",
            dir.to_str().unwrap(),
            "--method",
            "l1",
            "--ratio",
            "0.25",
            "--prune-partitions",
            &cfg_usize(&dir, "num_writer").to_string(),
            "-o",
            tmp.path().join("bad").to_str().unwrap(),
            "-q",
        ],
        &[],
    );
    assert_ne!(code, 0);
    assert!(err.contains("num_writer"), "{err}");
}

/// Replace tensors of the checkpoint in `dir`.
fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

/// With gates that ignore their input, every step decays by the same a: the shared partition's
/// receptive field is the m tokens with a^(m-1) >= 1e-3 (away from the sequence start), and
/// the routed partitions, which decay only when selected, reach further.
#[test]
fn inspect_receptive_field_of_constant_gates() {
    let a: f64 = 0.9;
    let span = (1e-3f64.ln() / a.ln()).floor() as usize + 1;
    for transition in ["gla", "gdn"] {
        let tmp = tempfile::tempdir().unwrap();
        random_checkpoint_of(tmp.path(), true, 4, transition);
        edit_tensors(tmp.path(), |t| {
            let full = |shape: &[usize], v: f64| Tensor::full(v as f32, shape, &Device::Cpu).unwrap();
            for l in 0..2 {
                let p = format!("model.layers.{l}.attn.");
                if transition == "gla" {
                    // logsigmoid(b) / 16 = ln a
                    for i in 0..2 {
                        t.insert(format!("{p}gk_proj.{i}.0.weight"), full(&[16, HIDDEN], 0.0));
                        t.insert(format!("{p}gk_proj.{i}.1.bias"), full(&[HEADS * DK], -(a.powi(-16) - 1.0).ln()));
                    }
                } else {
                    // -exp(A_log) softplus(dt_bias) = ln a
                    t.insert(format!("{p}a_proj.weight"), full(&[2 * HEADS, HIDDEN], 0.0));
                    t.insert(format!("{p}A_log"), full(&[2 * HEADS], 0.0));
                    t.insert(format!("{p}dt_bias"), full(&[2 * HEADS], (1.0 / a - 1.0).ln()));
                }
            }
        });
        let ckpt = Checkpoint::open(tmp.path()).unwrap();
        let fam = family_for(&ckpt).unwrap();
        let (model, layout) = (fam.load(&ckpt, &LoadOptions::cpu_f32()).unwrap(), fam.layout(&ckpt).unwrap());
        let mut rng = StdRng::seed_from_u64(1);
        let seqs: Vec<Vec<u32>> =
            (0..2).map(|_| (0..200).map(|_| rng.random_range(0..VOCAB as u32)).collect()).collect();
        let r = statecut::inspect::inspect(model.as_ref(), &layout, &seqs, 100, 0, true).unwrap();
        for l in &r.layers {
            let rf = l.receptive_field.as_ref().unwrap();
            eprintln!("{transition} layer {}: {rf:?}", l.layer);
            assert!((rf.shared.mean - span as f64).abs() < 1e-9, "{transition}: shared span {:?}", rf.shared);
            assert_eq!((rf.shared.std, rf.shared.whole_prefix), (0.0, 0.0));
            assert!(rf.routed.mean > rf.shared.mean + 1.0, "{transition}: routed {:?}", rf.routed);
            let channels = if transition == "gla" { DK } else { 1 };
            assert_eq!(rf.shared.count, 2 * statecut::inspect::partitions::RF_TOKENS * HEADS * channels);
            // Each read position is counted once per selected partition: num_reader = 2.
            assert_eq!(rf.routed.count, 2 * rf.shared.count);
            let z = l.near_zero_keys.as_ref().unwrap();
            assert_eq!(z.partitions.len(), PARTS);
            assert!([z.shared, z.routed].iter().chain(&z.partitions).all(|x| (0.0..=1.0).contains(x)));
        }
        let table = statecut::inspect::render_table(&r);
        assert!(table.contains("receptive field") && table.contains("near-zero keys"), "{table}");
    }
}

/// `statecut eval` on the protocol of the fixture's reference.json (the script's float32
/// perplexity on the first windows of eval/wiki) gives the script's number.
#[test]
fn fixture_eval_matches_reference_perplexity() {
    let Some(shared) = common::shared() else { return };
    let dir = fixture();
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let (key, want) = reference
        .as_object()
        .unwrap()
        .iter()
        .find_map(|(k, v)| k.strip_prefix("eval_wiki_ppl_f32_").map(|p| (p.to_string(), v.as_f64().unwrap())))
        .expect("reference.json has eval_wiki_ppl_f32_<seqlen>x<windows>");
    let (seqlen, windows) = key.split_once('x').unwrap();
    let data = shared.join("data/eval/wiki.jsonl");
    let (code, out, err) = common::statecut(
        &[
            "eval",
            "-m",
            dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--seqlen",
            seqlen,
            "--windows",
            windows,
            "--json",
            "-q",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let got = serde_json::from_str::<Value>(&out).unwrap()["ppl"].as_f64().unwrap();
    eprintln!("sse_gla: ppl {got:.4} vs reference {want:.4} ({key})");
    assert!((got - want).abs() / want < 1e-3, "ppl {got} vs reference {want}");
}

/// SSE-H: the layout lists only the SSE layers, and pruning keeps the attention layers intact
/// and the pruned hybrid's forms in agreement.
#[test]
fn hybrid_layout_and_prune() {
    let dir = fixture_dir("sse_h");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let attn: Vec<usize> = serde_json::from_value(ckpt.config["attn"]["layers"].clone()).unwrap();
    let layout = family_for(&ckpt).unwrap().layout(&ckpt).unwrap();
    let linear: Vec<usize> = layout.layers.iter().map(|l| l.layer).collect();
    let want: Vec<usize> = (0..cfg_usize(&dir, "num_hidden_layers")).filter(|i| !attn.contains(i)).collect();
    assert_eq!(linear, want);
    assert_eq!(layout.num_layers, cfg_usize(&dir, "num_hidden_layers"));

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let (code, _, err) = common::statecut(
        &["prune", "-m", dir.to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "-o", out.to_str().unwrap(), "-q"],
        &[],
    );
    assert_eq!(code, 0, "prune failed:\n{err}");
    assert_eq!(cfg_usize(&out, "head_dim"), cfg_usize(&dir, "head_dim") / 2);
    let pruned = Checkpoint::open(&out).unwrap();
    for l in &attn {
        let name = format!("model.layers.{l}.attn.q_proj.weight");
        assert_eq!(pruned.info(&name).unwrap().shape, ckpt.info(&name).unwrap().shape, "{name}");
    }
    assert_forms_agree(&out, &common::golden(&dir)["input_ids"].to_dtype(DType::U32).unwrap());
}
