//! `inspect`: how much of its recurrent state a model uses, per layer and head.
//!
//! For each head: the stable rank er(S) = ‖S‖_F²/‖S‖_2² of the final state and its utilization
//! u = er/min(d_k, d_v) (averaged over calibration sequences), the normalised singular-value
//! energy entropy of S, and σ_max, σ_min, κ of the head's joint key/query activation matrix
//! M = [K_cal; Q_cal] (the quantities of the paper's Tables 5 and 6). Models with routed state
//! partitions (SSE) also get partition usage, near-zero keys and gate receptive fields
//! (`partitions`).

pub mod partitions;

use crate::arch::{CausalLm, Observer, StateLayout};
use crate::calib::Collector;
use crate::linalg::spectrum::{singular_values, SpectrumStats};
use anyhow::Result;
use candle_core::{DType, Tensor};
use faer::Mat;
use partitions::{NearZeroKeys, PartitionAcc, ReceptiveField};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize)]
pub struct HeadReport {
    pub head: usize,
    pub key_head: usize,
    pub stable_rank: f64,
    pub utilization: f64,
    pub entropy: f64,
    /// Mean |cosine| between distinct rows (key channels) of the state: near 1 means the rows
    /// are redundant copies of one direction.
    pub row_similarity: f64,
    pub sigma_max: f64,
    pub sigma_min: f64,
    pub kappa: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    pub layer: usize,
    pub heads: Vec<HeadReport>,
    /// Models with routed state partitions (SSE): the fraction of tokens routed to each
    /// partition (they sum to the number of partitions a token selects).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition_usage: Option<Vec<f64>>,
    /// SSE: share of near-zero key entries after the key feature map (see `partitions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_zero_keys: Option<NearZeroKeys>,
    /// SSE: gate receptive field in tokens (see `partitions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub receptive_field: Option<ReceptiveField>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub mean_stable_rank: f64,
    pub mean_utilization: f64,
    pub median_kappa: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    pub model: String,
    pub family: String,
    pub dk: usize,
    pub sequences: usize,
    pub seqlen: usize,
    pub layers: Vec<LayerReport>,
    pub summary: Summary,
    /// Mean normalised state spectra σ_i/σ_1 per layer and head (for plots), not serialised.
    #[serde(skip)]
    pub state_spectra: BTreeMap<usize, Vec<Vec<f64>>>,
    /// Joint key/query activation spectra per layer and key head, not serialised.
    #[serde(skip)]
    pub activation_spectra: BTreeMap<usize, Vec<Vec<f64>>>,
}

/// Mean |cos| over pairs of distinct non-zero rows of a row-major [rows, cols] matrix.
pub fn mean_row_cosine(m: &[f32], rows: usize, cols: usize) -> f64 {
    let unit: Vec<Vec<f64>> = m
        .chunks_exact(cols)
        .map(|r| {
            let n = r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            r.iter().map(|x| if n > 0.0 { *x as f64 / n } else { 0.0 }).collect()
        })
        .collect();
    let (mut sum, mut pairs) = (0.0, 0usize);
    for i in 0..rows {
        for j in i + 1..rows {
            sum += unit[i].iter().zip(&unit[j]).map(|(a, b)| a * b).sum::<f64>().abs();
            pairs += 1;
        }
    }
    if pairs == 0 {
        0.0
    } else {
        sum / pairs as f64
    }
}

/// Row-major f32 data as a faer matrix.
pub fn to_mat(rows: usize, cols: usize, data: &[f32]) -> Mat<f64> {
    Mat::from_fn(rows, cols, |i, j| data[i * cols + j] as f64)
}

#[derive(Default, Clone)]
struct StateAcc {
    er: f64,
    entropy: f64,
    row_sim: f64,
    spectrum: Vec<f64>,
    n: usize,
}

/// Observer that accumulates state statistics and samples key/query rows.
pub struct InspectObserver {
    pub collector: Collector,
    states: BTreeMap<usize, Vec<StateAcc>>,
    /// Per layer: tokens routed to each partition, and tokens seen.
    routing: BTreeMap<usize, (Vec<f64>, f64)>,
    partitions: BTreeMap<usize, PartitionAcc>,
}

impl InspectObserver {
    pub fn new(layout: &StateLayout, rows: usize, seed: u64) -> Self {
        Self {
            collector: Collector::new(layout, rows, seed),
            states: BTreeMap::new(),
            routing: BTreeMap::new(),
            partitions: BTreeMap::new(),
        }
    }
}

impl Observer for InspectObserver {
    fn wants_state(&self) -> bool {
        true
    }
    fn needs_logits(&self) -> bool {
        false
    }
    fn sequences(&mut self, first: usize, n: usize) -> Result<()> {
        self.collector.sequences(first, n)
    }
    fn qk_input(&mut self, layer: usize, x: &Tensor) -> Result<()> {
        self.collector.qk_input(layer, x)
    }
    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        self.collector.qk(layer, q, k)
    }
    fn routing(&mut self, layer: usize, selected: &Tensor) -> Result<()> {
        let (b, t, n) = selected.dims3()?;
        let counts = selected.to_dtype(DType::F32)?.reshape((b * t, n))?.sum(0)?.to_vec1::<f32>()?;
        let acc = self.routing.entry(layer).or_insert_with(|| (vec![0.0; n], 0.0));
        acc.0.iter_mut().zip(counts).for_each(|(a, c)| *a += c as f64);
        acc.1 += (b * t) as f64;
        Ok(())
    }
    fn partition_keys(
        &mut self,
        layer: usize,
        keys: [&Tensor; 2],
        log_decays: [&Tensor; 2],
        selected: &Tensor,
    ) -> Result<()> {
        self.partitions.entry(layer).or_default().add(keys, log_decays, selected)
    }
    fn state(&mut self, layer: usize, s: &Tensor) -> Result<()> {
        let (b, h, dk, dv) = s.dims4()?;
        let data = s.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let acc = self.states.entry(layer).or_insert_with(|| vec![StateAcc::default(); h]);
        for bi in 0..b {
            for (hi, a) in acc.iter_mut().enumerate() {
                let off = (bi * h + hi) * dk * dv;
                let sv = singular_values(to_mat(dk, dv, &data[off..off + dk * dv]).as_ref())?;
                let st = SpectrumStats::from_singular_values(&sv, dk.min(dv));
                a.er += st.stable_rank;
                a.entropy += st.entropy;
                a.row_sim += mean_row_cosine(&data[off..off + dk * dv], dk, dv);
                let top = sv.first().copied().unwrap_or(0.0).max(f64::MIN_POSITIVE);
                if a.spectrum.is_empty() {
                    a.spectrum = vec![0.0; sv.len()];
                }
                a.spectrum.iter_mut().zip(&sv).for_each(|(x, s)| *x += s / top);
                a.n += 1;
            }
        }
        Ok(())
    }
}

/// Run `sequences` through the model and build the report.
pub fn inspect(
    model: &dyn CausalLm,
    layout: &StateLayout,
    sequences: &[Vec<u32>],
    rows: usize,
    seed: u64,
    quiet: bool,
) -> Result<InspectReport> {
    let mut obs = InspectObserver::new(layout, rows, seed);
    if let Some(layers) = model.layers() {
        let seqs: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
        let pb = crate::stream::layer_bar(layers, "inspect", quiet);
        crate::stream::run_layer_major(layers, &seqs, 0, None, &mut obs, |_, _| Ok(()), pb)?;
    } else {
        let pb = crate::progress::bar(sequences.len() as u64, "inspect", quiet);
        for (i, seq) in sequences.iter().enumerate() {
            // Each sequence samples from its own streams, as in calibration, so that a
            // layer-streamed run draws the same rows.
            obs.collector.reseed_sequences(i, 1);
            let ids = Tensor::from_slice(seq, (1, seq.len()), model.device())?;
            model.forward(&ids, &mut obs)?;
            pb.inc(1);
        }
        pb.finish_and_clear();
    }
    obs.collector.sync()?;
    let dk = layout.dk;
    let mut layers = Vec::new();
    let (mut state_spectra, mut activation_spectra) = (BTreeMap::new(), BTreeMap::new());
    for l in &layout.layers {
        let calib = &obs.collector.layers[&l.layer];
        let mut act = Vec::new();
        let mut act_sv = Vec::new();
        for kh in 0..l.key_heads {
            let mut m = calib.keys.head(kh, dk);
            m.extend(calib.queries.head(kh, dk));
            let rows = m.len() / dk;
            let sv = singular_values(to_mat(rows, dk, &m).as_ref())?;
            act.push(SpectrumStats::from_singular_values(&sv, dk));
            act_sv.push(sv);
        }
        let accs = obs.states.get(&l.layer).cloned().unwrap_or_default();
        let r = (l.value_heads / l.key_heads).max(1);
        let heads: Vec<HeadReport> = accs
            .iter()
            .enumerate()
            .map(|(h, a)| {
                let n = a.n.max(1) as f64;
                let er = a.er / n;
                let s = &act[h / r];
                HeadReport {
                    head: h,
                    key_head: h / r,
                    stable_rank: er,
                    utilization: er / dk.min(l.dv) as f64,
                    entropy: a.entropy / n,
                    row_similarity: a.row_sim / n,
                    sigma_max: s.sigma_max,
                    sigma_min: s.sigma_min,
                    kappa: s.kappa,
                }
            })
            .collect();
        state_spectra
            .insert(l.layer, accs.iter().map(|a| a.spectrum.iter().map(|x| x / a.n.max(1) as f64).collect()).collect());
        activation_spectra.insert(l.layer, act_sv);
        let partition_usage =
            obs.routing.get(&l.layer).map(|(c, n)| c.iter().map(|x| x / n.max(1.0)).collect::<Vec<f64>>());
        let parts = obs.partitions.get(&l.layer);
        layers.push(LayerReport {
            layer: l.layer,
            heads,
            partition_usage,
            near_zero_keys: parts.map(PartitionAcc::near_zero_keys),
            receptive_field: parts.map(PartitionAcc::receptive_field),
        });
    }
    let all: Vec<&HeadReport> = layers.iter().flat_map(|l| &l.heads).collect();
    let n = all.len().max(1) as f64;
    let mut kappas: Vec<f64> = all.iter().map(|h| h.kappa).collect();
    kappas.sort_by(f64::total_cmp);
    let summary = Summary {
        mean_stable_rank: all.iter().map(|h| h.stable_rank).sum::<f64>() / n,
        mean_utilization: all.iter().map(|h| h.utilization).sum::<f64>() / n,
        median_kappa: kappas.get(kappas.len() / 2).copied().unwrap_or(f64::NAN),
    };
    Ok(InspectReport {
        model: String::new(),
        family: layout.family.clone(),
        dk,
        sequences: sequences.len(),
        seqlen: sequences.first().map_or(0, Vec::len),
        layers,
        summary,
        state_spectra,
        activation_spectra,
    })
}

/// The human-readable table.
pub fn render_table(r: &InspectReport) -> String {
    let mut s = format!(
        "{} ({}), d_k {}, {} sequences x {} tokens\n{:>5} {:>4} {:>8} {:>6} {:>6} {:>6} {:>9} {:>9} {:>9}\n",
        r.model,
        r.family,
        r.dk,
        r.sequences,
        r.seqlen,
        "layer",
        "head",
        "er(S)",
        "u",
        "H",
        "cos",
        "sigma_max",
        "sigma_min",
        "kappa"
    );
    for l in &r.layers {
        for h in &l.heads {
            s += &format!(
                "{:>5} {:>4} {:>8.2} {:>6.3} {:>6.3} {:>6.3} {:>9.3} {:>9.4} {:>9.1}\n",
                l.layer,
                h.head,
                h.stable_rank,
                h.utilization,
                h.entropy,
                h.row_similarity,
                h.sigma_max,
                h.sigma_min,
                h.kappa
            );
        }
    }
    for l in &r.layers {
        if let Some(u) = &l.partition_usage {
            let parts: Vec<String> = u.iter().map(|x| format!("{x:.3}")).collect();
            s += &format!("layer {} partition usage (fraction of tokens): {}\n", l.layer, parts.join(" "));
        }
        if let Some(z) = &l.near_zero_keys {
            let parts: Vec<String> = z.partitions.iter().map(|x| format!("{x:.3}")).collect();
            s += &format!(
                "layer {} near-zero keys (|k| < {:.0e}): shared {:.3}, routed {:.3} (per partition {})\n",
                l.layer,
                partitions::NEAR_ZERO,
                z.shared,
                z.routed,
                parts.join(" ")
            );
        }
        if let Some(rf) = &l.receptive_field {
            let parts: Vec<String> = rf.partitions.iter().map(|x| format!("{:.1}", x.mean)).collect();
            s += &format!(
                "layer {} receptive field (tokens, decay >= {}, last {} tokens): shared {:.1} +- {:.1}, routed {:.1} \
                 +- {:.1} (per partition {})\n",
                l.layer,
                rf.threshold,
                rf.last_tokens,
                rf.shared.mean,
                rf.shared.std,
                rf.routed.mean,
                rf.routed.std,
                parts.join(" ")
            );
        }
    }
    s += &format!(
        "mean er(S) {:.2}, mean utilization {:.3}, median kappa {:.1}\n",
        r.summary.mean_stable_rank, r.summary.mean_utilization, r.summary.median_kappa
    );
    s
}

#[cfg(test)]
mod tests {
    use super::mean_row_cosine;

    #[test]
    fn row_cosine() {
        assert_eq!(mean_row_cosine(&[1.0, 0.0, 0.0, 1.0], 2, 2), 0.0);
        assert!((mean_row_cosine(&[1.0, 1.0, -2.0, -2.0], 2, 2) - 1.0).abs() < 1e-12);
    }
}
