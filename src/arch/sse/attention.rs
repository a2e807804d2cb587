//! The softmax attention layers of hybrid SSE models (SSE-H; fla `fla/layers/attn.py`
//! `Attention`, placed by the config's `attn` dict): q/k/v/o projections, optional per-head q/k
//! RMSNorm, rotary embedding of the whole head (rotate-half), GQA, causal softmax with an
//! optional sliding window.

use super::config::AttnConfig;
use crate::arch::LayerCache;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::ops::repeat_heads;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear_b, linear_no_bias, Linear, VarBuilder};

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    norms: Option<[RmsNorm; 2]>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    theta: f64,
    window: Option<usize>,
}

impl Attention {
    pub(super) fn load(vb: VarBuilder, c: &AttnConfig, hidden: usize, eps: f64) -> Result<Self> {
        let hd = hidden / c.num_heads;
        let kv = c.num_kv_heads.unwrap_or(c.num_heads);
        let norms = if c.qk_norm {
            let n = |name: &str| RmsNorm::load(vb.pp(name), hd, eps, NormWeight::Plain);
            Some([n("q_norm")?, n("k_norm")?])
        } else {
            None
        };
        Ok(Self {
            q_proj: linear_b(hidden, c.num_heads * hd, c.qkv_bias, vb.pp("q_proj"))?,
            k_proj: linear_b(hidden, kv * hd, c.qkv_bias, vb.pp("k_proj"))?,
            v_proj: linear_b(hidden, kv * hd, c.qkv_bias, vb.pp("v_proj"))?,
            o_proj: linear_no_bias(c.num_heads * hd, hidden, vb.pp("o_proj"))?,
            norms,
            heads: c.num_heads,
            kv_heads: kv,
            head_dim: hd,
            theta: c.rope_theta,
            window: c.window_size,
        })
    }

    /// cos and sin [T, hd] for positions start..start+T (fla computes them in float32).
    fn rope_tables(&self, start: usize, t: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.head_dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| 1.0 / (self.theta as f32).powf((2 * i) as f32 / self.head_dim as f32)).collect();
        let inv = Tensor::from_vec(inv, (1, half), dev)?;
        let pos = Tensor::arange(start as u32, (start + t) as u32, dev)?.to_dtype(DType::F32)?.reshape((t, 1))?;
        let freqs = pos.matmul(&inv)?;
        let emb = Tensor::cat(&[&freqs, &freqs], 1)?;
        Ok((emb.cos()?, emb.sin()?))
    }

    /// x [B, H, T, hd]: x·cos + rotate_half(x)·sin
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let half = self.head_dim / 2;
        let rotated = Tensor::cat(&[&x.narrow(3, half, half)?.neg()?, &x.narrow(3, 0, half)?], 3)?;
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?;
        Ok((x.broadcast_mul(cos)? + rotated.to_dtype(DType::F32)?.broadcast_mul(sin)?)?.to_dtype(dtype)?)
    }

    /// `cache`: keys and values of earlier positions (decoding); `None` for a plain forward.
    pub(super) fn forward(&self, x: &Tensor, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hq, hd) = (self.heads, self.head_dim);
        let q = self.q_proj.forward(x)?.reshape((b, t, hq, hd))?;
        let k = self.k_proj.forward(x)?.reshape((b, t, self.kv_heads, hd))?;
        let (q, k) = match &self.norms {
            Some([nq, nk]) => (nq.forward(&q)?, nk.forward(&k)?),
            None => (q, k),
        };
        let r = hq / self.kv_heads;
        let q = q.transpose(1, 2)?;
        let k = repeat_heads(&k, r)?.transpose(1, 2)?;
        let v = repeat_heads(&self.v_proj.forward(x)?.reshape((b, t, self.kv_heads, hd))?, r)?;
        let mut v = v.transpose(1, 2)?.contiguous()?;
        let past = match cache.as_deref() {
            Some(LayerCache::Attention { k, .. }) => k.dim(2)?,
            _ => 0,
        };
        let (cos, sin) = self.rope_tables(past, t, x.device())?;
        let q = self.rope(&q, &cos, &sin)?.contiguous()?;
        let mut k = self.rope(&k, &cos, &sin)?.contiguous()?;
        if let Some(c) = cache {
            if let LayerCache::Attention { k: pk, v: pv } = &*c {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *c = LayerCache::Attention { k: k.clone(), v: v.clone() };
        }
        let scores = (q.matmul(&k.t()?)? * (hd as f64).powf(-0.5))?;
        let scores = scores.to_dtype(DType::F32)?.broadcast_add(&mask(past, t, self.window, x.device())?)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        let o = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, hq * hd))?;
        Ok(self.o_proj.forward(&o)?)
    }
}

/// [T, past+T] additive mask: the query at position p = past+i sees keys j ≤ p, and with a
/// window w only those with p - j < w (flash-attn `window_size=(w-1, 0)`).
fn mask(past: usize, t: usize, window: Option<usize>, dev: &Device) -> Result<Tensor> {
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
    use super::mask;
    use candle_core::Device;

    #[test]
    fn window_mask() {
        let m = mask(1, 2, Some(2), &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        let seen: Vec<Vec<bool>> = m.iter().map(|r| r.iter().map(|x| x.is_finite()).collect()).collect();
        assert_eq!(seen, vec![vec![true, true, false], vec![false, true, true]]);
    }
}
