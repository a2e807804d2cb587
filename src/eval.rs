//! Perplexity over fixed windows (the protocol of the reference perplexities).

use crate::arch::layered::Layers;
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
    let inputs: Vec<u32> = batch.iter().flat_map(|w| w[..l].iter().copied()).collect();
    let ids = Tensor::from_vec(inputs, (batch.len(), l), model.device())?;
    logits_nll(&model.forward(&ids, &mut NoObserver)?, batch)
}

/// Sum of -log p(target) of the logits [B, L, V] of a batch of windows of length L+1.
fn logits_nll(logits: &Tensor, batch: &[&[u32]]) -> Result<f64> {
    let l = batch[0].len() - 1;
    let targets: Vec<u32> = batch.iter().flat_map(|w| w[1..].iter().copied()).collect();
    let targets = Tensor::from_vec(targets, (batch.len(), l, 1), logits.device())?;
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp.gather(&targets, 2)?;
    Ok(-(picked.sum_all()?.to_scalar::<f32>()? as f64))
}

/// Per pass of `batch` windows, the summed -log p(target), by running the windows layer-major
/// through a layer-streamed model.
fn streamed_nll(layers: &dyn Layers, windows: &[&[u32]], batch: usize, quiet: bool) -> Result<Vec<f64>> {
    let inputs: Vec<&[u32]> = windows.iter().map(|w| &w[..w.len() - 1]).collect();
    let mut out = Vec::new();
    let on_logits = |first: usize, logits: &Tensor| -> Result<()> {
        out.push(logits_nll(logits, &windows[first..first + logits.dim(0)?])?);
        Ok(())
    };
    let pb = crate::stream::layer_bar(layers, "eval", quiet);
    crate::stream::run_layer_major(layers, &inputs, 0, Some(batch), &mut NoObserver, on_logits, pb)?;
    Ok(out)
}

/// Perplexity of `model` over `windows`, `batch` windows per forward.
pub fn perplexity(model: &dyn CausalLm, windows: &[&[u32]], batch: usize, quiet: bool) -> Result<EvalResult> {
    if windows.is_empty() {
        bail!("the evaluation text is shorter than one window; use a longer file or a smaller --seqlen");
    }
    let seqlen = windows[0].len() - 1;
    let start = Instant::now();
    let mut nll = 0f64;
    if let Some(layers) = model.layers() {
        // The same sums in the same order as the resident loop below.
        nll = streamed_nll(layers, windows, batch.max(1), quiet)?.into_iter().fold(nll, |a, b| a + b);
    } else {
        let pb = crate::progress::bar(windows.len() as u64, "eval", quiet);
        for chunk in windows.chunks(batch.max(1)) {
            nll += window_nll(model, chunk)?;
            pb.inc(chunk.len() as u64);
            let done = pb.position() as usize * seqlen;
            pb.set_message(format!("ppl {:.2}", (nll / done as f64).exp()));
        }
        pb.finish_and_clear();
    }
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
