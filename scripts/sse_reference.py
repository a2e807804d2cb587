#!/usr/bin/env python3
"""Reference SSE causal LM (Sparse State Expansion, arXiv 2507.16577) in plain PyTorch, with the
GLA (`linear_attn_type: "gla"`) or the Gated DeltaNet (`"gdn"`) transition in every partition.

The layer follows flash-linear-attention's `fla/layers/sse.py` (`SSEGLA`, `SSEGDN`) and the model
`fla/models/sse/` (config `model_type: "sse"`), with the same module names so that the
checkpoint's tensor names are fla's:

  model.embeddings.weight
  model.layers.{i}.attn_norm.weight, model.layers.{i}.mlp_norm.weight
  model.layers.{i}.attn.q_proj.weight, k_proj.weight, v_proj.weight         [key_dim|value_dim, D]
  model.layers.{i}.attn.lora_q_proj.{0,1}.weight, lora_k_proj.{0,1}.weight  D -> head_v_dim -> key_dim
  model.layers.{i}.attn.gk_proj.{0,1}.0.weight, gk_proj.{0,1}.1.{weight,bias}  D -> 16 -> key_dim
      (gk_proj.0 is the shared partition's decay, gk_proj.1 the sparse partitions'; GLA)
  model.layers.{i}.attn.a_proj.weight, b_proj.weight [2H, D], A_log, dt_bias [2H]
      (GDN; the first H outputs are the shared partition's, the last H the sparse ones')
  model.layers.{i}.attn.e_proj.weight                                        [N, D] router
  model.layers.{i}.attn.q_conv1d_shared.weight, k_conv1d_shared.weight      [key_dim, 1, K] (use_short_conv)
  model.layers.{i}.attn.g_proj.{0,1}.weight                                  D -> head_v_dim -> value_dim
  model.layers.{i}.attn.o_norm.weight, o_proj.weight
  model.layers.{i}.mlp.{gate,up,down}_proj.weight
  model.norm.weight, lm_head.weight (absent when tie_word_embeddings)

Per head, with q, k of width dk and the scale dk^-1/2:
  shared path:  q1 = silu(conv(x W_q)), k1 = softmax(conv(x W_k)), g1 = logsigmoid(gk_proj.0(x)) / 16
  sparse path:  q2 = silu(x W_q + lora_q(x)), k2 = softmax(x W_k + lora_k(x)), g2 = ... gk_proj.1
  v = silu(x W_v);  e = softmax(x W_e) over N partitions; T = top-k(e) (k = num_writer = num_reader)
  shared:  S0 <- diag(exp g1) S0 + k1 v^T                      (every token)
  p in T:  Sp <- diag(exp g2) Sp + e_p k2 v^T                   (unselected partitions: unchanged,
                                                                 no decay either)
  o = S0^T (scale q1) + sum_{p in T} e_p Sp^T (scale q2)
  out = o_proj(rmsnorm(o) * w * silu(g_proj(x)))

The GDN variant keeps everything but the transition and the key/query feature maps:
  q = l2norm(silu(.)), k = l2norm(silu(.)) (fla's Gated DeltaNet: SiLU, then the kernel's L2 norm),
  normalised before the routing weight scales them (otherwise the norm would undo emulq/emulk);
  g = -exp(A_log) * softplus(a_proj(x) + dt_bias) per head, beta = sigmoid(b_proj(x)) (x2 with
  allow_neg_eigval), each split into the shared half and the sparse half;
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T   (gated delta rule, per partition; e_p k for
  the routed ones, which leaves unselected partitions unchanged as k = 0 there).

SSE-H hybrids put fla's softmax `Attention` (q/k/v/o_proj, rotary, GQA) in the layers that the
config's `attn` dict lists (`{"layers": [...], "num_heads", "num_kv_heads", "qkv_bias",
"window_size", "rope_theta"}`), as every fla model does.

Three computations of the same layer, which must agree:
  mask:   (N+1)·H heads, sparse heads partition-major, q·e·read-mask, k·e·write-mask, v and g
          times the write mask, one GLA pass, outputs summed over the N+1 partitions;
  varlen: per (sequence, partition) the routed tokens are gathered in order, the recurrence runs
          on that subsequence, outputs are scattered back and added to the shared path;
  loop:   one token at a time with all N+1 states.

Reading of fla's code (flash-linear-attention PR #882 files `fla/layers/sse.py`,
`fla/models/sse/`, `fla/ops/sse/`, as carried by BICLab/SpikingBrain2.0's
`flash-linear-attention_dev`):
  - `gk_proj` is a ModuleList of two low-rank decays: index 0 for the shared partition, 1 for the
    routed ones; both are per key channel (GLA `chunk_gla(g=gk)`), `logsigmoid(.) / 16`.
  - the LoRA corrections have rank head_v_dim and feed only the routed partitions; the short convs
    (`q_conv1d_shared`, `k_conv1d_shared`, no activation) only the shared one.
  - `use_k_softmax=True`, `use_q_softmax=False` (SiLU queries), `emulq=emulk=True`, v = silu(v);
    these, `gate_logit_normalizer=16` and `gate_low_rank_dim=16` are layer defaults, not config
    fields.
  - routing weights are the top-k softmax probabilities, not renormalised; the mask form masks
    v and g with the write mask (no decay for unselected partitions) and lays the sparse heads
    out partition-major; the varlen form needs num_writer == num_reader.
  - GLA's default scale dk^-1/2 applies to every partition.

Usage:
  sse_reference.py train --out DIR [--minutes 4] [--device cpu|cuda]   train, write goldens and reference.json
  sse_reference.py init --out DIR --linear-attn-type gdn               random tiny model + goldens (test fixture)
  sse_reference.py init --out DIR --layers 3 --attn-layers 1            an SSE-H hybrid
  sse_reference.py golden --out DIR                                     rewrite goldens (and reference.json)
  sse_reference.py --eval DIR [--eval-file F] [--eval-windows 8] [--eval-seqlen 512]
"""

import argparse
import glob
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def shared_dir():
    """The reference data: $STATECUT_SHARED, else shared/ beside or inside the checkout. Only the
    trained fixture and its text goldens need it; `init` and the random fixtures' goldens do not."""
    if os.environ.get("STATECUT_SHARED"):
        return os.environ["STATECUT_SHARED"]
    for d in (os.path.join(HERE, "..", "..", "shared"), os.path.join(HERE, "..", "shared"), "/work/shared"):
        if os.path.isdir(os.path.join(d, "data")):
            return os.path.normpath(d)
    raise SystemExit("reference data not found: set STATECUT_SHARED to the shared/ folder")


GATE_LOGIT_NORMALIZER = 16
GATE_LOW_RANK_DIM = 16

CONFIG = {
    "model_type": "sse",
    "architectures": ["SSEForCausalLM"],
    "attn_mode": "chunk",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_heads": 2,
    "num_v_heads": None,
    "head_dim": 64,
    "expand_v": 1.0,
    "use_output_gate": True,
    "use_short_conv": False,
    "conv_size": 4,
    "allow_neg_eigval": False,
    "num_sparse_partition": 4,
    "num_writer": 2,
    "num_reader": 2,
    "linear_attn_type": "gla",
    "sse_implementation": "mask",
    "aux_loss_coef": 0.01,
    "max_position_embeddings": 2048,
    "hidden_ratio": 4,
    "intermediate_size": 256,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "attn": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "tie_word_embeddings": True,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "fuse_cross_entropy": True,
    "vocab_size": 4096,
}


# The random GDN test fixture: small enough to commit (a byte-sized vocabulary, no tokenizer).
TINY = {
    "hidden_size": 64,
    "num_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "use_short_conv": True,
    "vocab_size": 256,
    "sse_implementation": "varlen",
}


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class ShortConv(nn.Module):
    """Depthwise causal conv, no activation (fla ShortConvolution with activation=None)."""

    def __init__(self, channels, kernel):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) / math.sqrt(kernel))
        self.kernel = kernel

    def forward(self, x):  # [B, T, C]
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=self.kernel - 1, groups=x.shape[-1])
        return y[..., : x.shape[1]].transpose(1, 2)


def gla_chunk(q, k, v, g, scale, chunk=8):
    """GLA over [B, T, H, *]: S <- diag(exp g_t) S + k_t v_t^T, o_t = S^T (scale q_t).

    Chunked: exact intra-chunk products with pairwise per-channel decays, states between chunks.
    Returns o [B, T, H, V] and the final state [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V)
    outs = []
    for s0 in range(0, T, chunk):
        qc, kc, vc, gc = (x[:, s0 : s0 + chunk].transpose(1, 2) for x in (q, k, v, g))
        c = qc.shape[2]
        b = gc.cumsum(2)  # [B, H, c, K]
        o = (qc * scale * b.exp()) @ S
        diff = b[:, :, :, None, :] - b[:, :, None, :, :]  # [B, H, c(t), c(s), K]
        causal = torch.tril(torch.ones(c, c, dtype=torch.bool, device=q.device))
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
        A = (qc[:, :, :, None, :] * scale * kc[:, :, None, :, :] * decay).sum(-1)
        o = o + A @ vc
        last = b[:, :, -1:, :]
        S = last.squeeze(2).exp()[..., None] * S + (kc * (last - b).exp()).transpose(-1, -2) @ vc
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, 1), S


def l2norm(x, eps=1e-6):
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gdn_recurrent(q, k, v, g, beta, scale):
    """Gated delta rule over [B, T, H, *], one token at a time: S <- exp(g_t) S,
    S <- S + k_t (beta_t (v_t - S^T k_t))^T, o_t = S^T (scale q_t); g [B, T, H, 1].
    Returns o [B, T, H, V] and the final state [B, H, K, V]."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kt = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - (kt[..., None] * S).sum(-2))
        S = S + kt[..., None] * u[..., None, :]
        outs.append((q[:, t, :, :, None] * scale * S).sum(-2))
    return torch.stack(outs, 1), S


def recurrence(q, k, v, g, beta, scale):
    """GLA (beta None, g [B, T, H, K]) or the gated delta rule (beta [B, T, H], g [B, T, H, 1])."""
    if beta is None:
        return gla_chunk(q, k, v, g, scale)
    return gdn_recurrent(q, k, v, g, beta, scale)


class SSE(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        D = cfg["hidden_size"]
        self.H = cfg["num_heads"]
        if cfg.get("num_v_heads") not in (None, self.H):
            raise ValueError("num_v_heads != num_heads is not supported here")
        self.dk = cfg["head_dim"]
        self.dv = int(self.dk * cfg["expand_v"])
        self.N = cfg["num_sparse_partition"]
        self.topk = cfg["num_writer"]
        if cfg["num_reader"] != cfg["num_writer"]:
            raise ValueError("num_reader must equal num_writer")
        self.eps = cfg["norm_eps"]
        self.impl = cfg["sse_implementation"]
        kd, vd = self.H * self.dk, self.H * self.dv
        self.q_proj = nn.Linear(D, kd, bias=False)
        self.k_proj = nn.Linear(D, kd, bias=False)
        self.v_proj = nn.Linear(D, vd, bias=False)
        self.lora_q_proj = nn.Sequential(nn.Linear(D, self.dv, bias=False), nn.Linear(self.dv, kd, bias=False))
        self.lora_k_proj = nn.Sequential(nn.Linear(D, self.dv, bias=False), nn.Linear(self.dv, kd, bias=False))
        self.gdn = cfg.get("linear_attn_type", "gla") == "gdn"
        if self.gdn:
            self.a_proj = nn.Linear(D, 2 * self.H, bias=False)
            self.b_proj = nn.Linear(D, 2 * self.H, bias=False)
            # fla GatedDeltaNet init: A ~ U(0, 16), dt ~ logU(1e-3, 0.1), dt_bias = softplus^-1(dt)
            self.A_log = nn.Parameter(torch.empty(2 * self.H).uniform_(1, 16).log())
            dt = torch.exp(torch.rand(2 * self.H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
            self.beta_scale = 2.0 if cfg.get("allow_neg_eigval") else 1.0
        else:
            self.gk_proj = nn.ModuleList(
                [
                    nn.Sequential(
                        nn.Linear(D, GATE_LOW_RANK_DIM, bias=False), nn.Linear(GATE_LOW_RANK_DIM, kd, bias=True)
                    )
                    for _ in range(2)
                ]
            )
        self.e_proj = nn.Linear(D, self.N, bias=False)
        self.use_short_conv = cfg["use_short_conv"]
        if self.use_short_conv:
            self.q_conv1d_shared = ShortConv(kd, cfg["conv_size"])
            self.k_conv1d_shared = ShortConv(kd, cfg["conv_size"])
        self.use_output_gate = cfg["use_output_gate"]
        if self.use_output_gate:
            self.g_proj = nn.Sequential(nn.Linear(D, self.dv, bias=False), nn.Linear(self.dv, vd, bias=False))
        self.o_norm = RMSNorm(self.dv, self.eps)
        self.o_proj = nn.Linear(vd, D, bias=False)

    def features(self, x):
        B, T, _ = x.shape
        q1, k1 = self.q_proj(x), self.k_proj(x)
        q2, k2 = q1 + self.lora_q_proj(x), k1 + self.lora_k_proj(x)
        v = self.v_proj(x)
        eta = self.e_proj(x)
        if self.use_short_conv:
            q1, k1 = self.q_conv1d_shared(q1), self.k_conv1d_shared(k1)
        heads = lambda t, d: t.reshape(B, T, self.H, d)  # noqa: E731
        q1, q2, k1, k2 = (heads(t, self.dk) for t in (q1, q2, k1, k2))
        v = F.silu(heads(v, self.dv))
        q1, q2 = F.silu(q1), F.silu(q2)
        if self.gdn:
            q1, q2, k1, k2 = l2norm(q1), l2norm(q2), l2norm(F.silu(k1)), l2norm(F.silu(k2))
            g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
            beta = torch.sigmoid(self.b_proj(x)) * self.beta_scale
            H = self.H
            gk1, gk2 = g[..., :H, None].to(v), g[..., H:, None].to(v)
            beta = (beta[..., :H], beta[..., H:])
        else:
            k1, k2 = F.softmax(k1.float(), -1).to(v), F.softmax(k2.float(), -1).to(v)
            gk1 = F.logsigmoid(heads(self.gk_proj[0](x), self.dk)) / GATE_LOGIT_NORMALIZER
            gk2 = F.logsigmoid(heads(self.gk_proj[1](x), self.dk)) / GATE_LOGIT_NORMALIZER
            beta = (None, None)
        e = F.softmax(eta.float(), -1)
        top_v, top_i = torch.topk(e, self.topk, dim=-1)
        sel = torch.zeros_like(e, dtype=torch.bool).scatter_(-1, top_i, True)
        w = torch.zeros_like(e).scatter_(-1, top_i, top_v).to(v)  # routing weight, 0 when unselected
        return q1, q2, k1, k2, v, gk1, gk2, e, sel, w, beta

    def mix_mask(self, f):
        q1, q2, k1, k2, v, gk1, gk2, e, sel, w, (b1, b2) = f
        B, T, H, K = q1.shape
        n = self.N + 1
        wm, sm = w[..., None, None], sel[..., None, None].to(v)
        q = torch.cat([q1[:, :, None], q2[:, :, None] * wm], 2).reshape(B, T, n * H, K)
        k = torch.cat([k1[:, :, None], k2[:, :, None] * wm], 2).reshape(B, T, n * H, K)
        vv = torch.cat([v[:, :, None], v[:, :, None] * sm], 2).reshape(B, T, n * H, -1)
        g = torch.cat([gk1[:, :, None], gk2[:, :, None] * sm], 2).reshape(B, T, n * H, -1)
        beta = None
        if b1 is not None:
            beta = torch.cat([b1[:, :, None], b2[:, :, None].expand(B, T, self.N, H)], 2).reshape(B, T, n * H)
        o, S = recurrence(q, k, vv, g, beta, K**-0.5)
        return o.reshape(B, T, n, H, -1).sum(2), S

    def mix_varlen(self, f):
        q1, q2, k1, k2, v, gk1, gk2, e, sel, w, (b1, b2) = f
        B, T, H, K = q1.shape
        o, _ = recurrence(q1, k1, v, gk1, b1, K**-0.5)
        o2 = torch.zeros_like(o)
        for b in range(B):
            for p in range(self.N):
                idx = sel[b, :, p].nonzero()[:, 0]
                if idx.numel() == 0:
                    continue
                wp = w[b, idx, p][None, :, None, None]
                bp = None if b2 is None else b2[b, idx][None]
                sub = recurrence(q2[b, idx][None] * wp, k2[b, idx][None] * wp, v[b, idx][None], gk2[b, idx][None], bp, K**-0.5)
                o2[b].index_add_(0, idx, sub[0][0])
        return o + o2

    def mix_loop(self, f):
        q1, q2, k1, k2, v, gk1, gk2, e, sel, w, (b1, b2) = f
        B, T, H, K = q1.shape
        scale = K**-0.5

        def step(S, k, v, g, beta):  # S [B, H, K, V]; GLA: S <- exp(g) S + k v^T; GDN: delta rule
            S = g.exp()[..., None] * S
            u = v if beta is None else beta[..., None] * (v - (k[..., None] * S).sum(-2))
            return S + k[..., None] * u[..., None, :]

        S = q1.new_zeros(B, self.N + 1, H, K, v.shape[-1])
        outs = []
        for t in range(T):
            S0 = step(S[:, 0], k1[:, t], v[:, t], gk1[:, t], None if b1 is None else b1[:, t])
            o = (q1[:, t, :, :, None] * scale * S0).sum(-2)
            parts = [S0]
            for p in range(self.N):
                wp = w[:, t, p][:, None, None]
                upd = step(S[:, p + 1], wp * k2[:, t], v[:, t], gk2[:, t], None if b2 is None else b2[:, t])
                Sp = torch.where(sel[:, t, p][:, None, None, None], upd, S[:, p + 1])
                o = o + (wp[..., None] * q2[:, t, :, :, None] * scale * Sp).sum(-2)
                parts.append(Sp)
            S = torch.stack(parts, 1)
            outs.append(o)
        return torch.stack(outs, 1)

    def forward(self, x, impl=None):
        f = self.features(x)
        impl = impl or self.impl
        o = {"mask": lambda: self.mix_mask(f)[0], "varlen": lambda: self.mix_varlen(f), "loop": lambda: self.mix_loop(f)}[impl]()
        B, T, _ = x.shape
        o = self.o_norm(o)
        if self.use_output_gate:
            o = o * F.silu(self.g_proj(x).reshape(B, T, self.H, self.dv))
        out = self.o_proj(o.reshape(B, T, -1))
        # load-balance loss (writer-only): sum p·f · N / k
        aux = (f[7].mean((0, 1)) * f[8].float().mean((0, 1))).sum() * self.N / self.topk
        return out, aux


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


class Attention(nn.Module):
    """fla `fla/layers/attn.py` Attention (the softmax layers of SSE-H, placed by the config's
    `attn` dict): head_dim = hidden / num_heads, GQA, optional per-head q/k RMSNorm, rotary
    embedding of the whole head (rotate-half, float32 tables), causal softmax, optional sliding
    window (flash-attn window_size=(w-1, 0))."""

    def __init__(self, cfg):
        super().__init__()
        a = cfg["attn"]
        D = cfg["hidden_size"]
        self.H = a["num_heads"]
        self.KV = a.get("num_kv_heads") or self.H
        self.hd = D // self.H
        bias = a.get("qkv_bias", False)
        self.q_proj = nn.Linear(D, self.H * self.hd, bias=bias)
        self.k_proj = nn.Linear(D, self.KV * self.hd, bias=bias)
        self.v_proj = nn.Linear(D, self.KV * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.H * self.hd, D, bias=False)
        self.qk_norm = a.get("qk_norm", False)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg["norm_eps"])
            self.k_norm = RMSNorm(self.hd, cfg["norm_eps"])
        self.theta = a.get("rope_theta", 10000.0)
        self.window = a.get("window_size")

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.H, self.hd)
        k = self.k_proj(x).reshape(B, T, self.KV, self.hd)
        v = self.v_proj(x).reshape(B, T, self.KV, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32, device=x.device) / self.hd))
        freqs = torch.outer(torch.arange(T, dtype=torch.float32, device=x.device), inv)
        emb = torch.cat([freqs, freqs], -1)[None, :, None]
        cos, sin = emb.cos(), emb.sin()
        q = (q.float() * cos + rotate_half(q).float() * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k).float() * sin).to(x.dtype)
        r = self.H // self.KV
        k, v = k.repeat_interleave(r, 2), v.repeat_interleave(r, 2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        i = torch.arange(T, device=x.device)
        allowed = i[None, :] <= i[:, None]
        if self.window is not None:
            allowed &= (i[:, None] - i[None, :]) < self.window
        s = (q @ k.transpose(-1, -2)).float() * self.hd**-0.5
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1).to(v.dtype)
        o = (p @ v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, D, inter):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        D = cfg["hidden_size"]
        inter = cfg.get("intermediate_size")
        if inter is None:
            inter = int(D * cfg["hidden_ratio"] * 2 / 3)
            inter = 256 * ((inter + 255) // 256)
        self.attn_norm = RMSNorm(D, cfg["norm_eps"])
        attn = cfg.get("attn")
        self.softmax = attn is not None and i in attn["layers"]
        self.attn = Attention(cfg) if self.softmax else SSE(cfg, i)
        self.mlp_norm = RMSNorm(D, cfg["norm_eps"])
        self.mlp = MLP(D, inter)

    def forward(self, h, impl=None):
        if self.softmax:
            a, aux = self.attn(self.attn_norm(h)), 0.0
        else:
            a, aux = self.attn(self.attn_norm(h), impl)
        h = h + a
        return h + self.mlp(self.mlp_norm(h)), aux


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])


class SSEForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.get("linear_attn_type", "gla") not in ("gla", "gdn"):
            raise ValueError("linear_attn_type must be 'gla' or 'gdn'")
        self.cfg = cfg
        self.model = Inner(cfg)
        self.tied = cfg["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids, impl=None):
        h = self.model.embeddings(ids)
        hidden = [h]
        aux = 0.0
        for i, blk in enumerate(self.model.layers):
            h, a = blk(h, impl)
            aux = aux + a
            if i + 1 < len(self.model.layers):
                hidden.append(h)
        h = self.model.norm(h)
        hidden.append(h)
        w = self.model.embeddings.weight if self.tied else self.lm_head.weight
        return h @ w.t(), hidden, aux

    def state_dict_fla(self):
        sd = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        return sd


def load_checkpoint(d, device="cpu"):
    cfg = json.load(open(os.path.join(d, "config.json")))
    m = SSEForCausalLM(cfg)
    sd = load_file(os.path.join(d, "model.safetensors"))
    sd = {k: v.float() for k, v in sd.items()}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise SystemExit(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return m.to(device).eval(), cfg


def tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def documents(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)["text"]


def stream(tok, eos, paths, limit):
    out = []
    for p in paths:
        for d in documents(p):
            out += tok.encode(d, add_special_tokens=False).ids
            out.append(eos)
            if len(out) >= limit:
                return out
    return out


def eval_ppl(model, ids, seqlen, windows, device):
    n = min((len(ids) - 1) // seqlen, windows)
    nll = 0.0
    with torch.no_grad():
        for i in range(n):
            w = torch.tensor(ids[i * seqlen : i * seqlen + seqlen + 1], device=device)[None]
            logits = model(w[:, :-1])[0].float()
            nll += F.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
    return math.exp(nll / (n * seqlen)), n


def cmd_eval(args):
    model, cfg = load_checkpoint(args.eval, args.device)
    tok = tokenizer(os.path.join(args.eval, "tokenizer.json"))
    eval_file = args.eval_file or os.path.join(shared_dir(), "data/eval/wiki.jsonl")
    ids = stream(tok, cfg["eos_token_id"], [eval_file], args.eval_windows * args.eval_seqlen + 1)
    ppl, n = eval_ppl(model, ids, args.eval_seqlen, args.eval_windows, args.device)
    hd = cfg["head_dim"]
    print(f"{args.eval}: head_dim {hd}, {n} windows x {args.eval_seqlen} tokens, perplexity {ppl:.4f}")


# The perplexity protocol of reference.json: the script's float32 forward on the first windows of
# data/eval/wiki.jsonl (documents joined with </s>), which `statecut eval` must reproduce.
REFERENCE_WINDOWS, REFERENCE_SEQLEN = 8, 512
REFERENCE_KEY = f"eval_wiki_ppl_f32_{REFERENCE_SEQLEN}x{REFERENCE_WINDOWS}"


def save_model(model, cfg, out, tok_path=None):
    """bf16 weights with fla's names, config.json and (for text models) tokenizer.json."""
    sd = {k: v.to(torch.bfloat16) for k, v in model.cpu().state_dict_fla().items()}
    os.makedirs(out, exist_ok=True)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    if tok_path:
        shutil.copy(tok_path, os.path.join(out, "tokenizer.json"))


def cmd_train(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = args.device
    cfg = dict(CONFIG)
    tok_path = os.path.join(shared_dir(), "models/delta_net/tokenizer.json")
    tok = tokenizer(tok_path)
    cfg["vocab_size"] = tok.get_vocab_size()
    eos = tok.token_to_id("</s>")
    cfg["eos_token_id"] = eos
    cfg["use_short_conv"] = args.short_conv
    cfg["linear_attn_type"] = args.linear_attn_type
    cfg["aux_loss_coef"] = args.aux_coef
    calib = sorted(glob.glob(os.path.join(shared_dir(), "data/calib/*.jsonl")))
    ids = stream(tok, eos, calib, 10**9)
    print(f"training tokens: {len(ids)} on {dev}")
    data = torch.tensor(ids)
    model = SSEForCausalLM(cfg).to(dev)
    for n, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    L, bs = args.seqlen, args.batch
    t0, step = time.time(), 0
    budget = args.minutes * 60
    loss = torch.tensor(float("nan"))
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for gr in opt.param_groups:
            gr["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, len(data) - L - 1, (bs,))
        batch = torch.stack([data[s : s + L + 1] for s in starts]).to(dev)
        logits, _, aux = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        (loss + cfg["aux_loss_coef"] * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            print(f"step {step} {time.time() - t0:.0f}s loss {loss.item():.3f} aux {aux.item():.3f}", flush=True)
        step += 1
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": step,
        "train_tokens": step * bs * L,
        "train_seconds": round(time.time() - t0, 1),
        "final_train_loss": loss.item(),
        "train_device": torch.cuda.get_device_name(0) if str(dev).startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "seed": args.seed,
    }
    # Store bf16 weights, and compute the golden outputs from those (rounded) weights in float32.
    save_model(model, cfg, args.out, tok_path)
    write_golden(args.out, text_ids(args.out))
    write_reference(args.out, facts)


def cmd_init(args):
    """A randomly initialised tiny model (no tokenizer) and its goldens: a parity fixture.

    Weights are scaled so that every mixer moves the residual stream as much as the embedding
    does (a 0.02 init would leave the logits to the embeddings alone), and the router is sharp,
    so that top-k routing is far from ties."""
    torch.manual_seed(args.seed)
    cfg = dict(CONFIG, **TINY, linear_attn_type=args.linear_attn_type)
    cfg["num_hidden_layers"] = args.layers
    if args.attn_layers:
        # SSE-H: fla's attn dict; GQA with 4 query and 2 key/value heads
        cfg["attn"] = {
            "layers": [int(i) for i in args.attn_layers.split(",")],
            "num_heads": 4,
            "num_kv_heads": 2,
            "qkv_bias": False,
            "window_size": None,
            "rope_theta": 10000.0,
        }
    model = SSEForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("embeddings.weight"):
                nn.init.normal_(p, std=1.0)
            elif n.endswith("e_proj.weight"):
                nn.init.normal_(p, std=3.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
            elif n.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    save_model(model, cfg, args.out)
    write_golden(args.out, torch.randint(0, cfg["vocab_size"], (1, 64)))


def text_ids(out):
    """The first 128 tokens of data/eval/wiki.jsonl (the reference models' golden input)."""
    tok = tokenizer(os.path.join(out, "tokenizer.json"))
    ids = stream(tok, tok.token_to_id("</s>"), [os.path.join(shared_dir(), "data/eval/wiki.jsonl")], 128)[:128]
    return torch.tensor(ids)[None]


def router_margin(model, hidden):
    """Smallest gap between the k-th and the (k+1)-th routing probability over tokens and layers."""
    gaps = []
    with torch.no_grad():
        for blk, h in zip(model.model.layers, hidden):
            if blk.softmax:
                continue
            e = blk.attn.features(blk.attn_norm(h))[7]
            top = torch.topk(e, blk.attn.topk + 1, dim=-1).values
            gaps.append((top[..., -2] - top[..., -1]).min().item())
    return min(gaps)


def write_golden(out, x):
    model, cfg = load_checkpoint(out)
    with torch.no_grad():
        logits, hidden, _ = model(x, "mask")
        lv, hv, _ = model(x, "varlen")
        ll, hl, _ = model(x, "loop")
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"mask vs varlen: logits rel {rel(lv, logits):.2e}; mask vs loop: logits rel {rel(ll, logits):.2e}")
    margin = router_margin(model, hidden)
    print(f"smallest router margin {margin:.2e}")
    if margin < 1e-5:
        print("warning: near-tie in top-k routing; float differences may route a token differently")
    for a, b in zip(hidden, hv):
        assert rel(b, a) < 1e-5
    for a, b in zip(hidden, hl):
        assert rel(b, a) < 1e-5
    assert rel(lv, logits) < 1e-5 and rel(ll, logits) < 1e-5
    save_file(
        {
            "input_ids": x.to(torch.int64).contiguous(),
            "logits": logits.float().contiguous(),
            "hidden_states": torch.stack(hidden).float().contiguous(),
            "last_hidden_varlen": hv[-1].float().contiguous(),
            "last_hidden_loop": hl[-1].float().contiguous(),
        },
        os.path.join(out, "golden.safetensors"),
    )
    print(f"wrote {out}/golden.safetensors")


def write_reference(out, facts=None):
    """reference.json: training facts and the perplexity of REFERENCE_KEY (kept facts of an
    earlier file when only the perplexity is recomputed)."""
    path = os.path.join(out, "reference.json")
    ref = json.load(open(path)) if os.path.exists(path) else {}
    ref.update(facts or {})
    model, cfg = load_checkpoint(out)
    tok = tokenizer(os.path.join(out, "tokenizer.json"))
    want = REFERENCE_WINDOWS * REFERENCE_SEQLEN + 1
    ids = stream(tok, cfg["eos_token_id"], [os.path.join(shared_dir(), "data/eval/wiki.jsonl")], want)
    ppl, n = eval_ppl(model, ids, REFERENCE_SEQLEN, REFERENCE_WINDOWS, "cpu")
    assert n == REFERENCE_WINDOWS
    ref[REFERENCE_KEY] = ppl
    with open(path, "w") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")
    print(f"{REFERENCE_KEY} = {ppl:.4f}; wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "cmd",
        nargs="?",
        choices=["train", "init", "golden"],
        help="train a tiny model, make a random one, or rewrite golden outputs",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "sse_gla"), help="model directory")
    ap.add_argument("--minutes", type=float, default=4.0, help="training time budget")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (training; goldens are always CPU float32)")
    ap.add_argument("--linear-attn-type", choices=["gla", "gdn"], default="gla", help="transition in every partition")
    ap.add_argument("--layers", type=int, default=2, help="init: number of layers")
    ap.add_argument("--attn-layers", help="init: comma-separated softmax attention layers (an SSE-H hybrid)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--short-conv", action="store_true", help="train with use_short_conv")
    ap.add_argument("--aux-coef", type=float, default=0.1, help="load-balance loss weight (config aux_loss_coef)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval", metavar="DIR", help="load a checkpoint and print perplexity")
    ap.add_argument("--eval-file", help="evaluation text (default: the reference data's data/eval/wiki.jsonl)")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.eval:
        cmd_eval(args)
    elif args.cmd == "train":
        cmd_train(args)
    elif args.cmd == "init":
        cmd_init(args)
    elif args.cmd == "golden":
        if os.path.exists(os.path.join(args.out, "tokenizer.json")):
            write_golden(args.out, text_ids(args.out))
            write_reference(args.out)
        else:
            write_golden(args.out, load_file(os.path.join(args.out, "golden.safetensors"))["input_ids"])
    else:
        ap.error("give `train`, `init`, `golden` or --eval DIR")


if __name__ == "__main__":
    main()
