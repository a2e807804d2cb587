//! Step-by-step decoding (prefill, then one token at a time through the conv and state caches)
//! reproduces the logits of the full forward.

mod common;

use common::flat;

use candle_core::{DType, Tensor};
use statecut::arch::{family_for, DecodeCache, LoadOptions, NoObserver};
use statecut::checkpoint::Checkpoint;

fn check(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    let golden = common::golden(&dir);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let model = family_for(&ckpt).unwrap().load(&ckpt, &LoadOptions::cpu_f32()).unwrap();
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap().narrow(1, 0, 48).unwrap();
    let full = model.forward(&ids, &mut NoObserver).unwrap();
    let mut cache = DecodeCache::default();
    let mut parts = vec![model.forward_cached(&ids.narrow(1, 0, 40).unwrap(), &mut cache).unwrap()];
    for t in 40..48 {
        parts.push(model.forward_cached(&ids.narrow(1, t, 1).unwrap(), &mut cache).unwrap());
    }
    assert_eq!(cache.pos, 48);
    let stepped = Tensor::cat(&parts, 1).unwrap();
    let err = common::rel_err(&flat(&stepped), &flat(&full));
    eprintln!("{name}: decode vs full forward relative error {err:.2e}");
    assert!(err < 1e-5, "{name}: {err}");
}

#[test]
fn delta_net_decode_matches_forward() {
    check("delta_net");
}

#[test]
fn gated_deltanet_decode_matches_forward() {
    check("gated_deltanet");
}

#[test]
fn mamba2_decode_matches_forward() {
    check("mamba2");
}

#[test]
fn qwen3_5_decode_matches_forward() {
    check("qwen3_5");
}

/// `bench --compare` times both models at every batch size (taking turns) and reports each one's
/// own cache size: the DeltaNet and Gated DeltaNet references have different state shapes.
#[test]
fn bench_compares_two_models() {
    let (Some(a), Some(b)) = (common::model_dir("delta_net"), common::model_dir("gated_deltanet")) else { return };
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let args = ["bench", "-m", a, "--compare", b, "--prompt-len", "16", "--batch-sizes", "1,2", "--decode-steps", "2"];
    let (code, out, err) = common::statecut(&[&args[..], &["--iterations", "1", "--json"]].concat(), &[]);
    assert_eq!(code, 0, "{err}");
    let reports: serde_json::Value = serde_json::from_str(&out).unwrap();
    let reports = reports.as_array().unwrap();
    assert_eq!(reports.len(), 2);
    let cache = |r: &serde_json::Value, i: usize| r["rows"][i]["cache_elems"].as_u64().unwrap();
    for r in reports {
        let rows = r["rows"].as_array().unwrap();
        assert_eq!(rows.iter().map(|x| x["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
        for x in rows {
            assert!(x["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
            assert!(x["decode_ms_per_token"].as_f64().unwrap() > 0.0);
            // CUDA graphs are for CUDA devices: the CPU launches its step op by op.
            assert_eq!(x["decode_graph"], false);
        }
        // The recurrent cache grows with the batch.
        assert_eq!(cache(r, 1), 2 * cache(r, 0));
    }
    assert_ne!(cache(&reports[0], 0), cache(&reports[1], 0));
}
