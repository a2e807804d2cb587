//! `statecut eval` on the reference protocol (64 windows of 512 tokens of eval/wiki) lands
//! within 2% of the perplexity the upstream library reported (`reference.json`).

mod common;

fn check(name: &str) {
    let Some(dir) = common::model_dir(name) else { return };
    let shared = common::shared().unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let want = reference["eval_wiki_ppl_bf16_512x64"].as_f64().unwrap();
    let data = shared.join("data/eval/wiki.jsonl");
    let (code, out, err) = common::statecut(
        &["eval", "-m", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--batch-size", "4", "--json"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((r["windows"].as_u64(), r["tokens"].as_u64()), (Some(64), Some(64 * 512)));
    let got = r["ppl"].as_f64().unwrap();
    eprintln!("{name}: ppl {got:.4} vs reference {want:.4}");
    assert!((got - want).abs() / want < 0.02, "{name}: ppl {got} vs reference {want}");
}

#[test]
fn delta_net_reference_ppl() {
    check("delta_net");
}

#[test]
fn gated_deltanet_reference_ppl() {
    check("gated_deltanet");
}

#[test]
fn mamba2_reference_ppl() {
    check("mamba2");
}

#[test]
fn qwen3_5_reference_ppl() {
    check("qwen3_5");
}
