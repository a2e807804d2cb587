//! Checkpoint surgery: slice rows out of the stored key/query tensors and write a new model
//! directory. Untouched tensors are copied byte for byte (no dtype round trip), every shard is
//! written with `{"format": "pt"}` metadata, and the output appears only when complete.

use crate::arch::StateLayout;
use crate::checkpoint::{Checkpoint, WeightFormat};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub use crate::staging::{sibling_tmp, Staged};
pub use crate::torch_save::RawTensor;

/// A CPU candle tensor as raw little-endian bytes in its own dtype.
pub fn raw_of(t: &Tensor) -> Result<RawTensor<'static>> {
    let shape = t.dims().to_vec();
    let flat = t.flatten_all()?;
    let (dtype, data) = match t.dtype() {
        DType::F32 => (safetensors::Dtype::F32, flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        DType::F64 => (safetensors::Dtype::F64, flat.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        DType::BF16 => {
            (safetensors::Dtype::BF16, flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        DType::F16 => {
            (safetensors::Dtype::F16, flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
        DType::I64 => (safetensors::Dtype::I64, flat.to_vec1::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        d => bail!("cannot serialise a {d:?} tensor"),
    };
    Ok(RawTensor { dtype, shape, data: Cow::Owned(data) })
}

/// Write candle tensors to a safetensors file with metadata, via a temporary file + rename.
/// The metadata is written in key order, so that equal inputs give byte-identical files.
pub fn write_tensors_atomic(path: &Path, tensors: &[(String, Tensor)], meta: HashMap<String, String>) -> Result<()> {
    let raws = tensors.iter().map(|(n, t)| Ok((n.clone(), raw_of(t)?))).collect::<Result<Vec<_>>>()?;
    let bytes = sorted_metadata(&safetensors::serialize(raws, Some(meta))?)?;
    crate::staging::write_atomic(path, |tmp| {
        std::fs::write(tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))
    })
}

/// A serialized safetensors file with its `__metadata__` keys sorted (the writer takes them
/// from a hash map, in an order that changes between runs). Tensor offsets are relative to the
/// data, so only the header changes.
fn sorted_metadata(file: &[u8]) -> Result<Vec<u8>> {
    let n = u64::from_le_bytes(file[..8].try_into()?) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&file[8..8 + n])?;
    if let Some(serde_json::Value::Object(meta)) = header.shift_remove("__metadata__") {
        let sorted: BTreeMap<String, serde_json::Value> = meta.into_iter().collect();
        let mut out = serde_json::Map::new();
        out.insert("__metadata__".into(), serde_json::to_value(sorted)?);
        out.extend(header);
        header = out;
    }
    let mut text = serde_json::to_string(&header)?.into_bytes();
    // The data must start 8-byte aligned: pad the header with spaces, as the writer does.
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + file.len() - 8 - n);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&file[8 + n..]);
    Ok(out)
}

/// The kept key/query channels: layer → key head → sorted channel indices.
pub type KeepSets = BTreeMap<usize, Vec<Vec<usize>>>;

/// Rows of every sliced tensor to keep, by tensor name.
pub fn kept_rows(ckpt: &Checkpoint, layout: &StateLayout, keep: &KeepSets) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for l in &layout.layers {
        let sets = keep.get(&l.layer).with_context(|| format!("no kept channels for layer {}", l.layer))?;
        // Group the slices by tensor: one tensor can hold several slices (q and k of in_proj_qkv).
        let mut by_tensor: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
        for s in &l.slices {
            let dropped = by_tensor.entry(&s.tensor).or_default();
            for (h, kept) in sets.iter().enumerate() {
                let kept: BTreeSet<usize> = kept.iter().copied().collect();
                for j in (0..layout.dk).filter(|j| !kept.contains(j)) {
                    dropped.insert(s.offset + h * s.head_stride + j);
                }
            }
        }
        for (t, dropped) in by_tensor {
            let rows = ckpt.info(t)?.shape[0];
            if let Some(bad) = dropped.iter().find(|r| **r >= rows) {
                bail!("{t}: row {bad} out of range ({rows} rows): the layout does not match the checkpoint");
            }
            out.insert(t.to_string(), (0..rows).filter(|r| !dropped.contains(r)).collect());
        }
    }
    Ok(out)
}

/// Weight files and their indexes, in any format a model directory may hold.
fn is_weights_file(name: &str) -> bool {
    const EXT: [&str; 9] = [".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"];
    name.ends_with(".index.json") || EXT.iter().any(|e| name.ends_with(e))
}

/// What the writer did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WriteStats {
    pub tensors: usize,
    pub sliced: usize,
    pub bytes: u64,
    pub params: usize,
}

/// Keep rows `keep` (dim 0) of a raw tensor.
fn slice_rows<'a>(t: RawTensor<'a>, keep: &[usize]) -> RawTensor<'a> {
    let row_bytes = t.data.len() / t.shape[0];
    let mut buf = Vec::with_capacity(keep.len() * row_bytes);
    for r in keep {
        buf.extend_from_slice(&t.data[r * row_bytes..(r + 1) * row_bytes]);
    }
    let mut shape = t.shape;
    shape[0] = keep.len();
    RawTensor { dtype: t.dtype, shape, data: Cow::Owned(buf) }
}

/// A PyTorch checkpoint (mamba_ssm reads only `pytorch_model.bin`) is written back in the same
/// format, tensor order and dtypes.
fn write_pytorch_bin(
    ckpt: &Checkpoint,
    rows: &BTreeMap<String, Vec<usize>>,
    replaced: &BTreeMap<String, RawTensor<'static>>,
    dir: &Path,
    stats: &mut WriteStats,
) -> Result<()> {
    let src = &ckpt.files[0];
    let tensors = candle_core::pickle::read_all(src).with_context(|| format!("reading {}", src.display()))?;
    let mut out = Vec::new();
    for (name, t) in tensors {
        let raw = match replaced.get(&name) {
            Some(r) => RawTensor { dtype: r.dtype, shape: r.shape.clone(), data: Cow::Owned(r.data.to_vec()) },
            None => raw_of(&t)?,
        };
        let raw = stats.pass(raw, rows.get(&name));
        out.push((name, raw));
    }
    crate::torch_save::write_pth(&dir.join(src.file_name().unwrap()), &out)
}

impl WriteStats {
    /// Slice a tensor when it has kept rows, and count it.
    fn pass<'a>(&mut self, raw: RawTensor<'a>, keep: Option<&Vec<usize>>) -> RawTensor<'a> {
        let raw = match keep {
            Some(keep) => slice_rows(raw, keep),
            None => raw,
        };
        self.count(&raw.shape, raw.data.len(), keep.is_some());
        raw
    }

    /// Count a written tensor of `shape` and `bytes`.
    fn count(&mut self, shape: &[usize], bytes: usize, sliced: bool) {
        self.sliced += usize::from(sliced);
        self.tensors += 1;
        self.bytes += bytes as u64;
        self.params += shape.iter().product::<usize>();
    }
}

/// A stored safetensors tensor, optionally with only rows `keep`, read from its file when the
/// writer asks for its bytes. A read that fails is recorded in `failed` (the writer's
/// interface cannot return it) and fails the write.
struct StoredTensor<'a> {
    info: &'a crate::checkpoint::TensorInfo,
    keep: Option<&'a Vec<usize>>,
    shape: Vec<usize>,
    failed: &'a std::sync::Mutex<Option<String>>,
}

impl<'a> StoredTensor<'a> {
    fn new(
        info: &'a crate::checkpoint::TensorInfo,
        keep: Option<&'a Vec<usize>>,
        failed: &'a std::sync::Mutex<Option<String>>,
    ) -> Self {
        let mut shape = info.shape.clone();
        if let (Some(k), Some(rows)) = (keep, shape.first_mut()) {
            *rows = k.len();
        }
        Self { info, keep, shape, failed }
    }
}

impl safetensors::View for StoredTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.info.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let data = match crate::checkpoint::read_bytes(self.info) {
            Ok(d) => d,
            Err(e) => {
                if let Ok(mut f) = self.failed.lock() {
                    f.get_or_insert(e.to_string());
                }
                return Cow::Owned(vec![0; self.data_len()]);
            }
        };
        let raw = RawTensor { dtype: self.info.dtype, shape: self.info.shape.clone(), data: Cow::Owned(data) };
        match self.keep {
            Some(k) => slice_rows(raw, k).data.into_owned().into(),
            None => raw.data.into_owned().into(),
        }
    }
    fn data_len(&self) -> usize {
        let stored = (self.info.bytes.end - self.info.bytes.start) as usize;
        match self.keep {
            Some(k) => stored / self.info.shape[0].max(1) * k.len(),
            None => stored,
        }
    }
}

/// A tensor of an output shard: stored (possibly sliced), or new.
enum Out<'a> {
    Stored(StoredTensor<'a>),
    New(&'a RawTensor<'static>),
}

impl safetensors::View for Out<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self {
            Out::Stored(t) => t.dtype(),
            Out::New(t) => t.dtype,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Out::Stored(t) => t.shape(),
            Out::New(t) => &t.shape,
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            Out::Stored(t) => t.data(),
            Out::New(t) => Cow::Borrowed(&t.data),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            Out::Stored(t) => t.data_len(),
            Out::New(t) => t.data.len(),
        }
    }
}

/// Write the pruned checkpoint into `dir` (which must not exist yet).
pub fn write_checkpoint(
    ckpt: &Checkpoint,
    rows: &BTreeMap<String, Vec<usize>>,
    config: &serde_json::Value,
    dir: &Path,
) -> Result<WriteStats> {
    write_checkpoint_with(ckpt, rows, &BTreeMap::new(), config, dir)
}

/// [`write_checkpoint`] with the tensors of `replaced` written in place of the stored ones
/// (same name, shape and dtype; a recovered model's merged weights).
pub fn write_checkpoint_with(
    ckpt: &Checkpoint,
    rows: &BTreeMap<String, Vec<usize>>,
    replaced: &BTreeMap<String, RawTensor<'static>>,
    config: &serde_json::Value,
    dir: &Path,
) -> Result<WriteStats> {
    for (name, raw) in replaced {
        let info = ckpt.info(name)?;
        if info.shape != raw.shape || info.dtype != raw.dtype || rows.contains_key(name) {
            bail!("internal error: the replacement of {name} does not match the stored tensor");
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut stats = WriteStats { tensors: 0, sliced: 0, bytes: 0, params: 0 };
    let mut weight_map = serde_json::Map::new();
    if ckpt.format == WeightFormat::PytorchBin {
        write_pytorch_bin(ckpt, rows, replaced, dir, &mut stats)?;
    }
    for file in ckpt.files.iter().filter(|_| ckpt.format == WeightFormat::Safetensors) {
        let fname = file.file_name().unwrap().to_string_lossy().into_owned();
        let failed = std::sync::Mutex::new(None);
        let mut out = Vec::new();
        for (name, info) in ckpt.tensors.iter().filter(|(_, t)| &t.file == file) {
            let t = match replaced.get(name) {
                Some(r) => Out::New(r),
                None => Out::Stored(StoredTensor::new(info, rows.get(name), &failed)),
            };
            stats.count(safetensors::View::shape(&t), safetensors::View::data_len(&t), rows.contains_key(name));
            weight_map.insert(name.clone(), serde_json::Value::String(fname.clone()));
            out.push((name.clone(), t));
        }
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let target = dir.join(&fname);
        // Each tensor is read (and sliced) only when the writer reaches it: host memory holds
        // one tensor at a time, not the shard.
        let written = safetensors::serialize_to_file(out, Some(meta), &target);
        if let Some(e) = failed.lock().ok().and_then(|mut f| f.take()) {
            bail!("reading {}: {e}", file.display());
        }
        written.with_context(|| format!("writing {}", target.display()))?;
    }
    if ckpt.sharded {
        let index = serde_json::json!({"metadata": {"total_size": stats.bytes}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)? + "\n")?;
    }
    // Every other file (tokenizer, generation config, chat template, remote code) is carried
    // over; weights this run did not rewrite (a pytorch_model.bin beside the safetensors) are not:
    // they would be the unpruned model.
    let weights: BTreeSet<PathBuf> = ckpt.files.iter().cloned().collect();
    for e in std::fs::read_dir(&ckpt.dir)? {
        let p = e?.path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let skip = weights.contains(&p)
            || is_weights_file(&name)
            || name == "config.json"
            || name.starts_with('.')
            || name.starts_with("statecut_");
        if p.is_file() && !skip {
            let to = dir.join(&name);
            std::fs::copy(&p, &to).with_context(|| format!("copying {}", p.display()))?;
            // The input's mode, writable by its owner: inputs may be read-only (hub cache,
            // shared folders), and outputs belong to the user.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(&p)?.permissions().mode() & 0o777;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode | 0o200))?;
            }
        }
    }
    // The input's own text with only the edited values replaced, where the edit allows.
    let original = std::fs::read_to_string(ckpt.dir.join("config.json")).ok();
    let text = original.and_then(|t| crate::config_text::splice(&t, &ckpt.config, config));
    let text = match text {
        Some(t) => t,
        None => serde_json::to_string_pretty(config)? + "\n",
    };
    std::fs::write(dir.join("config.json"), text)?;
    Ok(stats)
}
