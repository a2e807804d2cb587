//! Causal softmax attention, shared by every hybrid: q/k/v/o projections, optional per-head
//! q/k RMSNorm, optional rotary embedding of the first `dim` channels of each head
//! (rotate-half), GQA, an optional sliding window and an optional sigmoid output gate
//! (Qwen3.5). The families differ only in the [`AttentionSpec`] they build from their config.

use super::linear::Linear;
use crate::model::LayerCache;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::ops::repeat_heads;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;

/// Rotary embedding of the first `dim` channels of each head (rotate_half convention).
/// Qwen3.5's interleaved mRoPE reduces to this for text, where all position streams are equal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub dim: usize,
    pub theta: f64,
    /// transformers holds Qwen3.5's `inv_freq` in the checkpoint's dtype (bf16 for released
    /// models); rounding it the same way reproduces its logits to 1e-6 instead of 2e-4.
    pub inv_freq_dtype: DType,
    /// Rotate in float32 (fla, Llama-style) rather than in the activations' dtype (Qwen3.5).
    pub f32_rotation: bool,
}

impl Rope {
    /// Full-width rotation with float32 frequencies, as Llama-style attention computes it.
    pub fn full(head_dim: usize, theta: f64) -> Self {
        Self { dim: head_dim, theta, inv_freq_dtype: DType::F32, f32_rotation: true }
    }

    /// cos and sin [T, dim] for positions start..start+T, in `dtype`.
    fn tables(&self, start: usize, t: usize, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| (1.0 / self.theta.powf((2 * i) as f64 / self.dim as f64)) as f32).collect();
        let inv = Tensor::from_vec(inv, (1, half), dev)?.to_dtype(self.inv_freq_dtype)?.to_dtype(DType::F32)?;
        let pos = Tensor::arange(start as u32, (start + t) as u32, dev)?.to_dtype(DType::F32)?.reshape((t, 1))?;
        let freqs = pos.matmul(&inv)?;
        let emb = Tensor::cat(&[&freqs, &freqs], 1)?;
        Ok((emb.cos()?.to_dtype(dtype)?, emb.sin()?.to_dtype(dtype)?))
    }

    /// x [B, H, T, hd] at positions start..start+T.
    fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (dtype, t, hd) = (x.dtype(), x.dim(2)?, x.dim(D::Minus1)?);
        let work = if self.f32_rotation { DType::F32 } else { dtype };
        let (cos, sin) = self.tables(start, t, work, x.device())?;
        let (rot, pass) = (x.narrow(3, 0, self.dim)?, x.narrow(3, self.dim, hd - self.dim)?);
        let half = self.dim / 2;
        let rotated = Tensor::cat(&[&rot.narrow(3, half, half)?.neg()?, &rot.narrow(3, 0, half)?], 3)?;
        let out = (rot.to_dtype(work)?.broadcast_mul(&cos)? + rotated.to_dtype(work)?.broadcast_mul(&sin)?)?;
        let out = out.to_dtype(dtype)?;
        Ok(if pass.dim(3)? == 0 { out } else { Tensor::cat(&[&out, &pass], 3)? })
    }
}

/// The shape and switches of one attention layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionSpec {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Per-head `q_norm` / `k_norm` with this weight convention and eps.
    pub qk_norm: Option<(NormWeight, f64)>,
    /// `q_proj` rows are [q_h | gate_h] per head; the output is multiplied by sigmoid(gate).
    pub output_gate: bool,
    /// `None`: no positional embedding (NoPE).
    pub rope: Option<Rope>,
    /// The factor on q·k (1/sqrt(head_dim) unless a muP multiplier replaces it).
    pub scale: f64,
    /// Sliding window: the query at position p sees keys j with p - j < window.
    pub window: Option<usize>,
}

pub struct Attention {
    spec: AttentionSpec,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    norms: Option<[RmsNorm; 2]>,
}

impl Attention {
    /// The projections, in load order.
    pub fn linears(&self) -> Vec<&Linear> {
        vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    pub fn load(vb: VarBuilder, spec: &AttentionSpec) -> Result<Self> {
        let (hq, hkv, hd, hid) = (spec.heads, spec.kv_heads, spec.head_dim, spec.hidden);
        if hkv == 0 || !hq.is_multiple_of(hkv) || spec.rope.is_some_and(|r| r.dim > hd || r.dim % 2 == 1) {
            anyhow::bail!(
                "{}: {hq} attention heads, {hkv} key/value heads of width {hd}: expected heads a multiple of key/value heads and an even rotary width up to the head width",
                vb.prefix()
            );
        }
        let q_out = if spec.output_gate { 2 * hq * hd } else { hq * hd };
        let norms = match spec.qk_norm {
            Some((kind, eps)) => {
                let n = |name: &str| RmsNorm::load(vb.pp(name), hd, eps, kind);
                Some([n("q_norm")?, n("k_norm")?])
            }
            None => None,
        };
        Ok(Self {
            spec: spec.clone(),
            q_proj: Linear::load(vb.pp("q_proj"), hid, q_out, spec.qkv_bias)?,
            k_proj: Linear::load(vb.pp("k_proj"), hid, hkv * hd, spec.qkv_bias)?,
            v_proj: Linear::load(vb.pp("v_proj"), hid, hkv * hd, spec.qkv_bias)?,
            o_proj: Linear::load(vb.pp("o_proj"), hq * hd, hid, spec.o_bias)?,
            norms,
        })
    }

    /// `cache`: keys and values of earlier positions (decoding); `None` for a plain forward.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let s = &self.spec;
        let (b, t, _) = x.dims3()?;
        let (hq, hkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let (q, gate) = if s.output_gate {
            // each head's rows are [q_h | gate_h]
            let qg = self.q_proj.forward(x)?.reshape((b, t, hq, 2 * hd))?;
            (qg.narrow(3, 0, hd)?, Some(qg.narrow(3, hd, hd)?.reshape((b, t, hq * hd))?))
        } else {
            (self.q_proj.forward(x)?.reshape((b, t, hq, hd))?, None)
        };
        let k = self.k_proj.forward(x)?.reshape((b, t, hkv, hd))?;
        let (q, k) = match &self.norms {
            Some([nq, nk]) => (nq.forward(&q)?, nk.forward(&k)?),
            None => (q, k),
        };
        let r = hq / hkv;
        let (q, k) = (q.transpose(1, 2)?, repeat_heads(&k, r)?.transpose(1, 2)?);
        let v = repeat_heads(&self.v_proj.forward(x)?.reshape((b, t, hkv, hd))?, r)?;
        let mut v = v.transpose(1, 2)?.contiguous()?;
        let past = match cache.as_deref() {
            Some(LayerCache::Attention { k, .. }) => k.dim(2)?,
            _ => 0,
        };
        let (q, mut k) = match &s.rope {
            Some(rope) => (rope.apply(&q, past)?, rope.apply(&k, past)?),
            None => (q, k),
        };
        let q = q.contiguous()?;
        k = k.contiguous()?;
        if let Some(c) = cache {
            if let LayerCache::Attention { k: pk, v: pv } = &*c {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *c = LayerCache::Attention { k: k.clone(), v: v.clone() };
        }
        let mask = causal_mask(past, t, s.window, x.device())?;
        let o = crate::ops::attention::attention(&q, &k, &v, &mask, s.scale)?;
        let o = o.transpose(1, 2)?.reshape((b, t, hq * hd))?;
        let o = match gate {
            Some(g) => (o * candle_nn::ops::sigmoid(&g)?)?,
            None => o,
        };
        Ok(self.o_proj.forward(&o)?)
    }
}

/// [T, past+T] additive mask: the query at position p = past+i sees keys j ≤ p, and with a
/// window w only those with p - j < w (flash-attn `window_size=(w-1, 0)`).
pub(crate) fn causal_mask(past: usize, t: usize, window: Option<usize>, dev: &Device) -> Result<Tensor> {
    let n = past + t;
    let m: Vec<f32> = (0..t)
        .flat_map(|i| {
            let p = past + i;
            (0..n).map(move |j| if j > p || window.is_some_and(|w| p - j >= w) { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    Ok(Tensor::from_vec(m, (t, n), dev)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_the_rest() {
        for f32_rotation in [false, true] {
            let rope = Rope { dim: 4, theta: 10000.0, inv_freq_dtype: DType::F32, f32_rotation };
            let x = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((1, 1, 2, 6)).unwrap();
            let y = rope.apply(&x, 0).unwrap().squeeze(0).unwrap().to_vec3::<f32>().unwrap()[0].clone();
            // position 0 is the identity
            assert_eq!(y[0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
            // position 1: pair (x_i, x_{i+2}) rotated by inv_freq_i, channels 4.. untouched
            let (c0, s0, c1, s1) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
            let want = [6.0 * c0 - 8.0 * s0, 7.0 * c1 - 9.0 * s1, 8.0 * c0 + 6.0 * s0, 9.0 * c1 + 7.0 * s1, 10.0, 11.0];
            for (a, b) in y[1].iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "{:?} vs {want:?}", y[1]);
            }
            // continuing at position 1 equals the second row of a two-position call
            let one = rope.apply(&x.narrow(2, 1, 1).unwrap(), 1).unwrap().flatten_all().unwrap();
            assert_eq!(one.to_vec1::<f32>().unwrap(), y[1]);
        }
    }

    #[test]
    fn window_mask() {
        let m = causal_mask(1, 2, Some(2), &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        let seen: Vec<Vec<bool>> = m.iter().map(|r| r.iter().map(|x| x.is_finite()).collect()).collect();
        assert_eq!(seen, vec![vec![true, true, false], vec![false, true, true]]);
        let m = causal_mask(0, 3, None, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        let seen: Vec<Vec<bool>> = m.iter().map(|r| r.iter().map(|x| x.is_finite()).collect()).collect();
        assert_eq!(seen, vec![vec![true, false, false], vec![true, true, false], vec![true, true, true]]);
    }
}
