//! The linear-attention (delta-rule) mixer, shared by fla DeltaNet / Gated DeltaNet, Qwen3.5 /
//! Qwen3-Next Gated DeltaNet and Kimi Delta Attention: projections → one short conv + SiLU over
//! [q | k | v] → observer → β and decay → L2-normed q and k → the delta-rule recurrence → a
//! (gated) per-head RMSNorm → o_proj. The families differ only in the projection layout
//! ([`Projections`]), the decay ([`Decay`]) and the output gate ([`OutputGate`]).

use super::linear::Linear;
use crate::model::{LayerCache, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::decode::{OutNorm, StepDims, StepInputs};
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::derived::Derived;
use crate::ops::link::Made;
use crate::ops::norm::{l2_norm, RmsNorm};
use crate::ops::prep::{Heads, QkvPrep};
use crate::ops::{repeat_heads, softplus};
use anyhow::Result;
use candle_core::{DType, Module, Tensor};

/// eps of the q/k L2 norms (fla's `l2norm`, inside the square root).
const L2_EPS: f64 = 1e-6;

/// Head counts and widths: `heads` key heads of width `dk`, `v_heads` value heads (a multiple
/// of `heads`; value head j reads key head j / (v_heads / heads)) of width `dv`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearDims {
    pub hidden: usize,
    pub heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

impl LinearDims {
    fn r(&self) -> usize {
        self.v_heads / self.heads
    }
}

/// Where q, k, v and the per-value-head inputs (z for the output gate, b for β, a for the decay)
/// come from.
pub enum Projections {
    /// One projection each (fla, Kimi): `b`, `a`, `z` where the layer has them.
    Separate { q: Linear, k: Linear, v: Linear, b: Option<Linear>, a: Option<Linear>, z: Option<Linear> },
    /// Qwen3.5: flat [q | k | v], and z, b, a per value head.
    QwenSplit { qkv: Linear, z: Linear, b: Linear, a: Linear },
    /// Qwen3-Next: per key-head group [q_g | k_g | v_g | z_g] and [b_g | a_g].
    QwenFused { qkvz: Linear, ba: Linear },
    /// Every projection of `Separate` or `QwenSplit` stacked in one matrix, rows
    /// [q | k | v | z | b | a] (those present): one matmul per call. [`Projections::stacked`]
    /// builds it off the CPU.
    Stacked { all: Linear, z: bool, b: bool, a: bool },
}

struct Projected {
    /// pre-conv [q all | k all | v all]
    qkv: Tensor,
    /// `qkv` linked to the one op that reads it (see [`Projections::project`]): `qkv` is then
    /// its untracked value, and a reader that does not take the link gives it no gradient.
    linked: Option<crate::ops::link::Linked>,
    /// [B, T, Hv·dv]
    z: Option<Tensor>,
    /// [B, T, Hv]
    b: Option<Tensor>,
    a: Option<Tensor>,
}

impl Projections {
    /// The same projections as one [`Projections::Stacked`] matmul when the weights are on a
    /// GPU, plain (no gradient variables, no adapters) and without biases; otherwise unchanged.
    /// The CPU keeps separate matmuls, its reference path.
    pub fn stacked(self) -> Result<Self> {
        // The rows in stacked order, and which of z, b, a are among them.
        let (parts, z, b, a): (Vec<&Linear>, _, _, _) = match &self {
            Projections::Separate { q, k, v, b, a, z } => (
                [Some(q), Some(k), Some(v), z.as_ref(), b.as_ref(), a.as_ref()].into_iter().flatten().collect(),
                z.is_some(),
                b.is_some(),
                a.is_some(),
            ),
            Projections::QwenSplit { qkv, z, b, a } => (vec![qkv, z, b, a], true, true, true),
            _ => return Ok(self),
        };
        let plain = parts.iter().all(|p| p.bias().is_none() && p.is_plain());
        if !plain || parts[0].weight().device().is_cpu() {
            return Ok(self);
        }
        let all = Linear::new(Tensor::cat(&parts.iter().map(|p| p.weight()).collect::<Vec<_>>(), 0)?, None);
        Ok(Projections::Stacked { all, z, b, a })
    }

    /// The projections of x. `link`: the caller reads [q | k | v] with one linked op (the
    /// conv and heads in chunks with gradients), so a product of statecut's whose output is
    /// [q | k | v] alone may link its output to it (see `ops::link`).
    fn project(&self, x: &Tensor, d: LinearDims, link: bool) -> Result<Projected> {
        let (bs, t, _) = x.dims3()?;
        let linked = |y: crate::ops::link::Linked| (y.value.clone(), Some(y));
        Ok(match self {
            Projections::Separate { q, k, v, b, a, z } => {
                let opt = |p: &Option<Linear>| p.as_ref().map(|p| p.forward(x)).transpose();
                let qkv = [q, k, v];
                // With gradients on a GPU (trained weights, as in recovery): one product over the
                // stacked weights, not three and a copy of their outputs, whose backward would add
                // up each output's gradient again.
                // Without gradients (a trained model's passes that build no graph) the same one
                // product over the weights as they stand: three products and the copy of their
                // outputs into one took 1.2 ms a layer at 16 x 2048 tokens of a 1.3B model, one
                // product 0.7.
                let stack = !x.device().is_cpu() && qkv.iter().all(|p| p.adapter().is_none() && p.bias().is_none());
                let tracked = !crate::ops::untracked(&[x, q.weight(), k.weight(), v.weight()]);
                let (qkv, linked) = if stack && tracked {
                    let w = Linear::new(Tensor::cat(&qkv.map(|p| p.weight()), 0)?, None);
                    match w.forward_linked(x)?.filter(|_| link) {
                        Some(y) => linked(y),
                        None => (w.forward(x)?, None),
                    }
                } else if stack {
                    let w = Linear::new(Tensor::cat(&qkv.map(|p| p.weight().detach()), 0)?, None);
                    (crate::ops::linear(&w, x)?, None)
                } else {
                    (Tensor::cat(&[q.forward(x)?, k.forward(x)?, v.forward(x)?], 2)?, None)
                };
                Projected { qkv, linked, z: opt(z)?, b: opt(b)?, a: opt(a)? }
            }
            Projections::QwenSplit { qkv, z, b, a } => {
                let (qkv, linked) = match qkv.forward_linked(x)?.filter(|_| link) {
                    Some(y) => linked(y),
                    None => (qkv.forward(x)?, None),
                };
                Projected { qkv, linked, z: Some(z.forward(x)?), b: Some(b.forward(x)?), a: Some(a.forward(x)?) }
            }
            Projections::Stacked { all, z, b, a } => {
                // Narrowed views of one output: the conv and the decoding step read them in place.
                let y = crate::ops::linear(all, x)?;
                let mut at = 2 * d.heads * d.dk + d.v_heads * d.dv;
                let qkv = y.narrow(2, 0, at)?;
                let mut take = |present: bool, width: usize| -> Result<Option<Tensor>> {
                    if !present {
                        return Ok(None);
                    }
                    at += width;
                    Ok(Some(y.narrow(2, at - width, width)?))
                };
                let z = take(*z, d.v_heads * d.dv)?;
                let b = take(*b, d.v_heads)?;
                let a = take(*a, d.v_heads)?;
                Projected { qkv, linked: None, z, b, a }
            }
            Projections::QwenFused { qkvz, ba } => {
                // transformers `fix_query_key_value_ordering`
                let (r, hk) = (d.r(), d.heads);
                let rdv = r * d.dv;
                let m = qkvz.forward(x)?.reshape((bs, t, hk, 2 * d.dk + 2 * rdv))?;
                let part = |off: usize, len: usize| m.narrow(3, off, len)?.reshape((bs, t, hk * len));
                let qkv = Tensor::cat(&[part(0, d.dk)?, part(d.dk, d.dk)?, part(2 * d.dk, rdv)?], 2)?;
                let z = m.narrow(3, 2 * d.dk + rdv, rdv)?.reshape((bs, t, d.v_heads * d.dv))?;
                let ba = ba.forward(x)?.reshape((bs, t, hk, 2 * r))?;
                let b = ba.narrow(3, 0, r)?.reshape((bs, t, d.v_heads))?;
                let a = ba.narrow(3, r, r)?.reshape((bs, t, d.v_heads))?;
                Projected { qkv, linked: None, z: Some(z), b: Some(b), a: Some(a) }
            }
        })
    }
}

/// How the state decays per step.
pub enum Decay {
    /// DeltaNet
    None,
    /// g = -exp(A_log) · softplus(a + dt_bias) per value head (Gated DeltaNet); `a` comes from
    /// the projections. Float32 [Hv].
    PerHead { neg_a: Derived, dt_bias: Derived },
    /// g = -exp(A_log) · softplus(f_b(f_a(x)) + dt_bias) per value head and key channel (KDA).
    /// `neg_a` [Hv, 1] and `dt_bias` [Hv·dk], float32.
    PerChannel { f_a: Linear, f_b: Linear, neg_a: Derived, dt_bias: Derived },
}

/// What multiplies the normed output.
pub enum OutputGate {
    None,
    /// silu(z) (fla `FusedRMSNormGated`, Qwen3.5); z comes from the projections.
    Silu,
    /// sigmoid(g_b(g_a(x))) (Kimi Delta Attention).
    SigmoidLowRank {
        g_a: Linear,
        g_b: Linear,
    },
}

pub struct LinearAttention {
    pub dims: LinearDims,
    pub layer: usize,
    pub proj: Projections,
    /// one depthwise conv over [q | k | v]; without one, SiLU alone (fla `use_short_conv = False`)
    pub conv: Option<ShortConv>,
    pub decay: Decay,
    pub gate: OutputGate,
    /// β = scale · sigmoid(b) (2 for fla's `allow_neg_eigval`); β = 1 without b.
    pub beta_scale: f64,
    /// per-head norm over dv
    pub norm: RmsNorm,
    pub o_proj: Linear,
}

impl LinearAttention {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = match &self.proj {
            Projections::Separate { q, k, v, b, a, z } => {
                let mut o = vec![q, k, v];
                o.extend(b.iter().chain(a).chain(z));
                o
            }
            Projections::QwenSplit { qkv, z, b, a } => vec![qkv, z, b, a],
            Projections::QwenFused { qkvz, ba } => vec![qkvz, ba],
            Projections::Stacked { all, .. } => vec![all],
        };
        if let Decay::PerChannel { f_a, f_b, .. } = &self.decay {
            out.extend([f_a, f_b]);
        }
        if let OutputGate::SigmoidLowRank { g_a, g_b } = &self.gate {
            out.extend([g_a, g_b]);
        }
        out.push(&self.o_proj);
        out
    }

    /// `cache`: conv history and recurrent state carried between decoding calls.
    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        Ok(self.forward_made(x, obs, cache, false)?.tracked("linear attention")?)
    }

    /// [`Self::forward`]; `link_out`: the caller's next op (the frozen MLP step's residual sum)
    /// is the output's one reader and takes it linked, which a trained mixer's output may be
    /// (see `ops::link`).
    pub(crate) fn forward_made(
        &self,
        x: &Tensor,
        obs: &mut dyn Observer,
        cache: Option<&mut LayerCache>,
        link_out: bool,
    ) -> Result<Made> {
        let d = self.dims;
        let (b, t, _) = x.dims3()?;
        let cache = match cache {
            Some(c)
                if t == 1
                    && obs.passive()
                    && self.steps_fused(x)
                    && matches!(c, LayerCache::Recurrent { conv: Some(_), .. }) =>
            {
                return Ok(Made::Tracked(self.step(x, c)?));
            }
            other => other,
        };
        obs.qk_input(self.layer, x)?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state, .. }) => (conv.clone(), Some(state.clone())),
            _ => (None, None),
        };
        let dev = x.device();
        // With gradients on the chunk kernels: the conv, q and k normed straight into the
        // kernels' chunked layout, and the recurrence on those chunks (see `trained_chunks`).
        let chunks_with_gradients = prev_state.is_none()
            && cache.is_none()
            && obs.passive()
            && !obs.wants_state()
            && matches!(self.decay, Decay::None | Decay::PerHead { .. })
            && crate::ops::delta_rule::Kernel::chunk_kernels_with_gradients(dev, d.dk);
        // There the conv's op is [q | k | v]'s one reader, which may take it linked.
        let link = chunks_with_gradients && self.conv.as_ref().is_some_and(ShortConv::fits_ops);
        let p = self.proj.project(x, d, link)?;
        let trained_chunks = chunks_with_gradients && (p.linked.is_some() || self.mixes_with_gradients(&p.qkv)?);
        if trained_chunks {
            return self.trained_chunks(x, &p, link_out);
        }
        let (mixed, conv_state) = match &self.conv {
            Some(c) => {
                let (y, st) = c.forward_silu_cached(&p.qkv, prev_conv.as_ref())?;
                (y, Some(st))
            }
            None => (candle_nn::ops::silu(&p.qkv)?, None),
        };
        let kd = d.heads * d.dk;
        // Off the CPU and without a gradient, one kernel makes the recurrence's float32 inputs;
        // the observer's bf16 copies of q and k are made only for an observer that looks.
        let fused = crate::ops::fusable(&[&mixed]);
        let head = |off: usize, heads: usize, w: usize| mixed.narrow(2, off, heads * w)?.reshape((b, t, heads, w));
        if !obs.passive() {
            obs.qk(self.layer, &head(0, d.heads, d.dk)?, &head(kd, d.heads, d.dk)?)?;
        }
        let f32 = DType::F32;
        let (beta, g, gk) = self.gates(x, &p)?;
        // Long sequences take the chunk kernels, on tensor cores with v in its 16-bit dtype
        // (see `Kernel::chunks_without_gradients`); the fused kernel wants every input in float32.
        let chunks = fused
            && mixed.dtype() != f32
            && matches!(self.decay, Decay::None | Decay::PerHead { .. })
            && crate::ops::delta_rule::Kernel::chunks_without_gradients(dev, (b, t, d.v_heads), d.dk, d.dv);
        let (hq, hk, hv, scale) = self.heads();
        let (q, k, v) = if chunks || (!fused && !dev.is_cpu()) {
            // For the chunk kernels, and with gradients on a GPU: one op per part, each reading
            // its columns in place, their backwards writing one d(mixed) (see
            // `ops::prep::heads_qkv`).
            crate::ops::prep::heads_qkv(&mixed, hq, hk, hv)?
        } else if fused {
            let prep = QkvPrep { heads: d.heads, v_heads: d.v_heads, dk: d.dk, dv: d.dv, eps: L2_EPS as f32 };
            prep.run(&mixed)?
        } else {
            // Cast from the column slice, then split heads: one pass, not a copy and a cast.
            let head_f32 = |off: usize| mixed.narrow(2, off, kd)?.to_dtype(f32)?.reshape((b, t, d.heads, d.dk));
            let q = repeat_heads(&l2_norm(&head_f32(0)?, L2_EPS)?, d.r())?;
            let k = repeat_heads(&l2_norm(&head_f32(kd)?, L2_EPS)?, d.r())?;
            (q, k, head(2 * kd, d.v_heads, d.dv)?)
        };
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: g.as_ref(),
            gk: gk.as_ref(),
            scale,
            rule: Rule::Delta,
            initial: prev_state.as_ref(),
        };
        // A pass that stays on the fused op may take its chunked form.
        use crate::ops::delta_rule::Kernel;
        let in_chunks = fused && !chunks && Kernel::fused_in_chunks(dev, mixed.dtype());
        let o = match (chunks, in_chunks) {
            (true, _) => Kernel::scoped(Kernel::ChunkedKernels, || {
                crate::model::run_recurrence(&rec, self.layer, obs, cache, conv_state)
            })?,
            (false, true) => Kernel::scoped(Kernel::FusedChunks, || {
                crate::model::run_recurrence(&rec, self.layer, obs, cache, conv_state)
            })?,
            (false, false) => crate::model::run_recurrence(&rec, self.layer, obs, cache, conv_state)?,
        };
        Ok(Made::Tracked(self.output(x, o, p.z.as_ref())?))
    }

    /// Whether a gradient flows through the conv's output (or, without a conv, SiLU's) for the
    /// projections' output `qkv`: off the CPU, the input or the conv's weights tracked.
    fn mixes_with_gradients(&self, qkv: &Tensor) -> Result<bool> {
        let parts = self.conv.as_ref().map(ShortConv::parts).transpose()?;
        let (w, bias) = parts.map_or((None, None), |(w, b)| (Some(w), b));
        let inputs: Vec<&Tensor> = [Some(qkv), w.as_ref(), bias.as_ref()].into_iter().flatten().collect();
        Ok(!qkv.device().is_cpu() && !crate::ops::untracked(&inputs))
    }

    /// The layer from its projections `p` with gradients on the chunk kernels (a decay per head
    /// or none, no cache or initial state, an observer that does not look inside): q and k
    /// normed straight into the kernels' chunked layout, and with a short conv the conv inside
    /// the same ops (see `ops::prep::conv_heads_qk_chunks`), so that neither the conv's output
    /// nor q and k as heads are nodes of the graph.
    /// `link_out`: the output may go linked to the caller's next op (see [`Self::forward_made`]).
    fn trained_chunks(&self, x: &Tensor, p: &Projected, link_out: bool) -> Result<Made> {
        let (beta, g, _) = self.gates(x, p)?;
        let (hq, hk, hv, scale) = self.heads();
        let c = crate::ops::chunked::chunk_len(x.dim(1)?);
        use crate::ops::link::Operand;
        // A linked [q | k | v] has a gradient whatever the conv's weights track.
        let (input, operands) = match (&p.linked, &self.conv) {
            (Some(l), Some(conv)) => {
                let operands = conv.operands_in(p.qkv.dtype(), x.device())?;
                let operands = operands.ok_or_else(|| anyhow::anyhow!("a linked [q | k | v] needs the conv's op"))?;
                (Operand::Linked(l), Some(operands))
            }
            (Some(_), None) => anyhow::bail!("a linked [q | k | v] needs the short conv to read it"),
            (None, conv) => {
                (Operand::Tracked(&p.qkv), conv.as_ref().map(|c| c.grad_operands(&p.qkv)).transpose()?.flatten())
            }
        };
        // Linked to the recurrence, their one reader (see `ops::link`).
        let qkv = {
            use crate::ops::prep::{conv_heads_qk_linked, heads_qk_linked};
            let _s = crate::profile::span("short conv + heads in chunks", x.device());
            match (operands, &self.conv) {
                (Some((w, bias)), _) => conv_heads_qk_linked(input, &w, &bias, hq, hk, hv, c)?,
                (None, Some(conv)) => heads_qk_linked(&conv.forward_silu_cached(&p.qkv, None)?.0, hq, hk, hv, c)?,
                (None, None) => heads_qk_linked(&candle_nn::ops::silu(&p.qkv)?, hq, hk, hv, c)?,
            }
        };
        // With a frozen output projection the norm and projection are one op, o's one reader:
        // o goes to it linked.
        let d = self.dims;
        let gate = self.projected_gate(p.z.as_ref());
        let (b, t, _) = x.dims3()?;
        let through = self
            .o_proj
            .frozen_weight()
            .filter(|w| p.qkv.dtype() == x.dtype() && self.norm.projects_linked_heads(&[b, t, d.v_heads, d.dv], w));
        if let (Some(gate), Some(w)) = (gate, through) {
            let o = {
                let _s = crate::profile::span("recurrence", x.device());
                crate::ops::chunked::delta_linked_through(&qkv, &beta, g.as_ref(), scale)?
            };
            return Ok(match link_out {
                true => Made::Linked(self.norm.project_heads_linked_through(&o, gate, w)?),
                false => Made::Tracked(self.norm.project_heads_linked(&o, gate, w)?),
            });
        }
        let o = {
            let _s = crate::profile::span("recurrence", x.device());
            crate::ops::chunked::delta_from_linked(&qkv, &beta, g.as_ref(), scale)?
        };
        Ok(Made::Tracked(self.output(x, o, p.z.as_ref())?))
    }

    /// β [B, T, Hv], and the decay per head g [B, T, Hv] or per key channel gk [B, T, Hv, dk],
    /// in float32, as the upstream kernels compute them (bf16 gates compound over the sequence).
    fn gates(&self, x: &Tensor, p: &Projected) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims;
        let (b, t, _) = x.dims3()?;
        let f32 = DType::F32;
        let beta = match &p.b {
            Some(bb) => (candle_nn::ops::sigmoid(&bb.to_dtype(f32)?)? * self.beta_scale)?,
            None => Tensor::ones((b, t, d.v_heads), f32, x.device())?,
        };
        let (g, gk) = match &self.decay {
            Decay::None => (None, None),
            Decay::PerHead { neg_a, dt_bias } => {
                let a = p.a.as_ref().ok_or_else(|| anyhow::anyhow!("a per-head decay needs the a projection"))?;
                (Some(softplus(&a.to_dtype(f32)?.broadcast_add(&dt_bias.get()?)?)?.broadcast_mul(&neg_a.get()?)?), None)
            }
            Decay::PerChannel { f_a, f_b, neg_a, dt_bias } => {
                let f = f_b.forward(&f_a.forward(x)?)?.to_dtype(f32)?.broadcast_add(&dt_bias.get()?)?;
                (None, Some(softplus(&f.reshape((b, t, d.v_heads, d.dk))?)?.broadcast_mul(&neg_a.get()?)?))
            }
        };
        Ok((beta, g, gk))
    }

    /// q and k L2-normed and repeated for the value heads that read them, v copied (the parts of
    /// the heads ops, over the conv's [q | k | v] columns), and the queries' scale.
    fn heads(&self) -> (Heads, Heads, Heads, f64) {
        let d = self.dims;
        let kd = d.heads * d.dk;
        let hq = Heads { off: 0, heads: d.heads, d: d.dk, rep: d.r(), norm: Some(L2_EPS as f32) };
        let (hk, hv) = (Heads { off: kd, ..hq }, Heads { off: 2 * kd, heads: d.v_heads, d: d.dv, rep: 1, norm: None });
        (hq, hk, hv, (d.dk as f64).powf(-0.5))
    }

    /// The output projection of the recurrence's output o [B, T, Hv, dv] after the norm and the
    /// gate (`z`: the silu gate's projection); x is the layer's input.
    fn output(&self, x: &Tensor, o: Tensor, z: Option<&Tensor>) -> Result<Tensor> {
        let d = self.dims;
        let (b, t, _) = x.dims3()?;
        let f32 = DType::F32;
        let out_fused = {
            let (weight, _) = self.norm.applied()?;
            let z = z.into_iter().filter(|_| matches!(self.gate, OutputGate::Silu));
            crate::ops::fusable(&[&o, &weight].into_iter().chain(z).collect::<Vec<_>>())
        };
        if out_fused && matches!(self.gate, OutputGate::None | OutputGate::Silu) {
            // Norm and gate in one kernel, which reads o in float32 (as the fused kernel gives
            // it; the chunk kernels give it in the values' dtype).
            let norm = self.out_norm(z.cloned(), x.dtype())?;
            let o = o.to_dtype(f32)?.contiguous()?;
            return Ok(crate::ops::linear(&self.o_proj, &o.apply_op1_no_bwd(&norm)?)?);
        }
        let o = o.to_dtype(x.dtype())?;
        // With gradients on a GPU, the norm and a frozen output projection are one op.
        if let (Some(gate), Some(w)) = (self.projected_gate(z), self.o_proj.frozen_weight()) {
            if let Some(y) = self.norm.project_heads(&o, gate, w)? {
                return Ok(y);
            }
        }
        // The norms by heads lay o out [b, t, v_heads · dv], as the output projection reads it.
        let o = match &self.gate {
            OutputGate::None => self.norm.forward_heads(&o)?,
            OutputGate::Silu => {
                let z = z.ok_or_else(|| anyhow::anyhow!("a silu output gate needs the z projection"))?;
                self.norm.forward_gated_heads(&o, z)?
            }
            OutputGate::SigmoidLowRank { g_a, g_b } => {
                let gate = g_b.forward(&g_a.forward(x)?)?.reshape((b, t, d.v_heads, d.dv))?;
                let o = self.norm.forward(&o)?.to_dtype(f32)?;
                (o * candle_nn::ops::sigmoid(&gate.to_dtype(f32)?)?)?.to_dtype(x.dtype())?
            }
        };
        let o = if o.rank() == 3 { o } else { o.reshape((b, t, d.v_heads * d.dv))? };
        Ok(self.o_proj.forward(&o)?)
    }
}

impl LinearAttention {
    /// Whether a single-token step on `x` may take [`Self::step`]: off the CPU, with no gradient,
    /// for the layers it covers (a short conv, no per-channel decay, no low-rank gate).
    fn steps_fused(&self, x: &Tensor) -> bool {
        let Some(Ok((conv, _))) = self.conv.as_ref().map(|c| c.parts()) else { return false };
        let Ok((norm, _)) = self.norm.applied() else { return false };
        crate::ops::fusable(&[x, &norm, &conv])
            && !matches!(self.decay, Decay::PerChannel { .. })
            && matches!(self.gate, OutputGate::None | OutputGate::Silu)
    }

    /// The gate of the output norm where the norm and a frozen output projection may be one op
    /// (`RmsNorm::project_heads`): none, or silu(z) with z the projection the gate reads;
    /// `None` for a gate that op does not take.
    fn projected_gate<'a>(&self, z: Option<&'a Tensor>) -> Option<Option<&'a Tensor>> {
        match self.gate {
            OutputGate::None => Some(None),
            OutputGate::Silu => z.map(Some),
            OutputGate::SigmoidLowRank { .. } => None,
        }
    }

    /// The one-kernel output norm ([`OutNorm`]) of a layer without a gate or with silu(z), in
    /// `dtype`; `z` is the projection the gate reads.
    fn out_norm(&self, z: Option<Tensor>, dtype: DType) -> Result<OutNorm> {
        let (weight, eps) = self.norm.applied()?;
        let gate = match self.gate {
            OutputGate::Silu => Some(z.ok_or_else(|| anyhow::anyhow!("a silu output gate needs the z projection"))?),
            _ => None,
        };
        Ok(OutNorm { weight, gate, dtype, eps: eps as f32 })
    }

    /// One decoding step in five launches (projections, [`StepInputs`], the recurrence,
    /// [`OutNorm`], o_proj) instead of some fifty separate ops: what bounds a step at small
    /// batches is launching kernels, not the bytes it moves.
    fn step(&self, x: &Tensor, cache: &mut LayerCache) -> Result<Tensor> {
        let d = self.dims;
        let (b, _, _) = x.dims3()?;
        let (LayerCache::Recurrent { conv: Some(history), state, owned }, Some(conv)) = (&*cache, &self.conv) else {
            anyhow::bail!("a fused decoding step needs a conv history and a recurrent state");
        };
        // An owned cache is overwritten in place; its history is already float32 (see
        // `DecodeCache::exclusive`), so the kernel reads and writes the cache's own buffer.
        let in_place = *owned;
        let dtype = x.dtype();
        let p = self.proj.project(x, d, false)?;
        let (weight, bias) = conv.parts()?;
        let (neg_a, dt_bias, a) = match &self.decay {
            Decay::PerHead { neg_a, dt_bias } => (Some(neg_a.get()?), Some(dt_bias.get()?), p.a.clone()),
            _ => (None, None, None),
        };
        let history = if in_place { history.clone() } else { history.to_dtype(DType::F32)?.contiguous()? };
        let inputs = StepInputs {
            dims: StepDims { b, heads: d.heads, v_heads: d.v_heads, dk: d.dk, dv: d.dv, kernel: weight.dim(1)? },
            history,
            weight: weight.to_dtype(dtype)?.contiguous()?,
            bias: bias.map(|b| b.to_dtype(dtype)).transpose()?,
            b: p.b.clone(),
            a,
            neg_a,
            dt_bias,
            beta_scale: self.beta_scale as f32,
            eps: L2_EPS as f32,
            in_place,
        };
        let s = inputs.run(&p.qkv)?;
        let rec = Recurrence {
            q: &s.q,
            k: &s.k,
            v: &s.v,
            beta: &s.beta,
            g: s.g.as_ref(),
            gk: None,
            scale: (d.dk as f64).powf(-0.5),
            rule: Rule::Delta,
            initial: Some(state),
        };
        let o = if in_place {
            rec.fused_in_place()?
        } else {
            let (o, state) = rec.fused_with_state()?;
            *cache = LayerCache::Recurrent { conv: Some(s.history), state, owned: false };
            o
        };
        let norm = self.out_norm(p.z, dtype)?;
        Ok(crate::ops::linear(&self.o_proj, &o.apply_op1_no_bwd(&norm)?)?)
    }
}
