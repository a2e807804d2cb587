//! strong rank-revealing qr (gu & eisenstat 1996, algorithm 4, fixed rank k)
//! used to pick which channels of a recurrent state to keep.
//!
//! convention: the input is the calibration matrix `M = [K_cal; Q_cal]`, i.e.
//! rows are calibration samples (key rows stacked over query rows) and
//! columns are channels, so keeping channels means selecting columns.
//!
//! algorithm, in short:
//! 1. column-pivoted householder qr `M P = Q R` gives a good first guess;
//!    since `Q` is orthogonal, all later work runs on the small triangular
//!    factor `R` (at most `min(r, n) x n`) instead of `M` itself.
//! 2. split `R = [[A, B], [0, C]]` with `A` k x k, and score every
//!    (kept i, dropped j) pair by
//!    `rho_ij = sqrt((A^-1 B)_ij^2 + (gamma_j / omega_i)^2)`,
//!    `gamma_j = ||C(:, j)||`, `omega_i = 1 / ||row_i(A^-1)||`;
//!    `rho_ij` is exactly the factor by which swapping i and j would grow
//!    `|det A|`.
//! 3. while some `rho_ij > f`, swap the worst pair and re-triangularise.
//!    `|det A|` grows by more than `f` per swap and is bounded by the product
//!    of the top k singular values, so the loop terminates; at the end every
//!    `rho_ij <= f`, which gives the bounds checked by [`check_bounds`].

use std::collections::HashSet;

use anyhow::{anyhow, bail, ensure, Result};
use faer::linalg::triangular_solve::solve_upper_triangular_in_place;
use faer::{Mat, MatRef, Par};
use serde::Serialize;

use super::spectrum::{all_finite, singular_values};

/// tuning for [`strong_rrqr`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RrqrOptions {
    /// swap threshold, must be > 1: smaller is a tighter selection but may
    /// need more swaps (the swap count grows like `1 / ln f`).
    pub f: f64,
}

impl Default for RrqrOptions {
    /// 1.5: tight bounds at a handful of swaps in practice.
    fn default() -> Self {
        RrqrOptions { f: 1.5 }
    }
}

/// result of [`strong_rrqr`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RrqrSelection {
    /// the k kept column (channel) indices of `M`, sorted ascending.
    pub selected: Vec<usize>,
    /// the full column permutation of `M` in final factor order: the first k
    /// entries are the kept columns (same set as `selected`), the rest the
    /// dropped ones.
    pub pivot_order: Vec<usize>,
    /// number of strong-rrqr swaps done after the pivoted qr.
    pub swaps: usize,
    /// max `rho_ij` at termination, `<= f` (0 when k == n: nothing to swap).
    pub max_rho: f64,
}

/// outcome of [`check_bounds`]: the strong-rrqr theorem for one selection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RrqrBounds {
    /// `sqrt(1 + f^2 k (n - k))`, the theorem's slack factor.
    pub c_f: f64,
    /// `min_i sigma_i(A_k) c_f / sigma_i(M)` over i < k with
    /// `sigma_i(M) > 0`; >= 1 when the bound holds (inf if no such i).
    pub min_sigma_ratio: f64,
    /// `||C_k||_2 / (c_f sigma_{k+1}(M))`, <= 1 when the bound holds;
    /// 0 if k == n or `C_k` vanishes, inf if only `sigma_{k+1}(M)` vanishes.
    pub c_norm_ratio: f64,
    /// both bounds hold, up to relative tolerance 1e-9 (plus an absolute
    /// floor at rounding level, `64 eps max(r, n) sigma_1(M)`).
    pub holds: bool,
}

/// relative tolerance of [`check_bounds`].
const BOUND_RTOL: f64 = 1e-9;
/// pivots below this fraction of `|R_00|` count as numerically zero.
const RANK_RTOL: f64 = 1e-12;
/// slack on the per-swap determinant growth, for rounding in the refactor.
const DET_RTOL: f64 = 1e-12;

/// column order of faer's pivoted qr: entry `p` is the column of `M` that
/// sits at position `p` of the factor, i.e. `M[:, order] = Q R`.
///
/// faer stores `A = Q R P` with `P` applied on the right; its forward array
/// is exactly this map (pinned down by a unit test below).
pub fn pivoted_qr_order(m: MatRef<'_, f64>) -> Vec<usize> {
    let qr = m.col_piv_qr();
    qr.P().arrays().0.to_vec()
}

/// strong rank-revealing qr with fixed rank `k`: picks `k` columns of `m`
/// (rows = calibration samples, columns = channels) so that every
/// `rho_ij <= opts.f`, see the module docs.
///
/// errors on k == 0, k > n, fewer rows than k, NaN/inf entries, f <= 1,
/// numerical rank < k, or (never expected) failure to converge.
pub fn strong_rrqr(m: MatRef<'_, f64>, k: usize, opts: &RrqrOptions) -> Result<RrqrSelection> {
    let (rows, n) = (m.nrows(), m.ncols());
    let f = opts.f;
    ensure!(f > 1.0, "strong rrqr needs f > 1 (got {f}): with f <= 1 the swap loop need not terminate");
    ensure!(k > 0, "cannot keep k = 0 channels: k must be at least 1");
    ensure!(k <= n, "cannot keep k = {k} channels out of only n = {n} columns");
    ensure!(
        rows >= k,
        "fewer calibration rows ({rows}) than channels to keep ({k}): the activation matrix is rank-deficient; give more calibration tokens"
    );
    ensure!(all_finite(m), "activations contain NaN/inf");

    // step 1: pivoted qr; `base` maps factor positions to columns of m.
    let cpqr = m.col_piv_qr();
    let base: Vec<usize> = cpqr.P().arrays().0.to_vec();
    // w = R (p x n, upper trapezoidal); m[:, base] = Q w, so selecting
    // columns of w is the same problem as selecting columns of m.
    let w = cpqr.thin_R().to_owned();
    let p = w.nrows();
    let r00 = w[(0, 0)].abs();
    let tol = RANK_RTOL * r00;
    let num_rank = (0..p).take_while(|&i| r00 > 0.0 && w[(i, i)].abs() >= tol).count();
    ensure!(
        num_rank >= k,
        "activation matrix has numerical rank {num_rank} < k = {k}: no {k} channels are linearly independent on the calibration data"
    );

    // step 2-3: swap loop; `perm` maps current factor positions to columns
    // of w. the first factor is w itself (already triangular).
    let mut perm: Vec<usize> = (0..n).collect();
    let mut r = w.clone();
    let mut swaps = 0usize;
    // exact-arithmetic termination needs no cap; this one only guards
    // against rounding noise, and is never expected to trigger.
    let max_swaps = 100usize.saturating_mul(n).saturating_mul(n).max(100);
    let mut seen: HashSet<Vec<usize>> = HashSet::new();
    seen.insert(sorted(&perm[..k]));

    loop {
        let (max_rho, i, j) = worst_pair(r.as_ref(), k)?;
        if max_rho <= f {
            let pivot_order: Vec<usize> = perm.iter().map(|&c| base[c]).collect();
            let selected = sorted(&pivot_order[..k]);
            return Ok(RrqrSelection { selected, pivot_order, swaps, max_rho });
        }
        if swaps >= max_swaps {
            bail!(
                "strong rrqr did not converge within {max_swaps} swaps (max rho {max_rho} > f = {f}); rounding noise is likely cycling the selection"
            );
        }
        let old_logdet = log_abs_det(r.as_ref(), k);
        perm.swap(i, k + j);
        let wp = Mat::from_fn(p, n, |a, b| w[(a, perm[b])]);
        r = wp.qr().thin_R().to_owned();
        swaps += 1;
        let new_logdet = log_abs_det(r.as_ref(), k);
        let min_gain = f.ln() + (-DET_RTOL).ln_1p();
        ensure!(
            new_logdet - old_logdet >= min_gain,
            "strong rrqr swap grew |det A_k| by only {:.6e} (rho = {max_rho}, need > f = {f}): rounding noise dominates, the matrix is too ill-conditioned for this f",
            (new_logdet - old_logdet).exp()
        );
        ensure!(
            seen.insert(sorted(&perm[..k])),
            "strong rrqr revisited a selection after {swaps} swaps: rounding noise is cycling it, use a larger f"
        );
    }
}

/// max `rho_ij` over kept i, dropped j of the factor `r` (p x n upper
/// trapezoidal), with the first (i, j) in row-major order on ties.
fn worst_pair(r: MatRef<'_, f64>, k: usize) -> Result<(f64, usize, usize)> {
    let (p, n) = (r.nrows(), r.ncols());
    if k == n {
        return Ok((0.0, 0, 0));
    }
    let a = r.submatrix(0, 0, k, k);
    // a^-1 by triangular solve against the identity; u = a^-1 b the same way
    // (more accurate than multiplying by the explicit inverse).
    let mut ainv = Mat::<f64>::identity(k, k);
    solve_upper_triangular_in_place(a, ainv.as_mut(), Par::Seq);
    let mut u = r.submatrix(0, k, k, n - k).to_owned();
    solve_upper_triangular_in_place(a, u.as_mut(), Par::Seq);
    // 1 / omega_i = ||row_i(a^-1)||
    let inv_omega: Vec<f64> = (0..k).map(|i| ainv.row(i).norm_l2()).collect();
    let gamma: Vec<f64> =
        (0..n - k).map(|j| if p > k { r.submatrix(k, k + j, p - k, 1).norm_l2() } else { 0.0 }).collect();
    let mut best = (f64::NEG_INFINITY, 0, 0);
    for (i, &io) in inv_omega.iter().enumerate() {
        for (j, &g) in gamma.iter().enumerate() {
            let rho = u[(i, j)].hypot(g * io);
            if rho.is_nan() {
                return Err(anyhow!("strong rrqr produced a NaN score: the kept block became singular"));
            }
            if rho > best.0 {
                best = (rho, i, j);
            }
        }
    }
    Ok(best)
}

fn log_abs_det(r: MatRef<'_, f64>, k: usize) -> f64 {
    (0..k).map(|i| r[(i, i)].abs().ln()).sum()
}

fn sorted(v: &[usize]) -> Vec<usize> {
    let mut s = v.to_vec();
    s.sort_unstable();
    s
}

/// checks the strong-rrqr theorem (gu & eisenstat, thm 3.2) for a column
/// selection, independently of how it was found:
/// `sigma_i(A_k) >= sigma_i(M) / c_f` for i <= k and
/// `||C_k||_2 <= c_f sigma_{k+1}(M)`, with `c_f = sqrt(1 + f^2 k (n-k))`.
///
/// `sigma_i(A_k)` are the singular values of `M[:, S]` (same nonzero ones as
/// `A_k`), and `||C_k||_2` is the norm of the other columns' residual after
/// projecting onto span `M[:, S]`; neither depends on the order within S.
pub fn check_bounds(m: MatRef<'_, f64>, selected: &[usize], f: f64) -> Result<RrqrBounds> {
    let (rows, n) = (m.nrows(), m.ncols());
    let k = selected.len();
    ensure!(f > 1.0, "check_bounds needs f > 1 (got {f})");
    ensure!(k > 0, "check_bounds needs a non-empty selection");
    ensure!(k <= n, "cannot check a selection of {k} columns out of only n = {n}");
    let mut in_sel = vec![false; n];
    for &c in selected {
        ensure!(c < n, "selected column {c} is out of range (n = {n})");
        ensure!(!in_sel[c], "selected column {c} appears twice");
        in_sel[c] = true;
    }
    ensure!(all_finite(m), "activations contain NaN/inf");
    let rest: Vec<usize> = (0..n).filter(|&c| !in_sel[c]).collect();

    let c_f = (1.0 + f * f * (k as f64) * ((n - k) as f64)).sqrt();
    let sv_m = singular_values(m)?;
    let s1 = sv_m.first().copied().unwrap_or(0.0);
    let floor = 64.0 * f64::EPSILON * (rows.max(n) as f64) * s1;
    let sv_at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);

    let ms = Mat::from_fn(rows, k, |a, b| m[(a, selected[b])]);
    let sv_s = singular_values(ms.as_ref())?;
    let mut min_sigma_ratio = f64::INFINITY;
    let mut sigma_ok = true;
    for i in 0..k {
        let (ss, sm) = (sv_at(&sv_s, i), sv_at(&sv_m, i));
        if sm > 0.0 {
            min_sigma_ratio = min_sigma_ratio.min(ss * c_f / sm);
        }
        sigma_ok &= ss * c_f >= sm * (1.0 - BOUND_RTOL) - floor;
    }

    let (c_norm_ratio, c_ok) = if rest.is_empty() {
        (0.0, true)
    } else {
        let qs = ms.qr().compute_thin_Q();
        let mr = Mat::from_fn(rows, rest.len(), |a, b| m[(a, rest[b])]);
        let resid = &mr - &qs * (qs.transpose() * &mr);
        let c_norm = sv_at(&singular_values(resid.as_ref())?, 0);
        let bound = c_f * sv_at(&sv_m, k);
        let ratio = if c_norm == 0.0 {
            0.0
        } else if bound == 0.0 {
            f64::INFINITY
        } else {
            c_norm / bound
        };
        (ratio, c_norm <= bound * (1.0 + BOUND_RTOL) + floor)
    };

    Ok(RrqrBounds { c_f, min_sigma_ratio, c_norm_ratio, holds: sigma_ok && c_ok })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// faer's pivoted qr on orthogonal columns with norms 1, 3, 2 must pick
    /// them in order 1, 2, 0; this pins the direction of `P().arrays().0`.
    #[test]
    fn faer_permutation_direction() {
        let m = Mat::from_fn(3, 3, |i, j| match (i, j) {
            (0, 0) => 1.0,
            (1, 1) => 3.0,
            (2, 2) => 2.0,
            _ => 0.0,
        });
        assert_eq!(pivoted_qr_order(m.as_ref()), vec![1, 2, 0]);
    }

    /// `m[:, order] = Q R` on a non-symmetric example.
    #[test]
    fn faer_permutation_reconstructs() {
        let m = Mat::from_fn(5, 4, |i, j| ((i * 7 + j * 3) % 5) as f64 + (j * j) as f64 * 0.3);
        let qr = m.col_piv_qr();
        let order = pivoted_qr_order(m.as_ref());
        let qrm = qr.compute_thin_Q() * qr.thin_R();
        for (pos, &c) in order.iter().enumerate() {
            for i in 0..5 {
                assert!((qrm[(i, pos)] - m[(i, c)]).abs() < 1e-12);
            }
        }
    }
}
