//! Perplexity over fixed windows (the protocol of the reference perplexities).

use crate::arch::{CausalLm, NoObserver};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct EvalResult {
    pub ppl: f64,
    /// Mean negative log-likelihood per predicted token (nats).
    pub nll: f64,
    /// Predicted tokens.
    pub tokens: usize,
    pub windows: usize,
    pub seqlen: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
}

/// Sum of -log p(target) over a batch of windows of length L+1.
pub fn window_nll(model: &dyn CausalLm, batch: &[&[u32]]) -> Result<f64> {
    let l = batch[0].len() - 1;
    let dev = model.device();
    let inputs: Vec<u32> = batch.iter().flat_map(|w| w[..l].iter().copied()).collect();
    let targets: Vec<u32> = batch.iter().flat_map(|w| w[1..].iter().copied()).collect();
    let ids = Tensor::from_vec(inputs, (batch.len(), l), dev)?;
    let targets = Tensor::from_vec(targets, (batch.len(), l, 1), dev)?;
    let logits = model.forward(&ids, &mut NoObserver)?.to_dtype(DType::F32)?;
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let picked = logp.gather(&targets, 2)?;
    Ok(-(picked.sum_all()?.to_scalar::<f32>()? as f64))
}

/// Perplexity of `model` over `windows`, `batch` windows per forward.
pub fn perplexity(model: &dyn CausalLm, windows: &[&[u32]], batch: usize, quiet: bool) -> Result<EvalResult> {
    if windows.is_empty() {
        bail!("the evaluation text is shorter than one window; use a longer file or a smaller --seqlen");
    }
    let seqlen = windows[0].len() - 1;
    let pb = crate::progress::bar(windows.len() as u64, "eval", quiet);
    let start = Instant::now();
    let mut nll = 0f64;
    for chunk in windows.chunks(batch.max(1)) {
        nll += window_nll(model, chunk)?;
        pb.inc(chunk.len() as u64);
        let done = pb.position() as usize * seqlen;
        pb.set_message(format!("ppl {:.2}", (nll / done as f64).exp()));
    }
    pb.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let tokens = windows.len() * seqlen;
    let mean = nll / tokens as f64;
    Ok(EvalResult {
        ppl: mean.exp(),
        nll: mean,
        tokens,
        windows: windows.len(),
        seqlen,
        seconds,
        tokens_per_second: tokens as f64 / seconds,
    })
}
