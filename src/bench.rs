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

/// A model under test with its vocabulary size.
pub struct Subject<'a> {
    pub model: &'a dyn CausalLm,
    pub vocab: usize,
}

/// Time every model at every batch size, one row list per model. The models take turns within
/// each batch size (A B A B ...), so that clock or thermal drift during a run hits all of them
/// alike instead of skewing their ratio.
pub fn bench_models(
    subjects: &[Subject],
    args: &BenchArgs,
    batches: &[usize],
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
        let mut decode = vec![Vec::new(); subjects.len()];
        for i in 0..rounds {
            for (k, s) in subjects.iter().enumerate() {
                let Some(cache) = &caches[k] else { continue };
                let dev = s.model.device();
                let mut c = cache.clone();
                let step = random_ids(b, 1, s.vocab, dev, 7 + i as u64)?;
                sync(dev)?;
                let t0 = Instant::now();
                for _ in 0..args.decode_steps {
                    s.model.forward_cached(&step, &mut c)?;
                }
                sync(dev)?;
                if i >= args.warmup {
                    decode[k].push(t0.elapsed().as_secs_f64() * 1e3 / args.decode_steps as f64);
                }
            }
        }
        for k in 0..subjects.len() {
            let row = BenchRow {
                batch: b,
                prefill_tokens_per_s: (b * args.prompt_len) as f64 / median(std::mem::take(&mut prefill[k])),
                decode_ms_per_token: caches[k].as_ref().map(|_| median(std::mem::take(&mut decode[k]))),
                cache_elems: caches[k].as_ref().map(DecodeCache::elems),
            };
            if !quiet {
                eprintln!(
                    "model {}: batch {b}: prefill {:.0} tok/s, decode {}",
                    k + 1,
                    row.prefill_tokens_per_s,
                    row.decode_ms_per_token.map_or("n/a".into(), |d| format!("{d:.2} ms/token"))
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
    let subjects = loaded
        .iter()
        .map(|l| Ok(Subject { model: l.model.as_ref(), vocab: vocab_of(&l.ckpt.config)? }))
        .collect::<Result<Vec<_>>>()?;
    let rows = bench_models(&subjects, args, batches, quiet)?;
    for (m, rows) in models.iter().zip(rows) {
        reports.push(BenchReport {
            model: m.model.clone(),
            device: m.device.to_string(),
            dtype: m.dtype.to_string(),
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
