//! Property test: whatever a user types or feeds it, statecut never panics. Random argument
//! vectors and corrupted inputs (config.json, safetensors headers, shard indexes, activations
//! files) go to every subcommand; each run must end with exit status 1 and exactly one `error:`
//! line on stderr (or, for a corruption that leaves the input usable, succeed), with no output or
//! staging directory left behind and the inputs untouched.
//!
//! Runs on the committed fixtures alone; with the reference data (`STATECUT_TEST_DATA`) its
//! models join the pool. `PROPTEST_CASES` sets the number of cases per property.

mod common;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

const SUBCOMMANDS: [&str; 5] = ["eval", "inspect", "calibrate", "prune", "bench"];

/// A model to copy into each case's directory, with the tokenizer to pass when it has none.
#[derive(Debug, Clone)]
struct Model {
    dir: PathBuf,
    tokenizer: Option<PathBuf>,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn models() -> Vec<Model> {
    let gla_tok = fixture("sse_gla").join("tokenizer.json");
    let mut out = vec![
        Model { dir: fixture("sse_gla"), tokenizer: None },
        // sse_gdn has short convs (the conv kernel size matters) and a 256-token vocabulary: the
        // borrowed tokenizer's ids run past it, which must be an error too.
        Model { dir: fixture("sse_gdn"), tokenizer: Some(gla_tok.clone()) },
        Model { dir: fixture("sse_h"), tokenizer: Some(gla_tok) },
    ];
    if let Ok(p) = std::env::var("STATECUT_TEST_DATA") {
        for name in ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"] {
            let dir = Path::new(&p).join("models").join(name);
            if dir.join("config.json").is_file() {
                out.push(Model { dir, tokenizer: None });
            }
        }
    }
    out
}

/// Arguments that succeed quickly on the fixtures, per subcommand (`OUT` is the case's output
/// directory). Faults are applied on top of them.
fn base_args(cmd: &str) -> Vec<&'static str> {
    match cmd {
        "eval" => vec!["--seqlen", "8", "--windows", "2"],
        "inspect" => vec!["--nsamples", "1", "--seqlen", "8", "--rows", "16"],
        "calibrate" => vec!["--nsamples", "1", "--seqlen", "8", "--rows", "16", "-o", "OUT/acts.safetensors"],
        "prune" => vec!["--method", "l1", "--ratio", "0.5", "-o", "OUT/pruned"],
        "bench" => {
            vec!["--prompt-len", "4", "--decode-steps", "1", "--batch-sizes", "1", "--iterations", "1", "--warmup", "0"]
        }
        _ => unreachable!(),
    }
}

/// The numeric and enumerated flags of a subcommand with values that must be rejected.
fn bad_values(cmd: &str) -> Vec<(&'static str, Vec<&'static str>)> {
    let whole = vec!["0", "-1", "", "abc", "1.5", "1e3", "0x10", "99999999999999999999", "16777217", " ", "٣"];
    let two = {
        let mut v = whole.clone();
        v.push("1");
        v
    };
    let warmup = vec!["-1", "", "abc", "1.5", "1048577"];
    let ratio = vec!["0", "1", "1.5", "-0.5", "nan", "inf", "abc", "", "1e-400"];
    let rrqr_f = vec!["1", "0.5", "nan", "inf", "-2", "abc", ""];
    let dtype = vec!["f8", "int8", "", "F 32", "auto,f32"];
    let device = vec!["tpu", "cuda:x", "cuda:-1", "gpu", "", "cuda:", "cpu:0", "metal"];
    let seed = vec!["-1", "abc", "", "1.5", "99999999999999999999"];
    let model = vec![("--dtype", dtype), ("--device", device)];
    let calib = vec![
        ("--nsamples", whole.clone()),
        ("--seqlen", two.clone()),
        ("--rows", two.clone()),
        ("--batch-size", whole.clone()),
        ("--seed", seed.clone()),
    ];
    let mut v = match cmd {
        "eval" => vec![("--seqlen", whole.clone()), ("--windows", whole.clone()), ("--batch-size", whole.clone())],
        "inspect" => vec![
            ("--nsamples", whole.clone()),
            ("--seqlen", two.clone()),
            ("--rows", two.clone()),
            ("--seed", seed.clone()),
        ],
        "calibrate" => {
            let mut c = calib.clone();
            c.push(("--save-every", whole.clone()));
            c
        }
        "prune" => {
            let mut c = calib.clone();
            c.extend([
                ("--method", vec!["magic", "", "L 1", "l1,rand"]),
                ("--ratio", ratio),
                ("--round-to", whole.clone()),
                ("--rrqr-f", rrqr_f),
                ("--score-on", vec!["kk", "", "qkv"]),
                ("--eval-windows", whole.clone()),
                ("--eval-seqlen", whole.clone()),
                ("--prune-partitions", whole.clone()),
            ]);
            c
        }
        "bench" => vec![
            ("--prompt-len", whole.clone()),
            ("--decode-steps", whole.clone()),
            ("--batch-sizes", vec!["0", "1,0", "", ",", "1,,2", "a,b", "-1", "1;2", "1048577"]),
            ("--iterations", whole.clone()),
            ("--warmup", warmup),
        ],
        _ => unreachable!(),
    };
    v.extend(model);
    v
}

/// Flags and tokens that are never valid.
const GARBAGE: &[&str] = &[
    "--frobnicate",
    "-Z",
    "--seqlen=",
    "positional",
    "--quiet=yes",
    "--model",
    "--json=1",
    "-",
    "--\u{1}x",
    "--ratio",
];

/// A corruption of one input, and whether it must make the run fail (some leave it usable).
#[derive(Debug, Clone)]
enum Fault {
    /// `--flag value` with a value outside the flag's range.
    BadValue(String, String),
    /// A garbage flag or token at position `at` of the arguments.
    Garbage(usize, String),
    /// `key` of config.json (top level, or under text_config) set to `value`, or removed (None).
    ConfigKey(String, Option<Value>),
    /// config.json replaced by these bytes.
    ConfigBytes(Vec<u8>),
    /// model.safetensors cut to this fraction (per mille) of its length.
    Truncate(u16),
    /// One byte of the safetensors header (index per mille of the header) xor'ed with a mask.
    HeaderByte(u16, u8),
    /// The 8-byte header length replaced.
    HeaderLen(u64),
    /// One tensor's shape changed to another of the same size, or to an impossible one.
    Reshape(u16, bool),
    /// The weights split into a shard with an index, and the index corrupted.
    Index(u8),
    /// A valid activations file corrupted (`prune --activations`, or `calibrate --resume`).
    Activations(u8, u16),
    /// A broken or too short text file as `--data` / `--calib`.
    TextFile(u8),
}

impl Fault {
    fn must_fail(&self, cmd: &str) -> bool {
        match self {
            Fault::BadValue(..) | Fault::Garbage(..) | Fault::Truncate(_) | Fault::HeaderLen(_) => true,
            Fault::ConfigBytes(_) | Fault::Index(_) | Fault::TextFile(_) => true,
            Fault::Reshape(_, impossible) => *impossible,
            Fault::ConfigKey(key, v) => config_fault_must_fail(key, v.as_ref()),
            // Flipped bytes may land in a name or metadata that nothing reads.
            Fault::HeaderByte(..) => false,
            // A resumed run ignores `complete` and redoes what a flipped data byte spoiled.
            Fault::Activations(1, _) | Fault::Activations(6, _) if cmd == "calibrate" => false,
            Fault::Activations(kind, _) => *kind != 6,
        }
    }
}

/// Keys of the SSE fixtures' configs that size stored tensors: zero, negative or non-numbers can
/// never match them. (Other families read other keys; for them a changed key need not fail.)
const SIZE_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_heads",
    "head_dim",
    "intermediate_size",
    "num_sparse_partition",
    "num_writer",
];

/// Keys every family requires.
const REQUIRED: &[&str] = &["model_type", "hidden_size", "num_hidden_layers", "vocab_size"];

fn config_fault_must_fail(key: &str, v: Option<&Value>) -> bool {
    match v {
        None => REQUIRED.contains(&key),
        Some(v) if key == "model_type" => v.as_str().is_none_or(|s| !s.starts_with("sse")),
        Some(v) if SIZE_KEYS.contains(&key) => match v.as_f64() {
            Some(x) => x <= 0.0 || x.fract() != 0.0 || x > 1e12,
            // `null` is fla's "derive it" for some keys (intermediate_size).
            None => !v.is_null() || REQUIRED.contains(&key),
        },
        _ => false,
    }
}

const CONFIG_KEYS: &[&str] = &[
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_heads",
    "head_dim",
    "expand_k",
    "expand_v",
    "num_v_heads",
    "intermediate_size",
    "hidden_ratio",
    "use_short_conv",
    "conv_size",
    "conv_kernel",
    "num_sparse_partition",
    "num_writer",
    "num_reader",
    "linear_attn_type",
    "sse_implementation",
    "attn",
    "eos_token_id",
    "tie_word_embeddings",
    "norm_eps",
    "state_size",
    "n_groups",
    "expand",
    "time_step_limit",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_conv_kernel_dim",
    "layer_types",
    "full_attention_interval",
    "num_attention_heads",
    "num_key_value_heads",
];

fn config_value() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        Just(Some(Value::from(0))),
        Just(Some(Value::from(-1))),
        Just(Some(Value::from(1))),
        Just(Some(Value::from(3))),
        Just(Some(Value::from(u64::MAX))),
        Just(Some(Value::from(1u64 << 40))),
        Just(Some(Value::from(0.5))),
        Just(Some(Value::from(1e300))),
        Just(Some(Value::from("str"))),
        Just(Some(Value::Null)),
        Just(Some(Value::Bool(true))),
        Just(Some(serde_json::json!([]))),
        Just(Some(serde_json::json!([0, 1]))),
        Just(Some(serde_json::json!({}))),
        Just(Some(serde_json::json!({"layers": [0], "num_heads": 0}))),
        (0u64..600).prop_map(|n| Some(Value::from(n))),
    ]
}

fn fault(cmd: &'static str) -> impl Strategy<Value = Fault> {
    let bad: Vec<(String, String)> = bad_values(cmd)
        .into_iter()
        .flat_map(|(f, vs)| vs.into_iter().map(move |v| (f.to_string(), v.to_string())))
        .collect();
    let garbage: Vec<String> = GARBAGE.iter().map(|s| s.to_string()).collect();
    let config_bytes = prop_oneof![
        Just(b"".to_vec()),
        Just(b"{".to_vec()),
        Just(b"[]".to_vec()),
        Just(b"null".to_vec()),
        Just(b"{\"model_type\": 3}".to_vec()),
        Just(vec![0xff, 0xfe, 0x00]),
        proptest::collection::vec(any::<u8>(), 0..64),
    ];
    prop_oneof![
        3 => proptest::sample::select(bad).prop_map(|(f, v)| Fault::BadValue(f, v)),
        1 => (0usize..12, proptest::sample::select(garbage)).prop_map(|(at, g)| Fault::Garbage(at, g)),
        4 => (proptest::sample::select(CONFIG_KEYS), config_value()).prop_map(|(k, v)| Fault::ConfigKey(k.to_string(), v)),
        1 => config_bytes.prop_map(Fault::ConfigBytes),
        1 => (0u16..1000).prop_map(Fault::Truncate),
        1 => (0u16..1000, 1u8..=255).prop_map(|(i, m)| Fault::HeaderByte(i, m)),
        1 => prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(1 << 40), 2u64..4096].prop_map(Fault::HeaderLen),
        2 => (0u16..1000, any::<bool>()).prop_map(|(i, b)| Fault::Reshape(i, b)),
        1 => (0u8..7).prop_map(Fault::Index),
        2 => (0u8..8, 0u16..1000).prop_map(|(k, i)| Fault::Activations(k, i)),
        1 => (0u8..6).prop_map(Fault::TextFile),
    ]
}

/// Everything in a directory tree: relative path → bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn read_config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn write_config(dir: &Path, v: &Value) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// The safetensors header of a file: (header JSON, data bytes).
fn split_safetensors(bytes: &[u8]) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join_safetensors(header: &serde_json::Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let mut h = serde_json::to_vec(header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

/// Tensor names of a header sorted, without the metadata entry.
fn tensor_names(header: &serde_json::Map<String, Value>) -> Vec<String> {
    header.keys().filter(|k| *k != "__metadata__").cloned().collect()
}

/// Apply a corruption to the case directory's copy of the model (and the arguments); returns
/// false when it changed nothing that the model's family reads.
fn apply(fault: &Fault, model: &Path, acts: &Path, cmd: &str, args: &mut Vec<String>) -> bool {
    let weights = model.join("model.safetensors");
    match fault {
        Fault::BadValue(flag, value) => {
            args.push(flag.clone());
            args.push(value.clone());
        }
        Fault::Garbage(at, g) => {
            let at = (*at).min(args.len());
            args.insert(at, g.clone());
        }
        Fault::ConfigKey(key, value) => {
            let mut cfg = read_config(model);
            let target = match cfg.get_mut("text_config") {
                Some(t) if t.get(key.as_str()).is_some() => t,
                _ => &mut cfg,
            };
            let obj = target.as_object_mut().unwrap();
            if !obj.contains_key(key.as_str()) {
                return false;
            }
            match value {
                Some(v) => {
                    obj.insert(key.clone(), v.clone());
                }
                None => {
                    obj.remove(key.as_str());
                }
            }
            write_config(model, &cfg);
        }
        Fault::ConfigBytes(b) => std::fs::write(model.join("config.json"), b).unwrap(),
        Fault::Truncate(pm) => {
            let bytes = std::fs::read(&weights).unwrap();
            let keep = bytes.len() * *pm as usize / 1000;
            std::fs::write(&weights, &bytes[..keep.min(bytes.len() - 1)]).unwrap();
        }
        Fault::HeaderByte(pm, mask) => {
            let mut bytes = std::fs::read(&weights).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            bytes[8 + n * *pm as usize / 1000] ^= mask;
            std::fs::write(&weights, bytes).unwrap();
        }
        Fault::HeaderLen(n) => {
            let mut bytes = std::fs::read(&weights).unwrap();
            let n = if bytes[..8] == n.to_le_bytes() { n + 1 } else { *n };
            bytes[..8].copy_from_slice(&n.to_le_bytes());
            std::fs::write(&weights, bytes).unwrap();
        }
        Fault::Reshape(pm, impossible) => {
            let (mut header, data) = split_safetensors(&std::fs::read(&weights).unwrap());
            let names = tensor_names(&header);
            let name = &names[names.len() * *pm as usize / 1000];
            let info = header.get_mut(name).unwrap();
            let shape: Vec<u64> = serde_json::from_value(info["shape"].clone()).unwrap();
            let elems: u64 = shape.iter().product();
            let new: Vec<u64> = if *impossible {
                // Claims more elements than its bytes hold.
                shape.iter().map(|d| d + 1).collect()
            } else if shape.len() >= 2 && shape[0].is_multiple_of(2) {
                // Same bytes, another shape: the config and the weights disagree.
                let mut s = shape.clone();
                s[0] /= 2;
                s[1] *= 2;
                s
            } else {
                vec![elems]
            };
            info["shape"] = serde_json::json!(new);
            std::fs::write(&weights, join_safetensors(&header, &data)).unwrap();
        }
        Fault::Index(kind) => {
            let shard = "model-00001-of-00001.safetensors";
            std::fs::rename(&weights, model.join(shard)).unwrap();
            let (header, _) = split_safetensors(&std::fs::read(model.join(shard)).unwrap());
            let map: serde_json::Map<String, Value> =
                tensor_names(&header).into_iter().map(|n| (n, Value::from(shard))).collect();
            let index = match kind {
                0 => "{not json".to_string(),
                1 => serde_json::json!({"metadata": {}}).to_string(),
                2 => serde_json::json!({"weight_map": {"a": 3}}).to_string(),
                3 => serde_json::json!({"weight_map": {"a": "model-00002-of-00002.safetensors"}}).to_string(),
                4 => serde_json::json!({"weight_map": {}}).to_string(),
                5 => serde_json::json!({"weight_map": {"a": "../../../../../../etc/passwd"}}).to_string(),
                _ => serde_json::json!({"weight_map": map, "extra": [1]}).to_string().replace(shard, "/dev/null"),
            };
            std::fs::write(model.join("model.safetensors.index.json"), index).unwrap();
        }
        Fault::TextFile(kind) => {
            let (name, bytes): (&str, &[u8]) = match kind {
                0 => ("text.jsonl", b"{\"text\": \"fine\"}\n{not json\n"),
                1 => ("text.jsonl", b"{\"other\": \"no text field\"}\n"),
                2 => ("text.parquet", b"PAR1 not really parquet"),
                3 => ("text.txt", b"\xff\xfe invalid utf-8 \xc3\x28"),
                4 => ("text.txt", b""),
                _ => ("text.txt", b"too short"),
            };
            let path = acts.with_file_name(name);
            std::fs::write(&path, bytes).unwrap();
            let flag = match cmd {
                "eval" | "inspect" => "--data",
                "calibrate" | "prune" => "--calib",
                _ => "--data",
            };
            args.extend([flag.to_string(), path.to_string_lossy().into_owned()]);
        }
        Fault::Activations(kind, pm) => {
            let mut bytes = std::fs::read(acts).unwrap();
            let (mut header, data) = split_safetensors(&bytes);
            match kind {
                0 => bytes.truncate(bytes.len() * *pm as usize / 1000),
                1 => {
                    // Keys whose value is parsed (free text such as `text_column` may be anything),
                    // sorted: the file's metadata order is not fixed.
                    let meta = header["__metadata__"].as_object_mut().unwrap();
                    let free = ["text_column", "statecut_version"];
                    let mut keys: Vec<String> = meta.keys().filter(|k| !free.contains(&k.as_str())).cloned().collect();
                    keys.sort();
                    let k = &keys[keys.len() * *pm as usize / 1000];
                    meta.insert(k.clone(), Value::from("{garbage"));
                    bytes = join_safetensors(&header, &data);
                }
                2 => {
                    // Files written before `text_column` and `statecut_version` existed still load.
                    let meta = header["__metadata__"].as_object_mut().unwrap();
                    let optional = ["complete", "text_column", "statecut_version"];
                    let keys: Vec<String> = meta.keys().filter(|k| !optional.contains(&k.as_str())).cloned().collect();
                    meta.remove(&keys[keys.len() * *pm as usize / 1000]);
                    bytes = join_safetensors(&header, &data);
                }
                3 | 4 => {
                    // A statistic of the wrong shape: same bytes, rows and columns exchanged, or flat.
                    let names = tensor_names(&header);
                    let name =
                        names.iter().filter(|n| n.ends_with("keys") || n.ends_with("queries")).nth(*pm as usize % 2);
                    let info = header.get_mut(name.unwrap()).unwrap();
                    let shape: Vec<u64> = serde_json::from_value(info["shape"].clone()).unwrap();
                    // (A square one stays square: flatten it instead.)
                    let new = if *kind == 3 && shape[0] != shape[1] {
                        vec![shape[1], shape[0]]
                    } else {
                        vec![shape[0] * shape[1]]
                    };
                    info["shape"] = serde_json::json!(new);
                    bytes = join_safetensors(&header, &data);
                }
                5 => {
                    let names = tensor_names(&header);
                    header.remove(&names[names.len() * *pm as usize / 1000]);
                    bytes = join_safetensors(&header, &data);
                }
                6 => {
                    let i = 8 + *pm as usize * (bytes.len() - 8) / 1000;
                    bytes[i] ^= 0x5a;
                }
                _ => bytes = std::fs::read(model.join("config.json")).unwrap(),
            }
            std::fs::write(acts, bytes).unwrap();
            match cmd {
                "calibrate" => {
                    let partial = acts.with_file_name("acts.partial.safetensors");
                    std::fs::rename(acts, &partial).unwrap();
                    // The settings the file was made with, so that resuming gets past comparing them.
                    for (flag, v) in [("--nsamples", "2"), ("--seqlen", "128"), ("--rows", "256")] {
                        let i = args.iter().position(|a| a == flag).unwrap();
                        args[i + 1] = v.into();
                    }
                    args.push("--resume".into());
                }
                _ => {
                    args.push("--activations".into());
                    args.push(acts.to_string_lossy().into_owned());
                    if let Some(i) = args.iter().position(|a| a == "l1") {
                        args[i] = "drrqr".into();
                    }
                }
            }
        }
    }
    true
}

struct Setup {
    models: Vec<Model>,
    /// A valid activations file per model (calibrated once).
    acts: Vec<PathBuf>,
    _tmp: tempfile::TempDir,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let models = models();
    let acts = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let out = tmp.path().join(format!("acts{i}.safetensors"));
            let mut args: Vec<String> = ["calibrate", "-q", "-m", m.dir.to_str().unwrap(), "-o", out.to_str().unwrap()]
                .iter()
                .map(|s| s.to_string())
                .collect();
            args.extend(["--nsamples", "2", "--seqlen", "128", "--rows", "256", "--save-every", "1"].map(String::from));
            if let Some(t) = &m.tokenizer {
                args.extend(["--tokenizer".to_string(), t.to_string_lossy().into_owned()]);
            }
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, _, err) = common::statecut(&argv, &[]);
            // The borrowed tokenizer does not fit sse_gdn: that model gets no valid file.
            if code == 0 {
                out
            } else {
                assert!(err.starts_with("error: "), "{err}");
                PathBuf::new()
            }
        })
        .collect();
    Setup { models, acts, _tmp: tmp }
}

/// One case: copy the model, corrupt, run, check; returns the exit status.
fn run_case(s: &Setup, cmd: &str, model: usize, fault: &Fault) -> Result<i32, TestCaseError> {
    let m = &s.models[model];
    if matches!(fault, Fault::Activations(..)) && s.acts[model].as_os_str().is_empty() {
        return Ok(0);
    }
    let case = tempfile::tempdir().unwrap();
    let dir = case.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(&m.dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap();
        if name != "golden.safetensors" && p.is_file() {
            std::fs::copy(&p, dir.join(name)).unwrap();
        }
    }
    let out = case.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let acts = out.join("acts.safetensors");
    if matches!(fault, Fault::Activations(..)) {
        std::fs::copy(&s.acts[model], &acts).unwrap();
    }
    let mut args: Vec<String> = vec![cmd.into(), "-q".into(), "-m".into(), dir.to_string_lossy().into_owned()];
    if let Some(t) = &m.tokenizer {
        args.extend(["--tokenizer".into(), t.to_string_lossy().into_owned()]);
    }
    let o = out.to_string_lossy().into_owned();
    args.extend(base_args(cmd).into_iter().map(|a| a.replace("OUT", &o)));
    let fixture = m.dir.starts_with(fixture(""));
    let must_fail = apply(fault, &dir, &acts, cmd, &mut args)
        && fault.must_fail(cmd)
        && (fixture || !matches!(fault, Fault::ConfigKey(..)));
    let model_before = snapshot(&dir);
    let out_before = snapshot(&out);

    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _stdout, stderr) = common::statecut(&argv, &[("RUST_BACKTRACE", "0")]);
    let ctx = || format!("statecut {}\nexit {code}\nstderr:\n{stderr}", args.join(" "));
    prop_assert!(!stderr.contains("panicked"), "panic: {}", ctx());
    prop_assert!(code == 0 || code == 1, "exit status must be 0 or 1: {}", ctx());
    prop_assert!(code == 1 || !must_fail, "expected a failure: {}", ctx());
    prop_assert!(snapshot(&dir) == model_before, "the input model was modified: {}", ctx());
    // Nothing beside the outputs: no staging or old directories, no temporary files.
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("statecut-tmp") || n.contains("statecut-old"))
        .collect();
    prop_assert!(leftovers.is_empty(), "left behind {leftovers:?}: {}", ctx());
    if code == 1 {
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        prop_assert!(errors.len() == 1, "expected one error line: {}", ctx());
        prop_assert!(stderr.lines().all(|l| l.starts_with("error:") || l.starts_with("warning:")), "{}", ctx());
        prop_assert!(snapshot(&out) == out_before, "a failed run wrote output: {}", ctx());
    }
    Ok(code)
}

fn runner(default_cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(default_cases);
    // Every case starts a process: shrink briefly, and keep failures in the regressions file.
    TestRunner::new(Config { cases, max_shrink_iters: 32, source_file: Some(file!()), ..Config::default() })
}

/// Every subcommand, every kind of fault, on every model of the pool.
#[test]
fn no_input_makes_statecut_panic() {
    let s = setup();
    for cmd in SUBCOMMANDS {
        let n = s.models.len();
        runner(64)
            .run(&(0..n, fault(cmd)), |(model, f)| run_case(&s, cmd, model, &f).map(|_| ()))
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    }
}

/// The cases the property found first, kept as plain checks: numbers of 0 and configs whose
/// sizes disagree with the weights fail with one line instead of a panic.
#[test]
fn found_panics_stay_fixed() {
    let s = setup();
    let cases: Vec<(&str, Fault)> = vec![
        ("eval", Fault::BadValue("--seqlen".into(), "0".into())),
        ("inspect", Fault::BadValue("--seqlen".into(), "0".into())),
        ("eval", Fault::BadValue("--windows".into(), "0".into())),
        ("inspect", Fault::BadValue("--nsamples".into(), "0".into())),
        ("inspect", Fault::BadValue("--rows".into(), "0".into())),
        ("eval", Fault::BadValue("--batch-size".into(), "0".into())),
        ("calibrate", Fault::BadValue("--batch-size".into(), "0".into())),
        ("prune", Fault::ConfigKey("head_dim".into(), Some(Value::from(128)))),
        ("prune", Fault::ConfigKey("num_heads".into(), Some(Value::from(0)))),
        ("eval", Fault::ConfigKey("num_heads".into(), Some(Value::from(0)))),
        ("prune", Fault::Reshape(0, false)),
    ];
    for (cmd, f) in &cases {
        let code = run_case(&s, cmd, 0, f).unwrap_or_else(|e| panic!("{cmd} {f:?}: {e}"));
        assert_eq!(code, 1, "{cmd} {f:?} should fail");
    }
    // A conv kernel of 0 on the model with short convs.
    let conv0 = Fault::ConfigKey("conv_size".into(), Some(Value::from(0)));
    assert_eq!(run_case(&s, "eval", 1, &conv0).unwrap(), 1);
}

/// Where a case puts its output, relative to the input model `P/model`.
#[derive(Debug, Clone, Copy)]
enum Near {
    /// The model directory itself.
    Equal,
    /// Its parent `P`.
    Parent,
    /// A path inside it.
    Child,
    /// Its weights file.
    Weights,
    /// A symlink (outside the model) to the model directory.
    LinkToModel,
    /// A symlink (outside the model) to the weights file.
    LinkToWeights,
}

const WRITERS: [&str; 4] = ["prune", "calibrate", "sweep", "inspect"];

/// Run `statecut` with `args` for a writing subcommand with its output at `out`.
fn writer_args(cmd: &str, model: &Path, out: &Path, flag: bool) -> Vec<String> {
    let (m, o) = (model.to_string_lossy().into_owned(), out.to_string_lossy().into_owned());
    let mut a: Vec<String> = vec![cmd.into(), "-q".into(), "-m".into(), m];
    let rest: Vec<&str> = match cmd {
        "prune" => vec!["--method", "l1", "--ratio", "0.5", "-o"],
        "calibrate" => vec!["--nsamples", "1", "--seqlen", "16", "--rows", "16", "-o"],
        "sweep" => vec!["--methods", "l1", "--ratios", "0.5", "--nsamples", "1", "--seqlen", "16", "--rows", "16"]
            .into_iter()
            .chain(["--eval-windows", "1", "--eval-seqlen", "16", "--eval", "README.md", "-o"])
            .collect(),
        _ => vec!["--nsamples", "1", "--seqlen", "16", "--rows", "16", "--plot"],
    };
    a.extend(rest.into_iter().map(String::from));
    a.push(o);
    if flag {
        a.push(match cmd {
            "prune" => "--overwrite".into(),
            "calibrate" => "--resume".into(),
            "sweep" => "--write".into(),
            _ => "--json".into(),
        });
    }
    a
}

/// Every writing subcommand, with its output equal to, around or linked to the input model (with
/// and without --overwrite / --resume / --write): refused with one error line, the input and
/// its parent unchanged, no staging left.
#[test]
fn outputs_near_the_input_never_touch_it() {
    let near = prop_oneof![
        Just(Near::Equal),
        Just(Near::Parent),
        Just(Near::Child),
        Just(Near::Weights),
        Just(Near::LinkToModel),
        Just(Near::LinkToWeights),
    ];
    runner(24)
        .run(&(0..WRITERS.len(), near, any::<bool>(), 0..3usize), |(cmd, near, flag, depth)| {
            let cmd = WRITERS[cmd];
            let case = tempfile::tempdir().unwrap();
            let parent = case.path().join("p");
            let model = parent.join("model");
            std::fs::create_dir_all(&model).unwrap();
            for f in ["config.json", "tokenizer.json", "model.safetensors"] {
                std::fs::copy(fixture("sse_gla").join(f), model.join(f)).unwrap();
            }
            let weights = model.join("model.safetensors");
            let link = case.path().join("link");
            let out = match near {
                Near::Equal => model.clone(),
                Near::Parent => parent.clone(),
                Near::Child => (0..depth).fold(model.join("out"), |p, i| p.join(format!("d{i}"))),
                Near::Weights => weights.clone(),
                Near::LinkToModel => {
                    std::os::unix::fs::symlink(&model, &link).unwrap();
                    (0..depth).fold(link.clone(), |p, i| p.join(format!("d{i}")))
                }
                Near::LinkToWeights => {
                    std::os::unix::fs::symlink(&weights, &link).unwrap();
                    link.clone()
                }
            };
            let before = snapshot(&parent);
            let args = writer_args(cmd, &model, &out, flag);
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, _, stderr) = common::statecut(&argv, &[("RUST_BACKTRACE", "0")]);
            let ctx = || format!("statecut {}\nexit {code}\nstderr:\n{stderr}", args.join(" "));
            prop_assert!(code == 1, "expected a refusal: {}", ctx());
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
            prop_assert!(errors.len() == 1 && stderr.lines().count() == 1, "one error line: {}", ctx());
            prop_assert!(errors[0].contains("the input model"), "{}", ctx());
            prop_assert!(snapshot(&parent) == before, "the input was modified: {}", ctx());
            let left: Vec<PathBuf> =
                snapshot(case.path()).into_keys().filter(|p| p.to_string_lossy().contains("statecut-tmp")).collect();
            prop_assert!(left.is_empty(), "left {left:?}: {}", ctx());
            Ok(())
        })
        .unwrap();
}

/// SIGINT or SIGTERM at a random moment of prune, calibrate and sweep: each run ends with 130 or
/// 143 (or 0, done first; or by the signal itself when it lands before the handler is in place),
/// no staging is left, and running the command again (calibrate with
/// --resume) gives the uninterrupted result.
#[test]
fn signals_leave_no_staging_and_resume_matches() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("sse_gla");
    let whole = tmp.path().join("whole.safetensors");
    let cal = |out: &Path| -> Vec<String> {
        let mut a = writer_args("calibrate", &model, out, false);
        let i = a.iter().position(|x| x == "--nsamples").unwrap();
        a[i + 1] = "64".into();
        a.extend(["--save-every".into(), "1".into()]);
        a
    };
    let strs = |a: &[String]| a.iter().map(String::as_str).collect::<Vec<&str>>().join("\u{1}");
    let (code, _, err) = common::statecut(&cal(&whole).iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert_eq!(code, 0, "{err}");
    let whole = std::fs::read(&whole).unwrap();
    let interrupted = std::cell::Cell::new(0);
    runner(3)
        .run(&(0u64..400, any::<bool>()), |(delay_ms, term)| {
            for cmd in ["prune", "calibrate", "sweep"] {
                let case = tempfile::tempdir().unwrap();
                let out = case.path().join(if cmd == "calibrate" { "acts.safetensors" } else { "out" });
                let args = match cmd {
                    "calibrate" => cal(&out),
                    "prune" => {
                        let mut a = writer_args("prune", &model, &out, false);
                        a[5] = "drrqr".into();
                        a.extend(["--nsamples", "4", "--seqlen", "64"].map(String::from));
                        a
                    }
                    _ => writer_args("sweep", &model, &out, true),
                };
                let child = std::process::Command::new(env!("CARGO_BIN_EXE_statecut"))
                    .args(&args)
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                std::thread::sleep(std::time::Duration::from_millis(delay_ms));
                let sig = if term { libc::SIGTERM } else { libc::SIGINT };
                // SAFETY: a signal to a child this test started.
                unsafe { libc::kill(child.id() as libc::pid_t, sig) };
                let done = child.wait_with_output().unwrap();
                let code = done.status.code();
                let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
                let ctx = || format!("{} after {delay_ms} ms, exit {code:?}:\n{stderr}", strs(&args));
                // A signal that lands before the process has installed its handler (right after
                // the spawn) ends it by the signal's default action, before it has opened a file:
                // the checks below still hold for it.
                let early = code.is_none() && done.status.signal() == Some(sig) && delay_ms < 50;
                prop_assert!(code == Some(0) || code == Some(128 + sig) || early, "{}", ctx());
                interrupted.set(interrupted.get() + usize::from(code != Some(0)));
                let left: Vec<PathBuf> = snapshot(case.path())
                    .into_keys()
                    .chain(std::fs::read_dir(case.path()).unwrap().map(|e| e.unwrap().path()))
                    .filter(|p| p.to_string_lossy().contains("statecut-tmp"))
                    .collect();
                prop_assert!(left.is_empty(), "left {left:?}: {}", ctx());
                // (A signal during calibrate's final save lets the save finish.)
                if cmd == "calibrate" && out.exists() {
                    prop_assert!(std::fs::read(&out).unwrap() == whole, "{}", ctx());
                    continue;
                }
                // Again, to completion.
                let mut again = args.clone();
                match cmd {
                    "calibrate" => again.push("--resume".into()),
                    "prune" => again.push("--overwrite".into()),
                    _ => {}
                }
                let (c, _, e) = common::statecut(&again.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
                prop_assert!(c == 0, "the rerun failed: {e}\n{}", ctx());
                if cmd == "calibrate" {
                    prop_assert!(std::fs::read(&out).unwrap() == whole, "the resumed file differs: {}", ctx());
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!("{} of the runs were interrupted", interrupted.get());
    assert!(interrupted.get() > 0, "every run finished before its signal");
}
