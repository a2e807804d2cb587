//! `bench`: prefill throughput and decode latency, optionally against a second (pruned) model,
//! in the paper's Table 17 setting (decode after a 512-token prompt).

use crate::arch::{CausalLm, DecodeCache, NoObserver};
use crate::cli::BenchArgs;
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
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub prompt_len: usize,
    pub decode_steps: usize,
    pub iterations: usize,
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

/// Time one model.
pub fn bench_model(
    model: &dyn CausalLm,
    vocab: usize,
    args: &BenchArgs,
    batches: &[usize],
    quiet: bool,
) -> Result<Vec<BenchRow>> {
    let dev = model.device().clone();
    let mut rows = Vec::new();
    for &b in batches {
        let prompt = random_ids(b, args.prompt_len, vocab, &dev, b as u64)?;
        let mut times = Vec::new();
        for i in 0..args.warmup + args.iterations {
            sync(&dev)?;
            let t0 = Instant::now();
            model.forward(&prompt, &mut NoObserver)?;
            sync(&dev)?;
            if i >= args.warmup {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        let prefill = (b * args.prompt_len) as f64 / median(times);
        let mut decode = None;
        let mut cache_elems = None;
        let mut cache = DecodeCache::default();
        if model.forward_cached(&prompt, &mut cache).is_ok() {
            cache_elems = Some(cache.elems());
            let mut times = Vec::new();
            for i in 0..args.warmup + args.iterations {
                let mut c = cache.clone();
                let step = random_ids(b, 1, vocab, &dev, 7 + i as u64)?;
                sync(&dev)?;
                let t0 = Instant::now();
                for _ in 0..args.decode_steps {
                    model.forward_cached(&step, &mut c)?;
                }
                sync(&dev)?;
                if i >= args.warmup {
                    times.push(t0.elapsed().as_secs_f64() * 1e3 / args.decode_steps as f64);
                }
            }
            decode = Some(median(times));
        }
        if !quiet {
            eprintln!(
                "batch {b}: prefill {prefill:.0} tok/s, decode {}",
                decode.map_or("n/a".into(), |d| format!("{d:.2} ms/token"))
            );
        }
        rows.push(BenchRow { batch: b, prefill_tokens_per_s: prefill, decode_ms_per_token: decode, cache_elems });
    }
    Ok(rows)
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
    let batches: Vec<usize> = args
        .batch_sizes
        .split(',')
        .map(|s| s.trim().parse::<usize>().with_context(|| format!("--batch-sizes: {s:?} is not a number")))
        .collect::<Result<_>>()?;
    if args.iterations == 0 || args.decode_steps == 0 || args.prompt_len == 0 || batches.contains(&0) {
        anyhow::bail!("--iterations, --decode-steps, --prompt-len and batch sizes must be positive");
    }
    let mut reports = Vec::new();
    let mut models = vec![args.model.clone()];
    if let Some(c) = &args.compare {
        models.push(crate::cli::ModelArgs { model: c.clone(), ..args.model.clone() });
    }
    for m in &models {
        let loaded = crate::commands::load(m, false, quiet)?;
        let rows = bench_model(loaded.model.as_ref(), vocab_of(&loaded.ckpt.config)?, args, &batches, quiet)?;
        reports.push(BenchReport {
            model: m.model.clone(),
            device: m.device.clone(),
            dtype: m.dtype.clone(),
            prompt_len: args.prompt_len,
            decode_steps: args.decode_steps,
            iterations: args.iterations,
            rows,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    for r in &reports {
        println!(
            "{} on {} ({}), prompt {} tokens, median of {}",
            r.model, r.device, r.dtype, r.prompt_len, r.iterations
        );
        println!("{:>6} {:>14} {:>16} {:>12}", "batch", "prefill tok/s", "decode ms/token", "cache elems");
        for row in &r.rows {
            println!(
                "{:>6} {:>14.0} {:>16} {:>12}",
                row.batch,
                row.prefill_tokens_per_s,
                row.decode_ms_per_token.map_or("n/a".into(), |d| format!("{d:.3}")),
                row.cache_elems.map_or("n/a".into(), |e| e.to_string())
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
