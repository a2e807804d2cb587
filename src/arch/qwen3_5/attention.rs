//! Qwen3.5 / Qwen3-Next gated full attention: per-head [q | gate] projection, (1+w) q/k norms,
//! partial rotary embedding, GQA, causal softmax, output × sigmoid(gate).

use super::config::TextConfig;
use crate::arch::LayerCache;
use crate::ops::norm::{NormWeight, RmsNorm};
use crate::ops::repeat_heads;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear_b, Linear, VarBuilder};

/// Rotary embedding of the first `dim` channels of each head (rotate_half convention).
/// Qwen3.5's interleaved mRoPE reduces to this for text, where all position streams are equal.
pub struct Rope {
    dim: usize,
    theta: f64,
    /// transformers holds `inv_freq` in the checkpoint's dtype (bf16 for released models);
    /// rounding it the same way reproduces its logits to 1e-6 instead of 2e-4.
    inv_freq_dtype: DType,
}

impl Rope {
    /// cos and sin [T, dim] for positions start..start+T.
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

    /// x [B, H, T, hd]
    fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let hd = x.dim(D::Minus1)?;
        let (rot, pass) = (x.narrow(3, 0, self.dim)?, x.narrow(3, self.dim, hd - self.dim)?);
        let half = self.dim / 2;
        let rotated = Tensor::cat(&[&rot.narrow(3, half, half)?.neg()?, &rot.narrow(3, 0, half)?], 3)?;
        let out = (rot.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
        Ok(Tensor::cat(&[&out, &pass], 3)?)
    }
}

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    gated: bool,
    rope: Rope,
}

impl Attention {
    /// `stored` is the dtype the checkpoint's weights are stored in.
    pub fn load(vb: VarBuilder, c: &TextConfig, stored: DType) -> Result<Self> {
        let (hq, hkv, hd, hid) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim(), c.hidden_size);
        let q_out = if c.attn_output_gate { 2 * hq * hd } else { hq * hd };
        let bias = c.attention_bias;
        Ok(Self {
            q_proj: linear_b(hid, q_out, bias, vb.pp("q_proj"))?,
            k_proj: linear_b(hid, hkv * hd, bias, vb.pp("k_proj"))?,
            v_proj: linear_b(hid, hkv * hd, bias, vb.pp("v_proj"))?,
            o_proj: linear_b(hq * hd, hid, bias, vb.pp("o_proj"))?,
            q_norm: RmsNorm::load(vb.pp("q_norm"), hd, c.rms_norm_eps, NormWeight::OnePlus)?,
            k_norm: RmsNorm::load(vb.pp("k_norm"), hd, c.rms_norm_eps, NormWeight::OnePlus)?,
            heads: hq,
            kv_heads: hkv,
            head_dim: hd,
            gated: c.attn_output_gate,
            rope: Rope { dim: c.rotary_dim(), theta: c.rope_theta(), inv_freq_dtype: stored },
        })
    }

    /// `cache`: keys and values of earlier positions (decoding); `None` for a plain forward.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hq, hd) = (self.heads, self.head_dim);
        let (q, gate) = if self.gated {
            // each head's rows are [q_h | gate_h]
            let qg = self.q_proj.forward(x)?.reshape((b, t, hq, 2 * hd))?;
            (qg.narrow(3, 0, hd)?, Some(qg.narrow(3, hd, hd)?.reshape((b, t, hq * hd))?))
        } else {
            (self.q_proj.forward(x)?.reshape((b, t, hq, hd))?, None)
        };
        let r = hq / self.kv_heads;
        let q = self.q_norm.forward(&q)?.transpose(1, 2)?;
        let k = self.k_norm.forward(&self.k_proj.forward(x)?.reshape((b, t, self.kv_heads, hd))?)?;
        let k = repeat_heads(&k, r)?.transpose(1, 2)?;
        let v = repeat_heads(&self.v_proj.forward(x)?.reshape((b, t, self.kv_heads, hd))?, r)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let past = match cache.as_deref() {
            Some(LayerCache::Attention { k, .. }) => k.dim(2)?,
            _ => 0,
        };
        let (cos, sin) = self.rope.tables(past, t, q.dtype(), q.device())?;
        let q = self.rope.apply(&q, &cos, &sin)?.contiguous()?;
        let mut k = self.rope.apply(&k, &cos, &sin)?.contiguous()?;
        let mut v = v;
        if let Some(c) = cache {
            if let LayerCache::Attention { k: pk, v: pv } = &*c {
                k = Tensor::cat(&[pk, &k], 2)?;
                v = Tensor::cat(&[pv, &v], 2)?;
            }
            *c = LayerCache::Attention { k: k.clone(), v: v.clone() };
        }
        let scores = (q.matmul(&k.t()?)? * (hd as f64).powf(-0.5))?;
        let scores = scores.to_dtype(DType::F32)?.broadcast_add(&causal_mask(past, t, q.device())?)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        let o = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, hq * hd))?;
        let o = match gate {
            Some(g) => (o * candle_nn::ops::sigmoid(&g)?)?,
            None => o,
        };
        Ok(self.o_proj.forward(&o)?)
    }
}

/// [T, past+T] additive mask: query i (at position past+i) sees keys up to past+i.
fn causal_mask(past: usize, t: usize, dev: &Device) -> Result<Tensor> {
    let n = past + t;
    let m: Vec<f32> =
        (0..t).flat_map(|i| (0..n).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })).collect();
    Ok(Tensor::from_vec(m, (t, n), dev)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_the_rest() {
        let rope = Rope { dim: 4, theta: 10000.0, inv_freq_dtype: DType::F32 };
        let x = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((1, 1, 2, 6)).unwrap();
        let (cos, sin) = rope.tables(0, 2, DType::F32, &Device::Cpu).unwrap();
        let y = rope.apply(&x, &cos, &sin).unwrap().squeeze(0).unwrap().to_vec3::<f32>().unwrap()[0].clone();
        // position 0 is the identity
        assert_eq!(y[0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        // position 1: pair (x_i, x_{i+2}) rotated by inv_freq_i, channels 4.. untouched
        let (c0, s0, c1, s1) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        let want = [6.0 * c0 - 8.0 * s0, 7.0 * c1 - 9.0 * s1, 8.0 * c0 + 6.0 * s0, 9.0 * c1 + 7.0 * s1, 10.0, 11.0];
        for (a, b) in y[1].iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{:?} vs {want:?}", y[1]);
        }
    }
}
