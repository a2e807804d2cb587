//! A layer's recurrence with its final state going where it is wanted: the observer and the
//! decoding cache.

use super::{LayerCache, Observer};
use anyhow::{bail, Result};
use candle_core::Tensor;

/// Run a layer's recurrence: computes the final state only when the observer or a decoding
/// cache needs it (the plain path keeps the differentiable op), and stores the cache.
pub fn run_recurrence(
    rec: &crate::ops::delta_rule::Recurrence,
    layer: usize,
    obs: &mut dyn Observer,
    mut cache: Option<&mut LayerCache>,
    conv: Option<Tensor>,
) -> Result<Tensor> {
    let _s = crate::profile::span("recurrence", rec.q.device());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NoObserver;
    use candle_core::Device;

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
}
