//! Diagnostics of models with routed state partitions (SSE), after the SSE paper:
//!
//! - near-zero keys (Fig. 8): the share of key entries with |k| < 1e-5 after the key feature
//!   map, for the shared partition (every token) and for each routed partition (the tokens
//!   that write to it);
//! - gate receptive field (Fig. 10, measured on the last 128 tokens with a gate threshold of
//!   0.001): at query position t, the number of tokens s ≤ t whose write still has decay
//!   ∏_{u=s+1..t} a_u ≥ 0.001 at t, per key channel (per head for per-head decays). A routed
//!   partition decays only at the tokens routed to it, so its span counts the positions in
//!   between too; it is measured at the positions where the partition is read. Spans stop at
//!   the sequence start: `whole_prefix` is the fraction that reached it.

use anyhow::Result;
use candle_core::{DType, Tensor};
use serde::Serialize;

/// |k| below this counts as zero (the paper's Fig. 8).
pub const NEAR_ZERO: f32 = 1e-5;
/// Decay threshold of the receptive field (the paper's Fig. 10).
pub const RF_THRESHOLD: f64 = 1e-3;
/// Query positions of the receptive field: the last this many tokens of each sequence.
pub const RF_TOKENS: usize = 128;

#[derive(Debug, Clone, Serialize)]
pub struct NearZeroKeys {
    /// Share of the shared partition's key entries that are near zero.
    pub shared: f64,
    /// The same over every routed (token, partition) write.
    pub routed: f64,
    /// Per routed partition.
    pub partitions: Vec<f64>,
}

/// Receptive spans in tokens.
#[derive(Debug, Clone, Serialize)]
pub struct Span {
    pub mean: f64,
    pub std: f64,
    /// Fraction of spans that reached the start of the sequence (the span is a lower bound).
    pub whole_prefix: f64,
    pub count: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReceptiveField {
    pub threshold: f64,
    pub last_tokens: usize,
    pub shared: Span,
    pub routed: Span,
    pub partitions: Vec<Span>,
}

#[derive(Debug, Default, Clone)]
struct SpanAcc {
    sum: f64,
    sumsq: f64,
    n: usize,
    whole: usize,
}

impl SpanAcc {
    fn add(&mut self, span: usize, whole: bool) {
        let s = span as f64;
        self.sum += s;
        self.sumsq += s * s;
        self.n += 1;
        self.whole += whole as usize;
    }

    fn merge(&mut self, o: &SpanAcc) {
        self.sum += o.sum;
        self.sumsq += o.sumsq;
        self.n += o.n;
        self.whole += o.whole;
    }

    fn finish(&self) -> Span {
        let n = self.n.max(1) as f64;
        let mean = self.sum / n;
        Span {
            mean,
            std: (self.sumsq / n - mean * mean).max(0.0).sqrt(),
            whole_prefix: self.whole as f64 / n,
            count: self.n,
        }
    }
}

/// Per-layer accumulators.
#[derive(Debug, Default, Clone)]
pub struct PartitionAcc {
    /// (near-zero entries, entries): shared, then one per routed partition
    zeros: Vec<(f64, f64)>,
    /// shared, then one per routed partition
    spans: Vec<SpanAcc>,
}

/// Receptive spans of one channel whose log decay at step u is `g[u]` (0 where the state is not
/// updated), at query positions `positions`: for each t, the number of tokens s ≤ t whose write
/// survives to t with decay exp(Σ_{u=s+1..t} g[u]) ≥ `threshold`, and whether that is every
/// token 0..=t.
pub fn receptive_spans(g: &[f64], positions: &[usize], threshold: f64) -> Vec<(usize, bool)> {
    // c[s] = Σ_{u≤s} g[u] is non-increasing, and the decay from s to t is exp(c[t] - c[s]).
    let mut c = Vec::with_capacity(g.len());
    let mut acc = 0.0;
    for x in g {
        acc += x.min(0.0);
        c.push(acc);
    }
    let lim = threshold.ln();
    positions
        .iter()
        .map(|&t| {
            let first = c[..=t].partition_point(|&cs| c[t] - cs < lim);
            (t - first + 1, first == 0)
        })
        .collect()
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl PartitionAcc {
    /// Add one forward's keys [B, T, H, dk], log decays [B, T, H, c] (shared, routed) and
    /// routing [B, T, N].
    pub fn add(&mut self, keys: [&Tensor; 2], log_decays: [&Tensor; 2], selected: &Tensor) -> Result<()> {
        let (b, t, h, dk) = keys[0].dims4()?;
        let n = selected.dim(2)?;
        if self.zeros.is_empty() {
            self.zeros = vec![(0.0, 0.0); n + 1];
            self.spans = vec![SpanAcc::default(); n + 1];
        }
        let sel = host(selected)?;
        let row = h * dk;
        let near = |k: &[f32]| k.iter().filter(|x| x.abs() < NEAR_ZERO).count() as f64;
        let k1 = host(keys[0])?;
        self.zeros[0].0 += near(&k1);
        self.zeros[0].1 += k1.len() as f64;
        let k2 = host(keys[1])?;
        for (bt, k) in k2.chunks(row).enumerate() {
            let z = near(k);
            for p in 0..n {
                if sel[bt * n + p] > 0.0 {
                    self.zeros[p + 1].0 += z;
                    self.zeros[p + 1].1 += row as f64;
                }
            }
        }
        let c = log_decays[0].dim(3)?;
        let (g1, g2) = (host(log_decays[0])?, host(log_decays[1])?);
        let last: Vec<usize> = (t.saturating_sub(RF_TOKENS)..t).collect();
        let series = |g: &[f32], bi: usize, hi: usize, ci: usize| -> Vec<f64> {
            (0..t).map(|ti| g[((bi * t + ti) * h + hi) * c + ci] as f64).collect()
        };
        for bi in 0..b {
            for hi in 0..h {
                for ci in 0..c {
                    for (span, whole) in receptive_spans(&series(&g1, bi, hi, ci), &last, RF_THRESHOLD) {
                        self.spans[0].add(span, whole);
                    }
                    let g = series(&g2, bi, hi, ci);
                    for p in 0..n {
                        let on = |ti: usize| sel[(bi * t + ti) * n + p] > 0.0;
                        let gp: Vec<f64> = (0..t).map(|ti| if on(ti) { g[ti] } else { 0.0 }).collect();
                        let read: Vec<usize> = last.iter().copied().filter(|&ti| on(ti)).collect();
                        for (span, whole) in receptive_spans(&gp, &read, RF_THRESHOLD) {
                            self.spans[p + 1].add(span, whole);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn near_zero_keys(&self) -> NearZeroKeys {
        let share = |(z, n): (f64, f64)| z / n.max(1.0);
        let routed = self.zeros.iter().skip(1).fold((0.0, 0.0), |a, x| (a.0 + x.0, a.1 + x.1));
        NearZeroKeys {
            shared: share(self.zeros[0]),
            routed: share(routed),
            partitions: self.zeros.iter().skip(1).map(|&x| share(x)).collect(),
        }
    }

    pub fn receptive_field(&self) -> ReceptiveField {
        let mut routed = SpanAcc::default();
        self.spans.iter().skip(1).for_each(|s| routed.merge(s));
        ReceptiveField {
            threshold: RF_THRESHOLD,
            last_tokens: RF_TOKENS,
            shared: self.spans[0].finish(),
            routed: routed.finish(),
            partitions: self.spans.iter().skip(1).map(SpanAcc::finish).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn constant_decay_span() {
        // a = 0.5: 0.5^9 ≥ 1e-3 > 0.5^10, so the current token and 9 before it survive.
        let g = vec![0.5f64.ln(); 40];
        let s = receptive_spans(&g, &[3, 9, 10, 39], 1e-3);
        assert_eq!(s, vec![(4, true), (10, true), (10, false), (10, false)]);
    }

    #[test]
    fn steps_without_update_do_not_decay() {
        // Decays only at even steps: from t = 59 the 9 decays at 42..=58 reach back to s = 40.
        let g: Vec<f64> = (0..60).map(|u| if u % 2 == 0 { 0.5f64.ln() } else { 0.0 }).collect();
        assert_eq!(receptive_spans(&g, &[59], 1e-3), vec![(20, false)]);
        // No decay at all: everything survives.
        assert_eq!(receptive_spans(&[0.0; 7], &[6], 1e-3), vec![(7, true)]);
    }

    #[test]
    fn near_zero_and_spans_per_partition() {
        let dev = Device::Cpu;
        // B=1, T=4, H=1, dk=2; N=2 partitions, token t selects partition t % 2.
        let k1 = Tensor::new(&[[[[0.5f32, 0.5]], [[1.0, 0.0]], [[0.3, 0.7]], [[0.0, 1.0]]]], &dev).unwrap();
        let k2 = Tensor::new(&[[[[1.0f32, 1e-7]], [[0.2, 0.8]], [[1e-6, 1.0]], [[0.9, 0.1]]]], &dev).unwrap();
        let g = Tensor::full(0.5f32.ln(), (1, 4, 1, 1), &dev).unwrap();
        let sel = Tensor::new(&[[[1f32, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]], &dev).unwrap();
        let mut acc = PartitionAcc::default();
        acc.add([&k1, &k2], [&g, &g], &sel).unwrap();
        let z = acc.near_zero_keys();
        assert_eq!(z.shared, 2.0 / 8.0);
        assert_eq!(z.partitions, vec![2.0 / 4.0, 0.0]);
        assert_eq!(z.routed, 2.0 / 8.0);
        let rf = acc.receptive_field();
        // Shared: every position t spans t+1 tokens (0.5^3 > 1e-3).
        assert_eq!(rf.shared.mean, 2.5);
        assert_eq!(rf.shared.whole_prefix, 1.0);
        assert_eq!(rf.partitions[0].count, 2);
        assert_eq!(rf.partitions[0].mean, 2.0); // read at t = 0 and 2
        assert_eq!(rf.partitions[1].mean, 3.0); // read at t = 1 and 3
        assert_eq!(rf.routed.count, 4);
    }
}
