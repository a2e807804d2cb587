//! A model as stages (embedding, blocks, head) run for training with activation
//! checkpointing: the forward keeps each block's input (and, while memory allows, the block's
//! whole graph), the loss runs over chunks of token rows, and the backward goes one block at a
//! time, recomputing those that kept only their input, carrying the gradient of the residual
//! stream down from each block's output.

use super::loss::{self, KdConfig, Parts};
use crate::arch::layered::{self, Resident};
use crate::arch::NoObserver;
use crate::cli::Recompute;
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

/// One micro-batch's training pass: the student, the teacher (the same model with the
/// original slices) and the loss.
pub struct Pass<'a> {
    student: &'a Resident,
    teacher: &'a Resident,
    kd: &'a KdConfig,
    recompute: Recompute,
    /// Blocks that kept their graph in the last pass, and the most one held (bytes).
    kept: std::cell::Cell<(usize, usize)>,
}

impl<'a> Pass<'a> {
    pub fn new(student: &'a Resident, teacher: &'a Resident, kd: &'a KdConfig, recompute: Recompute) -> Self {
        Self { student, teacher, kd, recompute, kept: Default::default() }
    }

    /// How many blocks kept their graph in the last pass, and the most memory one held (bytes;
    /// 0 where it was not measured).
    pub fn kept(&self) -> (usize, usize) {
        self.kept.get()
    }

    /// The student's loss against the teacher on `ids` [B, T] predicting `targets` [B, T],
    /// scaled by `scale`, with the gradients of `vars` added to `acc`.
    pub fn run(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        scale: f64,
        vars: &[(String, Var)],
        acc: &mut HashMap<String, Tensor>,
    ) -> Result<Parts> {
        let (student, teacher, cfg) = (self.student, self.teacher, self.kd);
        let t_hidden = if cfg.kd_weight > 0.0 { Some(final_hidden(teacher, ids)?) } else { None };
        // Forward, keeping each block's input, and a block's whole graph where `keep` allows.
        let mut h = layered::embed(&*student.layers, &student.embed, ids, &mut NoObserver)?.detach();
        let mut keep = Keep::new(self.recompute, student.layers.device());
        let mut saved = Vec::with_capacity(student.blocks.len());
        for (i, blk) in student.blocks.iter().enumerate() {
            let at = |e: anyhow::Error| e.context(format!("layer {i}"));
            let out = match keep.next() {
                true => {
                    let x = Var::from_tensor(&h)?;
                    let y = blk.forward(x.as_tensor(), &mut NoObserver, None).map_err(at)?;
                    keep.kept_one();
                    let out = y.detach();
                    saved.push(Saved::Graph(x, y));
                    out
                }
                false => {
                    // Inference kernels: nothing differentiates this pass, only its recomputation.
                    let out =
                        crate::ops::without_gradients(|| blk.forward(&h, &mut NoObserver, None)).map_err(at)?.detach();
                    saved.push(Saved::Input(h.clone()));
                    out
                }
            };
            h = out;
        }
        self.kept.set((keep.kept, keep.first.map_or(0, |f| f.0)));
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
        // Backward, one block at a time, recomputing those that kept only their input.
        for i in (0..student.blocks.len()).rev() {
            let (x, y) = match saved.pop().context("block inputs out of step")? {
                Saved::Graph(x, y) => (x, y),
                Saved::Input(input) => {
                    let x = Var::from_tensor(&input)?;
                    drop(input);
                    let y = student.blocks[i]
                        .forward(x.as_tensor(), &mut NoObserver, None)
                        .with_context(|| format!("layer {i}"))?;
                    (x, y)
                }
            };
            let grads = crate::ops::seed_gradient(&y, &g)?.backward()?;
            drop(y);
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
}

/// What the forward keeps of one block for the backward.
enum Saved {
    /// Its input, to recompute it from.
    Input(Tensor),
    /// Its input as a variable and its output with the graph between them.
    Graph(Var, Tensor),
}

/// Which blocks keep their graph from the forward. Under [`Recompute::Auto`] on a GPU a block
/// keeps it while the free memory, less what the block will hold, still leaves room for the
/// rest of the step: the loss's chunks of logits, a recomputed block's forward and backward
/// (twice what a kept block holds), and a twentieth of the device. What a block holds is
/// measured on the first one, which is kept with half the device free; the free memory after
/// the others is predicted from it, so that the forward waits on the device only around the
/// first block.
struct Keep {
    policy: Recompute,
    device: candle_core::Device,
    /// Device memory in bytes.
    total: usize,
    /// Free memory before the first block, and (what it held, the free memory it left) after.
    before: Option<usize>,
    first: Option<(usize, usize)>,
    /// Blocks kept so far.
    kept: usize,
    /// Blocks asked about so far.
    asked: usize,
}

/// The memory rule of [`Recompute::Auto`], apart from the device: `total` bytes of device
/// memory, `logits` bytes for the loss's chunks.
struct Room {
    total: usize,
    logits: usize,
}

impl Room {
    /// Whether the next block keeps its graph, with `before` bytes free before the first block,
    /// `first` = (what the first kept block held, the free memory it left), `kept` blocks kept.
    fn keeps(&self, before: Option<usize>, first: Option<(usize, usize)>, kept: usize) -> bool {
        match first {
            None => kept == 0 && before.is_some_and(|f| f >= self.total / 2),
            Some((block, after)) => {
                let free = after.saturating_sub((kept - 1) * block);
                free >= 3 * block + self.logits + self.total / 20
            }
        }
    }
}

impl Keep {
    fn new(policy: Recompute, device: &candle_core::Device) -> Self {
        let total = crate::device::memory_info(device).map_or(0, |(_, t)| t);
        Self { policy, device: device.clone(), total, before: None, first: None, kept: 0, asked: 0 }
    }

    /// Whether the next block keeps its graph.
    fn next(&mut self) -> bool {
        // Measured once, before the first block: a refusal there holds for the pass.
        if self.asked == 0 && self.policy != Recompute::All {
            self.before = self.free();
        }
        self.asked += 1;
        match self.policy {
            Recompute::All => false,
            Recompute::None => true,
            Recompute::Auto => {
                let room = Room { total: self.total, logits: chunk_logit_bytes(&self.device) };
                room.keeps(self.before, self.first, self.kept)
            }
        }
    }

    /// A block kept its graph: the first one measures what it held.
    fn kept_one(&mut self) {
        if self.kept == 0 {
            if let (Some(before), Some(after)) = (self.before, self.free()) {
                self.first = Some((before.saturating_sub(after), after));
            }
        }
        self.kept += 1;
    }

    /// Free device memory after the queued work (`None` on the CPU).
    fn free(&self) -> Option<usize> {
        if self.device.is_cpu() {
            return None;
        }
        self.device.synchronize().ok()?;
        crate::device::free_memory(&self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::trainable::{Selector, Trainable};
    use crate::arch::{family_for, LoadOptions};
    use crate::checkpoint::Checkpoint;
    use candle_core::Device;
    use std::sync::Arc;

    /// The memory rule keeps blocks while what is left after the next one covers the loss's
    /// logits, a recomputed block (twice a kept one) and a twentieth of the device, and keeps
    /// none when the first block would start with less than half the device free.
    #[test]
    fn auto_keeps_blocks_while_memory_allows() {
        let gib = 1usize << 30;
        let room = Room { total: 140 * gib, logits: 4 * gib };
        // The first block: half the device free or more.
        assert!(room.keeps(Some(70 * gib), None, 0));
        assert!(!room.keeps(Some(69 * gib), None, 0));
        assert!(!room.keeps(None, None, 0), "unmeasured (the CPU): recompute");
        // After it, 5 GiB a block from 120 GiB free: the next block needs 15 + 4 + 7 = 26 GiB
        // left, so blocks 2..=20 are kept (free before block k is 120 - 5 (k - 1)).
        let first = Some((5 * gib, 120 * gib));
        let kept = (1..40).take_while(|&k| room.keeps(Some(125 * gib), first, k)).count() + 1;
        assert_eq!(kept, 20);
        // Whatever the sizes, the free memory predicted before a kept block covers the reserve.
        for (block, after) in [(1, 60), (3, 100), (9, 131), (20, 70)] {
            let first = Some((block * gib, after * gib));
            for k in 1..200 {
                if room.keeps(Some(140 * gib), first, k) {
                    let free = (after * gib).saturating_sub((k - 1) * block * gib);
                    assert!(free >= 3 * block * gib + 4 * gib + 7 * gib, "block {block} after {after} kept {k}");
                }
            }
        }
    }

    /// The checkpointed, chunked pass, recomputing every block or none, gives the gradients of
    /// one whole-graph backward of the same loss (cross-entropy, with the distillation term against a second copy).
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
        // Every block recomputed, and every block keeping its graph.
        let mut acc = HashMap::new();
        let mut kept = HashMap::new();
        for (recompute, acc) in [(Recompute::All, &mut acc), (Recompute::None, &mut kept)] {
            Pass::new(&student, &teacher, &cfg, recompute).run(&x, &y, 1.0 / (b * t) as f64, &vars, acc)?;
        }

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
            for (how, got) in [("recomputed", &acc[name]), ("kept", &kept[name])] {
                let err = ((got - want)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?)
                    / want.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
                assert!(err < 1e-4, "{name} ({how}): relative error {err}");
            }
        }
        Ok(())
    }
}
