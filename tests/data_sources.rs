//! Calibration and evaluation text from every source: jsonl, txt, parquet, and a hub dataset
//! read from the cache offline.

mod common;

use std::path::Path;
use std::sync::Arc;

/// A one-column parquet file (the shape of FineWeb's `text` column) from a jsonl file.
fn write_parquet(jsonl: &Path, out: &Path, limit: usize) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let texts: Vec<ByteArray> = std::fs::read_to_string(jsonl)
        .unwrap()
        .lines()
        .take(limit)
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().into())
        .collect();
    let schema = Arc::new(
        parse_message_type("message schema { REQUIRED BYTE_ARRAY id (UTF8); REQUIRED BYTE_ARRAY text (UTF8); }")
            .unwrap(),
    );
    let mut w = SerializedFileWriter::new(
        std::fs::File::create(out).unwrap(),
        schema,
        Arc::new(WriterProperties::builder().build()),
    )
    .unwrap();
    let mut rg = w.next_row_group().unwrap();
    let ids: Vec<ByteArray> = (0..texts.len()).map(|i| i.to_string().as_str().into()).collect();
    for col in [&ids, &texts] {
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<ByteArrayType>().write_batch(col, None, None).unwrap();
        c.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
}

fn ppl(args: &[&str], envs: &[(&str, &str)]) -> f64 {
    let (code, out, err) = common::statecut(args, envs);
    assert_eq!(code, 0, "{args:?}: {err}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["ppl"].as_f64().unwrap()
}

#[test]
fn every_text_source_gives_the_same_tokens() {
    let (Some(model), Some(shared)) = (common::model_dir("delta_net"), common::shared()) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = shared.join("data/eval/wiki.jsonl");
    // The first 20 documents in each format.
    let small = tmp.path().join("wiki20.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&jsonl).unwrap().lines().take(20).map(String::from).collect();
    std::fs::write(&small, lines.join("\n") + "\n").unwrap();
    let pq = tmp.path().join("wiki20.parquet");
    write_parquet(&jsonl, &pq, 20);
    let m = model.to_str().unwrap();
    let base = ["eval", "-m", m, "--seqlen", "128", "--windows", "4", "--json", "--data"];
    let run = |data: &str, envs: &[(&str, &str)]| {
        let mut a = base.to_vec();
        a.push(data);
        ppl(&a, envs)
    };
    let from_jsonl = run(small.to_str().unwrap(), &[]);
    assert_eq!(run(pq.to_str().unwrap(), &[]), from_jsonl, "parquet and jsonl must read the same text");

    // A hub dataset in the cache, read offline, shard by shard.
    let cache = tmp.path().join("hub");
    let snap = cache.join("datasets--statecut-test--wiki/snapshots/abc");
    std::fs::create_dir_all(snap.join("sample/10BT")).unwrap();
    std::fs::create_dir_all(cache.join("datasets--statecut-test--wiki/refs")).unwrap();
    std::fs::write(cache.join("datasets--statecut-test--wiki/refs/main"), "abc").unwrap();
    std::fs::copy(&pq, snap.join("sample/10BT/000_00000.parquet")).unwrap();
    let hub = run("statecut-test/wiki:sample/10BT", &[("HF_HUB_CACHE", cache.to_str().unwrap())]);
    assert_eq!(hub, from_jsonl, "a cached hub dataset must read the same text");

    // A missing column names the fix.
    let (code, _, err) =
        common::statecut(&["eval", "-m", m, "--data", pq.to_str().unwrap(), "--text-column", "body"], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("no column \"body\"") && err.contains("--text-column"), "{err}");

    // Plain text and the built-in text work too.
    let txt = tmp.path().join("a.txt");
    std::fs::write(&txt, std::fs::read_to_string(shared.join("data/eval/books.jsonl")).unwrap()).unwrap();
    assert!(run(txt.to_str().unwrap(), &[]).is_finite());
    let (code, out, err) = common::statecut(&["eval", "-m", m, "--seqlen", "128", "--windows", "2", "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"ppl\""));
}
