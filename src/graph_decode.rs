//! A decoding step captured once as a CUDA graph and replayed: one launch per token instead of
//! a few hundred, each of which costs the host more than the GPU spends on it at small batches.
//!
//! A replay reads and writes the addresses the capture saw. So the token ids and the logits
//! live in buffers of the decoder's own, and the cache is a [`DecodeCache::exclusive`] copy
//! whose layers' steps update their state in place. The temporaries a step allocates are
//! stream-ordered allocations, which the capture records as the graph's own memory, and the
//! shapes and strides candle uploads for some kernels come from its parameter cache: a replay
//! allocates and uploads nothing.

use crate::arch::{CausalLm, DecodeCache, LayerCache};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

#[cfg(feature = "cuda")]
type Graph = candle_core::cuda_backend::cudarc::driver::CudaGraph;
/// Without CUDA no decoder is ever made (`GraphDecoder::new` needs a CUDA device).
#[cfg(not(feature = "cuda"))]
struct Graph;

/// Replays one model's decoding step; see the module docs.
pub struct GraphDecoder<'a> {
    /// The graph reads the model's weights where they lie: it must not outlive them.
    _model: &'a dyn CausalLm,
    /// The states and conv histories the graph updates in place.
    _cache: DecodeCache,
    ids: Tensor,
    logits: Tensor,
    graph: Graph,
}

/// Why `cache` cannot be decoded from a replayed step, if it cannot: every layer must carry a
/// fixed-size recurrent state (attention caches grow each token).
fn unsupported(cache: &DecodeCache) -> Option<String> {
    cache.layers.iter().enumerate().find_map(|(i, l)| match l {
        LayerCache::Recurrent { .. } => None,
        LayerCache::Attention { .. } => Some(format!("layer {i} is attention, whose cache grows each token")),
        LayerCache::Parallel(_) => Some(format!("layer {i} runs mixers side by side")),
        LayerCache::Empty => Some(format!("layer {i} has no cache (prefill the prompt first)")),
    })
}

impl<'a> GraphDecoder<'a> {
    /// Decodes `ids` [B, 1] on from `cache` (which is left as it is): once eagerly, which loads
    /// every kernel and library handle the capture then records, and once captured. Returns
    /// the decoder and the logits of that first token. Fails, saying why, for a model whose
    /// step cannot be replayed.
    pub fn new(model: &'a dyn CausalLm, cache: &DecodeCache, ids: &Tensor) -> Result<(Self, Tensor)> {
        if !matches!(model.device(), Device::Cuda(_)) {
            bail!("a replayed decoding step needs a CUDA device");
        }
        if let Some(why) = unsupported(cache) {
            bail!("this model's decoding step cannot be replayed from a CUDA graph: {why}");
        }
        // Kernel parameters candle uploads per launch (shapes and strides) are cached for the
        // eager step and reused by the capture, so the graph reads device copies that stay
        // alive instead of host memory long gone by the replay.
        #[cfg(feature = "cuda")]
        let _params = match model.device() {
            Device::Cuda(d) => {
                // cudarc's per-buffer events would be recorded into the graph and waited on
                // outside it.
                if d.cuda_stream().context().is_event_tracking() {
                    bail!(
                        "a replayed decoding step needs the device opened without event tracking (as `--device cuda` \
                         opens it)"
                    );
                }
                Some(d.enable_cuda_graph_htod_cache())
            }
            _ => None,
        };
        let mut cache = cache.exclusive()?;
        let ids = ids.contiguous()?.copy()?;
        let first = model.forward_cached(&ids, &mut cache)?;
        // A layer whose step allocated a new state in place of updating its own (the general
        // path) would leave the replayed graph reading the old one.
        if let Some(i) = cache.layers.iter().position(|l| !matches!(l, LayerCache::Recurrent { owned: true, .. })) {
            bail!(
                "this model's decoding step cannot be replayed from a CUDA graph: layer {i} allocates a new state each \
                 token"
            );
        }
        let logits = first.contiguous()?.copy()?;
        let graph = capture(model, &mut cache, &ids, &logits)?;
        Ok((Self { _model: model, _cache: cache, ids, logits, graph }, first))
    }

    /// Logits [B, 1, V] for the next tokens `ids` [B, 1]: one graph launch. The tensor is the
    /// decoder's output buffer, which the next step overwrites.
    pub fn step(&mut self, ids: &Tensor) -> Result<Tensor> {
        self.ids.slice_set(&ids.contiguous()?, 0, 0).context("token ids must have the captured batch shape")?;
        self.launch()?;
        Ok(self.logits.clone())
    }

    #[cfg(feature = "cuda")]
    fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(|e| anyhow::anyhow!("launching the decoding graph: {e:?}"))
    }

    #[cfg(not(feature = "cuda"))]
    fn launch(&self) -> Result<()> {
        let Graph = self.graph;
        bail!("this statecut was built without CUDA")
    }
}

/// Records one decoding step on the device's stream; every exit ends the capture, so an error
/// leaves the stream usable.
#[cfg(feature = "cuda")]
fn capture(model: &dyn CausalLm, cache: &mut DecodeCache, ids: &Tensor, logits: &Tensor) -> Result<Graph> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let Device::Cuda(dev) = model.device() else { bail!("a replayed decoding step needs a CUDA device") };
    let stream = dev.cuda_stream();
    model.device().synchronize()?;
    let err = |what: &str, e| anyhow::anyhow!("{what} the decoding step as a CUDA graph: {e:?}");
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| err("capturing", e))?;
    let recorded = model.forward_cached(ids, cache).and_then(|out| Ok(logits.slice_set(&out, 0, 0)?));
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded.context("capturing the decoding step as a CUDA graph")?;
    let graph = graph.map_err(|e| err("instantiating", e))?.context("the captured decoding step is empty")?;
    graph.upload().map_err(|e| err("uploading", e))?;
    Ok(graph)
}

#[cfg(not(feature = "cuda"))]
fn capture(_: &dyn CausalLm, _: &mut DecodeCache, _: &Tensor, _: &Tensor) -> Result<Graph> {
    bail!("this statecut was built without CUDA")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_recurrent_caches_replay() -> Result<()> {
        let dev = Device::Cpu;
        let t = Tensor::zeros((1, 2, 2), candle_core::DType::F32, &dev)?;
        let rec = |conv: Option<Tensor>| LayerCache::Recurrent { conv, state: t.clone(), owned: false };
        let mut cache = DecodeCache { layers: vec![rec(Some(t.clone())), rec(Some(t.clone()))], pos: 3 };
        assert_eq!(unsupported(&cache), None);
        cache.layers[1] = LayerCache::Attention { k: t.clone(), v: t.clone() };
        assert!(unsupported(&cache).is_some_and(|w| w.starts_with("layer 1 is attention")));
        cache.layers[1] = rec(None);
        assert_eq!(unsupported(&cache), None);
        cache.layers[0] = LayerCache::Empty;
        assert!(unsupported(&cache).is_some_and(|w| w.starts_with("layer 0")));
        Ok(())
    }
}
