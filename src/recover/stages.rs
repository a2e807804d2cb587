//! A model as stages (embedding, blocks, head) run for training with activation
//! checkpointing: the forward keeps only each block's input, the loss runs over chunks of token
//! rows, and the backward recomputes one block at a time from its input, carrying the gradient
//! of the residual stream down through `sum(block(x) · g)`.

use super::loss::{self, KdConfig, Parts};
use crate::arch::layered::{self, Resident};
use crate::arch::NoObserver;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;

/// Bytes of float32 logits (and their softmax intermediates) one loss chunk may hold: small on
/// the CPU, larger on a GPU, where a few hundred rows against a 248k vocabulary would leave the
/// head's matmuls too thin to fill it.
fn chunk_logit_bytes(device: &candle_core::Device) -> usize {
    if device.is_cpu() {
        256 << 20
    } else {
        4 << 30
    }
}

/// The residual stream after the last block [B, T, D] (no gradient is kept).
pub fn final_hidden(m: &Resident, ids: &Tensor) -> Result<Tensor> {
    let mut h = layered::embed(&*m.layers, &m.embed, ids, &mut NoObserver)?;
    for blk in &m.blocks {
        h = blk.forward(&h, &mut NoObserver, None)?.detach();
    }
    Ok(h)
}

/// Logits [R, V] of residual rows [R, D].
fn logits(m: &Resident, rows: &Tensor) -> Result<Tensor> {
    let out = m.head.forward(&rows.unsqueeze(0)?, &mut NoObserver, m.blocks.len())?;
    Ok(out.squeeze(0)?)
}

/// Token rows per loss chunk for a vocabulary of `vocab`.
fn chunk_rows(m: &Resident, vocab: usize) -> usize {
    (chunk_logit_bytes(m.layers.device()) / (vocab.max(1) * 4 * 6)).max(1)
}

/// Add each variable's gradient in `grads` to `acc` (float32, by name).
fn accumulate(
    vars: &[(String, Var)],
    grads: &candle_core::backprop::GradStore,
    acc: &mut HashMap<String, Tensor>,
) -> Result<()> {
    for (name, var) in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            let g = g.to_dtype(DType::F32)?;
            let sum = match acc.remove(name) {
                Some(a) => (a + g)?,
                None => g,
            };
            acc.insert(name.clone(), sum);
        }
    }
    Ok(())
}

/// One micro-batch: the student's loss against the teacher on `ids` [B, T] predicting
/// `targets` [B, T], scaled by `scale`, with the gradients of `vars` added to `acc`.
#[allow(clippy::too_many_arguments)]
pub fn train_pass(
    student: &Resident,
    teacher: &Resident,
    ids: &Tensor,
    targets: &Tensor,
    cfg: &KdConfig,
    scale: f64,
    vars: &[(String, Var)],
    acc: &mut HashMap<String, Tensor>,
) -> Result<Parts> {
    let t_hidden = if cfg.kd_weight > 0.0 { Some(final_hidden(teacher, ids)?) } else { None };
    // Forward, keeping each block's input only.
    let mut h = layered::embed(&*student.layers, &student.embed, ids, &mut NoObserver)?.detach();
    let mut inputs = Vec::with_capacity(student.blocks.len());
    for (i, blk) in student.blocks.iter().enumerate() {
        // Inference kernels: nothing differentiates this pass, only its recomputation below.
        let out = crate::ops::without_gradients(|| blk.forward(&h, &mut NoObserver, None))
            .with_context(|| format!("layer {i}"))?
            .detach();
        inputs.push(std::mem::replace(&mut h, out));
    }
    // The loss over chunks of rows, each chunk's logits freed before the next.
    let (b, t, d) = h.dims3()?;
    let rows = h.reshape((b * t, d))?;
    let t_rows = t_hidden.map(|th| th.reshape((b * t, d))).transpose()?;
    let targets = targets.flatten_all()?;
    let step = chunk_rows(student, student.head.lm_head.weight().dim(0)?);
    let mut parts = Parts::default();
    let mut g_rows = Vec::new();
    for start in (0..b * t).step_by(step) {
        let n = step.min(b * t - start);
        let x = Var::from_tensor(&rows.narrow(0, start, n)?)?;
        let s_logits = logits(student, x.as_tensor())?;
        let t_logits = match &t_rows {
            Some(tr) => logits(teacher, &tr.narrow(0, start, n)?)?,
            None => s_logits.detach(),
        };
        let (loss, p) = loss::chunk(&s_logits, &t_logits, &targets.narrow(0, start, n)?, cfg, scale)?;
        let grads = loss.backward()?;
        accumulate(vars, &grads, acc)?;
        g_rows.push(grads.get(x.as_tensor()).context("no gradient reached the final hidden state")?.clone());
        parts += p;
    }
    let mut g = Tensor::cat(&g_rows, 0)?.reshape((b, t, d))?.to_dtype(h.dtype())?;
    drop((rows, h));
    // Backward, one recomputed block at a time.
    for i in (0..student.blocks.len()).rev() {
        let input = inputs.pop().context("block inputs out of step")?;
        let x = Var::from_tensor(&input)?;
        drop(input);
        let y =
            student.blocks[i].forward(x.as_tensor(), &mut NoObserver, None).with_context(|| format!("layer {i}"))?;
        let grads = crate::ops::seed_gradient(&y, &g)?.backward()?;
        accumulate(vars, &grads, acc)?;
        if i > 0 {
            g = grads
                .get(x.as_tensor())
                .with_context(|| format!("no gradient reached the input of layer {i}"))?
                .clone();
        }
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::trainable::{Selector, Trainable};
    use crate::arch::{family_for, LoadOptions};
    use crate::checkpoint::Checkpoint;
    use candle_core::Device;
    use std::sync::Arc;

    /// The checkpointed, chunked pass gives the gradients of one whole-graph backward of the
    /// same loss (cross-entropy, with the distillation term against a second copy).
    #[test]
    fn checkpointed_gradients_equal_a_whole_backward() -> Result<()> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/models/gdn-moby");
        let ckpt = Checkpoint::open(&dir)?;
        let family = family_for(&ckpt)?;
        let opts = LoadOptions::cpu_f32();
        let pick: Selector = Arc::new(|n: &str| {
            n.contains("layers.1.attn.q_proj")
                || n.contains("layers.0.attn.k_conv1d")
                || n.contains("layers.3.mlp.down")
        });
        let set = Trainable::default();
        let student = Resident::load(family.layers(
            &ckpt,
            &opts,
            set.wrap(ckpt.var_builder(opts.dtype, &opts.device)?, pick.clone()),
        )?)?;
        let teacher = Resident::load(family.layers(&ckpt, &opts, ckpt.var_builder(opts.dtype, &opts.device)?)?)?;
        let vars: Vec<(String, Var)> = set.vars().into_iter().collect();
        assert_eq!(vars.len(), 3);
        // Nudge the student off the teacher so that the distillation term has a gradient.
        for (_, v) in &vars {
            v.set(&(v.as_tensor() * 1.05)?)?;
        }
        let (b, t) = (2, 24);
        let ids: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 37 % 2000) as u32).collect();
        let wins: Vec<&[u32]> = ids.chunks(t + 1).collect();
        let (x, y) = crate::recover::batch_tensors(&wins, &Device::Cpu)?;
        let cfg = KdConfig { temperature: 2.0, kd_weight: 0.5, lm_weight: 1.0 };
        let mut acc = HashMap::new();
        train_pass(&student, &teacher, &x, &y, &cfg, 1.0 / (b * t) as f64, &vars, &mut acc)?;

        // The same loss over one graph.
        let mut h = layered::embed(&*student.layers, &student.embed, &x, &mut NoObserver)?;
        for blk in &student.blocks {
            h = blk.forward(&h, &mut NoObserver, None)?;
        }
        let s_logits = logits(&student, &h.reshape((b * t, ()))?)?;
        let t_logits = logits(&teacher, &final_hidden(&teacher, &x)?.reshape((b * t, ()))?)?;
        let (loss, _) = loss::chunk(&s_logits, &t_logits, &y.flatten_all()?, &cfg, 1.0 / (b * t) as f64)?;
        let whole = loss.backward()?;
        for (name, v) in &vars {
            let want = whole.get(v.as_tensor()).expect("whole-graph gradient");
            let got = &acc[name];
            let err = ((got - want)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?)
                / want.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
            assert!(err < 1e-4, "{name}: relative error {err}");
        }
        Ok(())
    }
}
