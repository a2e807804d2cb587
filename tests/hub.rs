//! Loading by hub id from a Hugging Face cache directory, offline.

mod common;

#[test]
fn loads_from_fake_hub_cache_offline() {
    let Some(src) = common::model_dir("delta_net") else { return };
    let shared = common::shared().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models--statecut-test--tiny-delta");
    let snap = repo.join("snapshots").join("0123456789abcdef0123456789abcdef01234567");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123456789abcdef0123456789abcdef01234567").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), snap.join(f)).unwrap();
    }
    let data = shared.join("data/eval/wiki.jsonl");
    let data = data.to_str().unwrap();
    let args = |m: &str| {
        vec!["eval", "-m", m, "--data", data, "--seqlen", "64", "--windows", "2", "--json"]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let cache = tmp.path().to_str().unwrap();
    let hub_args = args("statecut-test/tiny-delta");
    let (code, out, err) =
        common::statecut(&hub_args.iter().map(String::as_str).collect::<Vec<_>>(), &[("HF_HUB_CACHE", cache)]);
    assert_eq!(code, 0, "{err}");
    let local_args = args(src.to_str().unwrap());
    let (code2, out2, err2) = common::statecut(&local_args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert_eq!(code2, 0, "{err2}");
    let ppl = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["ppl"].as_f64().unwrap();
    assert_eq!(ppl(&out), ppl(&out2), "hub and local loads must give the same perplexity");

    // HF_HOME/hub is the fallback when HF_HUB_CACHE is unset.
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join("hub")).unwrap();
    std::fs::rename(&repo, home.path().join("hub").join("models--statecut-test--tiny-delta")).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"));
    cmd.args(&hub_args).env("HF_HUB_OFFLINE", "1").env_remove("HF_HUB_CACHE").env("HF_HOME", home.path());
    let out3 = cmd.output().unwrap();
    assert!(out3.status.success(), "{}", String::from_utf8_lossy(&out3.stderr));
    assert_eq!(ppl(&String::from_utf8_lossy(&out3.stdout)), ppl(&out));
}

#[test]
fn uncached_id_offline_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, _, err) = common::statecut(
        &["eval", "-m", "statecut-test/not-downloaded"],
        &[("HF_HUB_CACHE", tmp.path().to_str().unwrap())],
    );
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("HF_HUB_OFFLINE") && err.contains("huggingface-cli download"), "{err}");
}
