//! The Mamba-2 mixer, shared by Mamba-2 LMs and the Mamba-2 layers of hybrids (Nemotron-H,
//! Granite 4.0-H, Falcon-H1).
//!
//! The SSM is the plain linear-attention recurrence with k = B, q = C, v = x, β = dt,
//! g = dt·A, so groups play the part of key heads and N = `d_state` is the key width. Families
//! differ only in where the sizes come from ([`Mamba2Dims`]), in the muP multipliers on the
//! input and on the `in_proj` segments (Falcon-H1), and in the output norm.

use super::linear::Linear;
use crate::model::{LayerCache, Observer, RowSlice, SliceRole};
use crate::ops::conv::ShortConv;
use crate::ops::delta_rule::{Recurrence, Rule};
use crate::ops::derived::Derived;
use crate::ops::{repeat_heads, softplus};
use anyhow::Result;
use candle_core::{DType, Module, Tensor, D};
use candle_nn::VarBuilder;

/// The output norm of a Mamba-2 mixer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutputNorm {
    /// y·silu(z), no norm (mamba_ssm `rmsnorm = False`, Falcon-H1 `mamba_rms_norm = False`).
    None,
    /// RMSNorm over groups of `d_inner / groups` channels, after (or before) the silu(z) gate.
    Gated { groups: usize, before_gate: bool },
}

/// The sizes and switches of one Mamba-2 mixer, whatever config keys they were read from.
#[derive(Debug, Clone, PartialEq)]
pub struct Mamba2Dims {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// N: per-group width of B and C (the key width of the state).
    pub state: usize,
    pub groups: usize,
    /// heads × head_dim (Nemotron-H and Falcon-H1 store it apart from `expand`).
    pub d_inner: usize,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    /// bias of in_proj
    pub in_bias: bool,
    /// bias of out_proj (Falcon-H1 `projectors_bias`; the same switch as in_proj elsewhere)
    pub out_bias: bool,
    /// eps of the gated output norm
    pub eps: f64,
    /// dt clamp (min, max); (0, inf) means none.
    pub dt_limit: (f64, f64),
    pub norm: OutputNorm,
    /// Falcon-H1 muP: the input is scaled by `in_scale`, and the [z, x, B, C, dt] segments of
    /// in_proj's output by `segment_scales`.
    pub in_scale: f64,
    pub segment_scales: [f64; 5],
}

impl Mamba2Dims {
    /// The `in_proj` output width: [z | x | B | C | dt].
    pub fn in_proj_dim(&self) -> usize {
        2 * self.d_inner + 2 * self.groups * self.state + self.heads
    }

    /// Channels of the short conv: [x | B | C].
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.groups * self.state
    }

    /// The sizes every loader relies on, so that a config that disagrees fails once, here.
    pub fn check(&self) -> Result<()> {
        if self.heads * self.head_dim != self.d_inner {
            anyhow::bail!("{} heads x head_dim {} != inner width {}", self.heads, self.head_dim, self.d_inner);
        }
        if self.groups == 0 || !self.heads.is_multiple_of(self.groups) {
            anyhow::bail!("{} heads is not a multiple of {} groups", self.heads, self.groups);
        }
        if let OutputNorm::Gated { groups, .. } = self.norm {
            if groups == 0 || !self.d_inner.is_multiple_of(groups) {
                anyhow::bail!("the gated norm's {groups} groups do not divide the inner width {}", self.d_inner);
            }
        }
        Ok(())
    }

    /// Where the state's key/query channels live under `prefix` (`…mixer.`): the B and C rows of
    /// `in_proj` and the matching `conv1d` channels, each group owning N consecutive rows.
    pub fn slices(&self, prefix: &str, conv_bias: bool) -> Vec<RowSlice> {
        let (i, gn, n) = (self.d_inner, self.groups * self.state, self.state);
        let slice = |t: String, offset, role| RowSlice { tensor: t, offset, head_stride: n, role };
        let mut slices = vec![
            slice(format!("{prefix}in_proj.weight"), 2 * i, SliceRole::KeyProj),
            slice(format!("{prefix}in_proj.weight"), 2 * i + gn, SliceRole::QueryProj),
            slice(format!("{prefix}conv1d.weight"), i, SliceRole::Conv),
            slice(format!("{prefix}conv1d.weight"), i + gn, SliceRole::Conv),
        ];
        if self.in_bias {
            slices.push(slice(format!("{prefix}in_proj.bias"), 2 * i, SliceRole::Channel));
            slices.push(slice(format!("{prefix}in_proj.bias"), 2 * i + gn, SliceRole::Channel));
        }
        if conv_bias {
            slices.push(slice(format!("{prefix}conv1d.bias"), i, SliceRole::Conv));
            slices.push(slice(format!("{prefix}conv1d.bias"), i + gn, SliceRole::Conv));
        }
        slices
    }
}

/// mamba_ssm `RMSNormGated` with `group_size = d_inner / groups`: the RMS is taken per group.
struct GatedGroupNorm {
    /// float32
    weight: Derived,
    groups: usize,
    eps: f64,
    before_gate: bool,
}

impl GatedGroupNorm {
    fn norm(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let x = x.reshape((b, t, self.groups, c / self.groups))?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        Ok(x.broadcast_div(&(ms + self.eps)?.sqrt()?)?.reshape((b, t, c))?.broadcast_mul(&self.weight.get()?)?)
    }

    fn forward(&self, y: &Tensor, z: &Tensor) -> Result<Tensor> {
        let dtype = y.dtype();
        let (y, gate) = (y.to_dtype(DType::F32)?, candle_nn::ops::silu(&z.to_dtype(DType::F32)?)?);
        let out = if self.before_gate { (self.norm(&y)? * gate)? } else { self.norm(&(y * gate)?)? };
        Ok(out.to_dtype(dtype)?)
    }
}

pub struct Mamba2Mixer {
    dims: Mamba2Dims,
    layer: usize,
    in_proj: Linear,
    conv: ShortConv,
    dt_bias: Derived,
    /// A = -exp(A_log), [H]
    neg_a: Derived,
    /// D skip, [H, 1] or [H, P] (mamba_ssm `D_has_hdim`)
    d_skip: Tensor,
    norm: Option<GatedGroupNorm>,
    out_proj: Linear,
}

impl Mamba2Mixer {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.in_proj, &self.out_proj]
    }

    /// The mixer under `vb` (`…mixer`), decoder layer `layer`; with `grad` in_proj is a variable.
    /// `stored_shape` gives a checkpoint tensor's shape by name (`D` is stored as [H] or [H, P]).
    pub fn load(
        vb: VarBuilder,
        dims: &Mamba2Dims,
        layer: usize,
        stored_shape: &dyn Fn(&str) -> Result<Vec<usize>>,
        grad: bool,
    ) -> Result<Self> {
        let (h, p) = (dims.heads, dims.head_dim);
        let d_shape = stored_shape(&format!("{}.D", vb.prefix()))?.iter().product::<usize>();
        let d_skip =
            if d_shape == h * p { vb.get(h * p, "D")?.reshape((h, p))? } else { vb.get(h, "D")?.reshape((h, 1))? };
        let norm = match dims.norm {
            OutputNorm::Gated { groups, before_gate } => Some(GatedGroupNorm {
                weight: Derived::new(vb.get(dims.d_inner, "norm.weight")?, |t| t.to_dtype(DType::F32))?,
                groups,
                eps: dims.eps,
                before_gate,
            }),
            OutputNorm::None => None,
        };
        Ok(Self {
            dims: dims.clone(),
            layer,
            in_proj: Linear::load_trainable(&vb, "in_proj", dims.hidden, dims.in_proj_dim(), dims.in_bias, grad)?,
            conv: ShortConv::load(vb.pp("conv1d"), dims.conv_dim(), dims.conv_kernel, dims.conv_bias)?,
            dt_bias: Derived::new(vb.get(h, "dt_bias")?, |t| t.to_dtype(DType::F32))?,
            neg_a: Derived::new(vb.get(h, "A_log")?, |t| t.to_dtype(DType::F32)?.exp()?.neg())?,
            d_skip,
            norm,
            out_proj: Linear::load(vb.pp("out_proj"), dims.d_inner, dims.hidden, dims.out_bias)?,
        })
    }

    /// in_proj's output with Falcon-H1's per-segment muP scales applied (none elsewhere).
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.dims;
        let x = if c.in_scale != 1.0 { (x * c.in_scale)? } else { x.clone() };
        let proj = self.in_proj.forward(&x)?;
        if c.segment_scales == [1.0; 5] {
            return Ok(proj);
        }
        let gn = c.groups * c.state;
        let widths = [c.d_inner, c.d_inner, gn, gn, c.heads];
        let mut at = 0;
        let parts = widths
            .iter()
            .zip(c.segment_scales)
            .map(|(&w, s)| {
                let part = (proj.narrow(2, at, w)? * s)?;
                at += w;
                Ok(part)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 2)?)
    }

    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let c = &self.dims;
        let (prev_conv, prev_state) = match cache.as_deref() {
            Some(LayerCache::Recurrent { conv, state, .. }) => (conv.clone(), Some(state.clone())),
            _ => (None, None),
        };
        let (b, t, _) = x.dims3()?;
        let (i, gn, h, p) = (c.d_inner, c.groups * c.state, c.heads, c.head_dim);
        obs.qk_input(self.layer, x)?;
        // in_proj rows: [z | x | B | C | dt]
        let proj = self.project(x)?;
        let z = proj.narrow(2, 0, i)?;
        let (xbc, conv_state) = self.conv.forward_silu_cached(&proj.narrow(2, i, c.conv_dim())?, prev_conv.as_ref())?;
        let dt = proj.narrow(2, i + c.conv_dim(), h)?;
        let xs = xbc.narrow(2, 0, i)?.reshape((b, t, h, p))?;
        // B and C are group-major: group g owns channels g·N .. g·N+N-1
        let bm = xbc.narrow(2, i, gn)?.reshape((b, t, c.groups, c.state))?;
        let cm = xbc.narrow(2, i + gn, gn)?.reshape((b, t, c.groups, c.state))?;
        obs.qk(self.layer, &cm, &bm)?;
        // Δt and the decay in float32, as the upstream kernels compute them.
        let mut dt = softplus(&dt.to_dtype(DType::F32)?.broadcast_add(&self.dt_bias.get()?)?)?;
        let (lo, hi) = c.dt_limit;
        if lo > 0.0 || hi.is_finite() {
            dt = dt.clamp(lo, hi)?;
        }
        let g = dt.broadcast_mul(&self.neg_a.get()?)?;
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
        // A pass without gradients may take the fused op's chunked form.
        use crate::ops::delta_rule::Kernel;
        let in_chunks = crate::ops::fusable(&[&xbc, &dt, &g]) && Kernel::fused_in_chunks(xbc.device(), xbc.dtype());
        let o = match in_chunks {
            true => Kernel::scoped(Kernel::FusedChunks, || {
                crate::model::run_recurrence(&rec, self.layer, obs, cache, Some(conv_state))
            })?,
            false => crate::model::run_recurrence(&rec, self.layer, obs, cache, Some(conv_state))?,
        };
        let y = (o + xs.broadcast_mul(&self.d_skip)?)?.reshape((b, t, i))?;
        let y = match &self.norm {
            Some(n) => n.forward(&y, &z)?,
            None => (y * candle_nn::ops::silu(&z)?)?,
        };
        Ok(self.out_proj.forward(&y)?)
    }
}
