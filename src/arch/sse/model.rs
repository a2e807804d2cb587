//! Candle forward of SSE-GLA causal LMs (fla `SSEGLA` in an fla block stack).
//!
//! Per head, with the scale dk^-1/2:
//!   shared:  q1 = silu(conv(x W_q)), k1 = softmax(conv(x W_k)), g1 = logsigmoid(gk_proj.0(x)) / 16
//!   routed:  q2 = silu(x W_q + lora_q(x)), k2 = softmax(x W_k + lora_k(x)), g2 from gk_proj.1
//!   v = silu(x W_v), e = softmax(x W_e) over N partitions, T = top-k(e)
//!   S0 ← diag(exp g1) S0 + k1 vᵀ;  p ∈ T: Sp ← diag(exp g2) Sp + e_p k2 vᵀ (others unchanged)
//!   o = S0ᵀ(scale q1) + Σ_{p∈T} e_p Spᵀ(scale q2), then o_norm gated by g_proj, o_proj.

use super::config::{Dims, Implementation, SseConfig};
use crate::arch::{projection, CausalLm, DecodeCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::mlp::SwiGlu;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::ops::softplus;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{linear_b, linear_no_bias, Embedding, Linear, VarBuilder};

/// fla `gate_logit_normalizer` and `gate_low_rank_dim` (SSEGLA defaults, not in the config).
const GATE_LOGIT_NORMALIZER: f64 = 16.0;
const GATE_LOW_RANK_DIM: usize = 16;

/// `nn.Sequential(Linear(inp, mid), Linear(mid, out))`.
struct LowRank(Linear, Linear);

impl LowRank {
    fn load(vb: VarBuilder, inp: usize, mid: usize, out: usize, bias: bool) -> Result<Self> {
        Ok(Self(linear_no_bias(inp, mid, vb.pp("0"))?, linear_b(mid, out, bias, vb.pp("1"))?))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.1.forward(&self.0.forward(x)?)?)
    }
}

/// Per-token inputs of the N+1 partitions, [B, T, H, *], and the routing [B, T, N].
struct Features {
    q1: Tensor,
    q2: Tensor,
    k1: Tensor,
    k2: Tensor,
    v: Tensor,
    g1: Tensor,
    g2: Tensor,
    /// routing weight e_p where p is selected, 0 elsewhere
    w: Tensor,
    /// 1 where p is selected, 0 elsewhere
    sel: Tensor,
    sel_host: Vec<f32>,
}

struct Mixer {
    d: Dims,
    layer: usize,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    lora_q: LowRank,
    lora_k: LowRank,
    gk: [LowRank; 2],
    e_proj: Linear,
    convs: Option<[ShortConv; 2]>,
    g_proj: Option<LowRank>,
    o_norm: RmsNorm,
    o_proj: Linear,
}

fn ones(shape: (usize, usize, usize), like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::ones(shape, like.dtype(), like.device())?)
}

impl Mixer {
    fn load(
        vb: VarBuilder,
        cfg: &SseConfig,
        d: Dims,
        layer: usize,
        grad: bool,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let (hid, kd, vd) = (d.hidden, d.heads * d.dk, d.heads * d.dv);
        let convs = if d.use_short_conv {
            let bias = vb.contains_tensor("q_conv1d_shared.bias");
            let c = |name: &str| ShortConv::load(vb.pp(name), kd, d.conv_size, bias);
            Some([c("q_conv1d_shared")?, c("k_conv1d_shared")?])
        } else {
            None
        };
        let gk = |i: usize| LowRank::load(vb.pp("gk_proj").pp(i), hid, GATE_LOW_RANK_DIM, kd, true);
        Ok(Self {
            d,
            layer,
            q_proj: projection(&vb, "q_proj", kd, hid, false, grad, vars)?,
            k_proj: projection(&vb, "k_proj", kd, hid, false, grad, vars)?,
            v_proj: linear_no_bias(hid, vd, vb.pp("v_proj"))?,
            lora_q: LowRank::load(vb.pp("lora_q_proj"), hid, d.dv, kd, false)?,
            lora_k: LowRank::load(vb.pp("lora_k_proj"), hid, d.dv, kd, false)?,
            gk: [gk(0)?, gk(1)?],
            e_proj: linear_no_bias(hid, d.partitions, vb.pp("e_proj"))?,
            convs,
            g_proj: if d.use_output_gate { Some(LowRank::load(vb.pp("g_proj"), hid, d.dv, vd, false)?) } else { None },
            o_norm: RmsNorm::load(vb.pp("o_norm"), d.dv, cfg.norm_eps, NormWeight::Plain)?,
            o_proj: linear_no_bias(vd, hid, vb.pp("o_proj"))?,
        })
    }

    fn features(&self, x: &Tensor, obs: &mut dyn Observer) -> Result<Features> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        obs.qk_input(self.layer, x)?;
        let q1 = self.q_proj.forward(x)?;
        let k1 = self.k_proj.forward(x)?;
        let q2 = (&q1 + self.lora_q.forward(x)?)?;
        let k2 = (&k1 + self.lora_k.forward(x)?)?;
        let (q1, k1) = match &self.convs {
            Some([cq, ck]) => (cq.forward(&q1)?, ck.forward(&k1)?),
            None => (q1, k1),
        };
        let heads = |y: Tensor, w: usize| y.reshape((b, t, d.heads, w));
        let (q1, q2) = (candle_nn::ops::silu(&heads(q1, d.dk)?)?, candle_nn::ops::silu(&heads(q2, d.dk)?)?);
        let (k1, k2) = (heads(k1, d.dk)?, heads(k2, d.dk)?);
        // The shared path's queries as the state reads them, and its keys before the softmax
        // that normalises them.
        obs.qk(self.layer, &q1, &k1)?;
        let dtype = x.dtype();
        // candle_nn::ops::softmax (not softmax_last_dim) so that the key projections get gradients.
        let softmax = |k: &Tensor| -> Result<Tensor> {
            Ok(candle_nn::ops::softmax(&k.to_dtype(DType::F32)?, D::Minus1)?.to_dtype(dtype)?)
        };
        let (k1, k2) = (softmax(&k1)?, softmax(&k2)?);
        let v = candle_nn::ops::silu(&heads(self.v_proj.forward(x)?, d.dv)?)?;
        // logsigmoid(y) / 16 = -softplus(-y) / 16
        let gate = |i: usize| -> Result<Tensor> {
            let y = heads(self.gk[i].forward(x)?, d.dk)?;
            Ok((softplus(&y.neg()?)?.neg()? / GATE_LOGIT_NORMALIZER)?)
        };
        let (g1, g2) = (gate(0)?, gate(1)?);
        // Routing: softmax over partitions in float32, top-k, ties to the lower index.
        let e = candle_nn::ops::softmax(&self.e_proj.forward(x)?.to_dtype(DType::F32)?, D::Minus1)?;
        let probs = e.flatten_all()?.to_vec1::<f32>()?;
        let n = d.partitions;
        let mut sel_host = vec![0f32; probs.len()];
        let mut order: Vec<usize> = (0..n).collect();
        for (row, sel) in probs.chunks(n).zip(sel_host.chunks_mut(n)) {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &p in &order[..d.topk] {
                sel[p] = 1.0;
            }
        }
        let sel = Tensor::from_vec(sel_host.clone(), (b, t, n), x.device())?;
        obs.routing(self.layer, &sel)?;
        let w = (e * &sel)?.to_dtype(dtype)?;
        Ok(Features { q1, q2, k1, k2, v, g1, g2, w, sel: sel.to_dtype(dtype)?, sel_host })
    }

    fn scale(&self) -> f64 {
        (self.d.dk as f64).powf(-0.5)
    }

    /// All N+1 partitions as (N+1)·H heads, partition-major (fla's mask form): the routed
    /// queries and keys times e·mask, values and decays times the mask. Returns the summed
    /// output [B, T, H, dv] and, with `state`, the final states [B, (N+1)·H, dk, dv].
    fn mix_mask(&self, f: &Features, state: bool) -> Result<(Tensor, Option<Tensor>)> {
        let d = self.d;
        let (b, t, h, _) = f.q1.dims4()?;
        let n = d.partitions;
        let gate = |m: &Tensor| -> Result<Tensor> { Ok(m.unsqueeze(3)?.unsqueeze(4)?) };
        let (wm, sm) = (gate(&f.w)?, gate(&f.sel)?);
        let expand = |shared: &Tensor, routed: &Tensor, m: &Tensor| -> Result<Tensor> {
            let width = shared.dim(3)?;
            let routed = routed.unsqueeze(2)?.broadcast_mul(m)?;
            Ok(Tensor::cat(&[&shared.unsqueeze(2)?, &routed], 2)?.reshape((b, t, (n + 1) * h, width))?)
        };
        let q = expand(&f.q1, &f.q2, &wm)?;
        let k = expand(&f.k1, &f.k2, &wm)?;
        let v = expand(&f.v, &f.v, &sm)?;
        let gk = expand(&f.g1, &f.g2, &sm)?;
        let beta = ones((b, t, (n + 1) * h), &f.v)?;
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: None,
            gk: Some(&gk),
            scale: self.scale(),
            rule: Rule::Plain,
            initial: None,
        };
        let (o, s) = if state {
            let (o, s) = rec.forward_with_state()?;
            (o, Some(s))
        } else {
            (rec.forward()?, None)
        };
        Ok((o.reshape((b, t, n + 1, h, d.dv))?.sum(2)?, s))
    }

    /// fla's varlen form: the shared partition over the whole sequence, then for each
    /// (sequence, partition) the routed tokens gathered in order, the recurrence run on that
    /// subsequence, and its outputs scattered back.
    fn mix_varlen(&self, f: &Features) -> Result<Tensor> {
        let d = self.d;
        let (b, t, h, _) = f.q1.dims4()?;
        let n = d.partitions;
        let plain = |q: &Tensor, k: &Tensor, v: &Tensor, gk: &Tensor| -> Result<Tensor> {
            let (bb, tt, hh, _) = q.dims4()?;
            let beta = ones((bb, tt, hh), v)?;
            let rec = Recurrence {
                q,
                k,
                v,
                beta: &beta,
                g: None,
                gk: Some(gk),
                scale: self.scale(),
                rule: Rule::Plain,
                initial: None,
            };
            Ok(rec.forward()?)
        };
        let shared = plain(&f.q1, &f.k1, &f.v, &f.g1)?;
        let mut routed = Vec::with_capacity(b);
        for bi in 0..b {
            let mut ob = Tensor::zeros((t, h, d.dv), f.v.dtype(), f.v.device())?;
            for p in 0..n {
                let idx: Vec<u32> =
                    (0..t).filter(|&ti| f.sel_host[(bi * t + ti) * n + p] > 0.0).map(|ti| ti as u32).collect();
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
                let q = gather(&f.q2)?.broadcast_mul(&wp)?;
                let k = gather(&f.k2)?.broadcast_mul(&wp)?;
                let o = plain(&q, &k, &gather(&f.v)?, &gather(&f.g2)?)?;
                ob = ob.index_add(&ix, &o.squeeze(0)?, 0)?;
            }
            routed.push(ob);
        }
        Ok((shared + Tensor::stack(&routed, 0)?)?)
    }

    /// One token at a time with all N+1 states (candle ops only; a reference for tests).
    fn mix_loop(&self, f: &Features) -> Result<Tensor> {
        let d = self.d;
        let (b, t, h, dk) = f.q1.dims4()?;
        let n = d.partitions;
        let scale = self.scale();
        let mut states: Vec<Tensor> =
            (0..=n).map(|_| Tensor::zeros((b, h, dk, d.dv), f.v.dtype(), f.v.device())).collect::<Result<_, _>>()?;
        let mut outs = Vec::with_capacity(t);
        for ti in 0..t {
            let at = |x: &Tensor| -> Result<Tensor> { Ok(x.narrow(1, ti, 1)?.squeeze(1)?.contiguous()?) };
            let v = at(&f.v)?.unsqueeze(2)?; // [B,H,1,dv]
            let outer = |k: &Tensor| -> Result<Tensor> { Ok(k.unsqueeze(3)?.matmul(&v)?) }; // [B,H,dk,dv]
            let decay = |g: &Tensor| -> Result<Tensor> { Ok(at(g)?.exp()?.unsqueeze(3)?) };
            let read =
                |q: &Tensor, s: &Tensor| -> Result<Tensor> { Ok((q * scale)?.unsqueeze(2)?.matmul(s)?.squeeze(2)?) };
            states[0] = (states[0].broadcast_mul(&decay(&f.g1)?)? + outer(&at(&f.k1)?)?)?;
            let mut o = read(&at(&f.q1)?, &states[0])?;
            let (q2, k2, g2) = (at(&f.q2)?, at(&f.k2)?, decay(&f.g2)?);
            for p in 0..n {
                let col =
                    |m: &Tensor| -> Result<Tensor> { Ok(m.narrow(1, ti, 1)?.narrow(2, p, 1)?.reshape((b, 1, 1, 1))?) };
                let (wp, sp) = (col(&f.w)?, col(&f.sel)?);
                let s = &states[p + 1];
                let upd = (s.broadcast_mul(&g2)? + outer(&k2)?.broadcast_mul(&wp)?)?;
                // selected: the update; unselected: unchanged (no decay either)
                let s = (upd.broadcast_mul(&sp)? + s.broadcast_mul(&(1.0 - &sp)?)?)?;
                o = (o + read(&q2, &s)?.broadcast_mul(&wp.squeeze(3)?)?)?;
                states[p + 1] = s;
            }
            outs.push(o);
        }
        Ok(Tensor::stack(&outs, 1)?)
    }

    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, imp: Implementation) -> Result<Tensor> {
        let d = self.d;
        let (b, t, _) = x.dims3()?;
        let f = self.features(x, obs)?;
        let o = if obs.wants_state() {
            let (o, s) = self.mix_mask(&f, true)?;
            let s = s.context("mask form returned no state")?;
            // [B, (N+1)·H, dk, dv] partition-major -> head-major, so state j serves key head j/(N+1)
            let s = s.reshape((b, d.partitions + 1, d.heads, d.dk, d.dv))?.transpose(1, 2)?.reshape((
                b,
                d.heads * (d.partitions + 1),
                d.dk,
                d.dv,
            ))?;
            obs.state(self.layer, &s)?;
            o
        } else {
            match imp {
                Implementation::Mask => self.mix_mask(&f, false)?.0,
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

struct Block {
    attn_norm: RmsNorm,
    attn: Mixer,
    mlp_norm: RmsNorm,
    mlp: SwiGlu,
}

/// An SSE-GLA causal LM.
pub struct SseModel {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    vars: Vec<(String, Var)>,
    device: Device,
    implementation: Implementation,
}

impl SseModel {
    /// Load a checkpoint; `implementation` overrides the config's `sse_implementation`.
    pub fn open(ckpt: &Checkpoint, opts: &LoadOptions, implementation: Option<Implementation>) -> Result<Self> {
        let cfg: SseConfig = crate::arch::parse(ckpt, &ckpt.config)?;
        let d = cfg.dims()?;
        let vb = ckpt.var_builder(opts.dtype, &opts.device)?;
        let m = vb.pp("model");
        let embed_w = m.pp("embeddings").get((cfg.vocab_size, d.hidden), "weight")?;
        let mut vars = Vec::new();
        let mut blocks = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let l = m.pp(format!("layers.{i}"));
            blocks.push(Block {
                attn_norm: RmsNorm::load(l.pp("attn_norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
                attn: Mixer::load(l.pp("attn"), &cfg, d, i, opts.grad, &mut vars)
                    .with_context(|| format!("loading layer {i}"))?,
                mlp_norm: RmsNorm::load(l.pp("mlp_norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
                mlp: SwiGlu::load(l.pp("mlp"), d.hidden, d.intermediate)?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_w.clone(), None)
        } else {
            linear_no_bias(d.hidden, cfg.vocab_size, vb.pp("lm_head"))?
        };
        Ok(Self {
            embed: Embedding::new(embed_w, d.hidden),
            blocks,
            norm: RmsNorm::load(m.pp("norm"), d.hidden, cfg.norm_eps, NormWeight::Plain)?,
            lm_head,
            vars,
            device: opts.device.clone(),
            implementation: implementation.unwrap_or(d.implementation),
        })
    }
}

impl CausalLm for SseModel {
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, cache: Option<&mut DecodeCache>) -> Result<Tensor> {
        if cache.is_some() {
            anyhow::bail!("step-by-step decoding is not implemented for SSE models yet");
        }
        let mut h = self.embed.forward(ids)?;
        obs.hidden(0, &h)?;
        let n = self.blocks.len();
        for (i, blk) in self.blocks.iter().enumerate() {
            h = (&h + blk.attn.forward(&blk.attn_norm.forward(&h)?, obs, self.implementation)?)?;
            h = (&h + blk.mlp.forward(&blk.mlp_norm.forward(&h)?)?)?;
            if i + 1 < n {
                obs.hidden(i + 1, &h)?;
            }
        }
        let h = self.norm.forward(&h)?;
        obs.hidden(n, &h)?;
        Ok(self.lm_head.forward(&h)?)
    }

    fn grad_vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
