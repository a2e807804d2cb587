//! The chunked (WY) form of the recurrence in [`super::delta_rule`], written in batched matmuls.
//!
//! Same function as the sequential kernel, computed the way fla's `chunk_gated_delta_rule` and
//! Mamba-2's SSD do: split T into chunks of C tokens, do all intra-chunk work for every chunk at
//! once in [.., C, C] matmuls, then walk the chunks carrying only the [dk, dv] state. This is the
//! GPU path: every op is a candle op, so it runs on any device and candle autograd differentiates
//! it (the Grad selector's backward), with no hand-written kernel.
//!
//! Per chunk with start state S₀ and in-chunk cumulative log decay γ (γ_t = Σ_{j≤t} g_j):
//!   D_tj = exp(γ_t − γ_j) for j ≤ t, else 0
//!   delta rule: (I − A) U = β V − diag(β e^γ) K S₀,  A = −diag(β) (K Kᵀ ∘ D) strictly lower
//!   plain rule: U = β V
//!   O = (Q ∘ e^γ) S₀ + (Q Kᵀ ∘ D) U,   S_C = e^{γ_C} S₀ + (K ∘ e^{γ_C − γ})ᵀ U
//! (I − A)⁻¹ = Π_{i<log₂C} (I + A^{2^i}) exactly, because A is strictly lower triangular (A^C = 0),
//! which keeps the solve in matmuls too (in float64, see below).
//!
//! With a decay per key channel (GLA, Kimi Delta Attention) γ becomes a cumulative log decay per
//! channel Γ [C, dk], and D is folded into the factors: K̂ = K ∘ e^Γ, K̃ = K ∘ e^−Γ, Q̂ = Q ∘ e^Γ,
//!   delta rule: A = −diag(β) (K̂ K̃ᵀ) strictly lower,  (I − A) U = β V − diag(β) K̂ S₀
//!   O = Q̂ S₀ + (Q̂ K̃ᵀ ∘ causal) U,   S_C = diag(e^{Γ_C}) S₀ + (K ∘ e^{Γ_C − Γ})ᵀ U
//! in float64 over short chunks, so that e^−Γ stays finite.

use super::chunk_walk::WalkIn;
use super::recurrence::{Recurrence, Rule};
use candle_core::{DType, Device, Result, Tensor};

/// Chunk length used for long sequences (fla's default for the delta rule).
pub const CHUNK: usize = 64;
/// Chunk length with per-channel decays: e^−Γ over a chunk must stay finite in float64.
pub const CHANNEL_CHUNK: usize = 16;

/// [B,T,H,d] -> [N,B·H,C,d] float32, T zero-padded to N·C. Chunk-major so that chunk n is a
/// contiguous [B·H,C,d] block for the sequential walk; at most two batch dims, as matmul wants.
fn chunks(x: &Tensor, c: usize) -> Result<Tensor> {
    let (b, t, h, d) = x.dims4()?;
    let n = t.div_ceil(c);
    let x = x.to_dtype(DType::F32)?;
    let x = if n * c > t { x.pad_with_zeros(1, 0, n * c - t)? } else { x };
    x.reshape((b, n, c, h, d))?.permute((1, 0, 3, 2, 4))?.reshape((n, b * h, c, d))
}

/// [C, C] float32 matrix holding `yes` where `keep(t, j)` and `no` elsewhere.
fn mask(c: usize, dev: &Device, keep: impl Fn(usize, usize) -> bool, yes: f32, no: f32) -> Result<Tensor> {
    let v: Vec<f32> = (0..c * c).map(|i| if keep(i / c, i % c) { yes } else { no }).collect();
    Tensor::from_vec(v, (c, c), dev)
}

/// How the chunks are walked and the intra-chunk system solved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Candle ops only: the loop over chunks in matmuls, the solve in float64 products. The
    /// reference, and the path on devices without statecut's kernels.
    Composed,
    /// statecut's ops with their own backward, in float32: with a decay per head (or none) the
    /// intra-chunk solve, the walk and the outputs ([`super::chunk_intra`],
    /// [`super::chunk_walk`], [`super::chunk_out`]); with per-key-channel decays the walk alone.
    /// The rest stays in batched candle ops.
    Kernels,
}

/// Outputs o [B,T,H,dv] and final state [B,H,dk,dv], both float32, in the composed form.
pub fn forward(rec: &Recurrence) -> Result<(Tensor, Tensor)> {
    forward_in(rec, Form::Composed)
}

/// [`forward`] in the given form.
pub fn forward_in(rec: &Recurrence, form: Form) -> Result<(Tensor, Tensor)> {
    if let Some(gk) = rec.gk {
        return forward_per_channel(rec, gk, form);
    }
    if form == Form::Kernels {
        return forward_kernels(rec);
    }
    let (b, t, h, dk) = rec.q.dims4()?;
    let dv = rec.v.dim(3)?;
    let dev = rec.q.device();
    // Short inputs (decoding) use one power-of-two chunk; the product form needs C = 2^m.
    let c = CHUNK.min(t.next_power_of_two());
    let n = t.div_ceil(c);
    let mark = |stage| crate::profile::mark(stage, dev);
    mark("chunked: before");

    let q = (chunks(rec.q, c)? * rec.scale)?;
    let k = chunks(rec.k, c)?;
    let v = chunks(rec.v, c)?;
    let scalar = |x: &Tensor| super::chunk_layout::scalars_to_chunks(x, c); // [N,BH,C]
    let beta = scalar(rec.beta)?;
    mark("chunked: inputs to chunks");

    // Without a gate every decay factor is 1 (exactly, as exp(0) is): skipped, D is the mask.
    let decays = rec.g.map(|g| Decays::of(&scalar(g)?, c)).transpose()?;
    let causal = mask(c, dev, |t, j| j <= t, 1.0, 0.0)?;
    let weigh = |x: Tensor| match &decays {
        Some(d) => x * &d.decay,
        None => x.broadcast_mul(&causal),
    };
    let scaled = |x: &Tensor, f: fn(&Decays) -> &Tensor| match &decays {
        Some(d) => x.broadcast_mul(f(d)),
        None => Ok(x.clone()),
    };
    mark("chunked: decays");

    let k_t = k.t()?.contiguous()?; // [N,BH,dk,C]

    // (W, Kc): U = W − Kc S₀ for every chunk.
    let (w, kc) = match rec.rule {
        Rule::Plain => (v.broadcast_mul(&beta.unsqueeze(3)?)?, None),
        Rule::Delta => {
            let v_beta = v.broadcast_mul(&beta.unsqueeze(3)?)?;
            let k_beta = k.broadcast_mul(&beta.unsqueeze(3)?)?;
            let strict = mask(c, dev, |t, j| j < t, 1.0, 0.0)?;
            let a = weigh(k_beta.matmul(&k_t)?)?.broadcast_mul(&strict)?.neg()?;
            mark("chunked: A");
            // In float64: repeated squaring in float32 loses the un-gated DeltaNet's trained keys
            // (logits off by 2e-2 at C = 64); float64 keeps it exact at a small cost. Forward
            // substitution (the kernel form) is accurate in float32.
            let inv = super::chunk_intra::unit_lower_inverse(&a, c)?.to_dtype(DType::F32)?;
            mark("chunked: solve");
            (inv.matmul(&v_beta)?, Some(inv.matmul(&scaled(&k_beta, |d| &d.e_gamma)?)?))
        }
    };
    mark("chunked: W and Kc");
    let qk = weigh(q.matmul(&k_t)?)?; // [N,BH,C,C]
    let q_decayed = scaled(&q, |d| &d.e_gamma)?;
    mark("chunked: QK");
    let s0 = initial_state(rec, DType::F32)?;
    let k_to_end = scaled(&k, |d| &d.to_end)?.t()?.contiguous()?; // [N,BH,dk,C]
    let chunk_decay = decays.as_ref().map(|d| d.last.exp()?.unsqueeze(3)).transpose()?; // [N,BH,1,1]

    let mut s = s0;
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let u = match &kc {
            Some(kc) => (w.get(i)? - kc.get(i)?.matmul(&s)?)?,
            None => w.get(i)?,
        };
        outs.push((q_decayed.get(i)?.matmul(&s)? + qk.get(i)?.matmul(&u)?)?);
        if let Some(cd) = &chunk_decay {
            s = s.broadcast_mul(&cd.get(i)?)?;
        }
        s = (s + k_to_end.get(i)?.matmul(&u)?)?;
    }
    // [N,B·H,C,dv] -> [B,T,H,dv]
    let o = Tensor::stack(&outs, 0)?.reshape((n, b, h, c, dv))?.permute((1, 0, 3, 2, 4))?.reshape((b, n * c, h, dv))?;
    let o = if n * c > t { o.narrow(1, 0, t)? } else { o };
    Ok((o.contiguous()?, s.reshape((b, h, dk, dv))?))
}

/// [`forward_in`]'s kernel form with a decay per head (or none): one op each way
/// ([`super::chunk_recurrence`]).
fn forward_kernels(rec: &Recurrence) -> Result<(Tensor, Tensor)> {
    let c = chunk_len(rec.q.dim(1)?);
    super::chunk_recurrence::forward(rec, c, tensor_cores(rec))
}

/// The chunk length of the chunked forms for sequences of `t` steps.
pub fn chunk_len(t: usize) -> usize {
    CHUNK.min(t.next_power_of_two())
}

/// The delta rule on the chunk kernels from q and k already in chunks of [`chunk_len`]`(t)`
/// (`qk` [N, B·H, C, 2dk] differentiable and `keys` [N, B·H, C, dk], as
/// `prep::heads_qk_chunks` gives them), no initial state: o [B, T, H, dv] in the values' dtype.
pub fn delta_from_chunks(
    qk: &Tensor,
    keys: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    delta_in_chunks(qk, keys, v, super::chunk_recurrence::Links::default(), beta, g, scale, outputs)
}

/// [`delta_from_chunks`] from q | k and v linked to it (`prep::heads_qk_linked` and
/// `prep::conv_heads_qk_linked`), whose gradients then go through the links.
pub fn delta_from_linked(x: &super::prep::QkvChunks, beta: &Tensor, g: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let links = super::chunk_recurrence::Links { qk: Some(&x.qk), v: Some(&x.v) };
    delta_in_chunks(&x.qk.value, &x.keys, &x.v.value, links, beta, g, scale, outputs)
}

/// [`delta_from_linked`] with o linked in turn to the one op that reads it (the output norm
/// and projection, `RmsNorm::project_heads_linked`).
pub(crate) fn delta_linked_through(
    x: &super::prep::QkvChunks,
    beta: &Tensor,
    g: Option<&Tensor>,
    scale: f64,
) -> Result<super::link::Linked> {
    let links = super::chunk_recurrence::Links { qk: Some(&x.qk), v: Some(&x.v) };
    let run = super::chunk_recurrence::forward_chunked_linked;
    delta_in_chunks(&x.qk.value, &x.keys, &x.v.value, links, beta, g, scale, run)
}

/// The recurrence's outputs o, the final state dropped.
fn outputs(x: &super::chunk_recurrence::Chunked, rest: &super::chunk_recurrence::Rest, tensor: bool) -> Result<Tensor> {
    Ok(super::chunk_recurrence::forward_chunked(x, rest, tensor)?.0)
}

/// What [`delta_from_chunks`] and [`delta_from_linked`] run: q | k, keys and v as values, and
/// the links the values came through where they did, by `run` (the recurrence's op giving o).
#[allow(clippy::too_many_arguments)]
fn delta_in_chunks<R>(
    qk: &Tensor,
    keys: &Tensor,
    v: &Tensor,
    links: super::chunk_recurrence::Links,
    beta: &Tensor,
    g: Option<&Tensor>,
    scale: f64,
    run: impl FnOnce(&super::chunk_recurrence::Chunked, &super::chunk_recurrence::Rest, bool) -> Result<R>,
) -> Result<R> {
    use super::chunk_recurrence::{Chunked, Rest};
    let t = v.dim(1)?;
    let rest = Rest { v, beta, g, initial: None, scale, rule: super::recurrence::Rule::Delta };
    let x = Chunked { qk, keys, t, c: chunk_len(t), links };
    run(&x, &rest, v.dtype() != DType::F32)
}

/// Whether the chunk kernels may multiply on tensor cores: the values come in a 16-bit dtype
/// (the model's), coarser than the TF32 operands the tensor cores round every input to. (A
/// model's q and k may arrive in float32, L2-normalised in float32 from 16-bit projections.)
/// Float32 values keep float32 products throughout.
fn tensor_cores(rec: &Recurrence) -> bool {
    rec.v.dtype() != DType::F32
}

/// The state the recurrence starts from, [B·H, dk, dv] in `dtype`: the given one or zeros.
fn initial_state(rec: &Recurrence, dtype: DType) -> Result<Tensor> {
    let (b, _, h, dk) = rec.q.dims4()?;
    let dv = rec.v.dim(3)?;
    match rec.initial {
        Some(s) => s.to_dtype(dtype)?.reshape((b * h, dk, dv)),
        None => Tensor::zeros((b * h, dk, dv), dtype, rec.q.device()),
    }
}

/// The decay factors of one gated recurrence in chunks, from the in-chunk cumulative log decay γ.
struct Decays {
    /// D = exp(γ_t − γ_j) on and below the diagonal, 0 above [N,BH,C,C]
    decay: Tensor,
    /// e^γ [N,BH,C,1]
    e_gamma: Tensor,
    /// γ_C [N,BH,1]
    last: Tensor,
    /// e^{γ_C − γ_t} [N,BH,C,1]
    to_end: Tensor,
}

impl Decays {
    /// From the per-step log decays g [N,BH,C].
    fn of(g: &Tensor, c: usize) -> Result<Decays> {
        let gamma = g.cumsum(2)?;
        // Masking the exponent to −∞ above the diagonal keeps exp finite there (γ_t − γ_j > 0
        // can overflow) and its gradient zero.
        let above = mask(c, g.device(), |t, j| j <= t, 0.0, f32::NEG_INFINITY)?;
        let diff = gamma.unsqueeze(3)?.broadcast_sub(&gamma.unsqueeze(2)?)?;
        let last = gamma.narrow(2, c - 1, 1)?;
        Ok(Decays {
            decay: diff.broadcast_add(&above)?.exp()?,
            e_gamma: gamma.exp()?.unsqueeze(3)?,
            to_end: last.broadcast_sub(&gamma)?.exp()?.unsqueeze(3)?,
            last,
        })
    }
}

/// The walk's inputs (W, Kc, Kend, S₀, per-row decay) in float32.
type WalkInputs<'a> = (&'a Tensor, Option<&'a Tensor>, &'a Tensor, &'a Tensor, &'a Tensor);

/// Outputs and final state through [`super::chunk_walk::walk`]: every chunk's output from its
/// start state and its U, in two batched matmuls.
fn walked(
    rec: &Recurrence,
    (w, kc, kend, s0, rows): WalkInputs,
    q_decayed: &Tensor,
    qk: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, t, h, dk) = rec.q.dims4()?;
    let dv = w.dim(3)?;
    let mark = |stage| crate::profile::mark(stage, w.device());
    mark("chunked: walk inputs");
    let (n, bh, c, _) = kend.dims4()?;
    let wkc = super::chunk_walk::pack(w, kc)?;
    let ones = Tensor::ones((n, bh, c), DType::F32, w.device())?;
    let tensor = tensor_cores(rec);
    let x = WalkIn { wkc: &wkc, delta: kc.is_some(), k: kend, e: &ones, s0, a: rows, tensor };
    let (u, states) = super::chunk_walk::walk(&x)?;
    mark("chunked: walk");
    let o = (q_decayed.matmul(&states.narrow(0, 0, n)?)? + qk.matmul(&u)?)?; // [N,BH,C,dv]
    mark("chunked: output products");
    let o = o.reshape((n, b, h, c, dv))?.permute((1, 0, 3, 2, 4))?.reshape((b, n * c, h, dv))?;
    let o = if n * c > t { o.narrow(1, 0, t)? } else { o };
    let o = o.contiguous()?;
    mark("chunked: output layout");
    Ok((o, states.get(n)?.reshape((b, h, dk, dv))?))
}

/// [`forward`] with a decay per key channel `gk` [B,T,H,dk] (and the scalar `g` on top).
fn forward_per_channel(rec: &Recurrence, gk: &Tensor, form: Form) -> Result<(Tensor, Tensor)> {
    let (b, t, h, dk) = rec.q.dims4()?;
    let dv = rec.v.dim(3)?;
    let dev = rec.q.device();
    let c = CHANNEL_CHUNK.min(t.next_power_of_two());
    let n = t.div_ceil(c);
    let f64 = |x: Tensor| x.to_dtype(DType::F64);
    let q = f64((chunks(rec.q, c)? * rec.scale)?)?;
    let k = f64(chunks(rec.k, c)?)?;
    let v = f64(chunks(rec.v, c)?)?;
    let beta = f64(chunks(&rec.beta.unsqueeze(3)?, c)?)?; // [N,BH,C,1]
    let mut gam = f64(chunks(gk, c)?)?.cumsum(2)?; // [N,BH,C,dk]
    if let Some(g) = rec.g {
        gam = gam.broadcast_add(&f64(chunks(&g.unsqueeze(3)?, c)?)?.cumsum(2)?)?;
    }
    let (up, down) = (gam.exp()?, gam.neg()?.exp()?);
    let k_hat = (&k * &up)?;
    let k_til_t = (&k * &down)?.t()?.contiguous()?; // [N,BH,dk,C]
    let q_hat = (&q * &up)?;
    let last = gam.narrow(2, c - 1, 1)?; // [N,BH,1,dk]
    let mask64 = |keep: fn(usize, usize) -> bool| mask(c, dev, keep, 1.0, 0.0)?.to_dtype(DType::F64);
    let v_beta = v.broadcast_mul(&beta)?;
    let (w, kc) = match rec.rule {
        Rule::Plain => (v_beta, None),
        Rule::Delta => {
            let a = k_hat.broadcast_mul(&beta)?.matmul(&k_til_t)?.broadcast_mul(&mask64(|t, j| j < t)?)?.neg()?;
            let inv = super::chunk_intra::unit_lower_inverse(&a, c)?;
            (inv.matmul(&v_beta)?, Some(inv.matmul(&k_hat.broadcast_mul(&beta)?)?))
        }
    };
    let qk = q_hat.matmul(&k_til_t)?.broadcast_mul(&mask64(|t, j| j <= t)?)?;
    if form == Form::Kernels {
        // Everything that crosses chunks in float32: e^−Γ only ever met e^Γ within one.
        let f32 = |x: &Tensor| x.to_dtype(DType::F32);
        let kend = f32(&(&k * last.broadcast_sub(&gam)?.exp()?)?)?; // [N,BH,C,dk]
        let rows = f32(&last.exp()?.squeeze(2)?)?; // [N,BH,dk]
        let s0 = initial_state(rec, DType::F32)?;
        let (w, kc) = (f32(&w)?, kc.as_ref().map(f32).transpose()?);
        return walked(rec, (&w, kc.as_ref(), &kend, &s0, &rows), &f32(&q_hat)?, &f32(&qk)?);
    }
    let k_to_end = (&k * last.broadcast_sub(&gam)?.exp()?)?.t()?.contiguous()?; // [N,BH,dk,C]
    let chunk_decay = last.exp()?.transpose(2, 3)?; // [N,BH,dk,1]: rows of S
    let mut s = initial_state(rec, DType::F64)?;
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let u = match &kc {
            Some(kc) => (w.get(i)? - kc.get(i)?.matmul(&s)?)?,
            None => w.get(i)?,
        };
        outs.push((q_hat.get(i)?.matmul(&s)? + qk.get(i)?.matmul(&u)?)?);
        s = (s.broadcast_mul(&chunk_decay.get(i)?)? + k_to_end.get(i)?.matmul(&u)?)?;
    }
    let o = Tensor::stack(&outs, 0)?.reshape((n, b, h, c, dv))?.permute((1, 0, 3, 2, 4))?.reshape((b, n * c, h, dv))?;
    let o = if n * c > t { o.narrow(1, 0, t)? } else { o };
    Ok((o.contiguous()?.to_dtype(DType::F32)?, s.reshape((b, h, dk, dv))?.to_dtype(DType::F32)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::prep::Heads;
    use candle_core::Var;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// A linked chain's output `got` equals the tracked chain's `want` bit for bit, and so do
    /// their gradients of ⟨o, wo⟩ in `vars`, over two backwards of the linked graph; those named
    /// in `unread` have no gradient in either.
    fn assert_linked_matches(
        got: &Tensor,
        want: &Tensor,
        wo: &Tensor,
        vars: &[(&str, &Var)],
        unread: &[&str],
        case: &str,
    ) -> Result<()> {
        let bits = |t: &Tensor| t.to_dtype(DType::F32).and_then(|t| t.flatten_all()?.to_vec1::<f32>());
        let loss = |o: &Tensor| (o.to_dtype(DType::F32)? * wo)?.sum_all();
        assert_eq!(bits(got)?, bits(want)?, "outputs ({case})");
        let want = loss(want)?.backward()?;
        let got_loss = loss(got)?;
        for pass in 0..2 {
            let got = got_loss.backward()?;
            for (name, v) in vars {
                let (a, e) = (got.get(v.as_tensor()), want.get(v.as_tensor()));
                if unread.contains(name) {
                    assert!(a.is_none() && e.is_none(), "{name}, unread, took a gradient ({case})");
                    continue;
                }
                let (a, e) = (a.expect("a linked gradient"), e.expect("a tracked gradient"));
                assert_eq!(bits(a)?, bits(e)?, "d{name}, backward {pass} ({case})");
            }
        }
        Ok(())
    }

    fn rand(shape: &[usize], rng: &mut StdRng, lo: f32, hi: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| lo + (hi - lo) * rng.random::<f32>()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// A variable of `rand`'s draws in `dtype`.
    fn rand_var(shape: &[usize], rng: &mut StdRng, lo: f32, hi: f32, dtype: DType) -> Result<Var> {
        Var::from_tensor(&rand(shape, rng, lo, hi).to_dtype(dtype)?)
    }

    /// The linked-chain tests' [q | k | v] rows: `h` heads of `dk` for q and k (L2-normed), `h` of
    /// `dv` for v, and the rows' width.
    fn qkv_heads(h: usize, dk: usize, dv: usize) -> (Heads, Heads, Heads, usize) {
        let q = Heads { off: 0, heads: h, d: dk, rep: 1, norm: Some(1e-6) };
        let (k, v) = (Heads { off: h * dk, ..q }, Heads { off: 2 * h * dk, heads: h, d: dv, rep: 1, norm: None });
        (q, k, v, 2 * h * dk + h * dv)
    }

    struct Inputs {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        g: Tensor,
        gk: Tensor,
        s0: Tensor,
    }

    /// Keys L2-normalised and β ∈ (0, 1), as every delta-rule model feeds them; g ≤ 0.
    fn inputs(t: usize, seed: u64) -> Inputs {
        let mut rng = StdRng::seed_from_u64(seed);
        let (b, h, dk, dv) = (2, 3, 6, 5);
        let k = rand(&[b, t, h, dk], &mut rng, -1.0, 1.0);
        let norm = k.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap();
        Inputs {
            q: rand(&[b, t, h, dk], &mut rng, -1.0, 1.0),
            k: k.broadcast_div(&norm).unwrap(),
            v: rand(&[b, t, h, dv], &mut rng, -2.0, 2.0),
            beta: rand(&[b, t, h], &mut rng, 0.05, 0.95),
            g: rand(&[b, t, h], &mut rng, -0.4, 0.0),
            gk: rand(&[b, t, h, dk], &mut rng, -2.0, 0.0),
            s0: rand(&[b, h, dk, dv], &mut rng, -1.0, 1.0),
        }
    }

    fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
        let num = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        let den = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
        num / den.max(1e-30)
    }

    #[test]
    fn matches_sequential_kernel() {
        // T = 1 (decoding), below one chunk, exactly one chunk, and ragged multi-chunk lengths.
        for t in [1, 5, 64, 70, 130] {
            let x = inputs(t, t as u64);
            for rule in [Rule::Delta, Rule::Plain] {
                for (gated, channels) in [(true, false), (false, false), (true, true), (false, true)] {
                    for init in [false, true] {
                        let rec = Recurrence {
                            q: &x.q,
                            k: &x.k,
                            v: &x.v,
                            beta: &x.beta,
                            g: gated.then_some(&x.g),
                            gk: channels.then_some(&x.gk),
                            scale: 0.7,
                            rule,
                            initial: init.then_some(&x.s0),
                        };
                        let (o2, s2) = rec.sequential_with_state().unwrap();
                        for form in [Form::Composed, Form::Kernels] {
                            let (o, s) = forward_in(&rec, form).unwrap();
                            let what =
                                format!("{form:?} T {t} {rule:?} gated {gated} per-channel {channels} initial {init}");
                            assert_eq!(o.dims(), o2.dims(), "{what}");
                            assert!(rel_err(&o, &o2) < 1e-5, "{what}: outputs differ by {}", rel_err(&o, &o2));
                            assert!(rel_err(&s, &s2) < 1e-5, "{what}: states differ by {}", rel_err(&s, &s2));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_match_sequential_backward() {
        let x = inputs(70, 11);
        let w = rand(&[2, 70, 3, 5], &mut StdRng::seed_from_u64(5), -1.0, 1.0);
        for (rule, channels) in [(Rule::Delta, false), (Rule::Plain, false), (Rule::Delta, true), (Rule::Plain, true)] {
            let vars: Vec<Var> =
                [&x.q, &x.k, &x.v, &x.beta, &x.g, &x.gk].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let grads = |chunked: Option<Form>| -> Vec<Tensor> {
                let rec = Recurrence {
                    q: vars[0].as_tensor(),
                    k: vars[1].as_tensor(),
                    v: vars[2].as_tensor(),
                    beta: vars[3].as_tensor(),
                    g: Some(vars[4].as_tensor()),
                    gk: channels.then(|| vars[5].as_tensor()),
                    scale: 0.7,
                    rule,
                    initial: None,
                };
                let o = match chunked {
                    Some(form) => forward_in(&rec, form).unwrap().0,
                    None => rec.forward_sequential().unwrap(),
                };
                let store = (o * &w).unwrap().sum_all().unwrap().backward().unwrap();
                vars.iter().filter_map(|v| store.get(v.as_tensor()).cloned()).collect()
            };
            let b = grads(None);
            let names: &[&str] =
                if channels { &["q", "k", "v", "beta", "g", "gk"] } else { &["q", "k", "v", "beta", "g"] };
            for form in [Form::Composed, Form::Kernels] {
                let a = grads(Some(form));
                for (i, name) in names.iter().enumerate() {
                    let e = rel_err(&a[i], &b[i]);
                    assert!(e < 1e-4, "{form:?} {rule:?} per-channel {channels}: d{name} differs by {e}");
                }
            }
        }
    }

    /// The kernel form's gradients of every input, the initial state included, against central
    /// finite differences of its own forward: for both rules and each decay kind, over a ragged
    /// length that crosses chunks (float32, so the step is large and the bound loose).
    #[test]
    fn kernel_form_gradients_match_finite_differences() {
        let x = inputs(70, 23);
        let (wo, ws) = (
            rand(&[2, 70, 3, 5], &mut StdRng::seed_from_u64(2), -1.0, 1.0),
            rand(&[2, 3, 6, 5], &mut StdRng::seed_from_u64(3), -1.0, 1.0),
        );
        for rule in [Rule::Delta, Rule::Plain] {
            for (gated, channels) in [(false, false), (true, false), (true, true)] {
                let base = [&x.q, &x.k, &x.v, &x.beta, &x.g, &x.gk, &x.s0];
                let loss = |t: &[Tensor]| -> Tensor {
                    let rec = Recurrence {
                        q: &t[0],
                        k: &t[1],
                        v: &t[2],
                        beta: &t[3],
                        g: gated.then_some(&t[4]),
                        gk: channels.then_some(&t[5]),
                        scale: 0.7,
                        rule,
                        initial: Some(&t[6]),
                    };
                    let (o, s) = forward_in(&rec, Form::Kernels).unwrap();
                    ((o * &wo).unwrap().sum_all().unwrap() + (s * &ws).unwrap().sum_all().unwrap()).unwrap()
                };
                let vars: Vec<Var> = base.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
                let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let grads = loss(&tensors).backward().unwrap();
                let names = ["q", "k", "v", "beta", "g", "gk", "s0"];
                let mut rng = StdRng::seed_from_u64(9);
                for (i, name) in names.iter().enumerate() {
                    if (i == 4 && !gated) || (i == 5 && !channels) {
                        continue;
                    }
                    let grad = grads.get(vars[i].as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let flat = base[i].flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for _ in 0..4 {
                        let j = rng.random_range(0..flat.len());
                        let eps = 1e-2f32;
                        let at = |d: f32| {
                            let mut v = flat.clone();
                            v[j] += d;
                            let mut t: Vec<Tensor> = base.iter().map(|t| (*t).clone()).collect();
                            t[i] = Tensor::from_vec(v, base[i].shape(), &Device::Cpu).unwrap();
                            loss(&t).to_scalar::<f32>().unwrap()
                        };
                        let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                        let err = (fd - grad[j]).abs();
                        assert!(
                            err < 2e-2 * (1.0 + fd.abs()),
                            "{rule:?} gated {gated} per-channel {channels}: d{name}[{j}] {} against {fd}",
                            grad[j]
                        );
                    }
                }
            }
        }
    }

    /// The recurrence's inputs linked to it (prep's ops handing the recurrence q | k and v
    /// outside candle's graph) give the output and gradients the tracked inputs give, bit for
    /// bit: the rows of the projections, the conv's weight and bias, β and the decay, over two
    /// backwards, with the short conv inside the ops and without, float32 and bf16, T not a
    /// multiple of the chunk.
    #[test]
    fn linked_inputs_match_tracked_ones() -> Result<()> {
        use crate::ops::prep::{conv_heads_qk_chunks, conv_heads_qk_linked, heads_qk_chunks, heads_qk_linked};
        let mut rng = StdRng::seed_from_u64(31);
        let (b, t, h, dk, dv, taps) = (2, 70, 2, 8, 6, 4);
        let (q, k, v, width) = qkv_heads(h, dk, dv);
        let c = chunk_len(t);
        for dtype in [DType::F32, DType::BF16] {
            for conv in [false, true] {
                let mut var =
                    |shape: &[usize], lo: f32, hi: f32, dtype: DType| rand_var(shape, &mut rng, lo, hi, dtype);
                let x = var(&[b, t, width], -1.0, 1.0, dtype)?;
                let w = var(&[width, taps], -0.5, 0.5, dtype)?;
                let bias = var(&[width], -0.5, 0.5, dtype)?;
                let (beta, g) = (var(&[b, t, h], 0.1, 0.9, DType::F32)?, var(&[b, t, h], -0.3, -0.01, DType::F32)?);
                let wo = rand(&[b, t, h, dv], &mut rng, -1.0, 1.0);
                let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), bias.as_tensor());
                let tracked = || -> Result<Tensor> {
                    let (qk, keys, tv) = match conv {
                        true => conv_heads_qk_chunks(xt, wt, bt, q, k, v, c)?,
                        false => heads_qk_chunks(xt, q, k, v, c)?,
                    };
                    delta_from_chunks(&qk, &keys, &tv, beta.as_tensor(), Some(g.as_tensor()), 0.3)
                };
                let linked = || -> Result<Tensor> {
                    let x = match conv {
                        true => conv_heads_qk_linked(crate::ops::link::Operand::Tracked(xt), wt, bt, q, k, v, c)?,
                        false => heads_qk_linked(xt, q, k, v, c)?,
                    };
                    delta_from_linked(&x, beta.as_tensor(), Some(g.as_tensor()), 0.3)
                };
                let vars = [("x", &x), ("w", &w), ("bias", &bias), ("beta", &beta), ("g", &g)];
                let unread: &[&str] = if conv { &[] } else { &["w", "bias"] };
                let case = format!("{dtype:?}, conv {conv}");
                assert_linked_matches(&linked()?, &tracked()?, &wo, &vars, unread, &case)?;
            }
        }
        Ok(())
    }

    /// The projection before the conv linked to it (`projection::linked_linear`, then
    /// `conv_heads_qk_linked` over the linked output) gives the outputs and gradients (input,
    /// projection weight trained or frozen, conv weight and bias, β, decay) of the tracked chain,
    /// bit for bit, over two backwards.
    #[test]
    fn a_linked_projection_matches_a_tracked_one() -> Result<()> {
        use crate::ops::link::Operand;
        use crate::ops::prep::{conv_heads_qk_chunks, conv_heads_qk_linked};
        use crate::ops::projection::{linked_linear, trained_linear};
        let mut rng = StdRng::seed_from_u64(37);
        let (b, t, h, dk, dv, taps, inp) = (2, 70, 2, 8, 6, 4, 5);
        let (q, k, v, width) = qkv_heads(h, dk, dv);
        let c = chunk_len(t);
        for dtype in [DType::F32, DType::BF16] {
            for trained in [true, false] {
                let mut var =
                    |shape: &[usize], lo: f32, hi: f32, dtype: DType| rand_var(shape, &mut rng, lo, hi, dtype);
                let x = var(&[b, t, inp], -1.0, 1.0, dtype)?;
                let proj = var(&[width, inp], -0.5, 0.5, dtype)?;
                let w = var(&[width, taps], -0.5, 0.5, dtype)?;
                let bias = var(&[width], -0.5, 0.5, dtype)?;
                let (beta, g) = (var(&[b, t, h], 0.1, 0.9, DType::F32)?, var(&[b, t, h], -0.3, -0.01, DType::F32)?);
                let wo = rand(&[b, t, h, dv], &mut rng, -1.0, 1.0);
                let pw = if trained { proj.as_tensor().clone() } else { proj.as_tensor().detach() };
                let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), bias.as_tensor());
                let tracked = || -> Result<Tensor> {
                    let y = trained_linear(xt, &pw)?;
                    let (qk, keys, tv) = conv_heads_qk_chunks(&y, wt, bt, q, k, v, c)?;
                    delta_from_chunks(&qk, &keys, &tv, beta.as_tensor(), Some(g.as_tensor()), 0.3)
                };
                let linked = || -> Result<Tensor> {
                    let y = linked_linear(xt, &pw)?;
                    let x = conv_heads_qk_linked(Operand::Linked(&y), wt, bt, q, k, v, c)?;
                    delta_from_linked(&x, beta.as_tensor(), Some(g.as_tensor()), 0.3)
                };
                let vars = [("x", &x), ("proj", &proj), ("w", &w), ("bias", &bias), ("beta", &beta), ("g", &g)];
                let unread: &[&str] = if trained { &[] } else { &["proj"] };
                let case = format!("{dtype:?}, trained {trained}");
                assert_linked_matches(&linked()?, &tracked()?, &wo, &vars, unread, &case)?;
            }
        }
        Ok(())
    }

    /// o linked from the recurrence to the output norm and projection
    /// (`delta_linked_through`, `RmsNorm::project_heads_linked`), and that output linked in turn
    /// to a frozen MLP step's residual sum (`project_heads_linked_through`,
    /// `mlp::frozen_mlp_step_from`), give the outputs and gradients of the tracked chain
    /// (`norm_projected` on o, `frozen_mlp_step` on its output), bit for bit: ungated and gated
    /// by silu(z), float32 and bf16, over two backwards.
    #[test]
    fn a_linked_output_matches_a_tracked_one() -> Result<()> {
        use crate::ops::link::Operand;
        use crate::ops::mlp::{frozen_mlp_step, frozen_mlp_step_from};
        use crate::ops::norm::{norm_projected, NormWeight, RmsNorm};
        use crate::ops::prep::conv_heads_qk_linked;
        let mut rng = StdRng::seed_from_u64(41);
        let (b, t, h, dk, dv, taps, out, n) = (2, 70, 2, 8, 6, 4, 5, 3);
        let (q, k, v, width) = qkv_heads(h, dk, dv);
        let c = chunk_len(t);
        let cases =
            [DType::F32, DType::BF16].into_iter().flat_map(|d| [false, true].map(|g| [(d, g, false), (d, g, true)]));
        for (dtype, gated, step) in cases.flatten() {
            let mut var = |shape: &[usize], lo: f32, hi: f32, dtype: DType| rand_var(shape, &mut rng, lo, hi, dtype);
            let x = var(&[b, t, width], -1.0, 1.0, dtype)?;
            let w = var(&[width, taps], -0.5, 0.5, dtype)?;
            let bias = var(&[width], -0.5, 0.5, dtype)?;
            let (beta, g) = (var(&[b, t, h], 0.1, 0.9, DType::F32)?, var(&[b, t, h], -0.3, -0.01, DType::F32)?);
            let nw = var(&[dv], 0.5, 1.5, DType::F32)?;
            let z = var(&[b, t, h * dv], -1.0, 1.0, dtype)?;
            let res = var(&[b, t, out], -1.0, 1.0, dtype)?;
            let mw = var(&[out], 0.5, 1.5, DType::F32)?;
            let proj = rand(&[out, h * dv], &mut rng, -0.5, 0.5).to_dtype(dtype)?;
            let gate_up = rand(&[2 * n, out], &mut rng, -0.5, 0.5).to_dtype(dtype)?;
            let down = rand(&[out, n], &mut rng, -0.5, 0.5).to_dtype(dtype)?;
            let wo = rand(&[b, t, out], &mut rng, -1.0, 1.0);
            let norm = RmsNorm::new(nw.as_tensor().clone(), 1e-6, NormWeight::Plain)?;
            let gate = gated.then_some(z.as_tensor());
            let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), bias.as_tensor());
            let inputs = || conv_heads_qk_linked(Operand::Tracked(xt), wt, bt, q, k, v, c);
            let (rt, mt) = (res.as_tensor(), mw.as_tensor());
            let tracked = || -> Result<Tensor> {
                let o = delta_from_linked(&inputs()?, beta.as_tensor(), Some(g.as_tensor()), 0.3)?;
                let y = norm_projected(Operand::Tracked(&o), gate, nw.as_tensor(), 1e-6, &proj)?;
                match step {
                    true => frozen_mlp_step(rt, Some(&y), mt, 1e-6, &gate_up, &down),
                    false => Ok(y),
                }
            };
            let linked = || -> Result<Tensor> {
                assert!(norm.projects_linked_heads(&[b, t, h, dv], &proj));
                let o = delta_linked_through(&inputs()?, beta.as_tensor(), Some(g.as_tensor()), 0.3)?;
                match step {
                    true => {
                        let y = norm.project_heads_linked_through(&o, gate, &proj)?;
                        frozen_mlp_step_from(rt, Some(Operand::Linked(&y)), mt, 1e-6, &gate_up, &down)
                    }
                    false => norm.project_heads_linked(&o, gate, &proj),
                }
            };
            let vars = [("x", &x), ("w", &w), ("bias", &bias), ("beta", &beta), ("g", &g), ("norm", &nw)];
            let vars: Vec<_> = vars.into_iter().chain([("z", &z), ("residual", &res), ("MLP norm", &mw)]).collect();
            let mut unread = vec![];
            if !gated {
                unread.push("z");
            }
            if !step {
                unread.extend(["residual", "MLP norm"]);
            }
            let case = format!("{dtype:?}, gated {gated}, MLP step {step}");
            assert_linked_matches(&linked()?, &tracked()?, &wo, &vars, &unread, &case)?;
        }
        Ok(())
    }
}
