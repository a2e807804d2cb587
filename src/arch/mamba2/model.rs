//! Candle forward of Mamba-2 causal LMs (transformers `Mamba2ForCausalLM`, mamba_ssm
//! `MambaLMHeadModel`): pre-norm residual blocks of one Mamba-2 mixer each.

use super::config::Mamba2Config;
use crate::arch::layered::{self, Head, Layers};
use crate::arch::{projection, LayerCache, LoadOptions, Observer};
use crate::checkpoint::Checkpoint;
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::ops::{repeat_heads, softplus};
use crate::profile::mark;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{linear_b, Embedding, Linear, VarBuilder};

/// mamba_ssm `RMSNormGated` with `group_size = d_inner / ngroups`: the RMS is taken per group.
/// (transformers before 5.24 normalised over the full width, which differs when n_groups > 1.)
struct GatedGroupNorm {
    weight: Tensor,
    groups: usize,
    eps: f64,
    before_gate: bool,
}

impl GatedGroupNorm {
    fn norm(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let x = x.reshape((b, t, self.groups, c / self.groups))?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        Ok(x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.reshape((b, t, c))?.broadcast_mul(&self.weight)?)
    }

    fn forward(&self, y: &Tensor, z: &Tensor) -> Result<Tensor> {
        let dtype = y.dtype();
        let (y, gate) = (y.to_dtype(DType::F32)?, candle_nn::ops::silu(&z.to_dtype(DType::F32)?)?);
        let out = if self.before_gate { (self.norm(&y)? * gate)? } else { self.norm(&(y * gate)?)? };
        Ok(out.to_dtype(dtype)?)
    }
}

struct Mixer {
    cfg: Mamba2Config,
    layer: usize,
    in_proj: Linear,
    conv: ShortConv,
    dt_bias: Tensor,
    /// A = -exp(A_log), [H]
    neg_a: Tensor,
    /// D skip, [H, 1] or [H, P] (mamba_ssm `D_has_hdim`)
    d_skip: Tensor,
    norm: Option<GatedGroupNorm>,
    out_proj: Linear,
}

impl Mixer {
    fn load(
        vb: VarBuilder,
        cfg: &Mamba2Config,
        layer: usize,
        ckpt: &Checkpoint,
        grad: bool,
        vars: &mut Vec<(String, Var)>,
    ) -> Result<Self> {
        let (h, p) = (cfg.heads, cfg.head_dim);
        let d_shape = ckpt.info(&format!("{}.D", vb.prefix()))?.shape.iter().product::<usize>();
        let d_skip =
            if d_shape == h * p { vb.get(h * p, "D")?.reshape((h, p))? } else { vb.get(h, "D")?.reshape((h, 1))? };
        let norm = if cfg.rmsnorm {
            Some(GatedGroupNorm {
                weight: vb.get(cfg.d_inner, "norm.weight")?.to_dtype(DType::F32)?,
                groups: cfg.groups,
                eps: cfg.eps,
                before_gate: cfg.norm_before_gate,
            })
        } else {
            None
        };
        Ok(Self {
            cfg: cfg.clone(),
            layer,
            in_proj: projection(&vb, "in_proj", cfg.in_proj_dim(), cfg.hidden, cfg.bias, grad, vars)?,
            conv: ShortConv::load(vb.pp("conv1d"), cfg.conv_dim(), cfg.conv_kernel, cfg.conv_bias)?,
            dt_bias: vb.get(h, "dt_bias")?.to_dtype(candle_core::DType::F32)?,
            neg_a: vb.get(h, "A_log")?.to_dtype(candle_core::DType::F32)?.exp()?.neg()?,
            d_skip,
            norm,
            out_proj: linear_b(cfg.d_inner, cfg.hidden, cfg.bias, vb.pp("out_proj"))?,
        })
    }

    fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let c = &self.cfg;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state }) => (conv.first().cloned(), Some(state.clone())),
            _ => (None, None),
        };
        let (b, t, _) = x.dims3()?;
        let (i, gn, h, p) = (c.d_inner, c.groups * c.state, c.heads, c.head_dim);
        obs.qk_input(self.layer, x)?;
        // in_proj rows: [z | x | B | C | dt]
        let dev = x.device();
        mark("observer", dev);
        let proj = self.in_proj.forward(x)?;
        mark("qkv projections", dev);
        let z = proj.narrow(2, 0, i)?;
        let (xbc, conv_state) = self.conv.forward_silu_cached(&proj.narrow(2, i, c.conv_dim())?, prev_conv.as_ref())?;
        mark("short conv + silu", dev);
        let dt = proj.narrow(2, i + c.conv_dim(), h)?;
        let xs = xbc.narrow(2, 0, i)?.reshape((b, t, h, p))?;
        // B and C are group-major: group g owns channels g·N .. g·N+N-1
        let bm = xbc.narrow(2, i, gn)?.reshape((b, t, c.groups, c.state))?;
        let cm = xbc.narrow(2, i + gn, gn)?.reshape((b, t, c.groups, c.state))?;
        obs.qk(self.layer, &cm, &bm)?;
        mark("observer", dev);
        // Δt and the decay in float32, as the upstream kernels compute them.
        let mut dt = softplus(&dt.to_dtype(candle_core::DType::F32)?.broadcast_add(&self.dt_bias)?)?;
        let (lo, hi) = c.dt_limit;
        if lo > 0.0 || hi.is_finite() {
            dt = dt.clamp(lo, hi)?;
        }
        let g = dt.broadcast_mul(&self.neg_a)?;
        // head h reads group h / (H/G)
        let r = h / c.groups;
        let (q, k) = (repeat_heads(&cm, r)?, repeat_heads(&bm, r)?);
        let rec = Recurrence {
            q: &q,
            k: &k,
            v: &xs,
            beta: &dt,
            g: Some(&g),
            gk: None,
            scale: 1.0,
            rule: Rule::Plain,
            initial: prev_state.as_ref(),
        };
        mark("gates + l2 norms", dev);
        let o = crate::arch::run_recurrence(&rec, self.layer, obs, cache, vec![conv_state])?;
        mark("recurrence", dev);
        let y = (o + xs.broadcast_mul(&self.d_skip)?)?.reshape((b, t, i))?;
        let y = match &self.norm {
            Some(n) => n.forward(&y, &z)?,
            None => (y * candle_nn::ops::silu(&z)?)?,
        };
        Ok(self.out_proj.forward(&y)?)
    }
}

struct Block {
    norm: RmsNorm,
    mixer: Mixer,
}

impl layered::Block for Block {
    fn forward(&self, h: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let x = self.norm.forward(h)?;
        mark("norm", h.device());
        let h = (h + self.mixer.forward(&x, obs, cache)?)?;
        mark("mixer output", h.device());
        Ok(h)
    }
}

/// The stages of a Mamba-2 causal LM.
pub struct Mamba2Layers {
    vb: VarBuilder<'static>,
    ckpt: Checkpoint,
    cfg: Mamba2Config,
    /// mamba_ssm pads the vocabulary: the stored size.
    vocab: usize,
    grad: bool,
    device: Device,
}

impl Mamba2Layers {
    pub fn new(ckpt: &Checkpoint, cfg: &Mamba2Config, opts: &LoadOptions, vb: VarBuilder<'static>) -> Result<Self> {
        let vocab = *ckpt.info(cfg.format.embedding())?.shape.first().context("embedding has no shape")?;
        Ok(Self { vb, ckpt: ckpt.clone(), cfg: cfg.clone(), vocab, grad: opts.grad, device: opts.device.clone() })
    }
}

impl Layers for Mamba2Layers {
    fn num_blocks(&self) -> usize {
        self.cfg.layers
    }

    fn embed(&self) -> Result<Embedding> {
        Ok(Embedding::new(self.vb.get((self.vocab, self.cfg.hidden), self.cfg.format.embedding())?, self.cfg.hidden))
    }

    fn block(&self, i: usize, vars: &mut Vec<(String, Var)>) -> Result<Box<dyn layered::Block>> {
        let (cfg, l) = (&self.cfg, self.vb.pp(format!("backbone.layers.{i}")));
        Ok(Box::new(Block {
            norm: RmsNorm::load(l.pp("norm"), cfg.hidden, cfg.eps, NormWeight::Plain)?,
            mixer: Mixer::load(l.pp("mixer"), cfg, i, &self.ckpt, self.grad, vars)?,
        }))
    }

    fn head(&self, embed: Option<&Embedding>) -> Result<Head> {
        let cfg = &self.cfg;
        let lm_head = if cfg.tie || !self.ckpt.tensors.contains_key("lm_head.weight") {
            match embed {
                Some(e) => e.embeddings().clone(),
                None => self.embed()?.embeddings().clone(),
            }
        } else {
            self.vb.get((self.vocab, cfg.hidden), "lm_head.weight")?
        };
        let norm = RmsNorm::load(self.vb.pp("backbone.norm_f"), cfg.hidden, cfg.eps, NormWeight::Plain)?;
        Ok(Head { norm, lm_head: Linear::new(lm_head, None) })
    }

    fn block_prefix(&self, i: usize) -> String {
        format!("backbone.layers.{i}.")
    }

    fn embed_name(&self) -> String {
        self.cfg.format.embedding().into()
    }

    // transformers' Mamba2 `hidden_states` has no embedding entry: entry i is the residual
    // after block i (the last block's too), then the final norm's output.
    fn hidden_after(&self, i: usize) -> Option<usize> {
        Some(i)
    }

    fn reports_embeddings(&self) -> bool {
        false
    }

    fn device(&self) -> &Device {
        &self.device
    }
}
