//! The per-layer view of a selection: how much of each head's calibration key/query
//! activations the kept channels cannot express.

use super::LayerLoss;
use crate::arch::StateLayout;
use crate::calib::Calibration;
use crate::select::{drrqr_stack, reduce_rows};
use crate::surgery::KeepSets;
use anyhow::{Context, Result};
use faer::Mat;
use rayon::prelude::*;
use std::collections::BTreeMap;

/// Per layer and head, the triangular factor R of M = [K; Q] (RᵀR = MᵀM), computed once per
/// sweep: every projection statistic of M's columns can be read from R.
pub struct Factors(BTreeMap<usize, Vec<Mat<f64>>>);

impl Factors {
    pub fn of(cal: &Calibration, layout: &StateLayout) -> Self {
        let dk = layout.dk;
        let mut out = BTreeMap::new();
        for l in &layout.layers {
            let Some(lc) = cal.collector.layers.get(&l.layer) else { continue };
            let heads = (0..l.key_heads)
                .into_par_iter()
                .map(|h| reduce_rows(&drrqr_stack(&[&lc.keys.head(h, dk), &lc.queries.head(h, dk)], dk)))
                .collect();
            out.insert(l.layer, heads);
        }
        Self(out)
    }

    /// The loss of every layer under the kept channels `keep`.
    pub fn losses(&self, keep: &KeepSets) -> Result<Vec<LayerLoss>> {
        self.0
            .iter()
            .map(|(layer, heads)| {
                let sets = keep.get(layer).with_context(|| format!("no kept channels for layer {layer}"))?;
                let r: Vec<f64> = heads.iter().zip(sets).map(|(r, kept)| residual(r, kept)).collect();
                let (worst_head, worst) =
                    r.iter()
                        .copied()
                        .enumerate()
                        .fold((0, f64::NEG_INFINITY), |b, (h, v)| if v > b.1 { (h, v) } else { b });
                Ok(LayerLoss { layer: *layer, mean: r.iter().sum::<f64>() / r.len().max(1) as f64, worst, worst_head })
            })
            .collect()
    }
}

/// ‖R − Π_S R‖_F / ‖R‖_F with Π_S the projection on the span of R's columns `kept` (equal to
/// the same quantity of M, since M = QR with orthonormal Q).
pub fn residual(r: &Mat<f64>, kept: &[usize]) -> f64 {
    let total = r.norm_l2().powi(2);
    if total == 0.0 || kept.is_empty() {
        return if total == 0.0 { 0.0 } else { 1.0 };
    }
    let s = Mat::from_fn(r.nrows(), kept.len(), |i, j| r[(i, kept[j])]);
    let q = s.qr().compute_thin_Q();
    let inside = (q.transpose() * r).norm_l2().powi(2);
    ((total - inside).max(0.0) / total).sqrt()
}

#[cfg(test)]
mod tests {
    use super::residual;
    use faer::Mat;

    #[test]
    fn residual_of_kept_columns() {
        // Columns 0 and 1 independent, column 2 = column 0 + column 1.
        let m = Mat::from_fn(4, 3, |i, j| match j {
            0 => [1.0, 0.0, 2.0, 0.0][i],
            1 => [0.0, 1.0, 0.0, 3.0][i],
            _ => [1.0, 1.0, 2.0, 3.0][i],
        });
        assert!(residual(&m, &[0, 1]) < 1e-12, "column 2 lies in their span");
        assert!(residual(&m, &[0, 1, 2]) < 1e-12);
        // Keeping column 0 only leaves column 1 (norm² 10) and the column-1 part of column 2 (10) of 30.
        let want = (20.0f64 / 30.0).sqrt();
        assert!((residual(&m, &[0]) - want).abs() < 1e-12);
    }
}
