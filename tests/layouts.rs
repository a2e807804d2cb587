//! Checkpoint layouts the shared reference models do not come in, built at test time by
//! rewriting those models' tensors: Qwen3.5 as a multimodal `qwen3_5` checkpoint and as a
//! Qwen3-Next one (fused projections, dense and MoE), Mamba-2 as a mamba_ssm checkpoint
//! (`pytorch_model.bin`). Each must give the logits of the model it was converted from.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use statecut::arch::{family_for, LoadOptions, NoObserver, StateLayout};
use statecut::checkpoint::Checkpoint;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

type Tensors = HashMap<String, Tensor>;

fn read(dir: &Path) -> (Value, Tensors) {
    let config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    (config, candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap())
}

fn write_config(dir: &Path, config: &Value) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
}

fn write(dir: &Path, config: &Value, tensors: &Tensors) {
    write_config(dir, config);
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

/// Logits of the first 64 golden tokens of `src` through the model in `dir`, and its layout.
fn run(dir: &Path, src: &Path) -> (Vec<f32>, StateLayout) {
    let golden = candle_core::safetensors::load(src.join("golden.safetensors"), &Device::Cpu).unwrap();
    let ids = golden["input_ids"].narrow(1, 0, 64).unwrap().to_dtype(DType::U32).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let family = family_for(&ckpt).unwrap();
    let layout = family.layout(&ckpt).unwrap();
    check_slices(&ckpt, &layout);
    let model = family.load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let logits = model.forward(&ids, &mut NoObserver).unwrap();
    (logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(), layout)
}

/// Every row a layout names exists in its tensor.
fn check_slices(ckpt: &Checkpoint, layout: &StateLayout) {
    for l in &layout.layers {
        for s in &l.slices {
            let rows = ckpt.info(&s.tensor).unwrap().shape[0];
            let last = s.offset + (l.key_heads - 1) * s.head_stride + layout.dk;
            assert!(last <= rows, "{}: row {last} of {rows}", s.tensor);
        }
    }
}

fn assert_same(name: &str, got: &[f32], want: &[f32]) {
    let err = common::rel_err(got, want);
    eprintln!("{name}: relative logit difference {err:.3e}");
    assert!(err < 1e-5, "{name}: logits differ from the source model by {err:.3e}");
}

/// Rows `[off, off + len)` of a 2-D (or conv 3-D) tensor.
fn rows(t: &Tensor, off: usize, len: usize) -> Tensor {
    t.narrow(0, off, len).unwrap()
}

fn source(name: &str) -> Option<PathBuf> {
    let dir = common::model_dir(name)?;
    if !dir.join("model.safetensors").exists() {
        common::missing_data(&dir.join("model.safetensors"));
        return None;
    }
    Some(dir)
}

#[test]
fn qwen3_5_multimodal_layout() {
    let Some(src) = source("qwen3_5") else { return };
    let (text, tensors) = read(&src);
    let mut out: Tensors = tensors
        .iter()
        .map(|(k, v)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), v.clone()),
            None => (k.clone(), v.clone()),
        })
        .collect();
    // vision tower and multi-token-prediction head: present in released checkpoints, unused here
    let tiny =
        |r: usize, c: usize| Tensor::randn(0f32, 1.0, (r, c), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
    out.insert("model.visual.patch_embed.proj.weight".into(), tiny(8, 12));
    out.insert("model.visual.blocks.0.attn.qkv.weight".into(), tiny(24, 8));
    out.insert("mtp.fc.weight".into(), tiny(256, 512));
    out.insert("mtp.layers.0.input_layernorm.weight".into(), tiny(1, 256).squeeze(0).unwrap());
    let config = json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8},
        "image_token_id": 4000,
        "tie_word_embeddings": false,
        "eos_token_id": 2,
    });
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config, &out);
    let (want, wl) = run(&src, &src);
    let (got, gl) = run(tmp.path(), &src);
    assert_same("qwen3_5 multimodal", &got, &want);
    assert_eq!(gl.layers.len(), wl.layers.len());
    assert!(gl.layers[0].slices[0].tensor.starts_with("model.language_model.layers.0.linear_attn."));
}

/// Qwen3.5 tensors rewritten to Qwen3-Next's fused per-key-head-group projections.
fn to_next(text: &Value, tensors: &Tensors) -> Tensors {
    let c = |k: &str| text[k].as_u64().unwrap() as usize;
    let (hk, hv, dk, dv) =
        (c("linear_num_key_heads"), c("linear_num_value_heads"), c("linear_key_head_dim"), c("linear_value_head_dim"));
    let r = hv / hk;
    let mut out = Tensors::new();
    for (k, v) in tensors {
        if let Some(p) = k.strip_suffix("in_proj_qkv.weight") {
            let z = &tensors[&format!("{p}in_proj_z.weight")];
            let (b, a) = (&tensors[&format!("{p}in_proj_b.weight")], &tensors[&format!("{p}in_proj_a.weight")]);
            let mut qkvz = Vec::new();
            let mut ba = Vec::new();
            for g in 0..hk {
                qkvz.push(rows(v, g * dk, dk));
                qkvz.push(rows(v, hk * dk + g * dk, dk));
                qkvz.push(rows(v, 2 * hk * dk + g * r * dv, r * dv));
                qkvz.push(rows(z, g * r * dv, r * dv));
                ba.push(rows(b, g * r, r));
                ba.push(rows(a, g * r, r));
            }
            out.insert(format!("{p}in_proj_qkvz.weight"), Tensor::cat(&qkvz, 0).unwrap());
            out.insert(format!("{p}in_proj_ba.weight"), Tensor::cat(&ba, 0).unwrap());
        } else if !["in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"].iter().any(|s| k.ends_with(s)) {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

#[test]
fn qwen3_next_fused_layout() {
    let Some(src) = source("qwen3_5") else { return };
    let (text, tensors) = read(&src);
    let out = to_next(&text, &tensors);
    let mut config = text.clone();
    config["model_type"] = json!("qwen3_next");
    config["architectures"] = json!(["Qwen3NextForCausalLM"]);
    config["num_experts"] = json!(0);
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config, &out);
    let (want, wl) = run(&src, &src);
    let (got, gl) = run(tmp.path(), &src);
    assert_same("qwen3_next (dense)", &got, &want);

    // The fused layout's q/k rows are the same weights as the flat layout's.
    assert_eq!((gl.dk, gl.layers.len()), (wl.dk, wl.layers.len()));
    for (a, b) in wl.layers.iter().zip(&gl.layers) {
        for (sa, sb) in a.slices.iter().zip(&b.slices) {
            assert_eq!(sa.role, sb.role);
            for h in 0..a.key_heads {
                let ra = rows(&tensors[&sa.tensor], sa.offset + h * sa.head_stride, wl.dk);
                let rb = rows(&out[&sb.tensor], sb.offset + h * sb.head_stride, gl.dk);
                let d = (ra.to_dtype(DType::F32).unwrap() - rb.to_dtype(DType::F32).unwrap()).unwrap();
                assert_eq!(d.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{}", sb.tensor);
            }
        }
    }
}

#[test]
fn qwen3_next_moe_layout() {
    let Some(src) = source("qwen3_5") else { return };
    let (text, tensors) = read(&src);
    let mut out = to_next(&text, &tensors);
    // Every MLP becomes 4 routed experts (top 2, renormalised) whose down projections are halved,
    // plus a shared expert gated by sigmoid(0) = 1/2: the sum is the dense MLP again.
    let hidden = text["hidden_size"].as_u64().unwrap() as usize;
    let layers = text["num_hidden_layers"].as_u64().unwrap() as usize;
    for i in 0..layers {
        let p = format!("model.layers.{i}.mlp.");
        let take = |out: &mut Tensors, n: &str| out.remove(&format!("{p}{n}_proj.weight")).unwrap();
        let (gate, up, down) = (take(&mut out, "gate"), take(&mut out, "up"), take(&mut out, "down"));
        let half = (down.to_dtype(DType::F32).unwrap() * 0.5).unwrap().to_dtype(DType::BF16).unwrap();
        for e in 0..4 {
            out.insert(format!("{p}experts.{e}.gate_proj.weight"), gate.clone());
            out.insert(format!("{p}experts.{e}.up_proj.weight"), up.clone());
            out.insert(format!("{p}experts.{e}.down_proj.weight"), half.clone());
        }
        out.insert(format!("{p}shared_expert.gate_proj.weight"), gate);
        out.insert(format!("{p}shared_expert.up_proj.weight"), up);
        out.insert(format!("{p}shared_expert.down_proj.weight"), down);
        out.insert(
            format!("{p}shared_expert_gate.weight"),
            Tensor::zeros((1, hidden), DType::BF16, &Device::Cpu).unwrap(),
        );
        let router = Tensor::randn(0f32, 0.1, (4, hidden), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        out.insert(format!("{p}gate.weight"), router);
    }
    let mut config = text.clone();
    config["model_type"] = json!("qwen3_next");
    let inter = text["intermediate_size"].clone();
    for (k, v) in [
        ("num_experts", json!(4)),
        ("num_experts_per_tok", json!(2)),
        ("moe_intermediate_size", inter.clone()),
        ("shared_expert_intermediate_size", inter),
        ("norm_topk_prob", json!(true)),
        ("decoder_sparse_step", json!(1)),
        ("mlp_only_layers", json!([])),
    ] {
        config[k] = v;
    }
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &config, &out);
    let (want, _) = run(&src, &src);
    let (got, _) = run(tmp.path(), &src);
    assert_same("qwen3_next (MoE)", &got, &want);
}

/// A `torch.save` archive of a state dict, written by statecut's own writer.
fn save_pth(path: &Path, tensors: &Tensors) -> Result<()> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let raws = names
        .into_iter()
        .map(|n| Ok((n.clone(), statecut::surgery::raw_of(&tensors[n].to_dtype(DType::BF16)?)?)))
        .collect::<Result<Vec<_>>>()?;
    statecut::torch_save::write_pth(path, &raws)
}

/// The shared transformers Mamba-2 model rewritten in mamba_ssm's format (config.json with
/// `d_model` / `ssm_cfg`, `backbone.embedding.`, pytorch_model.bin) in `dir`; returns the original
/// config.
fn write_mamba_ssm(src: &Path, dir: &Path) -> Value {
    let (hf, tensors) = read(src);
    let mut out: Tensors =
        tensors.iter().map(|(k, v)| (k.replace("backbone.embeddings.", "backbone.embedding."), v.clone())).collect();
    // mamba_ssm saves the tied head too
    out.insert("lm_head.weight".into(), tensors["backbone.embeddings.weight"].clone());
    let c = |k: &str| hf[k].clone();
    let config = json!({
        "d_model": c("hidden_size"),
        "d_intermediate": 0,
        "n_layer": c("num_hidden_layers"),
        "vocab_size": c("vocab_size"),
        "ssm_cfg": {"layer": "Mamba2", "d_state": c("state_size"), "headdim": c("head_dim"),
                    "ngroups": c("n_groups"), "expand": c("expand"), "d_conv": c("conv_kernel")},
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": true,
        "residual_in_fp32": true,
        "fused_add_norm": true,
        "pad_vocab_size_multiple": 16,
        "tie_embeddings": true,
    });
    write_config(dir, &config);
    save_pth(&dir.join("pytorch_model.bin"), &out).unwrap();
    hf
}

#[test]
fn mamba2_mamba_ssm_layout() {
    let Some(src) = source("mamba2") else { return };
    let tmp = tempfile::tempdir().unwrap();
    write_mamba_ssm(&src, tmp.path());
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ckpt.model_type().unwrap(), "mamba2");
    assert_eq!(ckpt.format, statecut::checkpoint::WeightFormat::PytorchBin);
    let (want, wl) = run(&src, &src);
    let (got, gl) = run(tmp.path(), &src);
    assert_same("mamba2 (mamba_ssm)", &got, &want);
    let slices = |l: &StateLayout| -> Vec<(String, usize, usize)> {
        l.layers.iter().flat_map(|s| s.slices.iter().map(|r| (r.tensor.clone(), r.offset, r.head_stride))).collect()
    };
    assert_eq!(slices(&gl), slices(&wl));
    assert_eq!(gl.dk, wl.dk);

    // Pruning keeps the mamba_ssm format: pytorch_model.bin, `ssm_cfg.d_state` edited. (The output
    // goes outside the input model's directory, which statecut refuses to write into.)
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("pruned");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"))
        .args(["prune", "-m", tmp.path().to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "-o"])
        .arg(&out)
        .arg("-q")
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    assert!(out.join("pytorch_model.bin").exists() && !out.join("model.safetensors").exists());
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["ssm_cfg"]["d_state"], json!(wl.dk / 2));
    let pruned = Checkpoint::open(&out).unwrap();
    let layout = statecut::arch::family_for(&pruned).unwrap().layout(&pruned).unwrap();
    assert_eq!(layout.dk, wl.dk / 2);
    let orig = candle_core::pickle::read_all(tmp.path().join("pytorch_model.bin")).unwrap();
    let new: std::collections::HashMap<String, Tensor> =
        candle_core::pickle::read_all(out.join("pytorch_model.bin")).unwrap().into_iter().collect();
    let sliced: std::collections::HashSet<String> =
        gl.layers.iter().flat_map(|l| l.slices.iter().map(|s| s.tensor.clone())).collect();
    for (name, t) in orig {
        let n = &new[&name];
        if sliced.contains(&name) {
            assert!(n.dim(0).unwrap() < t.dim(0).unwrap(), "{name} was not sliced");
        } else {
            let d = (t.to_dtype(DType::F32).unwrap() - n.to_dtype(DType::F32).unwrap()).unwrap();
            assert_eq!(d.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{name} changed");
            assert_eq!(t.dtype(), n.dtype(), "{name} dtype changed");
        }
    }
    // And it still runs.
    let model =
        statecut::arch::family_for(&pruned).unwrap().load(&pruned, &statecut::arch::LoadOptions::cpu_f32()).unwrap();
    let ids = Tensor::new(&[[1u32, 5, 9, 2]], &Device::Cpu).unwrap();
    model.forward(&ids, &mut statecut::arch::NoObserver).unwrap();
}

/// mamba_ssm's `d_model` is the hidden size: `calibrate` records it in the activations file,
/// which checks the stored rows against it on load (0 skipped that check).
#[test]
fn mamba_ssm_hidden_size() {
    let Some(src) = source("mamba2") else { return };
    let tmp = tempfile::tempdir().unwrap();
    // The activations go beside the model: statecut refuses to write inside its input.
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    let hf = write_mamba_ssm(&src, &dir);
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
    let hidden = hf["hidden_size"].as_u64().unwrap() as usize;
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.hidden_size().unwrap(), hidden);

    let acts = tmp.path().join("acts.safetensors");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"))
        .args(["calibrate", "-m", dir.to_str().unwrap(), "--nsamples", "2", "--seqlen", "32", "-q", "-o"])
        .arg(&acts)
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let layout = family_for(&ckpt).unwrap().layout(&ckpt).unwrap();
    let (cal, _) = statecut::calib::Calibration::load(&acts, &layout).unwrap();
    assert_eq!(cal.fingerprint.hidden, hidden);
}
