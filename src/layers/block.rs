//! One decoder layer as a list of residual steps `h = h + scale · sublayer(norm(h))`: two steps
//! (mixer, then MLP or MoE) in most families, one in Nemotron-H, where every layer is a single
//! mixer or MLP, and a step of side-by-side mixers in Falcon-H1. Every family's decoder layer
//! is this one: each step's residual add is fused into the next step's norm (one kernel on
//! GPUs when no gradient flows).

use super::attention::Attention;
use super::linear::Linear;
use super::linear_attention::LinearAttention;
use super::mamba2::Mamba2Mixer;
use super::mla::Mla;
use super::mlp::Mlp;
use super::moe::Moe;
use super::sse::{Implementation, SseMixer};
use crate::model::layered;
use crate::model::{LayerCache, Observer};
use crate::ops::link::Made;
use crate::ops::norm::RmsNorm;
use crate::profile::span;
use anyhow::Result;
use candle_core::{Tensor, Var};

/// What one residual step runs.
pub enum Sublayer {
    Mamba2(Mamba2Mixer),
    Attention(Attention),
    /// delta-rule linear attention (KDA in the hybrids)
    Linear(LinearAttention),
    Mla(Mla),
    Mlp(Mlp),
    Moe(Moe),
    /// a Sparse State Expansion layer, run in the given form
    Sse(Box<SseMixer>, Implementation),
    /// Branches on the same normed input, each as (sublayer, input scale, output scale), summed.
    Parallel(Vec<(Sublayer, f64, f64)>),
}

impl Sublayer {
    /// [`Self::forward`]; `link_out`: the caller's next op takes the output linked where the
    /// sublayer can make it so (a trained linear-attention mixer, see `ops::link`).
    fn forward_made(
        &self,
        x: &Tensor,
        obs: &mut dyn Observer,
        cache: Option<&mut LayerCache>,
        link_out: bool,
    ) -> Result<Made> {
        match self {
            Sublayer::Linear(m) if link_out => m.forward_made(x, obs, cache, true),
            _ => Ok(Made::Tracked(self.forward(x, obs, cache)?)),
        }
    }

    /// Token mixers read and update `cache`; feed-forward sublayers ignore it.
    pub fn forward(&self, x: &Tensor, obs: &mut dyn Observer, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        match self {
            Sublayer::Mamba2(m) => m.forward(x, obs, cache),
            Sublayer::Attention(a) => a.forward(x, cache),
            Sublayer::Linear(m) => m.forward(x, obs, cache),
            Sublayer::Mla(m) => m.forward(x, cache),
            Sublayer::Mlp(m) => m.forward(x),
            Sublayer::Moe(m) => m.forward(x),
            Sublayer::Sse(m, imp) => m.forward(x, obs, *imp, cache),
            Sublayer::Parallel(branches) => {
                let mut caches = match cache {
                    Some(c) => {
                        if !matches!(c, LayerCache::Parallel(_)) {
                            *c = LayerCache::Parallel(vec![LayerCache::Empty; branches.len()]);
                        }
                        match c {
                            LayerCache::Parallel(v) => Some(v),
                            _ => unreachable!("set just above"),
                        }
                    }
                    None => None,
                };
                let mut sum: Option<Tensor> = None;
                for (i, (b, in_scale, out_scale)) in branches.iter().enumerate() {
                    let xi = if *in_scale != 1.0 { (x * *in_scale)? } else { x.clone() };
                    let y = b.forward(&xi, obs, caches.as_deref_mut().map(|c| &mut c[i]))?;
                    let y = if *out_scale != 1.0 { (y * *out_scale)? } else { y };
                    sum = Some(match sum {
                        Some(s) => (s + y)?,
                        None => y,
                    });
                }
                sum.ok_or_else(|| anyhow::anyhow!("a parallel step with no branches"))
            }
        }
    }

    /// The projections of this sublayer, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Sublayer::Mamba2(m) => m.linears(),
            Sublayer::Attention(a) => a.linears(),
            Sublayer::Linear(m) => m.linears(),
            Sublayer::Mla(m) => m.linears(),
            Sublayer::Mlp(m) => m.linears(),
            Sublayer::Moe(m) => m.linears(),
            Sublayer::Sse(m, _) => m.linears(),
            Sublayer::Parallel(branches) => branches.iter().flat_map(|(b, _, _)| b.linears()).collect(),
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Sublayer::Mlp(_) | Sublayer::Moe(_) => "mlp",
            _ => "mixer (rest)",
        }
    }
}

/// `h + scale · sublayer(norm(h))`
pub struct Step {
    pub norm: RmsNorm,
    pub sublayer: Sublayer,
    /// muP residual multiplier (Granite); 1 elsewhere.
    pub scale: f64,
}

impl Step {
    /// The norm's applied weight and epsilon, and the frozen MLP's stacked gate|up and down
    /// weights, where this step, on the residual stream `h` (plus `pending`, the last step's
    /// output), takes `ops::mlp::frozen_mlp_step`: a gradient flowing (through h, the step before
    /// or the norm's weight), a frozen SwiGLU MLP (see `SwiGlu::frozen`) and no residual
    /// multiplier. Without gradients the fused kernels are faster, and on the CPU the ops are
    /// the reference.
    fn frozen_mlp(&self, h: &Tensor, pending: Option<&Made>) -> Result<Option<FrozenMlp<'_>>> {
        if !self.may_take_frozen_mlp(h) {
            return Ok(None);
        }
        let Sublayer::Mlp(Mlp::SwiGlu(m)) = &self.sublayer else { return Ok(None) };
        let (w, eps) = self.norm.applied()?;
        if crate::ops::untracked(&[h, &w].into_iter().chain(pending.map(Made::node)).collect::<Vec<_>>()) {
            return Ok(None);
        }
        Ok(m.frozen(h).map(|(gate_up, down)| FrozenMlp { norm: (w, eps), gate_up, down }))
    }

    /// Whether this step takes `ops::mlp::frozen_mlp_step` once a gradient flows into it: a
    /// frozen SwiGLU MLP, no residual multiplier, off the CPU. The step before may then link
    /// its output to it.
    fn may_take_frozen_mlp(&self, h: &Tensor) -> bool {
        let Sublayer::Mlp(Mlp::SwiGlu(m)) = &self.sublayer else { return false };
        self.scale == 1.0 && !h.device().is_cpu() && m.frozen(h).is_some()
    }
}

/// What [`Step::frozen_mlp`] hands `ops::mlp::frozen_mlp_step`: the norm's applied weight and
/// epsilon, read once, and the MLP's weights.
struct FrozenMlp<'a> {
    norm: (Tensor, f64),
    gate_up: &'a Tensor,
    down: &'a Tensor,
}

/// A decoder layer: its steps in order.
pub struct Layer {
    pub steps: Vec<Step>,
}

impl layered::Block for Layer {
    fn forward(&self, h: &Tensor, obs: &mut dyn Observer, mut cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let dev = h.device();
        let mut h = h.clone();
        // The last step's output, added into the residual by the next step's norm, or inside
        // the next frozen MLP step, which may take it linked.
        let mut pending: Option<Made> = None;
        for (i, s) in self.steps.iter().enumerate() {
            if let Some(FrozenMlp { norm: (w, eps), gate_up, down }) = s.frozen_mlp(&h, pending.as_ref())? {
                // With gradients, the whole step is one op, the last step's output added inside
                // it (see `ops::mlp::frozen_mlp_step`).
                let _s = span("mlp", dev);
                let y = pending.take();
                h = crate::ops::mlp::frozen_mlp_step_from(&h, y.as_ref().map(Made::operand), &w, eps, gate_up, down)?;
                continue;
            }
            let x = {
                let _s = span("norm", dev);
                match pending.take() {
                    Some(y) => {
                        let (sum, x) = s.norm.add_forward(&h, &y.tracked("residual sum")?)?;
                        h = sum;
                        x
                    }
                    None => s.norm.forward(&h)?,
                }
            };
            let _s = span(s.sublayer.label(), dev);
            let link_out = s.scale == 1.0 && self.steps.get(i + 1).is_some_and(|n| n.may_take_frozen_mlp(&h));
            let y = s.sublayer.forward_made(&x, obs, cache.as_deref_mut(), link_out)?;
            pending = Some(match y {
                Made::Tracked(y) if s.scale != 1.0 => Made::Tracked((y * s.scale)?),
                y => y,
            });
        }
        if let Some(y) = pending {
            h = crate::ops::add::add(&h, &y.tracked("residual sum")?)?;
        }
        Ok(h)
    }

    fn params(&self, out: &mut Vec<(String, Var)>) {
        for l in self.steps.iter().flat_map(|s| s.sublayer.linears()) {
            l.params(out);
        }
    }
}
