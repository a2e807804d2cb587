//! spectral statistics of recurrent states and activation matrices.
//!
//! everything here works from the singular values, so one svd serves every
//! statistic; the helpers take `&[f64]` sorted descending, as returned by
//! [`singular_values`].

use anyhow::{anyhow, ensure, Result};
use faer::MatRef;
use serde::Serialize;

/// singular values of `m`, descending, `min(rows, cols)` of them.
///
/// errors on non-finite entries (the svd would not converge on them anyway)
/// or if faer's svd fails to converge.
pub fn singular_values(m: MatRef<'_, f64>) -> Result<Vec<f64>> {
    ensure!(all_finite(m), "matrix contains NaN/inf, so its singular values are undefined");
    if m.nrows() == 0 || m.ncols() == 0 {
        return Ok(Vec::new());
    }
    let mut sv = m.singular_values().map_err(|e| anyhow!("svd did not converge ({e:?})"))?;
    // faer already sorts descending; re-sort so callers can rely on it
    // even if a future version changes that.
    sv.sort_by(|a, b| b.total_cmp(a));
    Ok(sv)
}

/// stable rank `sum(s^2) / s_max^2`: a smooth, noise-robust stand-in for rank.
///
/// returns 0.0 for an empty or all-zero matrix (no direction carries energy).
pub fn stable_rank(sv: &[f64]) -> f64 {
    let smax = max_sv(sv);
    if smax == 0.0 {
        return 0.0;
    }
    // scale by s_max first so the squares cannot overflow.
    sv.iter().map(|s| (s / smax).powi(2)).sum()
}

/// condition number `s_max / s_min`.
///
/// `f64::INFINITY` when `s_min == 0` (including the all-zero matrix);
/// NaN for an empty slice.
pub fn condition_number(sv: &[f64]) -> f64 {
    if sv.is_empty() {
        return f64::NAN;
    }
    let smax = max_sv(sv);
    let smin = min_sv(sv);
    if smin == 0.0 {
        f64::INFINITY
    } else {
        smax / smin
    }
}

/// normalised energy entropy `-sum p_i ln p_i / ln n`, `p_i = s_i^2 / sum s^2`.
///
/// 1 means energy spread evenly over all `n` directions, 0 means one
/// direction holds it all; defined as 0 for `n <= 1` or an all-zero matrix.
pub fn energy_entropy(sv: &[f64]) -> f64 {
    let n = sv.len();
    let smax = max_sv(sv);
    if n <= 1 || smax == 0.0 {
        return 0.0;
    }
    let e: Vec<f64> = sv.iter().map(|s| (s / smax).powi(2)).collect();
    let total: f64 = e.iter().sum();
    let h: f64 = e
        .iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| {
            let p = x / total;
            -p * p.ln()
        })
        .sum();
    h / (n as f64).ln()
}

/// summary of a spectrum, serialisable for reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SpectrumStats {
    /// largest singular value.
    pub sigma_max: f64,
    /// smallest singular value.
    pub sigma_min: f64,
    /// condition number `sigma_max / sigma_min` (inf if `sigma_min == 0`).
    pub kappa: f64,
    /// `sum(s^2) / s_max^2`, see [`stable_rank`].
    pub stable_rank: f64,
    /// `stable_rank / d`: fraction of the `d` available dimensions in use.
    pub utilization: f64,
    /// normalised energy entropy, see [`energy_entropy`].
    pub entropy: f64,
}

impl SpectrumStats {
    /// builds the summary from descending singular values; `d` is the
    /// nominal dimension that `utilization` is measured against (0 gives
    /// utilization 0 rather than a division by zero).
    pub fn from_singular_values(sv: &[f64], d: usize) -> Self {
        let sr = stable_rank(sv);
        SpectrumStats {
            sigma_max: max_sv(sv),
            sigma_min: min_sv(sv),
            kappa: condition_number(sv),
            stable_rank: sr,
            utilization: if d == 0 { 0.0 } else { sr / d as f64 },
            entropy: energy_entropy(sv),
        }
    }
}

/// max without trusting the sort order of the caller's slice.
fn max_sv(sv: &[f64]) -> f64 {
    sv.iter().copied().fold(0.0, f64::max)
}

fn min_sv(sv: &[f64]) -> f64 {
    if sv.is_empty() {
        return 0.0;
    }
    sv.iter().copied().fold(f64::INFINITY, f64::min)
}

pub(crate) fn all_finite(m: MatRef<'_, f64>) -> bool {
    (0..m.ncols()).all(|j| (0..m.nrows()).all(|i| m[(i, j)].is_finite()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;

    #[test]
    fn diag_stats() {
        let m = Mat::from_fn(2, 2, |i, j| match (i, j) {
            (0, 0) => 1.0,
            (1, 1) => 0.01,
            _ => 0.0,
        });
        let sv = singular_values(m.as_ref()).unwrap();
        assert!((sv[0] - 1.0).abs() < 1e-14 && (sv[1] - 0.01).abs() < 1e-14);
        assert!((stable_rank(&sv) - 1.0001).abs() < 1e-12);
        assert!((condition_number(&sv) - 100.0).abs() < 1e-9);
        let st = SpectrumStats::from_singular_values(&sv, 4);
        assert!((st.utilization - 1.0001 / 4.0).abs() < 1e-12);
    }

    #[test]
    fn degenerate() {
        assert_eq!(stable_rank(&[0.0, 0.0]), 0.0);
        assert_eq!(energy_entropy(&[0.0, 0.0]), 0.0);
        assert_eq!(energy_entropy(&[3.0]), 0.0);
        assert_eq!(condition_number(&[1.0, 0.0]), f64::INFINITY);
        assert!((energy_entropy(&[2.0, 2.0, 2.0]) - 1.0).abs() < 1e-12);
    }
}
