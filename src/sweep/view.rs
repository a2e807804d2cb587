//! A pruned model without a pruned checkpoint: the original weights read through a VarBuilder
//! backend that keeps only the kept rows of the sliced tensors as they load, beside the edited
//! config. Every family loads it as it would load the written checkpoint.

use crate::checkpoint::Checkpoint;
use anyhow::Result;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Rows (dim 0) to keep of each sliced tensor, by checkpoint name.
pub type RowMap = BTreeMap<String, Vec<usize>>;

/// A backend reading `inner` and slicing the tensors in `rows`.
struct RowSliced {
    inner: VarBuilder<'static>,
    rows: Arc<RowMap>,
    /// Stored dtype of each sliced tensor: rows are gathered before any conversion, in the
    /// order a load of the written checkpoint converts (load, then cast), so values match bit
    /// for bit.
    stored: BTreeMap<String, DType>,
}

impl SimpleBackend for RowSliced {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(keep) = self.rows.get(name) else {
            return self.inner.get_with_hints_dtype(s, name, h, dtype);
        };
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name} ({} kept rows)", keep.len()),
                expected: s,
                got: t.shape().clone(),
            });
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(keep) = self.rows.get(name) else {
            return self.inner.get_unchecked_dtype(name, dtype);
        };
        let stored = self.stored.get(name).copied().unwrap_or(dtype);
        let t = self.inner.get_unchecked_dtype(name, stored)?;
        let idx: Vec<u32> = keep.iter().map(|&r| r as u32).collect();
        let idx = Tensor::from_vec(idx, keep.len(), dev)?;
        t.index_select(&idx, 0)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

fn candle_dtype(d: safetensors::Dtype) -> Option<DType> {
    Some(match d {
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F64 => DType::F64,
        _ => return None,
    })
}

impl Checkpoint {
    /// This checkpoint as it would be after keeping `rows` of the sliced tensors, with `config`
    /// (already edited for the new widths): nothing is written, the rows are cut as tensors load.
    pub fn sliced(&self, rows: RowMap, config: serde_json::Value) -> Result<Checkpoint> {
        let mut out = self.clone();
        for (name, keep) in &rows {
            let info = out.tensors.get_mut(name).ok_or_else(|| anyhow::anyhow!("tensor {name} not found"))?;
            if let Some(bad) = keep.iter().find(|r| **r >= info.shape[0]) {
                anyhow::bail!("{name}: row {bad} out of range ({} rows)", info.shape[0]);
            }
            info.shape[0] = keep.len();
        }
        out.config = config;
        out.row_view = Some(Arc::new(rows));
        Ok(out)
    }

    /// `vb` (over this checkpoint's files) with the rows of [`Checkpoint::sliced`] cut on load.
    pub(crate) fn slice_rows(&self, vb: VarBuilder<'static>) -> VarBuilder<'static> {
        let Some(rows) = &self.row_view else { return vb };
        let stored = rows
            .keys()
            .filter_map(|n| self.tensors.get(n).and_then(|i| candle_dtype(i.dtype)).map(|d| (n.clone(), d)))
            .collect();
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        VarBuilder::from_backend(Box::new(RowSliced { inner: vb, rows: rows.clone(), stored }), dtype, device)
    }
}
