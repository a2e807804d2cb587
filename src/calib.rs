//! Calibration statistics gathered while the model runs: uniform samples of key/query rows per
//! layer (reservoirs, memory bounded by `rows`, not by the calibration set) and per-feature
//! norms of the q/k projection inputs.

use crate::arch::{LayerState, Observer, StateLayout};
use anyhow::Result;
use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// A uniform sample of at most `cap` rows of width `width` (Vitter's algorithm R).
///
/// Rows offered from a GPU stay there (`on_device`, [cap, width] in the activations' dtype)
/// until [`Self::sync`] copies them into `rows`: only the final sample crosses to the host, not
/// every row that is kept for a while.
#[derive(Debug, Clone)]
pub struct Reservoir {
    pub cap: usize,
    pub width: usize,
    pub seen: u64,
    pub rows: Vec<f32>,
    /// Slots handed out by [`Self::plan`], which may run ahead of `rows` until [`Self::place`].
    planned: usize,
    on_device: Option<Tensor>,
}

impl Reservoir {
    pub fn new(cap: usize, width: usize) -> Self {
        Self { cap, width, seen: 0, rows: Vec::new(), planned: 0, on_device: None }
    }

    pub fn len(&self) -> usize {
        self.rows.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Slots filled so far: the host rows, or more once plans have run ahead of them (rows
    /// placed on a device reach `rows` only at [`Self::sync`]).
    fn slots(&self) -> usize {
        self.len().max(self.planned)
    }

    /// Where each of `n` offered rows goes: (row, slot), slot == current length meaning append;
    /// rows not kept are absent. It depends only on counts and the RNG, never on the values, so
    /// the kept rows can be picked on the device before anything is copied to the host. Several
    /// plans may be made before their rows are placed, as long as they are placed in order.
    pub fn plan(&mut self, n: usize, rng: &mut StdRng) -> Vec<(usize, usize)> {
        let mut len = self.slots();
        let mut out = Vec::new();
        for r in 0..n {
            if len < self.cap {
                out.push((r, len));
                len += 1;
            } else {
                let j = rng.random_range(0..=self.seen);
                if (j as usize) < self.cap {
                    out.push((r, j as usize));
                }
            }
            self.seen += 1;
        }
        self.planned = len;
        out
    }

    /// Store the rows a [`Self::plan`] kept, given in plan order as a row-major buffer.
    pub fn place(&mut self, plan: &[(usize, usize)], rows: &[f32]) {
        for ((_, slot), row) in plan.iter().zip(rows.chunks_exact(self.width)) {
            if *slot == self.len() {
                self.rows.extend_from_slice(row);
            } else {
                self.rows[slot * self.width..(slot + 1) * self.width].copy_from_slice(row);
            }
        }
    }

    /// Store the rows a [`Self::plan`] kept, given in plan order as a [n, width] tensor on a GPU,
    /// in the reservoir's device buffer (rows already on the host are moved there first).
    fn place_on_device(&mut self, plan: &[(usize, usize)], rows: &Tensor) -> Result<()> {
        let dev = rows.device();
        if self.on_device.is_none() {
            let buf = Tensor::zeros((self.cap, self.width), rows.dtype(), dev)?;
            let have = self.len();
            if have > 0 {
                let host = Tensor::from_slice(&self.rows, (have, self.width), dev)?.to_dtype(rows.dtype())?;
                buf.slice_set(&host, 0, 0)?;
            }
            self.on_device = Some(buf);
        }
        if plan.is_empty() {
            return Ok(());
        }
        // The new buffer is one gather from [old buffer; offered rows]: slot s takes its old row
        // or, if written, the last row written to it (as in `place`). candle's scatter walks the
        // written rows serially per column, which made this a large share of a calibration pass.
        let mut from: Vec<u32> = (0..self.cap as u32).collect();
        for (i, (_, slot)) in plan.iter().enumerate() {
            from[*slot] = (self.cap + i) as u32;
        }
        let buf = self.on_device.take().expect("allocated above");
        let both = Tensor::cat(&[&buf, &rows.to_dtype(buf.dtype())?], 0)?;
        self.on_device = Some(both.index_select(&Tensor::from_vec(from, self.cap, dev)?, 0)?);
        Ok(())
    }

    /// The filled rows of the device buffer (a contiguous view of its leading rows).
    fn device_rows(&self) -> Result<Tensor> {
        let buf = self.on_device.as_ref().ok_or_else(|| anyhow::anyhow!("no rows on a device"))?;
        Ok(buf.narrow(0, 0, self.slots())?)
    }

    /// Widen a [`HostCopy`] of [`Self::device_rows`] into `rows` (float32).
    fn land(&mut self, copied: HostCopy) -> Result<()> {
        self.rows = copied.widen()?;
        Ok(())
    }

    /// Offer every row of a row-major [n, width] buffer.
    pub fn offer(&mut self, data: &[f32], rng: &mut StdRng) {
        let plan = self.plan(data.len() / self.width, rng);
        let rows: Vec<f32> =
            plan.iter().flat_map(|(r, _)| data[r * self.width..(r + 1) * self.width].iter().copied()).collect();
        self.place(&plan, &rows);
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
    /// One (keys, queries) sampling stream per sequence of the batch in flight, so that a
    /// sequence's sample does not depend on the batch it ran in.
    rngs: Vec<(StdRng, StdRng)>,
    /// Skip the first `skip` tokens of each sequence (warm-up of the state), as in the paper's plots.
    pub skip: usize,
    /// Whether the forward must produce logits (only the Grad selector's loss needs them).
    pub need_logits: bool,
    /// Per layer: Σ x² (float64) of the inputs seen since the last [`Collector::sync`], on the
    /// inputs' device, and their token count.
    pending: BTreeMap<usize, (Tensor, u64)>,
    /// Seed of the run: sequence i samples from the streams of [`sequence_seed`]`(seed, i)`.
    seed: u64,
    /// Layer-streamed runs: the sampling streams of sequences not in flight, where the last
    /// layer they went through left them, and the first sequence in flight.
    parked: BTreeMap<usize, (StdRng, StdRng)>,
    in_flight: Option<usize>,
}

/// The seed of sequence `i`'s sampling streams in a run seeded with `seed`.
pub fn sequence_seed(seed: u64, i: usize) -> u64 {
    seed.wrapping_add(i as u64 * 0x1000_0000_01b3)
}

fn streams(seed: u64) -> (StdRng, StdRng) {
    (StdRng::seed_from_u64(seed), StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15))
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
            rngs: vec![streams(seed)],
            skip: 0,
            need_logits: true,
            pending: BTreeMap::new(),
            seed,
            parked: BTreeMap::new(),
            in_flight: None,
        }
    }

    /// Bring what the forward passes left on the device to the host: the sampled rows of every
    /// reservoir and the input sums (into [`LayerCalib::input_sq`]). Call before reading or
    /// saving the statistics.
    pub fn sync(&mut self) -> Result<()> {
        for (layer, (sq, n)) in std::mem::take(&mut self.pending) {
            let l = self.layers.get_mut(&layer).expect("pending sums are only kept for collected layers");
            let sq = sq.to_vec1::<f64>()?;
            if l.input_sq.is_empty() {
                l.input_sq = vec![0.0; sq.len()];
            }
            l.input_sq.iter_mut().zip(sq).for_each(|(a, b)| *a += b);
            l.input_count += n;
        }
        // 48 reservoirs of 2,500 x 2,048 bf16 rows at the 1.3B shapes: about 0.5 GB copied and
        // 1 GB of float32 written into fresh pages, which one thread took 0.6-1.1 s over. On a
        // GPU through page-locked staging, each buffer widened on every core while the next
        // copies; else the copies one after another, then the widening on every core.
        let mut held: Vec<&mut Reservoir> = Vec::new();
        for l in self.layers.values_mut() {
            held.extend([&mut l.keys, &mut l.queries].into_iter().filter(|r| r.on_device.is_some()));
        }
        let bufs = held.iter().map(|r| r.device_rows()).collect::<Result<Vec<_>>>()?;
        if let Some(rows) = crate::ops::gpu_to_host_f32(&bufs)? {
            held.into_iter().zip(rows).for_each(|(r, rows)| r.rows = rows);
            return Ok(());
        }
        let copies = bufs.iter().map(HostCopy::of).collect::<Result<Vec<_>>>()?;
        held.into_par_iter().zip(copies).try_for_each(|(r, c)| r.land(c))
    }

    /// Re-seed (used when resuming so that continued runs stay deterministic).
    pub fn reseed(&mut self, seed: u64) {
        self.reseed_batch(&[seed]);
    }

    /// One seed per sequence of the next forward pass's batch.
    pub fn reseed_batch(&mut self, seeds: &[u64]) {
        self.rngs = seeds.iter().map(|&s| streams(s)).collect();
    }

    /// Sample the next forward pass's batch as sequences `first..first + n` of the run.
    pub fn reseed_sequences(&mut self, first: usize, n: usize) {
        let seeds: Vec<u64> = (first..first + n).map(|i| sequence_seed(self.seed, i)).collect();
        self.reseed_batch(&seeds);
    }

    /// Layer-streamed runs: continue sequences `first..first + n` with the streams they left
    /// off with at the previous layer (fresh ones at the first), parking those in flight.
    /// Each sequence's streams are drawn from in the same order as in a resident run, layer
    /// after layer, so the samples are the same.
    fn continue_sequences(&mut self, first: usize, n: usize) {
        if let Some(prev) = self.in_flight.take() {
            for (i, s) in std::mem::take(&mut self.rngs).into_iter().enumerate() {
                self.parked.insert(prev + i, s);
            }
        }
        let seed = self.seed;
        self.rngs = (first..first + n)
            .map(|i| self.parked.remove(&i).unwrap_or_else(|| streams(sequence_seed(seed, i))))
            .collect();
        self.in_flight = Some(first);
    }
}

/// Offer the rows of every sequence of x [B, T, W] (minus the first `skip` of each) to `res`,
/// sequence i drawing from `pick(rngs[i])` (all from `rngs[0]` when there is one stream: a
/// batch without per-sequence seeds is sampled as one stream, in order), copying only the kept
/// rows off the device, in one gather and one copy.
fn offer_rows(
    res: &mut Reservoir,
    x: &Tensor,
    skip: usize,
    rngs: &mut [(StdRng, StdRng)],
    pick: fn(&mut (StdRng, StdRng)) -> &mut StdRng,
) -> Result<()> {
    let (b, t, w) = x.dims3()?;
    let skip = if t > skip { skip } else { 0 };
    let mut plans = Vec::with_capacity(b);
    let mut idx: Vec<u32> = Vec::new();
    for i in 0..b {
        let streams = if rngs.len() == b { &mut rngs[i] } else { &mut rngs[0] };
        let plan = res.plan(t - skip, pick(streams));
        idx.extend(plan.iter().map(|(r, _)| (i * t + r + skip) as u32));
        plans.push(plan);
    }
    if idx.is_empty() {
        return Ok(());
    }
    let n = idx.len();
    let idx = Tensor::from_vec(idx, n, x.device())?;
    let picked = x.reshape((b * t, w))?.index_select(&idx, 0)?;
    if !x.device().is_cpu() {
        return res.place_on_device(&plans.concat(), &picked);
    }
    let rows = HostCopy::of(&picked)?.widen()?;
    let mut at = 0;
    for plan in &plans {
        res.place(plan, &rows[at * w..(at + plan.len()) * w]);
        at += plan.len();
    }
    Ok(())
}

/// A contiguous tensor's values on the host as stored (its own dtype): the whole buffer behind it,
/// copied once, and the range it covers. candle's `to_vec1` copies a GPU buffer and then the range
/// again, and a float32 copy made on the GPU doubles what crosses the bus.
struct HostCopy {
    data: candle_core::CpuStorage,
    range: std::ops::Range<usize>,
}

impl HostCopy {
    fn of(x: &Tensor) -> Result<Self> {
        let (storage, layout) = x.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else {
            anyhow::bail!("calibration rows: the device buffer is not contiguous")
        };
        let data = match &*storage {
            candle_core::Storage::Cpu(s) => s.clone(),
            candle_core::Storage::Cuda(s) => candle_core::backend::BackendStorage::to_cpu_storage(s)?,
            candle_core::Storage::Metal(s) => candle_core::backend::BackendStorage::to_cpu_storage(s)?,
        };
        Ok(Self { data, range: a..b })
    }

    /// The values as float32 (exact from bf16 and f16; float64 rounded as candle's cast rounds it).
    fn widen(self) -> Result<Vec<f32>> {
        use candle_core::CpuStorage as C;
        let r = self.range;
        Ok(match self.data {
            C::BF16(v) => v[r].iter().map(|x| f32::from(*x)).collect(),
            C::F16(v) => v[r].iter().map(|x| f32::from(*x)).collect(),
            C::F32(v) if r.start == 0 && r.end == v.len() => v,
            C::F32(v) => v[r].to_vec(),
            C::F64(v) => v[r].iter().map(|x| *x as f32).collect(),
            other => anyhow::bail!(
                "calibration rows: unexpected dtype {:?}",
                candle_core::backend::BackendStorage::dtype(&other)
            ),
        })
    }
}

impl Observer for Collector {
    fn needs_logits(&self) -> bool {
        self.need_logits
    }

    fn sequences(&mut self, first: usize, n: usize) -> Result<()> {
        self.continue_sequences(first, n);
        Ok(())
    }

    fn qk_input(&mut self, layer: usize, x: &Tensor) -> Result<()> {
        if !self.layers.contains_key(&layer) {
            return Ok(());
        }
        // What the observer keeps must not hold the pass's autograd graph (with --grad every
        // sequence's graph would stay alive until `sync`).
        let x = &x.detach();
        let d = x.dim(2)?;
        let n = x.elem_count() / d;
        // Each pass's float32 sum is accumulated in float64, left on the device until `sync` so
        // that the forward pass does not wait for the host.
        let sq = if x.device().is_cpu() {
            // Σ over tokens as a [1, n] x [n, d] product: a column sum candle would do strided.
            let x = x.to_dtype(DType::F32)?;
            let ones = Tensor::ones((1, n), DType::F32, x.device())?;
            ones.matmul(&x.sqr()?.reshape((n, d))?)?.squeeze(0)?
        } else {
            // One pass over x in its own dtype instead of four float32 ones.
            crate::ops::prep::column_sums_of_squares(x)?
        };
        let sq = sq.to_dtype(DType::F64)?;
        let acc = match self.pending.remove(&layer) {
            Some((a, c)) => ((a + sq)?, c + n as u64),
            None => (sq, n as u64),
        };
        self.pending.insert(layer, acc);
        crate::profile::mark("observer: input norms", x.device());
        Ok(())
    }

    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        let skip = self.skip;
        let Some(l) = self.layers.get_mut(&layer) else { return Ok(()) };
        let (q, k) = (q.detach(), k.detach());
        let (b, t, h, d) = k.dims4()?;
        offer_rows(&mut l.keys, &k.reshape((b, t, h * d))?, skip, &mut self.rngs, |s| &mut s.0)?;
        offer_rows(&mut l.queries, &q.reshape((b, t, h * d))?, skip, &mut self.rngs, |s| &mut s.1)?;
        crate::profile::mark("observer: sample rows", k.device());
        Ok(())
    }
}

/// What a calibration run was asked to do (recorded in the activations file).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct CalibSettings {
    pub nsamples: usize,
    pub seqlen: usize,
    pub seed: u64,
    pub rows: usize,
    pub grad: bool,
    pub source: String,
}

/// Identifies the model an activations file belongs to.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ModelFingerprint {
    pub family: String,
    pub dk: usize,
    pub hidden: usize,
    /// (layer, key_heads, value_heads, dv) of every prunable layer.
    pub layers: Vec<(usize, usize, usize, usize)>,
    /// sha256 of the key/query projection weights ([`qk_sha256`]): tells same-shaped models
    /// apart. Absent in files written before it was recorded.
    #[serde(default)]
    pub weights: Option<String>,
}

/// sha256 over the names and stored bytes of the key/query projection tensors of `layout`, in
/// name order (pickled checkpoints: their float32 values).
pub fn qk_sha256(ckpt: &crate::checkpoint::Checkpoint, layout: &StateLayout) -> Result<String> {
    use crate::arch::SliceRole;
    use sha2::Digest;
    let names: std::collections::BTreeSet<&str> = layout
        .layers
        .iter()
        .flat_map(|l| &l.slices)
        .filter(|s| matches!(s.role, SliceRole::QueryProj | SliceRole::KeyProj))
        .map(|s| s.tensor.as_str())
        .collect();
    let mut h = sha2::Sha256::new();
    for name in names {
        h.update(name.as_bytes());
        let info = ckpt.info(name)?;
        if info.bytes.is_empty() {
            h.update(
                ckpt.tensor_f32(name)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
        } else {
            h.update(crate::checkpoint::read_bytes(info)?);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

impl ModelFingerprint {
    pub fn of(layout: &StateLayout, hidden: usize) -> Self {
        Self {
            family: layout.family.clone(),
            dk: layout.dk,
            hidden,
            layers: layout.layers.iter().map(|l| (l.layer, l.key_heads, l.value_heads, l.dv)).collect(),
            weights: None,
        }
    }
}

/// Everything calibration produces.
pub struct Calibration {
    pub settings: CalibSettings,
    pub fingerprint: ModelFingerprint,
    pub collector: Collector,
    /// Σ over sequences of dL/dW for each key/query projection (by checkpoint tensor name).
    pub grad_sum: BTreeMap<String, Tensor>,
    pub sequences_done: usize,
    pub tokens: usize,
    /// Field of jsonl/parquet calibration text that held the text.
    pub text_column: String,
    /// sha256 (hex) of the file this calibration was loaded from.
    pub sha256: Option<String>,
}

/// Sequences per forward pass when the user gives none: one on the CPU (the kernels already use
/// every core); on a GPU up to 16384 tokens' worth, fewer when the free memory (read after the
/// model is loaded) would not hold them, with a backward pass's activations of every one of
/// `blocks` layers under `--grad`.
fn auto_batch(device: &candle_core::Device, seqlen: usize, grad: bool, hidden: usize, blocks: usize) -> usize {
    if device.is_cpu() {
        return 1;
    }
    let free = crate::device::free_memory(device);
    if grad {
        grad_batch(free, seqlen, hidden, blocks)
    } else {
        crate::stream::gpu_batch(free, seqlen, hidden)
    }
}

/// Bytes a `--grad` pass holds per token, per unit of hidden width and per decoder layer until its
/// backward ends (the graph and the gradients of the composed chunked recurrence): above the 536
/// that Gated DeltaNet 1.3B measured on an H200 in bf16 (54 GB more for a second sequence of 2048
/// tokens, docs/BENCHMARKS.md).
const GRAD_BYTES_PER_TOKEN_PER_HIDDEN_PER_BLOCK: usize = 576;

/// Sequences per `--grad` pass on a GPU with `free` bytes free (unknown: one), using at most half.
pub(crate) fn grad_batch(free: Option<usize>, seqlen: usize, hidden: usize, blocks: usize) -> usize {
    let per_sequence = GRAD_BYTES_PER_TOKEN_PER_HIDDEN_PER_BLOCK * seqlen.max(1) * hidden.max(1) * blocks.max(1);
    free.map_or(1, |free| (free / 2 / per_sequence).clamp(1, 16384 / seqlen.max(1)).max(1))
}

impl Calibration {
    pub fn new(settings: CalibSettings, layout: &StateLayout, hidden: usize) -> Self {
        Self {
            collector: Collector::new(layout, settings.rows, settings.seed),
            fingerprint: ModelFingerprint::of(layout, hidden),
            settings,
            grad_sum: BTreeMap::new(),
            sequences_done: 0,
            tokens: 0,
            text_column: "text".into(),
            sha256: None,
        }
    }

    /// Run the remaining sequences through `model`, `batch` sequences of equal length per forward
    /// pass (`None`: chosen for the device), saving every `save_every` sequences. The sampled rows
    /// do not depend on the batch size.
    pub fn run(
        &mut self,
        model: &dyn crate::arch::CausalLm,
        seqs: &[Vec<u32>],
        batch: Option<usize>,
        save: Option<(&std::path::Path, usize)>,
        quiet: bool,
    ) -> Result<()> {
        self.collector.need_logits = self.settings.grad;
        // Charges the time since the last profiled event, if any, to "calibrate: setup", and
        // starts the clock of the pass: what follows up to its first span is "between spans".
        crate::profile::mark("calibrate: setup", model.device());
        if let Some(layers) = model.layers() {
            return self.run_layer_major(layers, seqs, batch, quiet);
        }
        let pb = crate::progress::bar(seqs.len() as u64, "calibrate", quiet);
        pb.set_position(self.sequences_done as u64);
        let hidden = self.fingerprint.hidden;
        let batch = batch.unwrap_or_else(|| {
            auto_batch(model.device(), self.settings.seqlen, self.settings.grad, hidden, model.num_blocks())
        });
        while self.sequences_done < seqs.len() {
            let first = self.sequences_done;
            let len = seqs[first].len();
            let n = seqs[first..].iter().take(batch.max(1)).take_while(|s| s.len() == len).count();
            // Deterministic across interruptions and batch sizes: each sequence has its own stream.
            self.collector.reseed_sequences(first, n);
            let flat: Vec<u32> = seqs[first..first + n].iter().flatten().copied().collect();
            let ids = Tensor::from_vec(flat, (n, len), model.device())?;
            let logits = model.forward(&ids, &mut self.collector)?;
            crate::stream::note_device_memory(model.device());
            if self.settings.grad {
                let logits = logits.narrow(1, 0, len - 1)?.reshape((n * (len - 1), ()))?;
                let targets = ids.narrow(1, 1, len - 1)?.flatten_all()?;
                // Σ over sequences of each sequence's mean token loss, as with one sequence per
                // pass; the cross-entropy in one op over the logits, float32 inside.
                let ce = crate::ops::distill::kd_rows(&logits, None, &targets, 1.0)?.narrow(1, 0, 1)?;
                let loss = (ce.sum_all()? / (len - 1) as f64)?;
                let grads = loss.backward()?;
                for (name, var) in model.grad_vars() {
                    let g = grads.get(var.as_tensor()).ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
                    let g = g.to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)?;
                    let acc = match self.grad_sum.remove(name) {
                        Some(a) => (a + g)?,
                        None => g,
                    };
                    self.grad_sum.insert(name.clone(), acc);
                }
            }
            self.sequences_done += n;
            self.tokens += n * len;
            pb.inc(n as u64);
            if let Some((path, every)) = save {
                let crossed = every > 0 && self.sequences_done / every > first / every;
                // SIGINT/SIGTERM during a resumable run: save what is done, then stop.
                let stop = crate::signals::pending().filter(|_| self.sequences_done < seqs.len());
                if (crossed || stop.is_some()) && self.sequences_done < seqs.len() {
                    self.collector.sync()?;
                    self.save(path, false)?;
                }
                if let Some(sig) = stop {
                    crate::signals::exit(sig, Some(path));
                }
            }
        }
        pb.finish_and_clear();
        crate::profile::mark("outside forward", model.device());
        self.collector.sync()?;
        crate::profile::mark("observer: rows to the host", model.device());
        self.check_finite()
    }

    /// [`Self::run`] on a layer-streamed model: all remaining sequences through each layer in
    /// turn. Gradients need every layer at once (refused when the model was opened), and
    /// partial saves need every layer done for some sequences, so neither happens here.
    fn run_layer_major(
        &mut self,
        layers: &dyn crate::arch::layered::Layers,
        seqs: &[Vec<u32>],
        batch: Option<usize>,
        quiet: bool,
    ) -> Result<()> {
        if self.settings.grad {
            anyhow::bail!("--grad needs every layer resident for the backward pass; it cannot run layer-streamed");
        }
        let first = self.sequences_done;
        let rest: Vec<&[u32]> = seqs[first..].iter().map(Vec::as_slice).collect();
        let pb = crate::stream::layer_bar(layers, "calibrate", quiet);
        crate::stream::run_layer_major(layers, &rest, first, batch, &mut self.collector, |_, _| Ok(()), pb)?;
        self.sequences_done = seqs.len();
        self.tokens += rest.iter().map(|s| s.len()).sum::<usize>();
        self.collector.sync()?;
        self.check_finite()
    }

    fn check_finite(&self) -> Result<()> {
        for (layer, l) in &self.collector.layers {
            if l.keys.rows.iter().chain(&l.queries.rows).any(|x| !x.is_finite()) {
                anyhow::bail!(
                    "layer {layer}: key/query activations contain NaN/inf; the model produced non-finite values (try --dtype f32)"
                );
            }
        }
        Ok(())
    }

    /// Save to `path` (atomically: written beside it, then renamed).
    pub fn save(&self, path: &std::path::Path, complete: bool) -> Result<()> {
        use std::collections::HashMap;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut seen = BTreeMap::new();
        for (layer, l) in &self.collector.layers {
            let w = l.keys.width;
            tensors.push((
                format!("layers.{layer}.keys"),
                Tensor::from_slice(&l.keys.rows, (l.keys.len(), w), &candle_core::Device::Cpu)?,
            ));
            tensors.push((
                format!("layers.{layer}.queries"),
                Tensor::from_slice(&l.queries.rows, (l.queries.len(), w), &candle_core::Device::Cpu)?,
            ));
            tensors.push((
                format!("layers.{layer}.input_sq"),
                Tensor::from_slice(&l.input_sq, l.input_sq.len(), &candle_core::Device::Cpu)?,
            ));
            seen.insert(*layer, (l.keys.seen, l.queries.seen, l.input_count));
        }
        for (name, g) in &self.grad_sum {
            tensors.push((format!("grad_sum.{name}"), g.clone()));
        }
        let mut meta = HashMap::new(); // written in key order (write_tensors_atomic)
        meta.insert("format".to_string(), "statecut-activations-v1".to_string());
        meta.insert("settings".to_string(), serde_json::to_string(&self.settings)?);
        meta.insert("fingerprint".to_string(), serde_json::to_string(&self.fingerprint)?);
        meta.insert("seen".to_string(), serde_json::to_string(&seen)?);
        meta.insert("sequences_done".to_string(), self.sequences_done.to_string());
        meta.insert("tokens".to_string(), self.tokens.to_string());
        meta.insert("complete".to_string(), complete.to_string());
        meta.insert("text_column".to_string(), self.text_column.clone());
        meta.insert("statecut_version".to_string(), env!("CARGO_PKG_VERSION").to_string());
        crate::surgery::write_tensors_atomic(path, &tensors, meta)
    }

    /// Load a file written by [`Calibration::save`].
    pub fn load(path: &std::path::Path, layout: &StateLayout) -> Result<(Self, bool)> {
        use anyhow::Context;
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .with_context(|| format!("{} is not a safetensors file", path.display()))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some("statecut-activations-v1") {
            anyhow::bail!(
                "{} is not a statecut activations file (write one with `statecut calibrate`)",
                path.display()
            );
        }
        let get = |k: &str| meta.get(k).with_context(|| format!("{}: missing metadata {k}", path.display()));
        let settings: CalibSettings = serde_json::from_str(get("settings")?)?;
        let fingerprint: ModelFingerprint = serde_json::from_str(get("fingerprint")?)?;
        let seen: BTreeMap<usize, (u64, u64, u64)> = serde_json::from_str(get("seen")?)?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)?;
        let mut cal = Calibration::new(settings, layout, fingerprint.hidden);
        // The weights are compared by [`Calibration::check_weights`], which needs the checkpoint.
        cal.fingerprint.weights = fingerprint.weights.clone();
        if cal.fingerprint != fingerprint {
            anyhow::bail!(
                "{} was calibrated on another model ({} d_k {} with {} layers; this model is {} d_k {} with {} layers)",
                path.display(),
                fingerprint.family,
                fingerprint.dk,
                fingerprint.layers.len(),
                cal.fingerprint.family,
                cal.fingerprint.dk,
                cal.fingerprint.layers.len()
            );
        }
        for (layer, l) in cal.collector.layers.iter_mut() {
            let t = |k: &str| {
                tensors
                    .get(&format!("layers.{layer}.{k}"))
                    .with_context(|| format!("{}: missing layers.{layer}.{k}", path.display()))
            };
            // A file edited or written by something else must not pass for this layout's rows.
            let sample = |k: &str, r: &Reservoir| -> Result<Vec<f32>> {
                let x = t(k)?;
                match x.dims() {
                    [n, w] if *n <= r.cap && *w == r.width && x.dtype() == DType::F32 => {}
                    d => anyhow::bail!(
                        "{}: layers.{layer}.{k} is {:?} {d:?}, expected F32 [at most {}, {}]; re-run `statecut calibrate`",
                        path.display(),
                        x.dtype(),
                        r.cap,
                        r.width
                    ),
                }
                Ok(x.flatten_all()?.to_vec1::<f32>()?)
            };
            l.keys.rows = sample("keys", &l.keys)?;
            l.queries.rows = sample("queries", &l.queries)?;
            let sq = t("input_sq")?;
            if sq.rank() != 1
                || sq.dtype() != DType::F64
                || (fingerprint.hidden > 0 && sq.dim(0)? != fingerprint.hidden)
            {
                anyhow::bail!(
                    "{}: layers.{layer}.input_sq is {:?} {:?}, expected F64 [{}]; re-run `statecut calibrate`",
                    path.display(),
                    sq.dtype(),
                    sq.dims(),
                    fingerprint.hidden
                );
            }
            l.input_sq = sq.to_vec1::<f64>()?;
            let (ks, qs, ic) = seen.get(layer).copied().unwrap_or_default();
            (l.keys.seen, l.queries.seen, l.input_count) = (ks, qs, ic);
        }
        for (name, t) in tensors {
            if let Some(n) = name.strip_prefix("grad_sum.") {
                cal.grad_sum.insert(n.to_string(), t);
            }
        }
        cal.sequences_done = get("sequences_done")?.parse()?;
        cal.tokens = get("tokens")?.parse()?;
        let complete = get("complete")? == "true";
        // Files written before the column was recorded were made with the default.
        cal.text_column = meta.get("text_column").cloned().unwrap_or_else(|| "text".into());
        cal.sha256 = Some(sha256_hex(&bytes));
        cal.check_finite()?;
        Ok((cal, complete))
    }
}

impl Calibration {
    /// Whether `path` is a statecut activations file (its header says so).
    pub fn is_activations(path: &std::path::Path) -> bool {
        use std::io::Read;
        let header = || -> Option<String> {
            let mut f = std::fs::File::open(path).ok()?;
            let mut n = [0u8; 8];
            f.read_exact(&mut n).ok()?;
            let n = u64::from_le_bytes(n).min(1 << 24) as usize;
            let mut buf = vec![0u8; n];
            f.read_exact(&mut buf).ok()?;
            String::from_utf8(buf).ok()
        };
        header().is_some_and(|h| h.contains("\"statecut-activations-v1\""))
    }

    /// Record the key/query weights of the model this calibration runs on.
    pub fn fingerprint_weights(&mut self, ckpt: &crate::checkpoint::Checkpoint) -> Result<()> {
        let layout = ckpt_layout(ckpt)?;
        self.fingerprint.weights = Some(qk_sha256(ckpt, &layout)?);
        Ok(())
    }

    /// Refuse a file loaded from `path` that was made on a model with other key/query weights.
    pub fn check_weights(&self, path: &std::path::Path, ckpt: &crate::checkpoint::Checkpoint) -> Result<()> {
        let have = qk_sha256(ckpt, &ckpt_layout(ckpt)?)?;
        match &self.fingerprint.weights {
            Some(w) if *w == have => Ok(()),
            Some(w) => anyhow::bail!(
                "{} was calibrated on another model of the same shape (key/query weights sha256 {}, this model's {}); calibrate this model",
                path.display(),
                &w[..w.len().min(12)],
                &have[..12]
            ),
            None => anyhow::bail!(
                "{} does not record which model's weights it was calibrated on (an older statecut wrote it); re-run `statecut calibrate`",
                path.display()
            ),
        }
    }
}

fn ckpt_layout(ckpt: &crate::checkpoint::Checkpoint) -> Result<StateLayout> {
    crate::arch::family_for(ckpt)?.layout(ckpt)
}

/// sha256 of `bytes` as lowercase hex: identifies an activations file in reports and recipes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn grad_batch_fits_free_memory() {
        // 1.3B shape: hidden 2048, 24 layers, 2048 tokens: 58 GB a sequence at this rate
        let per = GRAD_BYTES_PER_TOKEN_PER_HIDDEN_PER_BLOCK * 2048 * 2048 * 24;
        assert_eq!(grad_batch(Some(4 * per + per / 2), 2048, 2048, 24), 2);
        assert_eq!(grad_batch(Some(per), 2048, 2048, 24), 1);
        assert_eq!(grad_batch(None, 2048, 2048, 24), 1);
        assert_eq!(grad_batch(Some(usize::MAX / 2), 2048, 2048, 24), 8, "never above 16384 tokens a pass");
    }

    /// The device-buffer path (run here on CPU tensors) keeps exactly the rows `place` keeps,
    /// including slots replaced twice in one batch and rows that were on the host first.
    #[test]
    fn device_buffer_matches_host_placement() {
        let width = 3;
        let batch = |n: usize, at: usize| -> Vec<f32> { (0..n * width).map(|i| (at * width + i) as f32).collect() };
        let (mut host, mut dev) = (Reservoir::new(7, width), Reservoir::new(7, width));
        let (mut r1, mut r2) = (StdRng::seed_from_u64(4), StdRng::seed_from_u64(4));
        // The first batch lands on the host in both, then the rest goes to the device buffer.
        host.offer(&batch(5, 0), &mut r1);
        dev.offer(&batch(5, 0), &mut r2);
        for (i, n) in [4usize, 30, 2, 50].into_iter().enumerate() {
            let data = batch(n, 100 * (i + 1));
            let plan = host.plan(n, &mut r1);
            let kept: Vec<f32> = plan.iter().flat_map(|(r, _)| data[r * width..(r + 1) * width].to_vec()).collect();
            host.place(&plan, &kept);
            let plan2 = dev.plan(n, &mut r2);
            assert_eq!(plan, plan2);
            let t = Tensor::from_vec(kept, (plan.len(), width), &candle_core::Device::Cpu).unwrap();
            dev.place_on_device(&plan2, &t).unwrap();
        }
        assert!(host.plan(0, &mut r1).is_empty());
        let copied = HostCopy::of(&dev.device_rows().unwrap()).unwrap();
        dev.land(copied).unwrap();
        assert_eq!(host.rows, dev.rows);
        assert_eq!(dev.len(), 7);
    }

    /// A copy of a buffer's leading rows widens to what candle's cast gives, in each dtype.
    #[test]
    fn host_copy_widens_like_a_cast() {
        let x = Tensor::randn(0f32, 2.0, (9, 5), &candle_core::Device::Cpu).unwrap();
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let x = x.to_dtype(dt).unwrap();
            for rows in [9, 4] {
                let part = x.narrow(0, 0, rows).unwrap();
                let want = part.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(HostCopy::of(&part).unwrap().widen().unwrap(), want, "{dt:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn reservoir_is_uniform_and_bounded() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut r = Reservoir::new(100, 1);
        let data: Vec<f32> = (0..10_000).map(|i| i as f32).collect();
        r.offer(&data, &mut rng);
        assert_eq!(r.len(), 100);
        assert_eq!(r.seen, 10_000);
        // A uniform sample of 0..10000 has mean near 5000 (std of the mean ~290).
        let mean: f32 = r.rows.iter().sum::<f32>() / 100.0;
        assert!((mean - 5000.0).abs() < 1500.0, "{mean}");
        assert_eq!(r.head(0, 1).len(), 100);
    }
}
