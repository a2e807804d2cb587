//! Score-based selectors (paper §3.4): per channel j of a head,
//! L1 s_j = ‖W_Q[j,:]‖_1 + ‖W_K[j,:]‖_1, S-Wanda s_j = Σ_i (|W_Q[j,i]| + |W_K[j,i]|)·‖X_:i‖,
//! Grad s_j = Σ_i |W_Q[j,i]·∂L/∂W_Q[j,i]| + |W_K[j,i]·∂L/∂W_K[j,i]|, Rand a seeded draw.

use rand::{rngs::StdRng, Rng, SeedableRng};

/// Row j of a row-major [rows, cols] buffer.
fn row(w: &[f32], cols: usize, j: usize) -> &[f32] {
    &w[j * cols..(j + 1) * cols]
}

/// `weights`: the head's projection rows (one [dk, D] block per q/k projection slice).
pub fn l1_scores(weights: &[Vec<f32>], dk: usize) -> Vec<f64> {
    (0..dk)
        .map(|j| weights.iter().map(|w| row(w, w.len() / dk, j).iter().map(|x| x.abs() as f64).sum::<f64>()).sum())
        .collect()
}

pub fn swanda_scores(weights: &[Vec<f32>], dk: usize, input_norms: &[f64]) -> Vec<f64> {
    (0..dk)
        .map(|j| {
            weights
                .iter()
                .map(|w| row(w, w.len() / dk, j).iter().zip(input_norms).map(|(x, n)| x.abs() as f64 * n).sum::<f64>())
                .sum()
        })
        .collect()
}

/// `grads`: the accumulated gradients matching `weights` block for block.
pub fn grad_scores(weights: &[Vec<f32>], grads: &[Vec<f32>], dk: usize) -> Vec<f64> {
    (0..dk)
        .map(|j| {
            weights
                .iter()
                .zip(grads)
                .map(|(w, g)| {
                    let c = w.len() / dk;
                    row(w, c, j).iter().zip(row(g, c, j)).map(|(a, b)| (a * b).abs() as f64).sum::<f64>()
                })
                .sum()
        })
        .collect()
}

/// Uniform random scores; the seed is mixed with the layer and head so heads differ.
pub fn rand_scores(dk: usize, seed: u64, layer: usize, head: usize) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ ((layer as u64) << 32) ^ (head as u64).wrapping_mul(0x9e37_79b9));
    (0..dk).map(|_| rng.random::<f64>()).collect()
}

/// Indices of the k largest scores, sorted ascending; ties go to the lower index.
pub fn top_k(scores: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut kept = idx[..k.min(idx.len())].to_vec();
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_deterministic_on_ties() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 0.5, 3.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[2.0, 2.0, 2.0], 3), vec![0, 1, 2]);
    }

    #[test]
    fn scores_by_hand() {
        // dk = 2 channels, D = 3 inputs; q and k blocks.
        let q = vec![1.0, -2.0, 0.0, 0.5, 0.5, 0.5];
        let k = vec![0.0, 0.0, 1.0, -1.0, 0.0, 0.0];
        let w = [q, k];
        assert_eq!(l1_scores(&w, 2), vec![4.0, 2.5]);
        assert_eq!(swanda_scores(&w, 2, &[1.0, 0.0, 2.0]), vec![3.0, 2.5]);
        let g = [vec![1.0; 6], vec![2.0; 6]];
        assert_eq!(grad_scores(&w, &g, 2), vec![5.0, 3.5]);
        assert_ne!(rand_scores(8, 0, 0, 0), rand_scores(8, 0, 0, 1));
        assert_eq!(rand_scores(8, 5, 2, 1), rand_scores(8, 5, 2, 1));
    }
}
