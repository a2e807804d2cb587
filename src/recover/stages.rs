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
            add_to(acc, name.clone(), g.to_dtype(DType::F32)?)?;
        }
    }
    Ok(())
}

/// `acc[name] += g`, or `g` where `acc` has no `name` yet.
fn add_to(acc: &mut HashMap<String, Tensor>, name: String, g: Tensor) -> Result<()> {
    let sum = match acc.remove(&name) {
        Some(a) => (a + g)?,
        None => g,
    };
    acc.insert(name, sum);
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
    /// What each block needs, measured the first time it is recomputed under
    /// [`Recompute::Auto`] on a GPU.
    sizes: std::cell::RefCell<Vec<Option<Need>>>,
    /// Whether a pass ran out of memory with blocks kept (then every block is recomputed).
    fell_back: std::cell::Cell<bool>,
    /// Device memory (bytes) a step may use under [`Recompute::Auto`] (`None`: the device's).
    budget: Option<usize>,
}

impl<'a> Pass<'a> {
    pub fn new(student: &'a Resident, teacher: &'a Resident, kd: &'a KdConfig, recompute: Recompute) -> Self {
        let sizes = std::cell::RefCell::new(vec![None; student.blocks.len()]);
        Self {
            student,
            teacher,
            kd,
            recompute,
            kept: Default::default(),
            sizes,
            fell_back: Default::default(),
            budget: None,
        }
    }

    /// Bound what [`Recompute::Auto`] keeps so that a step stays within `budget` bytes of device
    /// memory (`None`: the device's).
    pub fn within(mut self, budget: Option<usize>) -> Self {
        self.budget = budget;
        self
    }

    /// Whether a pass ran out of device memory with blocks kept, so that every block is
    /// recomputed from then on.
    pub fn fell_back(&self) -> bool {
        self.fell_back.get()
    }

    /// How many blocks kept their graph in the last pass, and the most memory one held (bytes;
    /// 0 where it was not measured).
    pub fn kept(&self) -> (usize, usize) {
        self.kept.get()
    }

    /// The student's loss against the teacher on `ids` [B, T] predicting `targets` [B, T],
    /// scaled by `scale`, with the gradients of `vars` added to `acc`.
    /// Under `--recompute auto`, a pass that runs out of device memory is run again recomputing
    /// every block, as is every pass after it: the rule's margins are estimates, and a step that
    /// fits with every block recomputed should not fail for having kept some.
    pub fn run(
        &self,
        ids: &Tensor,
        targets: &Tensor,
        scale: f64,
        vars: &[(String, Var)],
        acc: &mut HashMap<String, Tensor>,
    ) -> Result<Parts> {
        let policy = if self.fell_back.get() { Recompute::All } else { self.recompute };
        if policy != Recompute::Auto {
            return self.run_with(policy, ids, targets, scale, vars, acc);
        }
        // Gradients go to a map of their own, so that a failed pass adds nothing.
        let mut mine = HashMap::new();
        match self.run_with(policy, ids, targets, scale, vars, &mut mine) {
            Err(e) if out_of_memory(&e) => {
                drop(mine);
                self.fell_back.set(true);
                crate::device::release_cached(self.student.layers.device());
                self.run_with(Recompute::All, ids, targets, scale, vars, acc)
            }
            Err(e) => Err(e),
            Ok(parts) => {
                for (name, g) in mine {
                    add_to(acc, name, g)?;
                }
                Ok(parts)
            }
        }
    }

    fn run_with(
        &self,
        policy: Recompute,
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
        let mut keep = Keep::new(policy, student.layers.device(), self.sizes.borrow().clone(), self.budget);
        let mut saved = Vec::with_capacity(student.blocks.len());
        for (i, blk) in student.blocks.iter().enumerate() {
            let at = |e: anyhow::Error| e.context(format!("layer {i}"));
            let out = match keep.next(i) {
                true => {
                    let x = Var::from_tensor(&h)?;
                    let y = blk.forward(x.as_tensor(), &mut NoObserver, None).map_err(at)?;
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
        self.kept.set((keep.kept, keep.largest_kept));
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
            // (in use before the recompute, what its graph holds) where this block is measured.
            let mut measured = None;
            let (x, y) = match saved.pop().context("block inputs out of step")? {
                Saved::Graph(x, y) => (x, y),
                Saved::Input(input) => {
                    let x = Var::from_tensor(&input)?;
                    drop(input);
                    // The first recomputation of a block measures what it needs.
                    let start = if keep.measures() && self.sizes.borrow()[i].is_none() {
                        crate::device::reset_peak_in_use(&keep.device);
                        crate::device::in_use(&keep.device).map(|(now, _)| now)
                    } else {
                        None
                    };
                    let y = student.blocks[i]
                        .forward(x.as_tensor(), &mut NoObserver, None)
                        .with_context(|| format!("layer {i}"))?;
                    if let Some(s) = start {
                        measured = crate::device::in_use(&keep.device).map(|(now, _)| (s, now.saturating_sub(s)));
                    }
                    (x, y)
                }
            };
            let grads = crate::ops::seed_gradient(&y, &g)?.backward().with_context(|| format!("layer {i}"))?;
            drop(y);
            if let Some((s, graph)) = measured {
                if let Some((_, high)) = crate::device::in_use(&keep.device) {
                    self.sizes.borrow_mut()[i] = Some(Need { graph, peak: high.saturating_sub(s) });
                }
            }
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

/// Whether `e` is the device running out of memory.
fn out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let m = c.to_string();
        m.contains("OUT_OF_MEMORY") || m.contains("out of memory")
    })
}

/// What one block needs in bytes: its graph, held from its forward to its backward, and the most
/// in use while it is recomputed and differentiated.
#[derive(Debug, Clone, Copy)]
struct Need {
    graph: usize,
    peak: usize,
}

/// Which blocks keep their graph from the forward. Under [`Recompute::Auto`] on a GPU, what
/// each block needs is measured the first time the block is recomputed (the first pass keeps
/// none, so it measures them all). From then on the blocks to keep are planned once, before the
/// first block, from the free memory read there ([`Room::plan`]): the backward runs from the
/// last block to the first, so each block's backward needs only the graphs kept before it and
/// its own peak. Blocks are measured one by one because they differ: a hybrid's attention blocks
/// hold their [T, T] scores, many times a linear-attention block's graph, and their backward
/// needs more again. The forward waits on the device once, before the first block.
struct Keep {
    policy: Recompute,
    device: candle_core::Device,
    /// Which blocks keep their graphs under `auto` (`None` while some block is unmeasured, or on
    /// the CPU: then none does).
    plan: Option<Vec<bool>>,
    /// What each block needs, where measured.
    sizes: Vec<Option<Need>>,
    /// Blocks kept so far, and the largest of them (bytes).
    kept: usize,
    largest_kept: usize,
}

/// The memory rule of [`Recompute::Auto`], apart from the device: `total` bytes of device
/// memory (or the budget), `logits` bytes for the loss's chunks.
struct Room {
    total: usize,
    logits: usize,
}

impl Room {
    /// Which blocks keep their graphs with `before` bytes free before the first block, less a
    /// twentieth of `total` (what the forward keeps besides the graphs: every block's input,
    /// and the allocator's slack).
    ///
    /// Block j's backward runs after those of the blocks above it, which free their graphs, so
    /// it runs with the graphs kept below it held and needs its own peak on top (a kept block's
    /// peak counts its graph): Σ_{k<j, kept} graph_k + peak_j must fit for every j, and every
    /// kept graph with the loss's logits. A block's graph weighs on every block above it, so
    /// blocks are taken from the last down while all of that still fits.
    fn plan(&self, before: usize, needs: &[Need]) -> Vec<bool> {
        let room = before.saturating_sub(self.total / 20);
        let fits = |keep: &[bool]| {
            let mut held = 0usize;
            for (n, &k) in needs.iter().zip(keep) {
                if held + n.peak > room {
                    return false;
                }
                held += if k { n.graph } else { 0 };
            }
            held + self.logits <= room
        };
        let mut keep = vec![false; needs.len()];
        for j in (0..needs.len()).rev() {
            keep[j] = true;
            keep[j] = fits(&keep);
        }
        keep
    }
}

impl Keep {
    fn new(policy: Recompute, device: &candle_core::Device, sizes: Vec<Option<Need>>, budget: Option<usize>) -> Self {
        let mut keep = Self { policy, device: device.clone(), plan: None, sizes, kept: 0, largest_kept: 0 };
        // Planned once, before the first block, and only once every block is measured.
        let needs: Option<Vec<Need>> = keep.sizes.iter().copied().collect();
        if let (Recompute::Auto, Some(needs)) = (policy, needs) {
            let device_total = crate::device::memory_info(device).map_or(0, |(_, t)| t);
            let total = budget.map_or(device_total, |b| b.min(device_total));
            let room = Room { total, logits: chunk_logit_bytes(device) };
            keep.plan = keep.free(device_total, total).map(|before| room.plan(before, &needs));
        }
        keep
    }

    /// Whether block `i` keeps its graph.
    fn next(&mut self, i: usize) -> bool {
        let keep = match self.policy {
            Recompute::All => false,
            Recompute::None => true,
            Recompute::Auto => self.plan.as_ref().is_some_and(|p| p.get(i).copied().unwrap_or(false)),
        };
        if keep {
            let size = self.graph(i).unwrap_or(0);
            self.largest_kept = self.largest_kept.max(size);
            self.kept += 1;
        }
        keep
    }

    fn graph(&self, i: usize) -> Option<usize> {
        self.sizes.get(i).copied().flatten().map(|n| n.graph)
    }

    /// Whether recomputed blocks are measured (under `auto`, on a GPU).
    fn measures(&self) -> bool {
        self.policy == Recompute::Auto && !self.device.is_cpu()
    }

    /// Free device memory after the queued work, within `limit` of the device's `device_total`
    /// (`None` on the CPU).
    fn free(&self, device_total: usize, limit: usize) -> Option<usize> {
        if self.device.is_cpu() {
            return None;
        }
        self.device.synchronize().ok()?;
        let free = crate::device::free_memory(&self.device)?;
        Some(within_budget(free, device_total, limit))
    }
}

/// What of `free` bytes a step may still take when the device holds `device_total` and the
/// step may use `limit` in all: in use now is what is not free.
fn within_budget(free: usize, device_total: usize, limit: usize) -> usize {
    free.min(limit.saturating_sub(device_total.saturating_sub(free)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::trainable::{Selector, Trainable};
    use crate::arch::{family_for, LoadOptions};
    use crate::checkpoint::Checkpoint;
    use candle_core::Device;
    use std::sync::Arc;

    /// Whether `keep` fits `room` bytes: every block's backward with the graphs kept below it,
    /// and every kept graph with `logits`.
    fn valid(needs: &[Need], keep: &[bool], room: usize, logits: usize) -> bool {
        let mut held = 0;
        for (n, &k) in needs.iter().zip(keep) {
            if held + n.peak > room {
                return false;
            }
            held += if k { n.graph } else { 0 };
        }
        held + logits <= room
    }

    /// The memory rule's plan fits (each block's backward with the graphs kept below it, and
    /// all of them with the loss's logits), keeps every block that could be added to it, takes
    /// the last blocks first, and keeps none when even recomputing every block does not fit.
    #[test]
    fn auto_plans_blocks_that_fit_their_backward() {
        let gib = 1usize << 30;
        let room = Room { total: 140 * gib, logits: 4 * gib };
        let need = |graph: usize, peak: usize| Need { graph: graph * gib, peak: peak * gib };
        // 30 blocks of 5 GiB, 10 at their peak, 120 GiB free less 7: the last block's backward
        // holds the other kept graphs, so 21 fit ((21 − 1)·5 + 10 = 110 ≤ 113, 21·5 + 4 = 109);
        // a rule reserving the peak for every kept block would keep 19.
        let uniform = vec![need(5, 10); 30];
        let plan = room.plan(120 * gib, &uniform);
        assert_eq!(plan.iter().filter(|&&k| k).count(), 21);
        assert!(plan[9..].iter().all(|&k| k) && !plan[8], "the last blocks first: {plan:?}");
        assert!(!room.plan(9 * gib, &uniform).iter().any(|&k| k), "not even one block's backward fits");
        // Random needs: hybrids, one block far larger than the rest, budgets from nothing to all.
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for case in 0..300 {
            let len = 1 + next(40) as usize;
            let needs: Vec<Need> = (0..len)
                .map(|_| {
                    let graph = 1 + next(20) as usize;
                    need(graph, graph + next(3 * graph as u64) as usize)
                })
                .collect();
            let before = next(200) as usize * gib;
            let plan = room.plan(before, &needs);
            let r = before.saturating_sub(7 * gib);
            if !valid(&needs, &vec![false; len], r, 4 * gib) {
                assert!(!plan.iter().any(|&k| k), "case {case}: nothing fits, yet {plan:?}");
                continue;
            }
            assert!(valid(&needs, &plan, r, 4 * gib), "case {case}: the plan does not fit");
            for j in (0..len).filter(|&j| !plan[j]) {
                let mut more = plan.clone();
                more[j] = true;
                assert!(!valid(&needs, &more, r, 4 * gib), "case {case}: block {j} would fit too");
            }
        }
        // A hybrid whose last block is an attention block, 16 GiB held and 60 at its peak: it
        // is kept (no backward runs after it), and the blocks below it fit beside its peak.
        let hybrid: Vec<Need> = (0..32).map(|i| if i % 4 == 3 { need(16, 60) } else { need(2, 4) }).collect();
        let plan = room.plan(100 * gib, &hybrid);
        assert!(plan[31], "{plan:?}");
        assert!(valid(&hybrid, &plan, 93 * gib, 4 * gib));
    }

    /// A budget counts as free only what it leaves above the memory in use, and never more than
    /// the device has free.
    #[test]
    fn a_budget_bounds_the_free_memory() {
        let gib = 1usize << 30;
        assert_eq!(within_budget(120 * gib, 140 * gib, 140 * gib), 120 * gib);
        assert_eq!(within_budget(120 * gib, 140 * gib, 45 * gib), 25 * gib);
        assert_eq!(within_budget(120 * gib, 140 * gib, 10 * gib), 0, "a budget below what is in use");
        assert_eq!(within_budget(30 * gib, 140 * gib, 200 * gib), 30 * gib);
    }

    /// The device's out-of-memory error is recognised under the context a pass adds to it.
    #[test]
    fn out_of_memory_is_recognised() {
        let e = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")").context("layer 31");
        assert!(out_of_memory(&e));
        assert!(!out_of_memory(&anyhow::anyhow!("shape mismatch").context("layer 3")));
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
