//! Text sources (jsonl, txt, parquet, hub datasets, the built-in text) and their tokenization
//! into the token streams that evaluation and calibration consume.

use anyhow::{bail, Context, Result};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Public-domain text (Moby-Dick, chapters 1 onward) so that commands run with no input.
pub const BUILTIN_TEXT: &str = include_str!("../assets/calibration.txt");

/// Where documents come from.
#[derive(Debug, Clone)]
pub enum TextSource {
    Builtin,
    Jsonl {
        path: PathBuf,
        column: String,
    },
    Txt(PathBuf),
    Parquet {
        path: PathBuf,
        column: String,
    },
    /// Parquet shards of a hub dataset, streamed one file at a time.
    HubDataset {
        id: String,
        revision: String,
        subset: Option<String>,
        split: String,
        column: String,
    },
}

impl TextSource {
    /// Interpret a `--data`/`--calib` argument: a file by its extension, a directory of
    /// parquet/jsonl files, `builtin`, or a hub dataset id `org/name`.
    pub fn parse(arg: Option<&str>, column: &str) -> Result<Self> {
        let Some(arg) = arg else { return Ok(Self::Builtin) };
        if arg == "builtin" {
            return Ok(Self::Builtin);
        }
        let p = Path::new(arg);
        if p.is_file() {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
            return Ok(match ext.as_str() {
                "jsonl" | "json" => Self::Jsonl { path: p.into(), column: column.into() },
                "parquet" => Self::Parquet { path: p.into(), column: column.into() },
                "txt" | "text" | "md" => Self::Txt(p.into()),
                _ => bail!("{arg}: unknown text format \"{ext}\"; use .jsonl, .txt or .parquet"),
            });
        }
        if p.exists() {
            bail!("{arg} is not a file; pass a .jsonl, .txt or .parquet file or a hub dataset id");
        }
        let parts: Vec<&str> = arg.split(':').collect();
        let id = parts[0];
        if id.split('/').count() == 2 && !id.starts_with('.') && !id.starts_with('/') {
            return Ok(Self::HubDataset {
                id: id.into(),
                revision: "main".into(),
                subset: parts.get(1).map(|s| s.to_string()),
                split: parts.get(2).unwrap_or(&"train").to_string(),
                column: column.into(),
            });
        }
        bail!("text file {arg} does not exist")
    }

    /// The documents of this source, lazily.
    pub fn documents(&self) -> Result<Box<dyn Iterator<Item = Result<String>>>> {
        Ok(match self {
            Self::Builtin => Box::new(
                BUILTIN_TEXT
                    .split("CHAPTER ")
                    .filter(|s| !s.trim().is_empty())
                    .map(|s| Ok(format!("CHAPTER {s}")))
                    .collect::<Vec<_>>()
                    .into_iter(),
            ),
            Self::Txt(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                Box::new(std::iter::once(Ok(text)))
            }
            Self::Jsonl { path, column } => jsonl_documents(path, column.clone())?,
            Self::Parquet { path, column } => Box::new(parquet_documents(path, column)?.into_iter().map(Ok)),
            Self::HubDataset { id, revision, subset, split, column } => {
                hub_documents(id, revision, subset.as_deref(), split, column.clone())?
            }
        })
    }
}

fn jsonl_documents(path: &Path, column: String) -> Result<Box<dyn Iterator<Item = Result<String>>>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let name = path.display().to_string();
    let lines = std::io::BufReader::new(f).lines().enumerate();
    Ok(Box::new(lines.filter_map(move |(i, line)| {
        let line = match line {
            Ok(l) => l,
            Err(e) => return Some(Err(anyhow::anyhow!("{name}: reading line {}: {e}", i + 1))),
        };
        if line.trim().is_empty() {
            return None;
        }
        let parsed = serde_json::from_str::<serde_json::Value>(&line)
            .with_context(|| format!("{name}:{}: not valid JSON", i + 1))
            .and_then(|v| {
                v.get(&column).and_then(|t| t.as_str()).map(str::to_string).with_context(|| {
                    format!("{name}:{}: no string field \"{column}\" (choose the field with --text-column)", i + 1)
                })
            });
        Some(parsed)
    })))
}

/// All strings of `column` in a parquet file (FineWeb's format).
pub fn parquet_documents(path: &Path, column: &str) -> Result<Vec<String>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader = SerializedFileReader::new(f).with_context(|| format!("{} is not a parquet file", path.display()))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let idx = schema.columns().iter().position(|c| c.name() == column).with_context(|| {
        let names: Vec<String> = schema.columns().iter().map(|c| c.name().to_string()).collect();
        format!(
            "{}: no column \"{column}\" (columns: {}; choose one with --text-column)",
            path.display(),
            names.join(", ")
        )
    })?;
    let projection = parquet::schema::types::Type::group_type_builder("schema")
        .with_fields(vec![schema.root_schema().get_fields()[idx].clone()])
        .build()?;
    let mut out = Vec::new();
    for row in reader.get_row_iter(Some(projection))? {
        let row = row?;
        for (_, field) in row.get_column_iter() {
            if let Field::Str(s) = field {
                out.push(s.clone());
            }
        }
    }
    Ok(out)
}

fn hub_documents(
    id: &str,
    revision: &str,
    subset: Option<&str>,
    split: &str,
    column: String,
) -> Result<Box<dyn Iterator<Item = Result<String>>>> {
    let files = crate::hub::dataset_parquet_files(id, revision, subset, split)?;
    let (id, revision) = (id.to_string(), revision.to_string());
    Ok(Box::new(files.into_iter().flat_map(move |file| {
        let docs = crate::hub::resolve_repo(&id, &revision, hf_hub::RepoType::Dataset, &[file.as_str()])
            .and_then(|dir| parquet_documents(&dir.join(&file), &column));
        match docs {
            Ok(d) => d.into_iter().map(Ok).collect::<Vec<_>>(),
            Err(e) => vec![Err(e)],
        }
    })))
}

/// A tokenizer plus the end-of-document token that joins documents.
pub struct TextTokenizer {
    tok: Tokenizer,
    pub eos: u32,
}

impl TextTokenizer {
    /// Load `tokenizer.json` from a model directory (or an explicit file).
    pub fn load(model_dir: &Path, explicit: Option<&Path>, config: &serde_json::Value) -> Result<Self> {
        let path = explicit.map(Path::to_path_buf).unwrap_or_else(|| model_dir.join("tokenizer.json"));
        if !path.exists() {
            bail!("{} not found; pass a tokenizer with --tokenizer FILE", path.display());
        }
        let tok = Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        // multimodal wrappers (Qwen3.5) keep it in text_config
        let eos = config
            .get("eos_token_id")
            .or_else(|| config.pointer("/text_config/eos_token_id"))
            .and_then(|v| v.as_u64().or_else(|| v.as_array().and_then(|a| a.first()).and_then(|x| x.as_u64())))
            .map(|v| v as u32)
            .or_else(|| ["</s>", "<|endoftext|>", "<|im_end|>"].iter().find_map(|t| tok.token_to_id(t)))
            .context("cannot find the end-of-text token: config.json has no eos_token_id")?;
        Ok(Self { tok, eos })
    }

    /// Token ids of `text` without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec())
    }

    /// Token ids of `text` with the special tokens the tokenizer adds by default (a BOS for
    /// Llama-style tokenizers, nothing for byte-level BPE ones), as transformers encodes by default.
    pub fn encode_special(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tok.encode(text, true).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec())
    }

    /// The text of token ids (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok.decode(ids, true).map_err(|e| anyhow::anyhow!("detokenizing: {e}"))
    }

    /// Documents joined into one stream, each followed by the end-of-text token, stopping once
    /// `limit` tokens are collected.
    pub fn stream(&self, docs: impl Iterator<Item = Result<String>>, limit: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for d in docs {
            out.extend(self.encode(&d?)?);
            out.push(self.eos);
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }
}

/// Evaluation windows: window i = tokens[i·L .. i·L + L + 1]; the model reads the first L and
/// predicts the last L.
pub fn windows(tokens: &[u32], seqlen: usize, max_windows: usize) -> Vec<&[u32]> {
    if seqlen == 0 || tokens.len() < seqlen + 1 {
        return Vec::new();
    }
    let n = ((tokens.len() - 1) / seqlen).min(max_windows);
    (0..n).map(|i| &tokens[i * seqlen..i * seqlen + seqlen + 1]).collect()
}
