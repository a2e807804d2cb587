//! A model's state layout: the key/query geometry of its recurrent layers, as its family
//! describes it from the config, checked against the stored tensors.

use crate::checkpoint::Checkpoint;
use crate::model::{RowSlice, SliceRole};
use anyhow::{bail, Context, Result};
use serde::Serialize;

/// The recurrent state of one layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerState {
    pub layer: usize,
    /// Index sets per layer: fla heads, Mamba-2 groups, Qwen3.5 key heads.
    pub key_heads: usize,
    /// Number of recurrent states (value heads); each key head serves value_heads/key_heads.
    pub value_heads: usize,
    pub dv: usize,
    pub slices: Vec<RowSlice>,
}

/// The key/query geometry of a model: one key width `dk` shared by every head and layer.
#[derive(Debug, Clone, Serialize)]
pub struct StateLayout {
    pub family: String,
    pub dk: usize,
    /// Layers with a prunable recurrent state (hybrids list only their linear layers).
    pub layers: Vec<LayerState>,
    pub num_layers: usize,
}

impl StateLayout {
    /// Elements of all recurrent states for a key width `dk`.
    pub fn state_elems(&self, dk: usize) -> usize {
        self.layers.iter().map(|l| l.value_heads * dk * l.dv).sum()
    }

    pub fn layer(&self, layer: usize) -> Option<&LayerState> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Check the layout against the stored tensors, so that a config.json that disagrees with
    /// its weights fails here, once, instead of in whichever reader first indexes a row: every
    /// sliced tensor exists and has the rows `offset + h * head_stride + j` of every head h and
    /// channel j < dk, distinct slices of one tensor share no row, and the key/query projection
    /// blocks of a layer agree on their input width.
    pub fn check(&self, ckpt: &Checkpoint) -> Result<()> {
        let cfg = || format!("{}/config.json", ckpt.dir.display());
        if self.dk == 0 || self.dk > i32::MAX as usize {
            bail!("{} describes a key width of {}", cfg(), self.dk);
        }
        if self.layers.is_empty() {
            bail!("{} describes no layer with a recurrent state", cfg());
        }
        for l in &self.layers {
            let at = || format!("{} layer {}", cfg(), l.layer);
            // Sizes derived from float config values (expand_v, ...) saturate instead of failing.
            let sane = |n: usize| (1..=i32::MAX as usize).contains(&n);
            if !sane(l.key_heads) || !sane(l.dv) || !sane(l.value_heads) || !l.value_heads.is_multiple_of(l.key_heads) {
                bail!(
                    "{}: {} key heads, {} value heads of width {}: expected at least one of each, value heads a multiple of key heads",
                    at(),
                    l.key_heads,
                    l.value_heads,
                    l.dv
                );
            }
            // The row ranges of each head of each slice, by tensor, to find slices that overlap.
            let mut claimed: std::collections::BTreeMap<&str, Vec<(usize, usize)>> = Default::default();
            let mut proj_cols = None;
            for s in &l.slices {
                let info = ckpt.info(&s.tensor).with_context(|| {
                    format!("{} does not match the weights ({} is expected for layer {})", cfg(), s.tensor, l.layer)
                })?;
                let rows = info.shape.first().copied().unwrap_or(0);
                let end = (l.key_heads - 1).checked_mul(s.head_stride).and_then(|x| x.checked_add(s.offset + self.dk));
                if s.head_stride < self.dk || end.is_none_or(|e| e > rows) {
                    bail!(
                        "{} does not match the weights: {} has shape {:?}, too small for {} heads of d_k {} (rows from {} every {})",
                        cfg(),
                        s.tensor,
                        info.shape,
                        l.key_heads,
                        self.dk,
                        s.offset,
                        s.head_stride
                    );
                }
                let ranges = claimed.entry(&s.tensor).or_default();
                ranges.extend((0..l.key_heads).map(|h| (s.offset + h * s.head_stride, self.dk)));
                if matches!(s.role, SliceRole::QueryProj | SliceRole::KeyProj) {
                    let cols = match info.shape[..] {
                        [_, c] if c > 0 => c,
                        _ => bail!(
                            "{}: projection {} has shape {:?}, expected [rows, inputs]",
                            at(),
                            s.tensor,
                            info.shape
                        ),
                    };
                    if proj_cols.is_some_and(|c| c != cols) {
                        bail!(
                            "{}: key and query projections disagree on their input width ({} has {cols})",
                            at(),
                            s.tensor
                        );
                    }
                    proj_cols = Some(cols);
                }
            }
            for (tensor, ranges) in &mut claimed {
                ranges.sort_unstable();
                if let Some(w) = ranges.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
                    bail!("{}: the key channels of {tensor} overlap at row {}", at(), w[1].0);
                }
            }
        }
        Ok(())
    }
}
