"""The PyTorch pieces the reference scripts share, each written once:

  - flash-linear-attention's layers in plain PyTorch, with fla's module names (so that a
    checkpoint's tensor names are fla's) and fla's math: Gated DeltaNet, DeltaNet, SSE (GLA or
    Gated DeltaNet transitions, with the softmax attention of SSE-H hybrids), and the causal LM
    around them (fla's `model.embeddings`, `model.layers.{i}`, `model.norm`, `lm_head`);
  - the text protocol of `statecut eval`: documents joined with the end-of-text token, windows of
    L + 1 tokens, perplexity over them;
  - the time- or step-budgeted training loop, and saving and loading checkpoints in fla's layout.

The scripts in scripts/ import it by name: `python3 scripts/NAME.py` puts scripts/ on sys.path.
Every computation is kept operation for operation as the committed fixtures were computed, so
that a script regenerates its fixture byte for byte. Where two forms of one computation remain
(the short convolutions' initial draw, the rounding of the delta rule), a comment says which
fixture needs which.
"""

import json
import math
import os
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def shared_dir():
    """The reference data: $STATECUT_SHARED, else shared/ beside or inside the checkout."""
    if os.environ.get("STATECUT_SHARED"):
        return os.environ["STATECUT_SHARED"]
    for d in (os.path.join(HERE, "..", "..", "shared"), os.path.join(HERE, "..", "shared"), "/work/shared"):
        if os.path.isdir(os.path.join(d, "data")):
            return os.path.normpath(d)
    raise SystemExit("reference data not found: set STATECUT_SHARED to the shared/ folder")


# ---------------------------------------------------------------------------------------------
# Files


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def read_checkpoint(d):
    """config.json and model.safetensors of a model directory, the weights as float32."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    return cfg, {k: v.float() for k, v in load_file(os.path.join(d, "model.safetensors")).items()}


def save_checkpoint(model, cfg, out, tokenizer=None):
    """fla's save_pretrained layout: bf16 weights under the module names, config.json, and
    tokenizer.json (`tokenizer`: a file to copy or a tokenizers.Tokenizer to save). Moves the
    model to the CPU."""
    os.makedirs(out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.cpu().state_dict().items()}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(out, "config.json"), cfg)
    if isinstance(tokenizer, str):
        shutil.copy(tokenizer, os.path.join(out, "tokenizer.json"))
    elif tokenizer is not None:
        tokenizer.save(os.path.join(out, "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# Text: statecut eval's protocol


def tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def documents(path, column="text"):
    """The documents of a .jsonl file (blank lines skipped)."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)[column]


def encode(tok, docs, eos, limit=None):
    """Documents joined into one stream, each followed by the end-of-text token; with `limit`,
    the stream ends with the document that brings it to `limit` tokens or more."""
    ids = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False).ids
        ids.append(eos)
        if limit is not None and len(ids) >= limit:
            break
    return ids


def stream(tok, eos, paths, limit):
    """`encode` over the documents of .jsonl files, in order."""
    return encode(tok, (d for p in paths for d in documents(p)), eos, limit)


def first_tokens(tokenizer_path, data_path, eos, n):
    """[1, n] token ids (int64) of the first documents of a .jsonl file: the fixtures' golden input."""
    return torch.tensor([stream(tokenizer(tokenizer_path), eos, [data_path], n)[:n]])


def windows(ids, seqlen, n):
    """At most n windows: window i is ids[i*L .. i*L+L+1], its last L tokens predicted."""
    count = min(n, (len(ids) - 1) // seqlen)
    return [ids[i * seqlen : i * seqlen + seqlen + 1] for i in range(count)]


def eval_windows(tokenizer_path, data, seqlen, n, eos):
    """The first n windows of a .jsonl text, as `statecut eval --data` reads it."""
    return windows(stream(tokenizer(tokenizer_path), eos, [data], n * seqlen + 1), seqlen, n)


@torch.no_grad()
def perplexity(logits, wins, device="cpu"):
    """exp of the mean next-token cross-entropy over the windows; `logits` maps [1, L] token ids
    to [1, L, V] logits."""
    nll = 0.0
    for w in wins:
        x = torch.tensor([w], device=device)
        nll += F.cross_entropy(logits(x[:, :-1])[0].float(), x[0, 1:], reduction="sum").item()
    return math.exp(nll / sum(len(w) - 1 for w in wins))


def library_logits(model, device, autocast=False):
    """`logits` for perplexity() from a transformers model, under bf16 autocast if asked."""

    def logits(x):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=x).logits

    return logits


# ---------------------------------------------------------------------------------------------
# Training


def random_windows(data, seqlen, batch, generator=None):
    """[batch, seqlen + 1] windows of a token tensor at uniform random offsets."""
    starts = torch.randint(0, len(data) - seqlen - 1, (batch,), generator=generator)
    return torch.stack([data[s : s + seqlen + 1] for s in starts])


def warmup_cosine(peak, warmup, floor):
    """A learning rate for `train`: linear warm-up over `warmup` steps, then cosine decay over
    the budget to `floor` times the peak."""
    return lambda step, frac: peak * min(1.0, (step + 1) / warmup) * (
        floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    )


def train(model, opt, batch_loss, lr_at, steps=None, minutes=None, log_every=25, log_lr=False):
    """Gradient steps: `steps` of them, or as many as start within `minutes` of wall time.
    lr_at(step, frac) sets the learning rate, frac being the share of the budget already spent;
    batch_loss() returns the loss to minimise and a dict of named values to log. Gradients are
    clipped to norm 1. Returns the steps taken, the last step's logged values and the start time
    (for the callers' elapsed-time facts)."""
    t0, step, parts = time.time(), 0, {}
    budget = None if minutes is None else minutes * 60
    while step < steps if budget is None else time.time() - t0 < budget:
        frac = step / steps if budget is None else (time.time() - t0) / budget
        lr = lr_at(step, frac)
        for gr in opt.param_groups:
            gr["lr"] = lr
        loss, parts = batch_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0:
            shown = (f" lr {lr:.2e}" if log_lr else "") + "".join(f" {k} {v.item():.3f}" for k, v in parts.items())
            print(f"step {step} {time.time() - t0:.0f}s{shown}", flush=True)
        step += 1
    return step, parts, t0


def init_normal(model, std):
    """Every matrix (projections, embeddings) ~ N(0, std^2), as fla initialises them."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=std)


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def l2norm(x, eps=1e-6):
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class ShortConv(nn.Module):
    """fla's ShortConvolution: depthwise causal conv1d without bias, then SiLU when `silu`.
    The weight is drawn ~ U(+-1/sqrt(K)) (`init="uniform"`, torch's Conv1d default) or
    ~ N(0, 1/K) (`"normal"`); each fixture was trained from one of the two draws."""

    def __init__(self, channels, kernel, silu=False, init="normal"):
        super().__init__()
        if init == "uniform":
            bound = 1 / math.sqrt(kernel)
            w = torch.empty(channels, 1, kernel).uniform_(-bound, bound)
        else:
            w = torch.randn(channels, 1, kernel) / math.sqrt(kernel)
        self.weight = nn.Parameter(w)
        self.kernel = kernel
        self.silu = silu

    def forward(self, x):  # [B, T, C]
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=self.kernel - 1, groups=x.shape[-1])
        y = y[..., : x.shape[1]].transpose(1, 2)
        return F.silu(y) if self.silu else y


class MLP(nn.Module):
    """fla's GatedMLP: SwiGLU."""

    def __init__(self, D, inter):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def intermediate_size(cfg):
    """The MLP width: the config's, else fla's GatedMLP default (2/3 of hidden_ratio x hidden,
    rounded up to a multiple of 256)."""
    inter = cfg.get("intermediate_size")
    if inter is None:
        inter = int(cfg["hidden_size"] * cfg["hidden_ratio"] * 2 / 3)
        inter = 256 * ((inter + 255) // 256)
    return inter


def decay_params(n, a_min):
    """fla's Gated DeltaNet decay initialisation: A ~ U(a_min, 16), dt ~ logU(1e-3, 0.1),
    dt_bias = softplus^-1(dt). Returns the parameters A_log and dt_bias."""
    A_log = nn.Parameter(torch.empty(n).uniform_(a_min, 16).log())
    dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return A_log, nn.Parameter(dt + torch.log(-torch.expm1(-dt)))


# ---------------------------------------------------------------------------------------------
# The delta rule and GLA. q, k [B, T, H, K], v [B, T, H, V]; o_t = S^T (scale q_t).


def recurrent_gated_delta_rule(q, k, v, g, beta, scale):
    """Gated delta rule one token at a time, g and beta [B, T, H]: S <- exp(g_t) S,
    S <- S + k_t (beta_t (v_t - S^T k_t))^T. Products as einsum."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, 1)


def unit_lower_inverse(a):
    """(I + A)^-1 for strictly lower-triangular A [.., C, C]: A is nilpotent (A^C = 0), so the
    inverse is (I - A)(I + A^2)(I + A^4)...; batched matrix products, much faster on the CPU than
    a batched triangular solve."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    inv, p, n = eye - a, a @ a, 2
    while n < a.shape[-1]:
        inv = inv + inv @ p
        p, n = p @ p, 2 * n
    return inv


def chunk_gated_delta_rule(q, k, v, g, beta, scale, chunk=32):
    """The same function in chunks of C tokens. With b_t the cumulative log decay from the chunk's
    start, Gamma_t = exp(b_t) and S0 the state before the chunk, the updates u_t of the chunk solve
        u_t + sum_{s<t} beta_t exp(b_t - b_s) (k_t . k_s) u_s = beta_t v_t - beta_t Gamma_t S0^T k_t,
    a unit lower-triangular system; then o_t = Gamma_t S0^T q_t + sum_{s<=t} exp(b_t - b_s) (q_t . k_s) u_s
    and the next S0 = Gamma_C S0 + sum_s exp(b_C - b_s) k_s u_s^T."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # g = 0, beta = 0, k = 0: padded steps leave the state alone
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = q.shape[1] // chunk
    split = lambda x: x.reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4)  # noqa: E731  [B, H, n, C, *]
    q, k, v = split(q * scale), split(k), split(v)
    g, beta = split(g[..., None])[..., 0], split(beta[..., None])[..., 0]
    b = g.cumsum(-1)
    # Decays below e^-60 are taken as e^-60: they contribute nothing at float32 precision, and
    # letting them underflow makes subnormal floats, 10-100x slower on the CPU.
    exp = lambda x: x.clamp(min=-60).exp()  # noqa: E731
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (b[..., :, None] - b[..., None, :]).clamp(min=-60).masked_fill(~causal, float("-inf")).exp()
    eye = torch.eye(chunk)
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay) * (1 - eye)
    inv = unit_lower_inverse(lower)
    w = inv @ ((beta * exp(b))[..., None] * k)
    u0 = inv @ (beta[..., None] * v)
    qk = (q @ k.transpose(-1, -2)) * decay
    S = q.new_zeros(B, H, K, V)
    outs = []
    for i in range(n):
        bi = b[:, :, i]
        u = u0[:, :, i] - w[:, :, i] @ S
        outs.append((q[:, :, i] * exp(bi)[..., None]) @ S + qk[:, :, i] @ u)
        last = bi[..., -1:]
        S = exp(last)[..., None] * S + (k[:, :, i] * exp(last - bi)[..., None]).transpose(-1, -2) @ u
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, V)
    return o[:, :T]


def gdn_recurrent(q, k, v, g, beta, scale):
    """The same rule with g [B, T, H, 1] (GLA's shape, one decay for every key channel) and the
    products as broadcast sums, which round differently from the einsum form.
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


# Three forms of the gated delta rule, equal but for rounding. Each fixture regenerates byte for
# byte only with the form it was computed with: gdn_moby trains with "chunk" and takes its goldens
# from "recurrent"; gdn_recall trains with "loop" (SSE's form of the rule).
DELTA_RULES = {
    "chunk": chunk_gated_delta_rule,
    "recurrent": recurrent_gated_delta_rule,
    "loop": lambda q, k, v, g, beta, scale: gdn_recurrent(q, k, v, g[..., None], beta, scale)[0],
}


class DeltaRuleLayer(nn.Module):
    """What fla's DeltaNet and Gated DeltaNet layers share: SiLU short convolutions after the q, k,
    v projections, q and k L2-normalised per head (eps 1e-6 in the sqrt), beta = sigmoid(x W_b),
    and the output RMSNorm and projection. The subclasses register their modules in fla's order,
    which fixes the order of the random draws at construction."""

    def add_short_convs(self, kd, vd, kernel, init):
        conv = lambda c: ShortConv(c, kernel, silu=True, init=init)  # noqa: E731
        self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(kd), conv(kd), conv(vd)

    def add_output(self, vd, D, eps):
        self.o_norm = RMSNorm(self.dv, eps)
        self.o_proj = nn.Linear(vd, D, bias=False)

    def qkv_beta(self, x):
        B, T, _ = x.shape
        q = l2norm(self.q_conv1d(self.q_proj(x)).reshape(B, T, self.H, self.dk))
        k = l2norm(self.k_conv1d(self.k_proj(x)).reshape(B, T, self.H, self.dk))
        v = self.v_conv1d(self.v_proj(x)).reshape(B, T, self.H, self.dv)
        return q, k, v, torch.sigmoid(self.b_proj(x))


class GatedDeltaNet(DeltaRuleLayer):
    """fla's GatedDeltaNet layer (fla/layers/gated_deltanet.py, use_gate, use_short_conv):
      beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (q / sqrt(head_dim))
      out = o_proj(rmsnorm(o) * w * silu(x W_g)).
    `impl` names the form of the rule in DELTA_RULES; `conv_init` the short convs' draw."""

    def __init__(self, cfg, conv_init="uniform", impl="chunk"):
        super().__init__()
        D = cfg["hidden_size"]
        self.H = cfg["num_heads"]
        self.dk = cfg["head_dim"]
        self.dv = int(self.dk * cfg["expand_v"])
        self.impl = impl
        kd, vd = self.H * self.dk, self.H * self.dv
        self.q_proj = nn.Linear(D, kd, bias=False)
        self.k_proj = nn.Linear(D, kd, bias=False)
        self.v_proj = nn.Linear(D, vd, bias=False)
        self.a_proj = nn.Linear(D, self.H, bias=False)
        self.b_proj = nn.Linear(D, self.H, bias=False)
        self.A_log, self.dt_bias = decay_params(self.H, 0)
        self.add_short_convs(kd, vd, cfg["conv_size"], conv_init)
        self.g_proj = nn.Linear(D, vd, bias=False)
        self.add_output(vd, D, cfg["norm_eps"])

    def forward(self, x, impl=None):
        B, T, _ = x.shape
        q, k, v, beta = self.qkv_beta(x)
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        o = DELTA_RULES[impl or self.impl](q, k, v, g, beta, self.dk**-0.5)
        o = self.o_norm(o) * F.silu(self.g_proj(x).reshape(B, T, self.H, self.dv))
        return self.o_proj(o.reshape(B, T, -1))


class DeltaNet(DeltaRuleLayer):
    """fla's DeltaNet layer (use_beta, qk_activation silu, qk_norm l2, short convs with SiLU,
    output RMSNorm without a gate): the delta rule without decay, token by token."""

    def __init__(self, cfg):
        super().__init__()
        D, self.H = cfg["hidden_size"], cfg["num_heads"]
        kd, vd = int(D * cfg["expand_k"]), int(D * cfg["expand_v"])
        self.dk, self.dv = kd // self.H, vd // self.H
        self.q_proj = nn.Linear(D, kd, bias=False)
        self.k_proj = nn.Linear(D, kd, bias=False)
        self.v_proj = nn.Linear(D, vd, bias=False)
        self.b_proj = nn.Linear(D, self.H, bias=False)
        self.add_short_convs(kd, vd, cfg["conv_size"], "uniform")
        self.add_output(vd, D, cfg["norm_eps"])

    def forward(self, x, impl=None):  # impl: one form here
        q, k, v, beta = self.qkv_beta(x)
        o = recurrent_gated_delta_rule(q, k, v, torch.zeros_like(beta), beta, self.dk**-0.5)
        return self.o_proj(self.o_norm(o).reshape(*x.shape[:2], -1))


class Block(nn.Module):
    """fla's pre-norm block: h + attn(attn_norm(h)), then h + mlp(mlp_norm(h))."""

    def __init__(self, cfg, attn):
        super().__init__()
        D = cfg["hidden_size"]
        self.attn_norm = RMSNorm(D, cfg["norm_eps"])
        self.attn = attn
        self.mlp_norm = RMSNorm(D, cfg["norm_eps"])
        self.mlp = MLP(D, intermediate_size(cfg))

    def forward(self, h, *args):
        h = h + self.attn(self.attn_norm(h), *args)
        return h + self.mlp(self.mlp_norm(h))


class Inner(nn.Module):
    def __init__(self, cfg, mixer):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Block(cfg, mixer(cfg, i)) for i in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])


class CausalLM(nn.Module):
    """fla's ForCausalLM around the layers mixer(cfg, i) makes; the head is the embedding matrix
    when tie_word_embeddings."""

    def __init__(self, cfg, mixer):
        super().__init__()
        self.model = Inner(cfg, mixer)
        self.tied = cfg["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids, *args):
        """Logits and the hidden states as transformers' output_hidden_states gives them (the
        last one after the final norm); `args` go to every layer."""
        h = self.model.embeddings(ids)
        hidden = [h]
        for i, blk in enumerate(self.model.layers):
            h = blk(h, *args)
            if i + 1 < len(self.model.layers):
                hidden.append(h)
        h = self.model.norm(h)
        hidden.append(h)
        w = self.model.embeddings.weight if self.tied else self.lm_head.weight
        return h @ w.t(), hidden


class GatedDeltaNetForCausalLM(CausalLM):
    """forward(ids, impl=None): `impl` picks the form of the delta rule for this call."""

    def __init__(self, cfg, conv_init="uniform", impl="chunk"):
        super().__init__(cfg, lambda cfg, i: GatedDeltaNet(cfg, conv_init, impl))


# ---------------------------------------------------------------------------------------------
# SSE (arXiv 2507.16577): fla/layers/sse.py (SSEGLA, SSEGDN) and fla/models/sse/; the model's
# forms and the reading of fla's code are described in sse_reference.py.

GATE_LOGIT_NORMALIZER = 16
GATE_LOW_RANK_DIM = 16


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
            self.A_log, self.dt_bias = decay_params(2 * self.H, 1)
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
        # load-balance loss (writer-only): sum p·f · N / k; SSEForCausalLM sums it over the layers
        self.aux = (f[7].mean((0, 1)) * f[8].float().mean((0, 1))).sum() * self.N / self.topk
        return out


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

    def forward(self, x, impl=None):  # impl: for the SSE layers beside it
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


class SSEForCausalLM(CausalLM):
    """forward(ids, impl=None) -> (logits, hidden states, load-balance loss); `impl` ("mask",
    "varlen" or "loop") overrides the config's sse_implementation."""

    def __init__(self, cfg):
        if cfg.get("linear_attn_type", "gla") not in ("gla", "gdn"):
            raise ValueError("linear_attn_type must be 'gla' or 'gdn'")
        attn = cfg.get("attn")
        softmax = lambda i: attn is not None and i in attn["layers"]  # noqa: E731
        super().__init__(cfg, lambda cfg, i: Attention(cfg) if softmax(i) else SSE(cfg, i))
        self.cfg = cfg

    def forward(self, ids, impl=None):
        logits, hidden = super().forward(ids, impl)
        aux = 0.0
        for blk in self.model.layers:
            if isinstance(blk.attn, SSE):
                aux = aux + blk.attn.aux
        return logits, hidden, aux


def load_sse(d, device="cpu"):
    """An SSE checkpoint in float32, in eval mode, and its config."""
    cfg, sd = read_checkpoint(d)
    m = SSEForCausalLM(cfg)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise SystemExit(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return m.to(device).eval(), cfg
