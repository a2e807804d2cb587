//! Architecture adapters: one folder per model family, all behind [`Family`].
//!
//! A family knows how to read its config, build a candle forward, describe where its recurrent
//! state's key/query channels live in the checkpoint ([`StateLayout`]), and edit its config so a
//! pruned checkpoint reloads in the family's own library. Everything else (calibration,
//! selectors, surgery, reports) is written once against these descriptions.

pub mod config;
mod defaults;
pub mod falcon_h1;
pub mod fla;
pub mod granite_h;
pub mod kimi_linear;
pub mod layered;
pub mod mamba2;
pub mod nemotron_h;
pub mod qwen3_5;
pub mod sse;
pub mod trainable;

use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, VarBuilder};
use serde::Serialize;
use serde_json::Value;

/// Where the rows of one key/query channel set live in one stored tensor (sliced along dim 0).
///
/// Channel `j` of head `h` is row `offset + h * head_stride + j`.
#[derive(Debug, Clone, Serialize)]
pub struct RowSlice {
    pub tensor: String,
    pub offset: usize,
    pub head_stride: usize,
    pub role: SliceRole,
}

/// What a sliced tensor is, so selectors know which rows carry projection weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SliceRole {
    /// rows of the query projection (W_Q, Mamba-2 C)
    QueryProj,
    /// rows of the key projection (W_K, Mamba-2 B)
    KeyProj,
    /// conv weight or bias channels
    Conv,
    /// other tensors with one row per key channel (SSE: the low-rank corrections' second
    /// factors, the per-channel decay projections and their biases)
    Channel,
}

/// The recurrent state of one layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerState {
    pub layer: usize,
    /// Index sets per layer: fla heads, Mamba-2 groups, Qwen3.5 key heads.
    pub key_heads: usize,
    /// Number of recurrent states (value heads); each key head serves value_heads/key_heads.
    pub value_heads: usize,
    pub dv: usize,
    pub slices: Vec<RowSlice>,
}

/// The key/query geometry of a model: one key width `dk` shared by every head and layer.
#[derive(Debug, Clone, Serialize)]
pub struct StateLayout {
    pub family: String,
    pub dk: usize,
    /// Layers with a prunable recurrent state (hybrids list only their linear layers).
    pub layers: Vec<LayerState>,
    pub num_layers: usize,
}

impl StateLayout {
    /// Elements of all recurrent states for a key width `dk`.
    pub fn state_elems(&self, dk: usize) -> usize {
        self.layers.iter().map(|l| l.value_heads * dk * l.dv).sum()
    }

    pub fn layer(&self, layer: usize) -> Option<&LayerState> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Check the layout against the stored tensors, so that a config.json that disagrees with
    /// its weights fails here, once, instead of in whichever reader first indexes a row: every
    /// sliced tensor exists and has the rows `offset + h * head_stride + j` of every head h and
    /// channel j < dk, distinct slices of one tensor share no row, and the key/query projection
    /// blocks of a layer agree on their input width.
    pub fn check(&self, ckpt: &Checkpoint) -> Result<()> {
        let cfg = || format!("{}/config.json", ckpt.dir.display());
        if self.dk == 0 || self.dk > i32::MAX as usize {
            bail!("{} describes a key width of {}", cfg(), self.dk);
        }
        if self.layers.is_empty() {
            bail!("{} describes no layer with a recurrent state", cfg());
        }
        for l in &self.layers {
            let at = || format!("{} layer {}", cfg(), l.layer);
            // Sizes derived from float config values (expand_v, ...) saturate instead of failing.
            let sane = |n: usize| (1..=i32::MAX as usize).contains(&n);
            if !sane(l.key_heads) || !sane(l.dv) || !sane(l.value_heads) || !l.value_heads.is_multiple_of(l.key_heads) {
                bail!(
                    "{}: {} key heads, {} value heads of width {}: expected at least one of each, value heads a multiple of key heads",
                    at(),
                    l.key_heads,
                    l.value_heads,
                    l.dv
                );
            }
            // The row ranges of each head of each slice, by tensor, to find slices that overlap.
            let mut claimed: std::collections::BTreeMap<&str, Vec<(usize, usize)>> = Default::default();
            let mut proj_cols = None;
            for s in &l.slices {
                let info = ckpt.info(&s.tensor).with_context(|| {
                    format!("{} does not match the weights ({} is expected for layer {})", cfg(), s.tensor, l.layer)
                })?;
                let rows = info.shape.first().copied().unwrap_or(0);
                let end = (l.key_heads - 1).checked_mul(s.head_stride).and_then(|x| x.checked_add(s.offset + self.dk));
                if s.head_stride < self.dk || end.is_none_or(|e| e > rows) {
                    bail!(
                        "{} does not match the weights: {} has shape {:?}, too small for {} heads of d_k {} (rows from {} every {})",
                        cfg(),
                        s.tensor,
                        info.shape,
                        l.key_heads,
                        self.dk,
                        s.offset,
                        s.head_stride
                    );
                }
                let ranges = claimed.entry(&s.tensor).or_default();
                ranges.extend((0..l.key_heads).map(|h| (s.offset + h * s.head_stride, self.dk)));
                if matches!(s.role, SliceRole::QueryProj | SliceRole::KeyProj) {
                    let cols = match info.shape[..] {
                        [_, c] if c > 0 => c,
                        _ => bail!(
                            "{}: projection {} has shape {:?}, expected [rows, inputs]",
                            at(),
                            s.tensor,
                            info.shape
                        ),
                    };
                    if proj_cols.is_some_and(|c| c != cols) {
                        bail!(
                            "{}: key and query projections disagree on their input width ({} has {cols})",
                            at(),
                            s.tensor
                        );
                    }
                    proj_cols = Some(cols);
                }
            }
            for (tensor, ranges) in &mut claimed {
                ranges.sort_unstable();
                if let Some(w) = ranges.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
                    bail!("{}: the key channels of {tensor} overlap at row {}", at(), w[1].0);
                }
            }
        }
        Ok(())
    }
}

/// Per-forward callbacks: how calibration and inspection see inside a model without the
/// model knowing about them. Every method has a no-op default.
pub trait Observer {
    /// Whether every hook is a no-op, so a layer may take a fused path that never calls them
    /// (the single-token decoding step).
    fn passive(&self) -> bool {
        false
    }
    /// Ask the model to compute final recurrent states (costs an extra non-differentiable pass).
    fn wants_state(&self) -> bool {
        false
    }
    /// Whether the caller uses the logits. When false, a forward may return the final (normed)
    /// hidden state instead and skip the LM head: a [tokens, vocab] tensor that can outweigh a
    /// layer's activations many times over (Qwen3.5's vocabulary is 248k).
    fn needs_logits(&self) -> bool {
        true
    }
    /// Layer-streamed runs: the next forward continues sequences `first..first + n` of the run
    /// (numbered from 0 in the order a resident run feeds them), at the layer after the one
    /// they last went through. Observers with per-sequence state pick it up here.
    fn sequences(&mut self, _first: usize, _n: usize) -> Result<()> {
        Ok(())
    }
    /// Hidden states as transformers' `output_hidden_states` returns them: index 0 = embeddings,
    /// except for Mamba-2, whose index i is the residual after block i; the last index is the
    /// final norm's output in both cases.
    fn hidden(&mut self, _index: usize, _h: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Input of the q/k projections [B, T, D] (S-Wanda norms).
    fn qk_input(&mut self, _layer: usize, _x: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Queries and keys [B, T, key_heads, dk] after the short conv and SiLU, before the L2 norm.
    fn qk(&mut self, _layer: usize, _q: &Tensor, _k: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Final recurrent states [B, value_heads, dk, dv].
    fn state(&mut self, _layer: usize, _s: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Routing of models with routed state partitions (SSE): [B, T, N], 1 where a token writes
    /// to and reads from partition p, 0 elsewhere.
    fn routing(&mut self, _layer: usize, _selected: &Tensor) -> Result<()> {
        Ok(())
    }
    /// Models with routed state partitions (SSE), for diagnostics: the keys after the key feature
    /// map [B, T, H, dk] and the log decays [B, T, H, c] (c = dk for per-channel decays, 1 for
    /// per-head ones) of the shared partition (index 0) and the routed ones (index 1), with the
    /// routing of [`Observer::routing`]. A routed partition decays only where it is selected.
    fn partition_keys(
        &mut self,
        _layer: usize,
        _keys: [&Tensor; 2],
        _log_decays: [&Tensor; 2],
        _selected: &Tensor,
    ) -> Result<()> {
        Ok(())
    }
}

/// An observer that sees nothing.
pub struct NoObserver;
impl Observer for NoObserver {
    fn passive(&self) -> bool {
        true
    }
}

/// What one layer carries from one decoding call to the next.
#[derive(Debug, Clone, Default)]
pub enum LayerCache {
    #[default]
    Empty,
    /// The last K-1 inputs [B, K-1, C] of the layer's short conv (one depthwise conv over all
    /// its channels; `None` without one; in the activations' dtype, or float32 after a fused
    /// decoding step, which holds the same values) and the recurrent state [B, H, dk, dv].
    /// `owned`: these tensors belong to this cache alone (see [`DecodeCache::exclusive`]), so a
    /// step that can overwrites them in place instead of allocating new ones, as a step
    /// replayed from a CUDA graph must.
    Recurrent { conv: Option<Tensor>, state: Tensor, owned: bool },
    /// Keys and values of a softmax-attention layer [B, H, T, d].
    Attention { k: Tensor, v: Tensor },
    /// One cache per branch of a layer whose mixers run side by side (Falcon-H1).
    Parallel(Vec<LayerCache>),
}

impl LayerCache {
    fn elems(&self) -> usize {
        match self {
            LayerCache::Empty => 0,
            LayerCache::Recurrent { conv, state, .. } => {
                state.elem_count() + conv.as_ref().map_or(0, Tensor::elem_count)
            }
            LayerCache::Attention { k, v } => k.elem_count() + v.elem_count(),
            LayerCache::Parallel(branches) => branches.iter().map(LayerCache::elems).sum(),
        }
    }
}

/// A decoding session: one cache per layer and the number of tokens seen.
#[derive(Debug, Clone, Default)]
pub struct DecodeCache {
    pub layers: Vec<LayerCache>,
    pub pos: usize,
}

impl DecodeCache {
    pub fn new(layers: usize) -> Self {
        Self { layers: vec![LayerCache::Empty; layers], pos: 0 }
    }

    /// Start a call over `tokens` more tokens of a model with `layers` layers.
    pub fn begin(&mut self, layers: usize, tokens: usize) {
        self.layers.resize(layers, LayerCache::Empty);
        self.pos += tokens;
    }

    /// Elements held by recurrent states and attention caches (what a smaller state saves).
    pub fn elems(&self) -> usize {
        self.layers.iter().map(LayerCache::elems).sum()
    }
    /// A copy whose recurrent tensors belong to it alone, float32 and contiguous, and marked
    /// `owned`: decoding steps that can then update them in place. Clones of a cache share
    /// their tensors, so an in-place step on one would change the others.
    pub fn exclusive(&self) -> Result<Self> {
        fn layer(c: &LayerCache) -> Result<LayerCache> {
            // A compact copy: a state may be a view into its recurrence's whole output.
            let own = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(candle_core::DType::F32)?.force_contiguous()?) };
            Ok(match c {
                LayerCache::Recurrent { conv, state, .. } => {
                    LayerCache::Recurrent { conv: conv.as_ref().map(own).transpose()?, state: own(state)?, owned: true }
                }
                LayerCache::Attention { k, v } => LayerCache::Attention { k: k.copy()?, v: v.copy()? },
                LayerCache::Parallel(branches) => {
                    LayerCache::Parallel(branches.iter().map(layer).collect::<Result<_>>()?)
                }
                LayerCache::Empty => LayerCache::Empty,
            })
        }
        Ok(Self { layers: self.layers.iter().map(layer).collect::<Result<_>>()?, pos: self.pos })
    }
}

/// Run a layer's recurrence: computes the final state only when the observer or a decoding
/// cache needs it (the plain path keeps the differentiable op), and stores the cache.
pub fn run_recurrence(
    rec: &crate::ops::delta_rule::Recurrence,
    layer: usize,
    obs: &mut dyn Observer,
    mut cache: Option<&mut LayerCache>,
    conv: Option<Tensor>,
) -> Result<Tensor> {
    if !obs.wants_state() && cache.is_none() {
        return rec.forward().map_err(Into::into);
    }
    // An owned cache off the CPU is updated where it lies: the state by the fused kernel, the
    // conv history copied over the old one (the addresses a replayed step reads stay fixed).
    if let Some(LayerCache::Recurrent { conv: history, state, owned: true }) = cache.as_deref_mut() {
        if !state.device().is_cpu() && rec.initial.is_some_and(|s| s.id() == state.id()) {
            // o in the values' dtype, as `forward_with_state` returns it.
            let o = rec.fused_in_place()?.to_dtype(rec.v.dtype())?;
            obs.state(layer, state)?;
            match (history, conv) {
                (Some(h), Some(new)) => h.slice_set(&new.to_dtype(h.dtype())?.contiguous()?, 0, 0)?,
                (None, None) => {}
                _ => bail!("layer {layer}: the conv history changed presence between decoding calls"),
            }
            return Ok(o);
        }
    }
    let (o, state) = rec.forward_with_state()?;
    obs.state(layer, &state)?;
    if let Some(c) = cache {
        // After a prompt the state may be a view into an output of all its tokens' values, and
        // the conv history one into the projections of all its tokens, which the cache would
        // otherwise keep alive for the whole decoding session.
        let (state, conv) = if rec.q.dim(1)? > 1 {
            (state.force_contiguous()?, conv.map(|c| c.force_contiguous()).transpose()?)
        } else {
            (state, conv)
        };
        *c = LayerCache::Recurrent { conv, state, owned: false };
    }
    Ok(o)
}

/// A loaded causal language model.
pub trait CausalLm {
    /// Logits [B, T, V] for token ids [B, T], continuing from and updating `cache` when given.
    /// Families without step-by-step decoding reject a cache.
    fn run(&self, ids: &Tensor, obs: &mut dyn Observer, cache: Option<&mut DecodeCache>) -> Result<Tensor>;
    /// Logits [B, T, V] for token ids [B, T].
    fn forward(&self, ids: &Tensor, obs: &mut dyn Observer) -> Result<Tensor> {
        self.run(ids, obs, None)
    }
    /// Logits [B, T, V] for ids [B, T] continuing from `cache` (a prefill when it is new),
    /// updating it: the recurrent path used for generation and decode benchmarks.
    fn forward_cached(&self, ids: &Tensor, cache: &mut DecodeCache) -> Result<Tensor> {
        self.run(ids, &mut NoObserver, Some(cache))
    }
    /// Projection weights loaded as variables (with `LoadOptions::grad`), by checkpoint name.
    fn grad_vars(&self) -> &[(String, Var)];
    fn device(&self) -> &Device;
    /// Decoder layers: what a backward pass keeps activations for.
    fn num_blocks(&self) -> usize;
    /// The stages of a layer-streamed model, which calibration, evaluation and inspection run
    /// layer-major (`crate::stream`) instead of calling [`CausalLm::forward`] per batch.
    fn layers(&self) -> Option<&dyn layered::Layers> {
        None
    }
}

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub dtype: DType,
    pub device: Device,
    /// Load the key/query projection weights as variables so the LM loss can be differentiated.
    pub grad: bool,
}

impl LoadOptions {
    pub fn cpu_f32() -> Self {
        Self { dtype: DType::F32, device: Device::Cpu, grad: false }
    }
}

/// A model family.
pub trait Family: Sync {
    /// The `model_type` values this family reads.
    fn model_types(&self) -> &'static [&'static str];
    /// The layout as the config describes it; use [`Family::layout`], which checks it.
    fn describe_layout(&self, ckpt: &Checkpoint) -> Result<StateLayout>;
    /// The layout, checked against the stored tensors ([`StateLayout::check`]).
    fn layout(&self, ckpt: &Checkpoint) -> Result<StateLayout> {
        let layout = self.describe_layout(ckpt)?;
        layout.check(ckpt)?;
        Ok(layout)
    }
    /// The model's stages over `weights` (a view of `ckpt`'s tensors in `opts`' dtype and device).
    fn layers(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        weights: VarBuilder<'static>,
    ) -> Result<Box<dyn layered::Layers>>;
    /// The model with every stage loaded from the memory-mapped weights.
    fn load(&self, ckpt: &Checkpoint, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
        let weights = ckpt.var_builder(opts.dtype, &opts.device)?;
        Ok(Box::new(layered::Resident::load(self.layers(ckpt, opts, weights)?)?))
    }
    /// The model with the tensors `select` accepts (by checkpoint name) loaded as variables,
    /// returned with them: a loss over its logits can be differentiated with respect to each.
    fn load_trainable(
        &self,
        ckpt: &Checkpoint,
        opts: &LoadOptions,
        select: trainable::Selector,
    ) -> Result<(Box<dyn CausalLm>, trainable::Trainable)> {
        let set = trainable::Trainable::default();
        let weights = set.wrap(ckpt.var_builder(opts.dtype, &opts.device)?, select);
        Ok((Box::new(layered::Resident::load(self.layers(ckpt, opts, weights)?)?), set))
    }
    /// Edit config.json so that the family's library rebuilds the model with key width `dk`.
    fn set_key_width(&self, config: &mut Value, layout: &StateLayout, dk: usize) -> Result<()>;
    /// Models with routed state partitions: keep partitions `keep[layer]` (ascending, the same
    /// count in every layer) and edit config.json to match; returns the rows to keep of the
    /// tensors that change (sliced along dim 0).
    fn keep_partitions(
        &self,
        _config: &mut Value,
        _keep: &std::collections::BTreeMap<usize, Vec<usize>>,
    ) -> Result<Vec<(String, Vec<usize>)>> {
        bail!("this model family has no routed state partitions (--prune-partitions is for SSE models)")
    }
}

static FAMILIES: &[&dyn Family] = &[
    &fla::DeltaNetFamily,
    &fla::GatedDeltaNetFamily,
    &mamba2::Mamba2Family,
    &qwen3_5::Qwen35Family,
    &sse::SseFamily,
    &nemotron_h::NemotronHFamily,
    &granite_h::GraniteHybridFamily,
    &falcon_h1::FalconH1Family,
    &kimi_linear::KimiLinearFamily,
];

/// The end of every causal LM: the final norm, whose output is hidden state `index` for the
/// observer, then the LM head's logits, or that normed hidden state itself when the observer
/// needs no logits.
pub(crate) fn head(
    h: &Tensor,
    norm: &crate::ops::norm::RmsNorm,
    lm_head: &Linear,
    obs: &mut dyn Observer,
    index: usize,
) -> Result<Tensor> {
    let h = norm.forward(h)?;
    obs.hidden(index, &h)?;
    let out = if obs.needs_logits() { candle_core::Module::forward(lm_head, &h)? } else { h };
    crate::profile::mark("head", out.device());
    Ok(out)
}

/// A linear layer `name` under `vb`. With `grad` its weight is a variable, registered in `vars`
/// under its checkpoint name, so that the LM loss can be differentiated with respect to it.
pub(crate) fn projection(
    vb: &VarBuilder,
    name: &str,
    out: usize,
    inp: usize,
    bias: bool,
    grad: bool,
    vars: &mut Vec<(String, Var)>,
) -> Result<Linear> {
    if !grad {
        return Ok(candle_nn::linear_b(inp, out, bias, vb.pp(name))?);
    }
    let vb = vb.pp(name);
    let var = Var::from_tensor(&vb.get((out, inp), "weight")?)?;
    let b = if bias { Some(vb.get(out, "bias")?) } else { None };
    vars.push((format!("{}.weight", vb.prefix()), var.clone()));
    Ok(Linear::new(var.as_tensor().clone(), b))
}

/// The family adapter for a checkpoint.
pub fn family_for(ckpt: &Checkpoint) -> Result<&'static dyn Family> {
    let mt = ckpt.model_type()?;
    for f in FAMILIES {
        if f.model_types().contains(&mt.as_str()) {
            return Ok(*f);
        }
    }
    let known: Vec<&str> = FAMILIES.iter().flat_map(|f| f.model_types().iter().copied()).collect();
    bail!(
        "unsupported model_type \"{mt}\" in {}/config.json; statecut supports: {}",
        ckpt.dir.display(),
        known.join(", ")
    )
}

/// Read a typed config from JSON with one line naming the file and the key.
pub fn parse<T: serde::de::DeserializeOwned>(ckpt: &Checkpoint, value: &Value) -> Result<T> {
    let family = ckpt.model_type().unwrap_or_default();
    parse_as(ckpt, value, &family)
}

/// [`parse`] for a family named `family` in the message.
pub fn parse_as<T: serde::de::DeserializeOwned>(ckpt: &Checkpoint, value: &Value, family: &str) -> Result<T> {
    config::from_value(value)
        .map_err(|e| anyhow::anyhow!("{}/config.json does not match the {family} format: {e}", ckpt.dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// After a prompt the cache holds its own compact state and conv history, not views that
    /// would keep the prompt's whole outputs alive.
    #[test]
    fn prompt_caches_hold_compact_copies() -> Result<()> {
        let dev = Device::Cpu;
        let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev);
        let (q, k, v, beta) = (r(&[1, 3, 1, 2])?, r(&[1, 3, 1, 2])?, r(&[1, 3, 1, 2])?, r(&[1, 3, 1])?);
        let rec = crate::ops::delta_rule::Recurrence {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: None,
            gk: None,
            scale: 1.0,
            rule: crate::ops::delta_rule::Rule::Delta,
            initial: None,
        };
        // the last two of three steps' inputs, a view into a wider tensor
        let projections = r(&[1, 3, 10])?;
        let history = projections.narrow(1, 1, 2)?.narrow(2, 4, 6)?;
        let mut cache = LayerCache::Empty;
        run_recurrence(&rec, 0, &mut NoObserver, Some(&mut cache), Some(history.clone()))?;
        let LayerCache::Recurrent { conv: Some(c), state, owned: false } = &cache else { panic!("{cache:?}") };
        for t in [c, state] {
            let (storage, layout) = t.storage_and_layout();
            let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = &*storage else { panic!("not f32") };
            assert!(layout.is_contiguous() && layout.start_offset() == 0 && data.len() == t.elem_count());
        }
        assert_eq!(c.flatten_all()?.to_vec1::<f32>()?, history.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn exclusive_caches_own_float32_copies() -> Result<()> {
        let dev = Device::Cpu;
        let conv = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?.to_dtype(DType::BF16)?;
        let state = Tensor::randn(0f32, 1.0, (2, 1, 4, 4), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 1, 5, 4), &dev)?;
        let cache = DecodeCache {
            layers: vec![
                LayerCache::Recurrent { conv: Some(conv.clone()), state: state.clone(), owned: false },
                LayerCache::Attention { k: k.clone(), v: k.clone() },
            ],
            pos: 5,
        };
        let own = cache.exclusive()?;
        assert_eq!(own.pos, 5);
        let LayerCache::Recurrent { conv: Some(c), state: s, owned: true } = &own.layers[0] else {
            panic!("the recurrent layer is not owned: {:?}", own.layers[0]);
        };
        assert_eq!((c.dtype(), s.dtype()), (DType::F32, DType::F32));
        // Overwriting the copies leaves the originals as they were.
        s.slice_set(&s.zeros_like()?, 0, 0)?;
        assert!(state.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
        let diff = (c - conv.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        let LayerCache::Attention { k: k2, .. } = &own.layers[1] else { panic!("attention layer changed kind") };
        k2.slice_set(&k2.zeros_like()?, 0, 0)?;
        assert!(k.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
        Ok(())
    }
}
