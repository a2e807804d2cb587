//! Calibration statistics gathered while the model runs: uniform samples of key/query rows per
//! layer (reservoirs, memory bounded by `rows`, not by the calibration set) and per-feature
//! norms of the q/k projection inputs.

use crate::arch::{LayerState, Observer, StateLayout};
use anyhow::Result;
use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::BTreeMap;

/// A uniform sample of at most `cap` rows of width `width` (Vitter's algorithm R).
#[derive(Debug, Clone)]
pub struct Reservoir {
    pub cap: usize,
    pub width: usize,
    pub seen: u64,
    pub rows: Vec<f32>,
}

impl Reservoir {
    pub fn new(cap: usize, width: usize) -> Self {
        Self { cap, width, seen: 0, rows: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.rows.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Offer every row of a row-major [n, width] buffer.
    pub fn offer(&mut self, data: &[f32], rng: &mut StdRng) {
        for row in data.chunks_exact(self.width) {
            if self.len() < self.cap {
                self.rows.extend_from_slice(row);
            } else {
                let j = rng.random_range(0..=self.seen);
                if (j as usize) < self.cap {
                    let j = j as usize;
                    self.rows[j * self.width..(j + 1) * self.width].copy_from_slice(row);
                }
            }
            self.seen += 1;
        }
    }

    /// Column block [.., h*dk .. (h+1)*dk] as a row-major [len, dk] buffer.
    pub fn head(&self, h: usize, dk: usize) -> Vec<f32> {
        self.rows.chunks_exact(self.width).flat_map(|r| r[h * dk..(h + 1) * dk].iter().copied()).collect()
    }
}

/// Statistics of one layer.
#[derive(Debug, Clone)]
pub struct LayerCalib {
    pub keys: Reservoir,
    pub queries: Reservoir,
    /// Σ x_j² over tokens for each input feature of the q/k projections.
    pub input_sq: Vec<f64>,
    pub input_count: u64,
}

impl LayerCalib {
    /// sqrt(mean x_j²) per input feature (S-Wanda's ‖X_:j‖ up to a constant factor).
    pub fn input_norms(&self) -> Vec<f64> {
        let n = self.input_count.max(1) as f64;
        self.input_sq.iter().map(|s| (s / n).sqrt()).collect()
    }
}

/// Collects [`LayerCalib`] for every prunable layer of a model as an [`Observer`].
pub struct Collector {
    pub dk: usize,
    pub layers: BTreeMap<usize, LayerCalib>,
    rng_k: StdRng,
    rng_q: StdRng,
    /// Skip the first `skip` tokens of each sequence (warm-up of the state), as in the paper's plots.
    pub skip: usize,
}

impl Collector {
    /// `rows` rows per layer in total: half keys, half queries (stratified).
    pub fn new(layout: &StateLayout, rows: usize, seed: u64) -> Self {
        let layers = layout
            .layers
            .iter()
            .map(|l: &LayerState| {
                let w = l.key_heads * layout.dk;
                (
                    l.layer,
                    LayerCalib {
                        keys: Reservoir::new(rows.div_ceil(2), w),
                        queries: Reservoir::new(rows / 2, w),
                        input_sq: Vec::new(),
                        input_count: 0,
                    },
                )
            })
            .collect();
        Self {
            dk: layout.dk,
            layers,
            rng_k: StdRng::seed_from_u64(seed),
            rng_q: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            skip: 0,
        }
    }

    /// Re-seed (used when resuming so that continued runs stay deterministic).
    pub fn reseed(&mut self, seed: u64) {
        self.rng_k = StdRng::seed_from_u64(seed);
        self.rng_q = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    }
}

fn rows_f32(t: &Tensor, skip: usize) -> Result<Vec<f32>> {
    let t = if skip > 0 && t.dim(1)? > skip { t.narrow(1, skip, t.dim(1)? - skip)? } else { t.clone() };
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl Observer for Collector {
    fn qk_input(&mut self, layer: usize, x: &Tensor) -> Result<()> {
        let Some(l) = self.layers.get_mut(&layer) else { return Ok(()) };
        let d = x.dim(2)?;
        let x = x.to_dtype(DType::F32)?;
        let n = x.elem_count() / d;
        let sq = x.sqr()?.reshape((n, d))?.sum(0)?.to_vec1::<f32>()?;
        if l.input_sq.is_empty() {
            l.input_sq = vec![0.0; d];
        }
        l.input_sq.iter_mut().zip(sq).for_each(|(a, b)| *a += b as f64);
        l.input_count += n as u64;
        Ok(())
    }

    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        let skip = self.skip;
        let Some(l) = self.layers.get_mut(&layer) else { return Ok(()) };
        l.keys.offer(&rows_f32(k, skip)?, &mut self.rng_k);
        l.queries.offer(&rows_f32(q, skip)?, &mut self.rng_q);
        Ok(())
    }
}
