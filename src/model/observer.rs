//! How calibration and inspection see inside a model: per-forward callbacks.

use anyhow::Result;
use candle_core::Tensor;

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

/// An observer whose hooks time themselves as the stage "observer" (see `crate::profile`):
/// what the model core wraps around the caller's observer when profiling is on. Every method
/// of [`Observer`] is passed on, the defaulted ones included.
pub struct Timed<'a>(pub &'a mut dyn Observer);

impl Observer for Timed<'_> {
    fn passive(&self) -> bool {
        self.0.passive()
    }
    fn wants_state(&self) -> bool {
        self.0.wants_state()
    }
    fn needs_logits(&self) -> bool {
        self.0.needs_logits()
    }
    fn sequences(&mut self, first: usize, n: usize) -> Result<()> {
        self.0.sequences(first, n)
    }
    fn hidden(&mut self, index: usize, h: &Tensor) -> Result<()> {
        let _s = crate::profile::span("observer", h.device());
        self.0.hidden(index, h)
    }
    fn qk_input(&mut self, layer: usize, x: &Tensor) -> Result<()> {
        let _s = crate::profile::span("observer", x.device());
        self.0.qk_input(layer, x)
    }
    fn qk(&mut self, layer: usize, q: &Tensor, k: &Tensor) -> Result<()> {
        let _s = crate::profile::span("observer", q.device());
        self.0.qk(layer, q, k)
    }
    fn state(&mut self, layer: usize, s: &Tensor) -> Result<()> {
        let _s = crate::profile::span("observer", s.device());
        self.0.state(layer, s)
    }
    fn routing(&mut self, layer: usize, selected: &Tensor) -> Result<()> {
        let _s = crate::profile::span("observer", selected.device());
        self.0.routing(layer, selected)
    }
    fn partition_keys(
        &mut self,
        layer: usize,
        keys: [&Tensor; 2],
        log_decays: [&Tensor; 2],
        selected: &Tensor,
    ) -> Result<()> {
        let _s = crate::profile::span("observer", selected.device());
        self.0.partition_keys(layer, keys, log_decays, selected)
    }
}
