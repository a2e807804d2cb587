//! What a decoding session carries from one call to the next.

use anyhow::Result;
use candle_core::Tensor;

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

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
