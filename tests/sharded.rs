//! Sharded checkpoints (`model.safetensors.index.json`): loaded like single files, pruned into
//! shards with the same names, `{"format": "pt"}` metadata and a rewritten index; the input is
//! never modified.

mod common;

use candle_core::{DType, Device, Tensor};
use statecut::arch::{family_for, LoadOptions, NoObserver};
use statecut::checkpoint::Checkpoint;
use std::collections::HashMap;
use std::path::Path;

fn logits(dir: &Path) -> Vec<f32> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = Tensor::new(&[[1u32, 100, 200, 300, 2, 7]], &Device::Cpu).unwrap();
    model
        .forward(&ids, &mut NoObserver)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn sharded_load_and_prune() {
    let Some(src) = common::model_dir("gated_deltanet") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    std::fs::create_dir(&dir).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    // Split the tensors over two shards, layers 0-2 in the first.
    let all = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut map = serde_json::Map::new();
    for (name, t) in all {
        let first = ["model.layers.0.", "model.layers.1.", "model.layers.2.", "model.embeddings"]
            .iter()
            .any(|p| name.starts_with(p));
        let file = if first { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(name.clone(), file.into());
        if first {
            a.insert(name, t)
        } else {
            b.insert(name, t)
        };
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.sharded && ckpt.files.len() == 2);
    assert_eq!(logits(&dir), logits(&src), "sharded and single-file loads must agree");

    let before = snapshot(&dir);
    let out = tmp.path().join("out");
    let (code, _, err) = common::statecut(
        &["prune", "-m", dir.to_str().unwrap(), "--method", "l1", "--ratio", "0.5", "-o", out.to_str().unwrap(), "-q"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(snapshot(&dir), before, "the input directory was modified");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut total = 0u64;
    for shard in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        let bytes = std::fs::read(out.join(shard)).unwrap();
        let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        total += (bytes.len() - 8 - n) as u64;
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for name in st.names() {
            assert_eq!(index["weight_map"][name], shard, "{name}");
        }
    }
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    let pruned = Checkpoint::open(&out).unwrap();
    assert_eq!(family_for(&pruned).unwrap().layout(&pruned).unwrap().dk, 32);
    assert_eq!(logits(&out).len(), logits(&src).len());
}
