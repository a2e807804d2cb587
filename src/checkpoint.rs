//! Open a model directory: config.json, weight files (single, sharded, or a PyTorch pickle),
//! validated up front so that a corrupt file fails with one clear line before any work starts.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How the weights are stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    Safetensors,
    /// `pytorch_model.bin` (mamba_ssm checkpoints).
    PytorchBin,
}

/// Shape and dtype of one stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub file: PathBuf,
    /// Byte range of the data in `file` (safetensors; empty for pickles).
    pub bytes: std::ops::Range<u64>,
}

/// A model directory opened for reading.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Value,
    pub format: WeightFormat,
    /// Weight files in order (shards as the index lists them).
    pub files: Vec<PathBuf>,
    /// Every tensor name with its dtype, shape and file.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Whether the weights came with `model.safetensors.index.json`.
    pub sharded: bool,
    /// Rows kept of sliced tensors when this is an in-memory pruned view (`Checkpoint::sliced`).
    pub row_view: Option<std::sync::Arc<BTreeMap<String, Vec<usize>>>>,
}

/// Shard file names listed by a `model.safetensors.index.json`, deduplicated, in first-seen order.
pub fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .with_context(|| format!("{} has no weight_map", index.display()))?;
    let mut out: Vec<String> = Vec::new();
    for f in map.values() {
        let f = f.as_str().context("weight_map values must be file names")?;
        // Shards live beside the index: a path would read files outside the model directory.
        if f.is_empty() || f.contains(['/', '\\']) || f == ".." {
            bail!("{} lists shard \"{f}\", which is not a file name in the model directory", index.display());
        }
        if !out.iter().any(|x| x == f) {
            out.push(f.to_string());
        }
    }
    Ok(out)
}

/// Read and check a safetensors header without loading the data.
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorInfo)>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    let corrupt = |why: String| {
        anyhow::anyhow!("{} is not a valid safetensors file ({why}); re-download or re-export it", path.display())
    };
    if len < 8 {
        return Err(corrupt(format!("{len} bytes, too short for a header")));
    }
    let mut n = [0u8; 8];
    f.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n);
    if n > len - 8 || n > 100 << 20 {
        return Err(corrupt(format!("header of {n} bytes but the file has {len}: truncated")));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf)?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&buf).map_err(|e| corrupt(format!("header is not valid JSON: {e}")))?;
    let data_len = len - 8 - n;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let (start, end) = info.data_offsets;
        if end as u64 > data_len {
            return Err(corrupt(format!(
                "tensor {name} ends at byte {end} of a {data_len}-byte data section: truncated"
            )));
        }
        let at = 8 + n;
        let bytes = at + start as u64..at + end as u64;
        out.push((name, TensorInfo { dtype: info.dtype, shape: info.shape.clone(), file: path.to_path_buf(), bytes }));
    }
    Ok(out)
}

impl Checkpoint {
    /// Open `dir`, parse config.json and check every weight file's header.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("model directory {} does not exist", dir.display());
        }
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("{} has no config.json; pass a Hugging Face model directory", dir.display()))?;
        let config = parse_config(&text).with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
        let index = dir.join("model.safetensors.index.json");
        let (files, format, sharded) = if index.exists() {
            let files = index_shards(&index)?.into_iter().map(|f| dir.join(f)).collect::<Vec<_>>();
            for f in &files {
                if !f.exists() {
                    bail!("{} lists {} but it is missing; re-download the checkpoint", index.display(), f.display());
                }
            }
            (files, WeightFormat::Safetensors, true)
        } else if dir.join("model.safetensors").exists() {
            (vec![dir.join("model.safetensors")], WeightFormat::Safetensors, false)
        } else if dir.join("pytorch_model.bin").exists() {
            (vec![dir.join("pytorch_model.bin")], WeightFormat::PytorchBin, false)
        } else {
            bail!("{} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin", dir.display());
        };
        let mut tensors = BTreeMap::new();
        match format {
            WeightFormat::Safetensors => {
                for f in &files {
                    for (name, info) in read_header(f)? {
                        tensors.insert(name, info);
                    }
                }
            }
            WeightFormat::PytorchBin => {
                let f = &files[0];
                let pth = candle_core::pickle::read_pth_tensor_info(f, false, None)
                    .with_context(|| format!("{} is not a readable PyTorch checkpoint", f.display()))?;
                for t in pth {
                    let dtype = match t.dtype {
                        DType::BF16 => safetensors::Dtype::BF16,
                        DType::F16 => safetensors::Dtype::F16,
                        DType::F32 => safetensors::Dtype::F32,
                        DType::F64 => safetensors::Dtype::F64,
                        d => bail!("{}: tensor {} has unsupported dtype {d:?}", f.display(), t.name),
                    };
                    let shape = t.layout.shape().dims().to_vec();
                    tensors.insert(t.name, TensorInfo { dtype, shape, file: f.clone(), bytes: 0..0 });
                }
            }
        }
        check_config_numbers(&config, tensors.len()).with_context(|| format!("{}", cfg_path.display()))?;
        Ok(Self { dir: dir.to_path_buf(), config, format, files, tensors, sharded, row_view: None })
    }

    /// A candle VarBuilder over the weights (memory-mapped safetensors, or the pickle).
    pub fn var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        let vb = match self.format {
            // SAFETY: the files are memory-mapped read-only; statecut never writes to its inputs.
            WeightFormat::Safetensors => unsafe { VarBuilder::from_mmaped_safetensors(&self.files, dtype, device)? },
            WeightFormat::PytorchBin => VarBuilder::from_pth(&self.files[0], dtype, device)?,
        };
        Ok(self.slice_rows(vb))
    }

    /// The model width, whichever family wrote the config (see [`hidden_size`]).
    pub fn hidden_size(&self) -> Result<usize> {
        hidden_size(&self.config).with_context(|| format!("{}/config.json", self.dir.display()))
    }

    pub fn model_type(&self) -> Result<String> {
        model_type(&self.config)
    }

    /// A view of the weights that reads each tensor with positioned reads when it is asked for
    /// (nothing mapped, so host memory holds only the tensors in use), for layer-streamed runs.
    /// Pickles are read lazily by candle's own reader.
    pub fn streaming_var_builder(&self, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
        Ok(match self.format {
            WeightFormat::Safetensors => {
                VarBuilder::from_backend(Box::new(PositionedReads(self.tensors.clone())), dtype, device.clone())
            }
            WeightFormat::PytorchBin => self.var_builder(dtype, device)?,
        })
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors.get(name).with_context(|| format!("tensor {name} not found in {}", self.dir.display()))
    }
}

/// The stored bytes of one safetensors tensor, read at its offset.
pub fn read_bytes(info: &TensorInfo) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; (info.bytes.end - info.bytes.start) as usize];
    std::fs::File::open(&info.file)?.read_exact_at(&mut buf, info.bytes.start)?;
    Ok(buf)
}

/// A candle weight backend over safetensors files that reads each tensor when it is asked for.
struct PositionedReads(BTreeMap<String, TensorInfo>);

impl PositionedReads {
    fn load(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<candle_core::Tensor> {
        use safetensors::Dtype as S;
        let info = self.0.get(name).ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() })?;
        let stored = match info.dtype {
            S::BF16 => DType::BF16,
            S::F16 => DType::F16,
            S::F32 => DType::F32,
            S::F64 => DType::F64,
            S::I64 => DType::I64,
            S::I32 => DType::I32,
            S::U32 => DType::U32,
            S::U8 => DType::U8,
            d => return Err(candle_core::Error::Msg(format!("{name}: unsupported dtype {d:?}"))),
        };
        let bytes = read_bytes(info).map_err(|e| candle_core::Error::Msg(format!("reading {name}: {e}")))?;
        candle_core::Tensor::from_raw_buffer(&bytes, stored, &info.shape, dev)?.to_dtype(dtype)
    }
}

impl candle_nn::var_builder::SimpleBackend for PositionedReads {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        let t = self.load(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: s,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<candle_core::Tensor> {
        self.load(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// The largest whole number a config may hold: model sizes are far below it, and products of
/// two or three such sizes cannot overflow.
const MAX_CONFIG_INT: u64 = i32::MAX as u64;

/// Reject config numbers that no model has before any family derives sizes from them: integers
/// beyond [`MAX_CONFIG_INT`] anywhere, and layer counts beyond the stored tensors (each layer
/// stores at least one), which would otherwise size loops and allocations.
fn check_config_numbers(config: &Value, tensors: usize) -> Result<()> {
    fn walk(v: &Value, path: &str) -> Result<()> {
        match v {
            Value::Number(n) if n.as_u64().is_some_and(|x| x > MAX_CONFIG_INT) => {
                bail!("{path} = {n} is out of range (at most {MAX_CONFIG_INT})")
            }
            Value::Array(a) => a.iter().try_for_each(|x| walk(x, path)),
            Value::Object(o) => o
                .iter()
                .try_for_each(|(k, x)| walk(x, &if path.is_empty() { k.clone() } else { format!("{path}.{k}") })),
            _ => Ok(()),
        }
    }
    walk(config, "")?;
    for key in ["/num_hidden_layers", "/n_layer", "/text_config/num_hidden_layers"] {
        if let Some(n) = config.pointer(key).and_then(Value::as_u64) {
            if n as usize > tensors {
                bail!("{} = {n}, but the weights hold only {tensors} tensors", &key[1..].replace('/', "."));
            }
        }
    }
    Ok(())
}

/// Parse config.json, accepting the bare `Infinity`/`-Infinity`/`NaN` literals Python's json
/// writes (kept as strings so that nothing is lost when the config is written back).
pub fn parse_config(text: &str) -> Result<Value> {
    if let Ok(v) = serde_json::from_str(text) {
        return Ok(v);
    }
    let mut out = String::with_capacity(text.len());
    let mut in_str = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
        } else if let Some(lit) = ["-Infinity", "Infinity", "NaN"].iter().find(|l| rest.starts_with(**l)) {
            out.push('"');
            out.push_str(lit);
            out.push('"');
            rest = &rest[lit.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    Ok(serde_json::from_str(&out)?)
}

impl Checkpoint {
    /// One stored tensor as float32 on the CPU.
    pub fn tensor_f32(&self, name: &str) -> Result<candle_core::Tensor> {
        let info = self.info(name)?;
        let vb = self.var_builder(DType::F32, &Device::Cpu)?;
        Ok(vb.get(info.shape.clone(), name)?)
    }

    /// Number of parameters (elements of every stored tensor).
    pub fn num_params(&self) -> usize {
        self.tensors.values().map(|t| t.shape.iter().product::<usize>()).sum()
    }
}

/// The model width as every family spells it: `hidden_size`, mamba_ssm's `d_model`, or
/// `text_config.hidden_size` (multimodal wrappers). An error when none is there or the value is
/// not a whole number.
pub fn hidden_size(config: &Value) -> Result<usize> {
    for key in ["hidden_size", "d_model", "text_config.hidden_size"] {
        match config.pointer(&format!("/{}", key.replace('.', "/"))) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return v
                    .as_u64()
                    .map(|n| n as usize)
                    .with_context(|| format!("config key {key} is {v}, not a whole number"))
            }
        }
    }
    bail!("config.json has no hidden_size (nor mamba_ssm's d_model or text_config.hidden_size)")
}

/// `model_type` from config.json (top level). mamba_ssm configs have none: they are recognised
/// by `ssm_cfg` and named after their layer (`mamba2`, or `mamba` for Mamba-1).
pub fn model_type(config: &Value) -> Result<String> {
    if let Some(t) = config.get("model_type").and_then(Value::as_str) {
        return Ok(t.to_string());
    }
    if let (Some(_), Some(ssm)) = (config.get("d_model"), config.get("ssm_cfg")) {
        let mamba2 = ssm.get("layer").and_then(Value::as_str) == Some("Mamba2");
        return Ok(if mamba2 { "mamba2" } else { "mamba" }.to_string());
    }
    bail!("config.json has no model_type")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hidden_size_in_every_spelling() {
        assert_eq!(hidden_size(&json!({"hidden_size": 64})).unwrap(), 64);
        assert_eq!(hidden_size(&json!({"d_model": 768, "ssm_cfg": {"layer": "Mamba2"}})).unwrap(), 768);
        assert_eq!(hidden_size(&json!({"text_config": {"hidden_size": 2048}})).unwrap(), 2048);
        assert_eq!(hidden_size(&json!({"hidden_size": null, "d_model": 32})).unwrap(), 32);
        let e = hidden_size(&json!({"hidden_size": "64"})).unwrap_err().to_string();
        assert!(e.contains("config key hidden_size is \"64\""), "{e}");
        let e = hidden_size(&json!({"n_layer": 2})).unwrap_err().to_string();
        assert!(e.contains("has no hidden_size"), "{e}");
    }
}
