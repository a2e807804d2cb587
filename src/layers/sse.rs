//! One SSE layer (fla `SSEGLA` / `SSEGDN`): N routed state partitions plus a shared one.
//!
//! Per head, with the scale dk^-1/2 (index 1 the shared partition, 2 the routed ones):
//!   q1, k1 from conv(x W_q), conv(x W_k);  q2, k2 from x W_q + lora_q(x), x W_k + lora_k(x)
//!   GLA: q = silu(.), k = softmax(.), per-channel log decays g = logsigmoid(gk_proj.i(x)) / 16
//!   GDN: q = l2(silu(.)), k = l2(silu(.)), per-head g = -exp(A_log) softplus(a_proj(x) + dt_bias)
//!        and beta = sigmoid(b_proj(x)) (a_proj/b_proj/A_log/dt_bias: shared half, routed half)
//!   v = silu(x W_v), e = softmax(x W_e) over N partitions, T = top-k(e)
//!   S0 ← step(S0; k1, v, g1);  p ∈ T: Sp ← step(Sp; e_p k2, v, g2), others unchanged (no decay)
//!   o = S0ᵀ(scale q1) + Σ_{p∈T} e_p Spᵀ(scale q2), then o_norm gated by g_proj, o_proj.
//! where step is GLA's `diag(exp g) S + k vᵀ` or the gated delta rule.

use super::linear::Linear;
use crate::model::{LayerCache, Observer};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::derived::Derived;
use crate::ops::norm::{l2_norm, NormWeight, RmsNorm};
use crate::ops::softplus;
use anyhow::{Context, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::VarBuilder;

/// How the layer combines its N+1 partitions (all three compute the same function).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Implementation {
    /// (N+1)·H heads with masked queries/keys/values/decays, one pass, outputs summed.
    Mask,
    /// Per (sequence, partition): gather the routed tokens, run the recurrence, scatter back.
    Varlen,
    /// One token at a time with all N+1 states (a reference for tests).
    Loop,
}

/// The state transition inside every partition (`linear_attn_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// GLA: per-key-channel decay, plain write (`SSEGLA`).
    Gla,
    /// Gated DeltaNet: per-head decay, delta-rule write with strength beta (`SSEGDN`).
    Gdn,
}

/// Sizes derived from a config as fla's `SSEGLA`/`SSEGDN` derive them.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// N, the routed partitions (the shared partition comes on top).
    pub partitions: usize,
    /// k, partitions each token writes to and reads from.
    pub topk: usize,
    pub intermediate: usize,
    pub use_output_gate: bool,
    pub use_short_conv: bool,
    pub conv_size: usize,
    pub implementation: Implementation,
    pub transition: Transition,
    pub allow_neg_eigval: bool,
    /// the output norm's epsilon
    pub norm_eps: f64,
}

/// fla `gate_logit_normalizer` and `gate_low_rank_dim` (SSEGLA defaults, not in the config).
const GATE_LOGIT_NORMALIZER: f64 = 16.0;
const GATE_LOW_RANK_DIM: usize = 16;

/// `nn.Sequential(Linear(inp, mid), Linear(mid, out))`.
struct LowRank(Linear, Linear);

impl LowRank {
    fn load(vb: VarBuilder, inp: usize, mid: usize, out: usize, bias: bool) -> Result<Self> {
        Ok(Self(Linear::load(vb.pp("0"), inp, mid, false)?, Linear::load(vb.pp("1"), mid, out, bias)?))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.1.forward(&self.0.forward(x)?)?)
    }
}

/// The decay (and write strength) projections of the transition.
enum Gates {
    /// `gk_proj.{0,1}`: per-key-channel log decays of the shared and the routed partitions.
    Gla([LowRank; 2]),
    /// `a_proj`, `b_proj` [2H, D], `A_log`, `dt_bias` [2H]: first H shared, last H routed.
    Gdn { a_proj: Linear, b_proj: Linear, neg_a: Derived, dt_bias: Derived, beta_scale: f64 },
}

/// Per-token inputs of the N+1 partitions, [B, T, H, *] (index 0 the shared partition, 1 the
/// routed ones), and the routing [B, T, N].
struct Features {
    q: [Tensor; 2],
    k: [Tensor; 2],
    v: Tensor,
    /// log decays [B, T, H, c]: c = dk (GLA, per channel) or 1 (GDN, per head)
    g: [Tensor; 2],
    /// write strengths [B, T, H] (GDN)
    beta: Option<[Tensor; 2]>,
    /// routing weight e_p where p is selected, 0 elsewhere
    w: Tensor,
    /// 1 where p is selected, 0 elsewhere
    sel: Tensor,
}

pub struct SseMixer {
    d: Dims,
    layer: usize,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    lora_q: LowRank,
    lora_k: LowRank,
    gates: Gates,
    e_proj: Linear,
    /// the shared q/k convs as one depthwise conv over [q | k]
    conv: Option<ShortConv>,
    g_proj: Option<LowRank>,
    o_norm: RmsNorm,
    o_proj: Linear,
}

fn ones(shape: (usize, usize, usize), like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::ones(shape, like.dtype(), like.device())?)
}

/// Time step `ti` of [B, T, ...].
fn at(x: &Tensor, ti: usize) -> Result<Tensor> {
    Ok(x.narrow(1, ti, 1)?.squeeze(1)?.contiguous()?)
}

impl SseMixer {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.q_proj, &self.k_proj, &self.v_proj];
        out.extend([&self.lora_q.0, &self.lora_q.1, &self.lora_k.0, &self.lora_k.1]);
        match &self.gates {
            Gates::Gla([a, b]) => out.extend([&a.0, &a.1, &b.0, &b.1]),
            Gates::Gdn { a_proj, b_proj, .. } => out.extend([a_proj, b_proj]),
        }
        out.push(&self.e_proj);
        out.extend(self.g_proj.iter().flat_map(|g| [&g.0, &g.1]));
        out.push(&self.o_proj);
        out
    }

    pub fn load(vb: VarBuilder, d: Dims, layer: usize, grad: bool) -> Result<Self> {
        let (hid, kd, vd) = (d.hidden, d.heads * d.dk, d.heads * d.dv);
        let conv = if d.use_short_conv {
            let bias = vb.contains_tensor("q_conv1d_shared.bias");
            Some(ShortConv::concat(&vb, &[("q_conv1d_shared", kd), ("k_conv1d_shared", kd)], d.conv_size, bias)?)
        } else {
            None
        };
        let gates = match d.transition {
            Transition::Gla => {
                let gk = |i: usize| LowRank::load(vb.pp("gk_proj").pp(i), hid, GATE_LOW_RANK_DIM, kd, true);
                Gates::Gla([gk(0)?, gk(1)?])
            }
            Transition::Gdn => Gates::Gdn {
                a_proj: Linear::load(vb.pp("a_proj"), hid, 2 * d.heads, false)?,
                b_proj: Linear::load(vb.pp("b_proj"), hid, 2 * d.heads, false)?,
                neg_a: Derived::new(vb.get(2 * d.heads, "A_log")?, |t| t.to_dtype(DType::F32)?.exp()?.neg())?,
                dt_bias: Derived::new(vb.get(2 * d.heads, "dt_bias")?, |t| t.to_dtype(DType::F32))?,
                beta_scale: if d.allow_neg_eigval { 2.0 } else { 1.0 },
            },
        };
        Ok(Self {
            d,
            layer,
            q_proj: Linear::load_trainable(&vb, "q_proj", hid, kd, false, grad)?,
            k_proj: Linear::load_trainable(&vb, "k_proj", hid, kd, false, grad)?,
            v_proj: Linear::load(vb.pp("v_proj"), hid, vd, false)?,
            lora_q: LowRank::load(vb.pp("lora_q_proj"), hid, d.dv, kd, false)?,
            lora_k: LowRank::load(vb.pp("lora_k_proj"), hid, d.dv, kd, false)?,
            gates,
            e_proj: Linear::load(vb.pp("e_proj"), hid, d.partitions, false)?,
            conv,
            g_proj: if d.use_output_gate { Some(LowRank::load(vb.pp("g_proj"), hid, d.dv, vd, false)?) } else { None },
            o_norm: RmsNorm::load(vb.pp("o_norm"), d.dv, d.norm_eps, NormWeight::Plain)?,
            o_proj: Linear::load(vb.pp("o_proj"), vd, hid, false)?,
        })
    }

    fn rule(&self) -> Rule {
        match self.d.transition {
            Transition::Gla => Rule::Plain,
            Transition::Gdn => Rule::Delta,
        }
    }

    /// The features, and the short convs' last inputs (for a decoding cache), continuing from
    /// `prev_conv` when given.
    fn features(
        &self,
        x: &Tensor,
        obs: &mut dyn Observer,
        prev_conv: Option<&Tensor>,
    ) -> Result<(Features, Option<Tensor>)> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        obs.qk_input(self.layer, x)?;
        let q1 = self.q_proj.forward(x)?;
        let k1 = self.k_proj.forward(x)?;
        let q2 = (&q1 + self.lora_q.forward(x)?)?;
        let k2 = (&k1 + self.lora_k.forward(x)?)?;
        let kd = d.heads * d.dk;
        let (q1, k1, conv_state) = match &self.conv {
            Some(conv) => {
                let (y, st) = conv.forward_cached(&Tensor::cat(&[&q1, &k1], 2)?, prev_conv)?;
                (y.narrow(2, 0, kd)?, y.narrow(2, kd, kd)?, Some(st))
            }
            None => (q1, k1, None),
        };
        let heads = |y: Tensor, w: usize| y.reshape((b, t, d.heads, w));
        let (q1, q2) = (candle_nn::ops::silu(&heads(q1, d.dk)?)?, candle_nn::ops::silu(&heads(q2, d.dk)?)?);
        let (k1, k2) = (heads(k1, d.dk)?, heads(k2, d.dk)?);
        let dtype = x.dtype();
        let v = candle_nn::ops::silu(&heads(self.v_proj.forward(x)?, d.dv)?)?;
        let (q, k, g, beta) = match &self.gates {
            Gates::Gla(gk) => {
                // The shared path's queries as the state reads them, and its keys before the
                // softmax that normalises them.
                obs.qk(self.layer, &q1, &k1)?;
                // candle_nn::ops::softmax (not softmax_last_dim) so that the key projections get
                // gradients.
                let softmax = |k: &Tensor| -> Result<Tensor> {
                    Ok(candle_nn::ops::softmax(&k.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(dtype)?)
                };
                // logsigmoid(y) / 16 = -softplus(-y) / 16
                let gate = |i: usize| -> Result<Tensor> {
                    let y = heads(gk[i].forward(x)?, d.dk)?;
                    Ok((softplus(&y.neg()?)?.neg()? / GATE_LOGIT_NORMALIZER)?)
                };
                ([q1, q2], [softmax(&k1)?, softmax(&k2)?], [gate(0)?, gate(1)?], None)
            }
            Gates::Gdn { a_proj, b_proj, neg_a, dt_bias, beta_scale } => {
                let k1 = candle_nn::ops::silu(&k1)?;
                // After the conv and SiLU, before the L2 norm (as for fla's Gated DeltaNet).
                obs.qk(self.layer, &q1, &k1)?;
                let k2 = candle_nn::ops::silu(&k2)?;
                let l2 = |y: &Tensor| l2_norm(y, 1e-6);
                // g = -exp(A_log) * softplus(a + dt_bias), in float32
                let g = softplus(&a_proj.forward(x)?.to_dtype(DType::F32)?.broadcast_add(&dt_bias.get()?)?)?
                    .broadcast_mul(&neg_a.get()?)?
                    .to_dtype(dtype)?;
                let beta = (candle_nn::ops::sigmoid(&b_proj.forward(x)?)? * *beta_scale)?;
                let half = |y: &Tensor, i: usize| y.narrow(2, i * d.heads, d.heads);
                let g = [half(&g, 0)?.unsqueeze(3)?, half(&g, 1)?.unsqueeze(3)?];
                let beta = [half(&beta, 0)?.contiguous()?, half(&beta, 1)?.contiguous()?];
                ([l2(&q1)?, l2(&q2)?], [l2(&k1)?, l2(&k2)?], g, Some(beta))
            }
        };
        // Routing: softmax over partitions in float32, top-k, on the device. A partition is
        // selected when its place in the descending order is below k (the order's inverse gives
        // each partition its place); the CPU's stable sort breaks exact ties to the lower index.
        let e = candle_nn::ops::softmax(&self.e_proj.forward(x)?.to_dtype(DType::F32)?, D::Minus1)?.contiguous()?;
        let place = e.arg_sort_last_dim(false)?.arg_sort_last_dim(true)?;
        let sel = place.lt(&Tensor::full(d.topk as u32, place.shape(), place.device())?)?.to_dtype(DType::F32)?;
        obs.routing(self.layer, &sel)?;
        obs.partition_keys(self.layer, [&k[0], &k[1]], [&g[0], &g[1]], &sel)?;
        let w = (e * &sel)?.to_dtype(dtype)?;
        Ok((Features { q, k, v, g, beta, w, sel: sel.to_dtype(dtype)? }, conv_state))
    }

    fn scale(&self) -> f64 {
        (self.d.dk as f64).powf(-0.5)
    }

    /// One recurrence over [B, T, H', *] inputs with log decays `g` [B, T, H', c]; the final
    /// state when `state` (always when continuing from `initial`).
    #[allow(clippy::too_many_arguments)]
    fn recur(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: Option<&Tensor>,
        initial: Option<&Tensor>,
        state: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (b, t, h, _) = q.dims4()?;
        let beta = match beta {
            Some(x) => x.clone(),
            None => ones((b, t, h), v)?,
        };
        let per_head = if g.dim(3)? == 1 { Some(g.squeeze(3)?) } else { None };
        let rec = Recurrence {
            q,
            k,
            v,
            beta: &beta,
            g: per_head.as_ref(),
            gk: if per_head.is_none() { Some(g) } else { None },
            scale: self.scale(),
            rule: self.rule(),
            initial,
        };
        if state || initial.is_some() {
            let (o, s) = rec.forward_with_state()?;
            Ok((o, Some(s)))
        } else {
            Ok((rec.forward()?, None))
        }
    }

    /// All N+1 partitions as (N+1)·H heads, partition-major (fla's mask form): the routed
    /// queries and keys times e·mask, values and decays times the mask (a zero key writes
    /// nothing under either rule). Continues from `initial` [B, (N+1)·H, dk, dv] when given;
    /// returns the summed output [B, T, H, dv] and, with `state`, the final states.
    fn mix_mask(&self, f: &Features, initial: Option<&Tensor>, state: bool) -> Result<(Tensor, Option<Tensor>)> {
        let d = self.d;
        let (b, t, h, _) = f.q[0].dims4()?;
        let n = d.partitions;
        let gate = |m: &Tensor| -> Result<Tensor> { Ok(m.unsqueeze(3)?.unsqueeze(4)?) };
        let (wm, sm) = (gate(&f.w)?, gate(&f.sel)?);
        let expand = |shared: &Tensor, routed: &Tensor, m: Option<&Tensor>| -> Result<Tensor> {
            let width = shared.dim(3)?;
            let routed = routed.unsqueeze(2)?;
            let routed = match m {
                Some(m) => routed.broadcast_mul(m)?,
                None => routed.broadcast_as((b, t, n, h, width))?,
            };
            Ok(Tensor::cat(&[&shared.unsqueeze(2)?, &routed], 2)?.reshape((b, t, (n + 1) * h, width))?)
        };
        let q = expand(&f.q[0], &f.q[1], Some(&wm))?;
        let k = expand(&f.k[0], &f.k[1], Some(&wm))?;
        let v = expand(&f.v, &f.v, Some(&sm))?;
        let g = expand(&f.g[0], &f.g[1], Some(&sm))?;
        let beta = match &f.beta {
            Some([b1, b2]) => Some(expand(&b1.unsqueeze(3)?, &b2.unsqueeze(3)?, None)?.squeeze(3)?),
            None => None,
        };
        let (o, s) = self.recur(&q, &k, &v, &g, beta.as_ref(), initial, state)?;
        Ok((o.reshape((b, t, n + 1, h, d.dv))?.sum(2)?, s))
    }

    /// fla's varlen form: the shared partition over the whole sequence, then for each
    /// (sequence, partition) the routed tokens gathered in order, the recurrence run on that
    /// subsequence, and its outputs scattered back.
    fn mix_varlen(&self, f: &Features) -> Result<Tensor> {
        let d = self.d;
        let (b, t, h, _) = f.q[0].dims4()?;
        let n = d.partitions;
        let beta = |i: usize| f.beta.as_ref().map(|bb| &bb[i]);
        // The gather indices are built on the host: this form is the CPU's reference.
        let sel_host = f.sel.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let shared = self.recur(&f.q[0], &f.k[0], &f.v, &f.g[0], beta(0), None, false)?.0;
        let mut routed = Vec::with_capacity(b);
        for bi in 0..b {
            let mut ob = Tensor::zeros((t, h, d.dv), f.v.dtype(), f.v.device())?;
            for p in 0..n {
                let idx: Vec<u32> =
                    (0..t).filter(|&ti| sel_host[(bi * t + ti) * n + p] > 0.0).map(|ti| ti as u32).collect();
                if idx.is_empty() {
                    continue;
                }
                let len = idx.len();
                let ix = Tensor::from_vec(idx, len, f.v.device())?;
                let gather =
                    |x: &Tensor| -> Result<Tensor> { Ok(x.get(bi)?.contiguous()?.index_select(&ix, 0)?.unsqueeze(0)?) };
                let wp =
                    f.w.get(bi)?
                        .narrow(1, p, 1)?
                        .squeeze(1)?
                        .contiguous()?
                        .index_select(&ix, 0)?
                        .reshape((1, len, 1, 1))?;
                let q = gather(&f.q[1])?.broadcast_mul(&wp)?;
                let k = gather(&f.k[1])?.broadcast_mul(&wp)?;
                let bp = beta(1).map(gather).transpose()?;
                let o = self.recur(&q, &k, &gather(&f.v)?, &gather(&f.g[1])?, bp.as_ref(), None, false)?.0;
                ob = ob.index_add(&ix, &o.squeeze(0)?, 0)?;
            }
            routed.push(ob);
        }
        Ok((shared + Tensor::stack(&routed, 0)?)?)
    }

    /// One token at a time with all N+1 states (candle ops only; a reference for tests).
    fn mix_loop(&self, f: &Features) -> Result<Tensor> {
        let d = self.d;
        let (b, t, h, dk) = f.q[0].dims4()?;
        let n = d.partitions;
        let scale = self.scale();
        let mut states: Vec<Tensor> =
            (0..=n).map(|_| Tensor::zeros((b, h, dk, d.dv), f.v.dtype(), f.v.device())).collect::<Result<_, _>>()?;
        // S' = decay · S; u = v (GLA) or beta (v - S'ᵀk) (GDN); S = S' + k uᵀ
        let step = |s: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: Option<&Tensor>| -> Result<Tensor> {
            let s = s.broadcast_mul(&g.exp()?.unsqueeze(3)?)?;
            let u = match beta {
                None => v.clone(),
                Some(bt) => (v - k.unsqueeze(2)?.matmul(&s)?.squeeze(2)?)?.broadcast_mul(&bt.unsqueeze(2)?)?,
            };
            Ok((s + k.unsqueeze(3)?.matmul(&u.unsqueeze(2)?)?)?)
        };
        let read = |q: &Tensor, s: &Tensor| -> Result<Tensor> { Ok((q * scale)?.unsqueeze(2)?.matmul(s)?.squeeze(2)?) };
        let mut outs = Vec::with_capacity(t);
        for ti in 0..t {
            let v = at(&f.v, ti)?;
            let beta = |i: usize| f.beta.as_ref().map(|bb| at(&bb[i], ti)).transpose();
            states[0] = step(&states[0], &at(&f.k[0], ti)?, &v, &at(&f.g[0], ti)?, beta(0)?.as_ref())?;
            let mut o = read(&at(&f.q[0], ti)?, &states[0])?;
            let (q2, k2, g2, b2) = (at(&f.q[1], ti)?, at(&f.k[1], ti)?, at(&f.g[1], ti)?, beta(1)?);
            for p in 0..n {
                let col =
                    |m: &Tensor| -> Result<Tensor> { Ok(m.narrow(1, ti, 1)?.narrow(2, p, 1)?.reshape((b, 1, 1))?) };
                let (wp, sp) = (col(&f.w)?, col(&f.sel)?.unsqueeze(3)?);
                let s = &states[p + 1];
                let upd = step(s, &k2.broadcast_mul(&wp)?, &v, &g2, b2.as_ref())?;
                // selected: the update; unselected: unchanged (no decay either)
                let s = (upd.broadcast_mul(&sp)? + s.broadcast_mul(&(1.0 - &sp)?)?)?;
                o = (o + read(&q2, &s)?.broadcast_mul(&wp)?)?;
                states[p + 1] = s;
            }
            outs.push(o);
        }
        Ok(Tensor::stack(&outs, 1)?)
    }

    /// The layer's output; with a decoding `cache`, continues from and updates it (mask form).
    pub fn forward(
        &self,
        x: &Tensor,
        obs: &mut dyn Observer,
        imp: Implementation,
        cache: Option<&mut LayerCache>,
    ) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state, .. }) => (conv.as_ref(), Some(state)),
            _ => (None, None),
        };
        let (f, conv_state) = self.features(x, obs, prev_conv)?;
        let o = if obs.wants_state() || cache.is_some() {
            let (o, s) = self.mix_mask(&f, prev_state, true)?;
            let s = s.context("mask form returned no state")?;
            if obs.wants_state() {
                // [B, (N+1)·H, dk, dv] partition-major -> head-major, so state j serves key head
                // j/(N+1)
                let hm = s.reshape((b, d.partitions + 1, d.heads, d.dk, d.dv))?.transpose(1, 2)?.reshape((
                    b,
                    d.heads * (d.partitions + 1),
                    d.dk,
                    d.dv,
                ))?;
                obs.state(self.layer, &hm)?;
            }
            if let Some(c) = cache {
                *c = LayerCache::Recurrent { conv: conv_state, state: s, owned: false };
            }
            o
        } else {
            match imp {
                Implementation::Mask => self.mix_mask(&f, None, false)?.0,
                Implementation::Varlen => self.mix_varlen(&f)?,
                Implementation::Loop => self.mix_loop(&f)?,
            }
        };
        let o = match &self.g_proj {
            Some(gp) => self.o_norm.forward_gated(&o, &gp.forward(x)?.reshape((b, t, d.heads, d.dv))?)?,
            None => self.o_norm.forward(&o)?,
        };
        Ok(self.o_proj.forward(&o.reshape((b, t, d.heads * d.dv))?)?)
    }
}
