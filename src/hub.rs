//! Resolve `-m/--model` to a local directory: a path on disk, or a hub id read through the
//! Hugging Face cache layout users already have (`models--org--name/{refs,snapshots}`).

use anyhow::{bail, Context, Result};
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Path, PathBuf};

/// Files a model directory may carry besides weights; copied into pruned outputs when present.
pub const SIDE_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "merges.txt",
    "vocab.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
];

const WEIGHT_INDEX: &str = "model.safetensors.index.json";

fn truthy(v: &str) -> bool {
    matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

/// `HF_HUB_OFFLINE` as huggingface_hub reads it.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").map(|v| truthy(&v)).unwrap_or(false)
}

/// The hub cache directory: `HF_HUB_CACHE` > `HF_HOME/hub` > `~/.cache/huggingface/hub`.
pub fn cache_dir() -> PathBuf {
    if let Ok(p) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Ok(p) = std::env::var("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| ".".into());
    PathBuf::from(home).join(".cache").join("huggingface").join("hub")
}

fn looks_like_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty() && !p.starts_with('.') && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// Resolve a model argument to the directory holding its files.
pub fn resolve_model(model: &str, revision: &str) -> Result<PathBuf> {
    let path = Path::new(model);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if path.exists() {
        bail!("--model {model} is a file; pass the directory that holds config.json");
    }
    if !looks_like_hub_id(model) {
        bail!("model directory {model} does not exist (and it is not a hub id of the form org/name)");
    }
    resolve_repo(model, revision, RepoType::Model, &["config.json"])
}

/// Find (or, when online, download) `required` files of a hub repo and return its snapshot dir.
pub fn resolve_repo(id: &str, revision: &str, kind: RepoType, required: &[&str]) -> Result<PathBuf> {
    let dir = cache_dir();
    let repo = Repo::with_revision(id.to_string(), kind, revision.to_string());
    let cache = Cache::new(dir.clone());
    let cached = |file: &str| -> Option<PathBuf> {
        // A revision given as a commit hash has no refs/ entry: look in snapshots/ directly.
        let direct = dir.join(repo.folder_name()).join("snapshots").join(revision).join(file);
        if direct.exists() {
            return Some(direct);
        }
        cache.repo(repo.clone()).get(file)
    };
    if let Some(first) = cached(required[0]) {
        if required.iter().all(|f| cached(f).is_some()) {
            return Ok(snapshot_root(&first, required[0]));
        }
    }
    if offline() {
        bail!(
            "{id}@{revision} is not in the Hugging Face cache at {} and HF_HUB_OFFLINE is set; \
             download it first (`huggingface-cli download {id}`), unset HF_HUB_OFFLINE, or pass a local directory",
            dir.display()
        );
    }
    download(id, revision, kind, required, &dir)
}

/// The snapshot directory holding `file` (a repo-relative path, possibly in sub-folders).
fn snapshot_root(path: &Path, file: &str) -> PathBuf {
    path.ancestors().nth(file.split('/').count()).unwrap_or(path).to_path_buf()
}

fn download(id: &str, revision: &str, kind: RepoType, required: &[&str], dir: &Path) -> Result<PathBuf> {
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_cache_dir(dir.to_path_buf())
        .with_token(std::env::var("HF_TOKEN").ok().or_else(|| Cache::new(dir.to_path_buf()).token()))
        .build()
        .context("building the hub client")?;
    let repo = api.repo(Repo::with_revision(id.to_string(), kind, revision.to_string()));
    let mut snapshot = PathBuf::new();
    for f in required {
        let p = repo
            .get(f)
            .with_context(|| format!("downloading {f} from {id}@{revision} (check the id, network and HF_TOKEN)"))?;
        snapshot = snapshot_root(&p, f);
    }
    if matches!(kind, RepoType::Model) {
        // Weights: the sharded index if there is one, else a single file.
        match repo.get(WEIGHT_INDEX) {
            Ok(index) => {
                for shard in crate::checkpoint::index_shards(&index)? {
                    repo.get(&shard).with_context(|| format!("downloading {shard} from {id}"))?;
                }
            }
            Err(_) => {
                if repo.get("model.safetensors").is_err() {
                    repo.get("pytorch_model.bin")
                        .with_context(|| format!("{id} has neither model.safetensors nor pytorch_model.bin"))?;
                }
            }
        }
        for f in SIDE_FILES {
            let _ = repo.get(f); // optional files
        }
    }
    Ok(snapshot)
}

/// Parquet files of a hub dataset, optionally under a subset folder (`sample/10BT`) and split.
/// Offline, lists what the cache holds.
pub fn dataset_parquet_files(id: &str, revision: &str, subset: Option<&str>, split: &str) -> Result<Vec<String>> {
    let repo = Repo::with_revision(id.to_string(), RepoType::Dataset, revision.to_string());
    let all: Vec<String> = if offline() {
        let root = cache_dir().join(repo.folder_name());
        let hash = std::fs::read_to_string(root.join("refs").join(revision)).unwrap_or_else(|_| revision.to_string());
        let snap = root.join("snapshots").join(hash.trim());
        if !snap.is_dir() {
            bail!(
                "dataset {id} is not in the Hugging Face cache at {} and HF_HUB_OFFLINE is set; download it first or pass a local file",
                cache_dir().display()
            );
        }
        let mut files = Vec::new();
        walk(&snap, &snap, &mut files)?;
        files
    } else {
        let api = hf_hub::api::sync::ApiBuilder::from_env().with_cache_dir(cache_dir()).build()?;
        let info = api.repo(repo).info().with_context(|| format!("listing files of dataset {id}"))?;
        info.siblings.into_iter().map(|s| s.rfilename).collect()
    };
    let mut files: Vec<String> = all
        .into_iter()
        .filter(|f| f.ends_with(".parquet"))
        .filter(|f| subset.is_none_or(|s| f.starts_with(&format!("{}/", s.trim_end_matches('/')))))
        .collect();
    if files.iter().any(|f| f.contains(split)) {
        files.retain(|f| f.contains(split));
    }
    files.sort();
    if files.is_empty() {
        bail!("dataset {id} has no parquet files{}", subset.map(|s| format!(" under {s}/")).unwrap_or_default());
    }
    Ok(files)
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            walk(root, &p, out)?;
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_string_lossy().into_owned());
        }
    }
    Ok(())
}
