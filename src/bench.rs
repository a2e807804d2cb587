//! `bench`: prefill throughput and decode latency, optionally against a second (pruned) model,
//! in the paper's Table 17 setting (decode after a 512-token prompt).

use crate::arch::{CausalLm, DecodeCache, LayerCache, NoObserver};
use crate::cli::BenchArgs;
use crate::graph_decode::GraphDecoder;
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub batch: usize,
    pub prefill_tokens_per_s: f64,
    /// Median milliseconds per decode step (one token for each sequence of the batch); None when
    /// the family has no step-by-step path yet.
    pub decode_ms_per_token: Option<f64>,
    /// Elements of the recurrent/attention cache after the prompt.
    pub cache_elems: Option<usize>,
    /// Bytes one decode step must move: every weight read once (all experts of an MoE, so an
    /// upper bound there), and the cache: recurrent states and conv histories read and written,
    /// attention keys and values read.
    pub weight_bytes_per_step: u64,
    pub cache_bytes_per_step: Option<u64>,
    /// (weights + cache bytes) / decode step time.
    pub decode_gb_per_s: Option<f64>,
    /// `decode_gb_per_s` over the device's measured copy bandwidth (what a memory-bound step reaches).
    pub bandwidth_fraction: Option<f64>,
    /// Whether the step was replayed from a CUDA graph (else launched op by op).
    pub decode_graph: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub iterations: usize,
    /// Device-to-device copy bandwidth measured before the run (read + written bytes per second).
    pub copy_gb_per_s: f64,
    pub rows: Vec<BenchRow>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn sync(dev: &Device) -> Result<()> {
    Ok(dev.synchronize()?)
}

fn random_ids(b: usize, t: usize, vocab: usize, dev: &Device, seed: u64) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| rng.random_range(0..vocab as u32)).collect();
    Ok(Tensor::from_vec(ids, (b, t), dev)?)
}

/// A model under test with its vocabulary size and the bytes of weights a decode step reads.
pub struct Subject<'a> {
    pub model: &'a dyn CausalLm,
    pub vocab: usize,
    pub weight_bytes: u64,
}

/// The weights a decode step reads, at `bytes_per_elem`: every stored tensor the forward uses
/// except the embedding table, of which a step reads only its tokens' rows (unless the LM head
/// is tied to it). Vision towers and MTP heads, which decoding does not run, are left out.
pub fn decode_weight_bytes(ckpt: &crate::checkpoint::Checkpoint, bytes_per_elem: usize) -> u64 {
    let tied = !ckpt.tensors.contains_key("lm_head.weight");
    ckpt.tensors
        .iter()
        .filter(|(name, _)| {
            let embedding =
                ["embed_tokens.weight", "embeddings.weight", "embedding.weight"].iter().any(|e| name.ends_with(e));
            let unused = name.starts_with("mtp.") || name.contains("visual.");
            !unused && (tied || !embedding)
        })
        .map(|(_, t)| (t.shape.iter().product::<usize>() * bytes_per_elem) as u64)
        .sum()
}

/// Bytes a decode step moves through `cache`: recurrent states and conv histories read and
/// written, attention keys and values read.
fn cache_bytes(cache: &DecodeCache) -> u64 {
    fn layer(c: &LayerCache) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        match c {
            LayerCache::Empty => 0,
            LayerCache::Recurrent { conv, state, .. } => 2 * (bytes(state) + conv.as_ref().map_or(0, bytes)),
            LayerCache::Attention { k, v } => bytes(k) + bytes(v),
            LayerCache::Parallel(branches) => branches.iter().map(layer).sum(),
        }
    }
    cache.layers.iter().map(layer).sum()
}

/// Device-to-device copy bandwidth (bytes read + written per second) of a 256 MiB buffer.
pub fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let n = 64 << 20;
    let x = Tensor::zeros(n, candle_core::DType::F32, dev)?;
    let _ = x.copy()?;
    sync(dev)?;
    let reps = 8;
    let t0 = Instant::now();
    for _ in 0..reps {
        let _ = x.copy()?;
    }
    sync(dev)?;
    Ok((2 * 4 * n * reps) as f64 / t0.elapsed().as_secs_f64())
}

/// Time every model at every batch size, one row list per model. The models take turns within
/// each batch size (A B A B ...), so that clock or thermal drift during a run hits all of them
/// alike instead of skewing their ratio.
pub fn bench_models(
    subjects: &[Subject],
    args: &BenchArgs,
    batches: &[usize],
    copy_bytes_per_s: f64,
    quiet: bool,
) -> Result<Vec<Vec<BenchRow>>> {
    let mut out: Vec<Vec<BenchRow>> = subjects.iter().map(|_| Vec::new()).collect();
    let rounds = args.warmup + args.iterations;
    for &b in batches {
        let prompts = subjects
            .iter()
            .map(|s| random_ids(b, args.prompt_len, s.vocab, s.model.device(), b as u64))
            .collect::<Result<Vec<_>>>()?;
        let mut prefill = vec![Vec::new(); subjects.len()];
        for i in 0..rounds {
            for (k, s) in subjects.iter().enumerate() {
                let dev = s.model.device();
                sync(dev)?;
                let t0 = Instant::now();
                s.model.forward(&prompts[k], &mut NoObserver)?;
                sync(dev)?;
                if i >= args.warmup {
                    prefill[k].push(t0.elapsed().as_secs_f64());
                }
            }
        }
        // The cache after the prompt; a family without step-by-step decoding has none.
        let caches: Vec<Option<DecodeCache>> = subjects
            .iter()
            .zip(&prompts)
            .map(|(s, p)| {
                let mut c = DecodeCache::default();
                s.model.forward_cached(p, &mut c).ok().map(|_| c)
            })
            .collect();
        // On CUDA the step is captured once per batch size and replayed, where the model allows.
        let mut graphs: Vec<Option<GraphDecoder>> = Vec::new();
        for (k, (s, cache)) in subjects.iter().zip(&caches).enumerate() {
            let dev = s.model.device();
            let graph = match cache {
                Some(c) if dev.is_cuda() && !args.eager => {
                    match GraphDecoder::new(s.model, c, &random_ids(b, 1, s.vocab, dev, 7)?) {
                        Ok((g, _)) => Some(g),
                        Err(e) => {
                            if !quiet {
                                eprintln!("model {}: batch {b}: decoding op by op: {e:#}", k + 1);
                            }
                            None
                        }
                    }
                }
                _ => None,
            };
            graphs.push(graph);
        }
        let mut decode = vec![Vec::new(); subjects.len()];
        for i in 0..rounds {
            for (k, s) in subjects.iter().enumerate() {
                let Some(cache) = &caches[k] else { continue };
                let dev = s.model.device();
                let step = random_ids(b, 1, s.vocab, dev, 7 + i as u64)?;
                let mut c = cache.clone();
                sync(dev)?;
                let t0 = Instant::now();
                for _ in 0..args.decode_steps {
                    match &mut graphs[k] {
                        Some(g) => drop(g.step(&step)?),
                        None => drop(s.model.forward_cached(&step, &mut c)?),
                    }
                }
                sync(dev)?;
                if i >= args.warmup {
                    decode[k].push(t0.elapsed().as_secs_f64() * 1e3 / args.decode_steps as f64);
                }
            }
        }
        for k in 0..subjects.len() {
            let ms = caches[k].as_ref().map(|_| median(std::mem::take(&mut decode[k])));
            let cache = caches[k].as_ref().map(cache_bytes);
            let moved = cache.map(|c| (c + subjects[k].weight_bytes) as f64);
            let rate = moved.zip(ms).map(|(m, ms)| m / (ms / 1e3));
            let row = BenchRow {
                batch: b,
                prefill_tokens_per_s: (b * args.prompt_len) as f64 / median(std::mem::take(&mut prefill[k])),
                decode_ms_per_token: ms,
                cache_elems: caches[k].as_ref().map(DecodeCache::elems),
                weight_bytes_per_step: subjects[k].weight_bytes,
                cache_bytes_per_step: cache,
                decode_gb_per_s: rate.map(|r| r / 1e9),
                bandwidth_fraction: rate.map(|r| r / copy_bytes_per_s),
                decode_graph: graphs[k].is_some(),
            };
            if !quiet {
                eprintln!(
                    "model {}: batch {b}: prefill {:.0} tok/s, decode {}{}",
                    k + 1,
                    row.prefill_tokens_per_s,
                    row.decode_ms_per_token.map_or("n/a".into(), |d| format!("{d:.2} ms/token")),
                    if row.decode_graph { " (CUDA graph)" } else { "" },
                );
            }
            out[k].push(row);
        }
    }
    Ok(out)
}

fn vocab_of(cfg: &serde_json::Value) -> Result<usize> {
    cfg.get("vocab_size")
        .or_else(|| cfg.pointer("/text_config/vocab_size"))
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .context("config.json has no vocab_size")
}

pub fn run(args: &BenchArgs, quiet: bool) -> Result<()> {
    let quiet = quiet || args.json;
    let batches = &args.batch_sizes;
    let mut reports = Vec::new();
    let mut models = vec![args.model.clone()];
    if let Some(c) = &args.compare {
        models.push(crate::cli::ModelArgs { model: c.clone(), ..args.model.clone() });
    }
    // Both models stay loaded so that they can take turns (see `bench_models`).
    let loaded = models.iter().map(|m| crate::commands::load(m, false, quiet)).collect::<Result<Vec<_>>>()?;
    let elem = args.model.dtype.resolve(loaded[0].model.device()).size_in_bytes();
    let subjects = loaded
        .iter()
        .map(|l| {
            let weight_bytes = decode_weight_bytes(&l.ckpt, elem);
            Ok(Subject { model: l.model.as_ref(), vocab: vocab_of(&l.ckpt.config)?, weight_bytes })
        })
        .collect::<Result<Vec<_>>>()?;
    let copy = copy_bandwidth(loaded[0].model.device())?;
    let rows = bench_models(&subjects, args, batches, copy, quiet)?;
    for (m, rows) in models.iter().zip(rows) {
        reports.push(BenchReport {
            model: m.model.clone(),
            device: m.device.to_string(),
            dtype: m.dtype.to_string(),
            prompt_len: args.prompt_len,
            decode_steps: args.decode_steps,
            iterations: args.iterations,
            copy_gb_per_s: copy / 1e9,
            rows,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    for r in &reports {
        println!(
            "{} on {} ({}), prompt {} tokens, median of {}; copy bandwidth {:.0} GB/s",
            r.model, r.device, r.dtype, r.prompt_len, r.iterations, r.copy_gb_per_s
        );
        println!(
            "{:>6} {:>14} {:>16} {:>12} {:>12} {:>12} {:>10} {:>10} {:>6}",
            "batch",
            "prefill tok/s",
            "decode ms/token",
            "decode tok/s",
            "weights MB",
            "cache MB",
            "GB/s",
            "of copy",
            "step"
        );
        let na = || "n/a".to_string();
        for row in &r.rows {
            println!(
                "{:>6} {:>14.0} {:>16} {:>12} {:>12.1} {:>12} {:>10} {:>10} {:>6}",
                row.batch,
                row.prefill_tokens_per_s,
                row.decode_ms_per_token.map_or_else(na, |d| format!("{d:.3}")),
                row.decode_ms_per_token.map_or_else(na, |d| format!("{:.0}", row.batch as f64 * 1e3 / d)),
                row.weight_bytes_per_step as f64 / 1e6,
                row.cache_bytes_per_step.map_or_else(na, |c| format!("{:.1}", c as f64 / 1e6)),
                row.decode_gb_per_s.map_or_else(na, |g| format!("{g:.0}")),
                row.bandwidth_fraction.map_or_else(na, |f| format!("{:.1}%", 100.0 * f)),
                if row.decode_graph { "graph" } else { "ops" },
            );
        }
    }
    if let [base, other] = &reports[..] {
        println!("speedup of {} over {}:", other.model, base.model);
        for (a, b) in base.rows.iter().zip(&other.rows) {
            let dec = match (a.decode_ms_per_token, b.decode_ms_per_token) {
                (Some(x), Some(y)) => format!("{:.2}x", x / y),
                _ => "n/a".into(),
            };
            println!(
                "  batch {:>3}: prefill {:.2}x, decode {dec}",
                a.batch,
                b.prefill_tokens_per_s / a.prefill_tokens_per_s
            );
        }
    }
    Ok(())
}
