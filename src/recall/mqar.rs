//! Multi-query associative recall, generated as Zoology's `multiquery_ar` generates it: `pairs`
//! key-value pairs (keys distinct, from [1, V/2); values distinct, from [V/2, V)), then the
//! query section, where each key appears once at an even offset chosen with Zoology's power-law
//! gaps (a = 0.01, so recent slots are favoured), every other position a random token from [0, V).
//! The model must predict the key's value at the position of the key. `gap` random tokens are
//! put between the pairs and the query section (Zoology: 0).

use super::{argmax_rows, Bucket};
use crate::arch::{CausalLm, NoObserver};
use crate::cli::RecallArgs;
use anyhow::{bail, Result};
use candle_core::Tensor;
use rand::{rngs::StdRng, seq::index::sample, Rng, SeedableRng};

/// Zoology's default power-law exponent for the query positions.
const POWER_A: f64 = 0.01;

/// One generated sequence: tokens, and per query (in order of appearance) its position and the
/// index of its pair in the context.
pub(super) struct Example {
    pub tokens: Vec<u32>,
    pub queries: Vec<(usize, usize)>,
    pub values: Vec<u32>,
}

fn vocab_of(a: &RecallArgs, model_vocab: usize) -> usize {
    a.mqar_vocab.unwrap_or(model_vocab)
}

/// Slots of the query section: every second token after the pairs and the gap.
fn slots(a: &RecallArgs) -> usize {
    a.context_len.saturating_sub(2 * a.pairs + a.gap) / 2
}

pub(super) fn check(a: &RecallArgs, model_vocab: usize) -> Result<()> {
    let v = vocab_of(a, model_vocab);
    if v > model_vocab {
        bail!("--mqar-vocab {v} is larger than the model's vocabulary ({model_vocab})");
    }
    if a.pairs == 0 || v / 2 <= a.pairs {
        bail!(
            "mqar: --pairs {} needs a vocabulary of more than {} tokens (have {v}); lower --pairs",
            a.pairs,
            2 * a.pairs + 2
        );
    }
    if slots(a) < a.pairs {
        bail!(
            "mqar: --context-len {} is too short for {} pairs and a gap of {} (needs at least {})",
            a.context_len,
            a.pairs,
            a.gap,
            4 * a.pairs + a.gap
        );
    }
    Ok(())
}

/// Draw `n` distinct indices of 0..len with probability proportional to w_i = a (i+1)^(a-1),
/// one after another (numpy's `choice(replace=False, p=...)`).
fn power_law_slots(rng: &mut StdRng, len: usize, n: usize) -> Vec<usize> {
    let mut w: Vec<f64> = (0..len).map(|i| POWER_A * ((i + 1) as f64).powf(POWER_A - 1.0)).collect();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let total: f64 = w.iter().sum();
        let mut x = rng.random::<f64>() * total;
        let mut pick = len - 1;
        for (i, wi) in w.iter().enumerate() {
            if x < *wi && *wi > 0.0 {
                pick = i;
                break;
            }
            x -= wi;
        }
        // Rounding can land on an already-taken last slot: take the last free one instead.
        if w[pick] == 0.0 {
            pick = w.iter().rposition(|x| *x > 0.0).unwrap_or(0);
        }
        w[pick] = 0.0;
        out.push(pick);
    }
    out
}

/// The `i`-th sequence of a task (each sequence has its own seeded stream).
pub(super) fn example(a: &RecallArgs, vocab: usize, i: usize) -> Example {
    let mut rng = StdRng::seed_from_u64(a.task_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64 + 1));
    let half = vocab / 2;
    let keys: Vec<u32> = sample(&mut rng, half - 1, a.pairs).into_iter().map(|k| (k + 1) as u32).collect();
    let values: Vec<u32> = sample(&mut rng, vocab - half, a.pairs).into_iter().map(|v| (v + half) as u32).collect();
    let mut tokens: Vec<u32> = keys.iter().zip(&values).flat_map(|(k, v)| [*k, *v]).collect();
    let noise = |rng: &mut StdRng| rng.random_range(0..vocab as u32);
    for _ in 0..a.gap {
        tokens.push(noise(&mut rng));
    }
    let start = tokens.len();
    let chosen = power_law_slots(&mut rng, slots(a), a.pairs);
    let mut section: Vec<Option<u32>> = vec![None; a.context_len - start];
    for (pair, slot) in chosen.iter().enumerate() {
        section[2 * slot] = Some(keys[pair]);
    }
    let mut queries: Vec<(usize, usize)> = chosen.iter().enumerate().map(|(p, s)| (start + 2 * s, p)).collect();
    queries.sort_unstable();
    tokens.extend(section.into_iter().map(|t| t.unwrap_or_else(|| noise(&mut rng))));
    let values = queries.iter().map(|(_, p)| values[*p]).collect();
    Example { tokens, queries, values }
}

/// (correct, total, buckets by query order then by pair position).
pub(super) fn run(
    a: &RecallArgs,
    model: &dyn CausalLm,
    model_vocab: usize,
    quiet: bool,
) -> Result<(usize, usize, Vec<Bucket>)> {
    let vocab = vocab_of(a, model_vocab);
    let (mut by_query, mut by_pair) = (vec![0usize; a.pairs], vec![0usize; a.pairs]);
    let pb = crate::progress::bar(a.samples as u64, "mqar", quiet);
    let batch = 8;
    for first in (0..a.samples).step_by(batch) {
        let exs: Vec<Example> = (first..(first + batch).min(a.samples)).map(|i| example(a, vocab, i)).collect();
        let flat: Vec<u32> = exs.iter().flat_map(|e| e.tokens.iter().copied()).collect();
        let ids = Tensor::from_vec(flat, (exs.len(), a.context_len), model.device())?;
        let logits = model.forward(&ids, &mut NoObserver)?;
        for (b, e) in exs.iter().enumerate() {
            let pos: Vec<u32> = e.queries.iter().map(|(p, _)| *p as u32).collect();
            let idx = Tensor::from_vec(pos, e.queries.len(), model.device())?;
            let picked = argmax_rows(&logits.get(b)?.index_select(&idx, 0)?)?;
            for (q, ((_, pair), (got, want))) in e.queries.iter().zip(picked.iter().zip(&e.values)).enumerate() {
                if got == want {
                    by_query[q] += 1;
                    by_pair[*pair] += 1;
                }
            }
        }
        pb.inc(exs.len() as u64);
    }
    pb.finish_and_clear();
    let correct = by_query.iter().sum();
    let mut buckets: Vec<Bucket> =
        by_query.iter().enumerate().map(|(i, c)| Bucket::new(format!("query {}", i + 1), *c, a.samples)).collect();
    buckets.extend(by_pair.iter().enumerate().map(|(i, c)| Bucket::new(format!("pair {}", i + 1), *c, a.samples)));
    Ok((correct, a.samples * a.pairs, buckets))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> RecallArgs {
        RecallArgs {
            pairs: 8,
            gap: 5,
            context_len: 64,
            mqar_vocab: Some(100),
            lengths: vec![],
            depths: vec![],
            filler: None,
            samples: 4,
            task_seed: 3,
        }
    }

    #[test]
    fn examples_follow_the_format() {
        let a = args();
        let e = example(&a, 100, 0);
        assert_eq!(e.tokens.len(), 64);
        assert_eq!(e.queries.len(), 8);
        let start = 2 * a.pairs + a.gap;
        for ((pos, pair), v) in e.queries.iter().zip(&e.values) {
            assert!(*pos >= start && (pos - start).is_multiple_of(2));
            // The query is the pair's key and the target its value.
            assert_eq!(e.tokens[*pos], e.tokens[2 * pair]);
            assert_eq!(*v, e.tokens[2 * pair + 1]);
            assert!(e.tokens[2 * pair] >= 1 && e.tokens[2 * pair] < 50 && *v >= 50 && *v < 100);
        }
        // Seeded: the same example twice, another for the next index.
        assert_eq!(example(&a, 100, 0).tokens, e.tokens);
        assert_ne!(example(&a, 100, 1).tokens, e.tokens);
    }
}
