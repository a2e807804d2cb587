//! Layer-streamed execution: when a model's weights do not fit on the device (or when asked),
//! they stay on the host and every stage is loaded once per run, used by all sequences, and
//! dropped, the sequential pipeline of GPTQ and llm-compressor: all sequences pass through
//! layer i before layer i + 1. Peak device memory is about one layer's weights plus the hidden
//! states plus one layer's activations, whatever the depth.
//!
//! Results equal a resident run's: per-sequence state of the observers (sampling streams) is
//! carried from layer to layer ([`crate::arch::Observer::sequences`]), and each layer sees the
//! sequences in the same order.

use crate::arch::layered::{self, Layers};
use crate::arch::Observer;
use crate::checkpoint::Checkpoint;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Parse a memory size: plain bytes, or a number with a unit: KiB/MiB/GiB/TiB (or K/M/G/T,
/// powers of 1024) or KB/MB/GB/TB (powers of 1000), case-insensitive, e.g. `4GiB`, `512MiB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let value: f64 =
        num.parse().map_err(|_| format!("\"{s}\" is not a size; expected e.g. 4GiB, 512MiB or 1000000"))?;
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(format!("unknown unit \"{unit}\" in \"{s}\"; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")),
    };
    Ok((value * scale).round() as u64)
}

/// Bytes in binary units for messages: `1.5 GiB`.
pub fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut u) = (bytes as f64, 0);
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// What the user asked for (`--max-device-memory`, `--offload`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Request {
    pub max_device_memory: Option<u64>,
    pub offload: bool,
}

/// Weight bytes of a model's stages in the compute dtype.
#[derive(Debug, Clone)]
pub struct StageSizes {
    pub blocks: Vec<u64>,
    pub embed: u64,
    /// An LM head stored apart from the embeddings (0 when tied).
    pub head: u64,
}

impl StageSizes {
    pub fn of(ckpt: &Checkpoint, layers: &dyn Layers, dtype: DType) -> Self {
        let bytes = |prefix: &str| -> u64 {
            ckpt.tensors
                .range(prefix.to_string()..)
                .take_while(|(n, _)| n.starts_with(prefix))
                .map(|(_, t)| (t.shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64)
                .sum()
        };
        let blocks = (0..layers.num_blocks()).map(|i| bytes(&layers.block_prefix(i))).collect();
        let embed = bytes(&layers.embed_name());
        Self { blocks, embed, head: bytes("lm_head.weight") }
    }

    pub fn total(&self) -> u64 {
        self.blocks.iter().sum::<u64>() + self.embed + self.head
    }

    /// The largest stage a streamed run holds at once, and what needs it.
    pub fn largest(&self) -> (u64, String) {
        let (i, b) = self.blocks.iter().enumerate().max_by_key(|(_, b)| **b).map_or((0, 0), |(i, b)| (i, *b));
        let ends = self.embed.max(self.head);
        if ends > b {
            (ends, "the embeddings need".into())
        } else {
            (b, format!("layer {i} needs"))
        }
    }
}

/// Whether to stream, given the request, the device and the weights' sizes. Only the memory
/// the user names or the device reports counts: on the CPU weights are taken to fit.
pub fn decide(req: &Request, sizes: &StageSizes, device: &Device, dtype: DType, grad: bool) -> Result<bool> {
    let total = sizes.total();
    let streamed = match req.max_device_memory {
        Some(max) => {
            let (need, what) = sizes.largest();
            if max < need {
                bail!(
                    "--max-device-memory {} is smaller than one layer: {what} {} ({need} bytes) of {dtype:?} \
                     weights; give at least that",
                    human(max),
                    human(need)
                );
            }
            req.offload || total > max
        }
        None => req.offload || crate::device::free_memory(device).is_some_and(|free| total as u128 > free as u128),
    };
    if streamed && grad {
        bail!(
            "--grad / --method grad needs a backward pass through every layer at once, which a layer-streamed run \
             (--offload, --max-device-memory, or weights of {} larger than the device's free memory) cannot do; \
             use another --method or a device that holds the model",
            human(total)
        );
    }
    Ok(streamed)
}

static PEAK_DEVICE_USED: AtomicU64 = AtomicU64::new(0);

/// Record the device memory in use now (CUDA: total minus free); nothing on the CPU.
pub fn note_device_memory(device: &Device) {
    if let Some((free, total)) = crate::device::memory_info(device) {
        PEAK_DEVICE_USED.fetch_max(total.saturating_sub(free) as u64, Ordering::Relaxed);
    }
}

/// Peak device memory of this process and how it was measured: on CUDA the most in use of
/// every reading (device-wide, so other processes count), on the CPU the peak resident set.
pub fn peak_memory(device: &Device) -> (Option<u64>, &'static str) {
    if device.is_cpu() {
        (peak_rss(), "peak resident set (VmHWM)")
    } else {
        note_device_memory(device);
        let p = PEAK_DEVICE_USED.load(Ordering::Relaxed);
        ((p > 0).then_some(p), "CUDA memory in use (total - free), highest reading")
    }
}

/// This process's peak resident set in bytes (Linux `VmHWM`).
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Sequences per pass: the given count, or on a GPU as many as the memory free now (with the
/// layer resident) holds, one on the CPU.
fn pass_size(batch: Option<usize>, device: &Device, seqlen: usize, hidden: usize) -> usize {
    match batch {
        Some(b) => b.max(1),
        None if device.is_cpu() => 1,
        None => gpu_batch(crate::device::free_memory(device), seqlen, hidden),
    }
}

/// Bytes of activations per token of a pass, an upper bound of what the H200 runs measured at
/// 16384 tokens per pass (1.3B to 9B models: 165-700 KB per token, one layer's activations at a
/// time): 40 float32 values per unit of hidden width.
const BYTES_PER_TOKEN_PER_HIDDEN: usize = 160;

/// Sequences per pass on a GPU with `free` bytes free (unknown: assume enough), using at most half.
pub(crate) fn gpu_batch(free: Option<usize>, seqlen: usize, hidden: usize) -> usize {
    let seqlen = seqlen.max(1);
    let mut tokens = 16384;
    if let Some(free) = free {
        tokens = tokens.min(free / 2 / (BYTES_PER_TOKEN_PER_HIDDEN * hidden.max(1)));
    }
    (tokens / seqlen).max(1)
}

/// Runs of equal-length sequences of at most `batch`: (first, count).
fn passes(seqs: &[&[u32]], batch: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut first = 0;
    while first < seqs.len() {
        let len = seqs[first].len();
        let n = seqs[first..].iter().take(batch).take_while(|s| s.len() == len).count();
        out.push((first, n));
        first += n;
    }
    out
}

/// Run `seqs` layer-major through `layers`: every stage is loaded once, all sequences pass
/// through it (in passes of `batch` sequences, `None`: sized from the free memory), and it is
/// dropped. `obs` sees each pass as a resident forward would; `on_output(first, out)` gets the
/// head's output (logits, or the normed hidden state when the observer needs no logits) of
/// sequences `first..first + n`. Sequence `i` is announced to the observer as `offset + i`.
/// `pb` ([`layer_bar`]) counts the layers.
pub fn run_layer_major(
    layers: &dyn Layers,
    seqs: &[&[u32]],
    offset: usize,
    batch: Option<usize>,
    obs: &mut dyn Observer,
    mut on_output: impl FnMut(usize, &Tensor) -> Result<()>,
    pb: indicatif::ProgressBar,
) -> Result<()> {
    let dev = layers.device().clone();
    let n_blocks = layers.num_blocks();
    // Hidden states per sequence [1, T, D]; on the host when the device could not hold them.
    let mut hidden: Vec<Tensor> = Vec::with_capacity(seqs.len());
    let embed = layers.embed()?;
    let d_model = embed.hidden_size();
    let seqlen = seqs.first().map_or(1, |s| s.len());
    let on_host = !dev.is_cpu()
        && crate::device::free_memory(&dev)
            .is_some_and(|free| (seqs.len() * seqlen * d_model * 4) as u128 * 4 > free as u128);
    let park = if on_host { Device::Cpu } else { dev.clone() };
    note_device_memory(&dev);
    for (first, n) in passes(seqs, pass_size(batch, &dev, seqlen, d_model)) {
        obs.sequences(offset + first, n)?;
        let flat: Vec<u32> = seqs[first..first + n].iter().flat_map(|s| s.iter().copied()).collect();
        let ids = Tensor::from_vec(flat, (n, seqs[first].len()), &dev)?;
        let h = layered::embed(layers, &embed, &ids, obs)?;
        hidden.extend(split(&h, &park)?);
    }
    drop(embed);
    let gather = |hidden: &[Tensor], first: usize, n: usize| -> Result<Tensor> {
        let parts: Vec<&Tensor> = hidden[first..first + n].iter().collect();
        Ok(Tensor::cat(&parts, 0)?.to_device(&dev)?)
    };
    for i in 0..n_blocks {
        let blk = layered::load_block(layers, i)?;
        note_device_memory(&dev);
        let mut next = Vec::with_capacity(seqs.len());
        for (first, n) in passes(seqs, pass_size(batch, &dev, seqlen, d_model)) {
            obs.sequences(offset + first, n)?;
            let h = gather(&hidden, first, n)?;
            let h = layered::run_block(layers, i, blk.as_ref(), &h, obs, None)?;
            note_device_memory(&dev);
            next.extend(split(&h, &park)?);
        }
        hidden = next;
        drop(blk);
        pb.inc(1);
    }
    let head = layers.head(None)?;
    for (first, n) in passes(seqs, pass_size(batch, &dev, seqlen, d_model)) {
        obs.sequences(offset + first, n)?;
        let out = head.forward(&gather(&hidden, first, n)?, obs, n_blocks)?;
        note_device_memory(&dev);
        on_output(first, &out)?;
    }
    pb.finish_and_clear();
    Ok(())
}

/// A progress bar over the layers of a layer-major run, with an ETA.
pub fn layer_bar(layers: &dyn Layers, what: &str, quiet: bool) -> indicatif::ProgressBar {
    crate::progress::bar(layers.num_blocks() as u64, &format!("{what} (layers)"), quiet)
}

/// The sequences of a [B, T, D] pass, each [1, T, D], on `park`.
fn split(h: &Tensor, park: &Device) -> Result<Vec<Tensor>> {
    let h = h.to_device(park)?;
    (0..h.dim(0)?).map(|b| Ok(h.narrow(0, b, 1)?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_batch_fits_free_memory() {
        // Plenty free: 16384 tokens per pass.
        assert_eq!(gpu_batch(Some(100 << 30), 2048, 4096), 8);
        assert_eq!(gpu_batch(None, 2048, 4096), 8);
        // A 9B model on a 24 GB card leaves ~5 GB: 5e9 / 2 / (160 * 4096) = 3814 tokens -> 1 sequence.
        assert_eq!(gpu_batch(Some(5_000_000_000), 2048, 4096), 1);
        assert_eq!(gpu_batch(Some(5_000_000_000), 512, 4096), 7);
        // Never below one sequence, even when nothing is free.
        assert_eq!(gpu_batch(Some(0), 2048, 4096), 1);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("512mib"), Ok(512 << 20));
        assert_eq!(parse_size("1000000"), Ok(1_000_000));
        assert_eq!(parse_size("123B"), Ok(123));
        assert_eq!(parse_size("2 KiB"), Ok(2048));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("4GB"), Ok(4_000_000_000));
        assert_eq!(parse_size("3kb"), Ok(3000));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("4XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("-4GiB").is_err());
        assert!(parse_size("1.2.3G").is_err());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(4 << 30), "4.0 GiB");
    }

    #[test]
    fn too_small_budget_names_the_layer() {
        let sizes = StageSizes { blocks: vec![100, 300, 200], embed: 50, head: 0 };
        let req = Request { max_device_memory: Some(250), offload: false };
        let e = decide(&req, &sizes, &Device::Cpu, DType::F32, false).unwrap_err().to_string();
        assert!(e.contains("layer 1 needs 300 B (300 bytes)"), "{e}");
        // Enough for a layer but not the model: streamed. Enough for all: resident.
        let req = Request { max_device_memory: Some(300), offload: false };
        assert!(decide(&req, &sizes, &Device::Cpu, DType::F32, false).unwrap());
        let req = Request { max_device_memory: Some(650), offload: false };
        assert!(!decide(&req, &sizes, &Device::Cpu, DType::F32, false).unwrap());
        // The CPU without a request: resident; --offload: streamed, never with gradients.
        assert!(!decide(&Request::default(), &sizes, &Device::Cpu, DType::F32, true).unwrap());
        let req = Request { max_device_memory: None, offload: true };
        assert!(decide(&req, &sizes, &Device::Cpu, DType::F32, false).unwrap());
        assert!(decide(&req, &sizes, &Device::Cpu, DType::F32, true).unwrap_err().to_string().contains("--grad"));
        let big_embed = StageSizes { blocks: vec![10], embed: 400, head: 0 };
        let req = Request { max_device_memory: Some(100), offload: false };
        let e = decide(&req, &big_embed, &Device::Cpu, DType::F32, false).unwrap_err().to_string();
        assert!(e.contains("the embeddings need"), "{e}");
    }

    #[test]
    fn passes_group_equal_lengths() {
        let (a, b) = ([1u32, 2, 3], [1u32, 2]);
        let seqs: Vec<&[u32]> = vec![&a, &a, &a, &b, &b];
        assert_eq!(passes(&seqs, 2), [(0, 2), (2, 1), (3, 2)]);
        assert_eq!(passes(&seqs, 8), [(0, 3), (3, 2)]);
    }
}
