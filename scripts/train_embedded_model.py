#!/usr/bin/env python3
"""Train the small Gated DeltaNet that ships in assets/models/gdn-moby, from text the repository
ships, in plain PyTorch on the CPU (no flash-linear-attention needed to rebuild it).

Text (Herman Melville, *Moby-Dick*, 1851, public domain):
  assets/calibration.txt + assets/train.txt   chapters 1-118 in order: tokenizer and model training
  assets/eval.txt                             chapters 119-135: held out, never trained on

Steps, all seeded:
  1. a byte-level BPE tokenizer (the `tokenizers` package, VOCAB tokens, `<unk>` `<s>` `</s>` = 0 1 2)
     trained on the training text;
  2. a Gated DeltaNet causal LM with flash-linear-attention's module names, config keys and
     forward math (fla `fla/layers/gated_deltanet.py`, `fla/models/gated_deltanet/`), trained for
     --steps on random windows of the training text;
  3. the bf16 weights, config.json and tokenizer files written to --out, in the layout fla's
     `save_pretrained` gives (`GatedDeltaNetForCausalLM`, tied embeddings);
  4. tests/fixtures/gdn_moby/golden.safetensors: `input_ids` [1, 64] (the first tokens of
     assets/eval.txt), float32 `logits` [1, 64, V] and `hidden_states` [L+1, 1, 64, D] of the
     float32 forward of the stored bf16 weights (token-by-token recurrence), and
     tests/fixtures/gdn_moby/reference.json: training facts and the perplexity of that forward on
     assets/eval.txt with `statecut eval`'s protocol (the file as one document followed by `</s>`,
     64 windows of 512 predicted tokens).

Per layer (pre-norm, RMSNorm with a plain weight, eps norm_eps):
  q, k, v = silu(causal depthwise conv(x W_{q,k,v}));  q, k L2-normalised per head (eps 1e-6 in the sqrt)
  beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (q / sqrt(head_dim))
  out = o_proj(rmsnorm(o) * w * silu(x W_g));  then a SwiGLU MLP, both with residuals.

Training uses the chunked form of the same recurrence (within a chunk of C tokens the delta-rule
updates are one unit lower-triangular solve); the goldens use the token-by-token form, and the
script checks that the two agree.

Usage:
  python3 scripts/train_embedded_model.py              # everything: 400 steps, one thread; the
                                                       # committed model took 394 s of CPU time
  python3 scripts/train_embedded_model.py --steps 50   # a quick, worse model
  python3 scripts/train_embedded_model.py golden       # rewrite the golden files only
"""

import argparse
import hashlib
import json
import math
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
ASSETS = os.path.join(ROOT, "assets")
TRAIN_FILES = [os.path.join(ASSETS, "calibration.txt"), os.path.join(ASSETS, "train.txt")]
EVAL_FILE = os.path.join(ASSETS, "eval.txt")
OUT = os.path.join(ASSETS, "models", "gdn-moby")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gdn_moby")
SPECIALS = ["<unk>", "<s>", "</s>"]
GOLDEN_TOKENS = 64
EVAL_SEQLEN, EVAL_WINDOWS = 512, 64

# The key set of the config.json fla 0.6 saves for GatedDeltaNetForCausalLM, scaled down.
CONFIG = {
    "allow_neg_eigval": False,
    "architectures": ["GatedDeltaNetForCausalLM"],
    "attn": None,
    "attn_mode": "chunk",
    "attnres_block_size": None,
    "bos_token_id": 1,
    "conv_size": 4,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "expand_v": 2,
    "fuse_cross_entropy": True,
    "fuse_linear_cross_entropy": False,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "head_dim": 64,
    "hidden_act": "swish",
    "hidden_ratio": 4,
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": None,
    "max_position_embeddings": 2048,
    "model_type": "gated_deltanet",
    "norm_eps": 1e-06,
    "num_heads": 2,
    "num_hidden_layers": 4,
    "num_v_heads": None,
    "output_gate_activation": "swish",
    "pad_token_id": None,
    "tie_word_embeddings": True,
    "transformers_version": "5.17.0",
    "use_cache": True,
    "use_gate": True,
    "use_l2warp": False,
    "use_short_conv": True,
    "vocab_size": 2048,
}

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": 1000000,
    "add_bos_token": False,
    "add_eos_token": False,
}
SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "transformers_version": "5.17.0",
    "use_cache": True,
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def chapters(text):
    """The training text as documents, one per chapter (as statecut splits its built-in text)."""
    return [("CHAPTER " + c) for c in text.split("CHAPTER ") if c.strip()]


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, s
    return tok


def encode(tok, docs, eos):
    """Documents joined into one stream, each followed by the end-of-text token."""
    ids = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False).ids
        ids.append(eos)
    return ids


# ---------------------------------------------------------------------------------------------
# The model


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2norm(x, eps=1e-6):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class ShortConv(nn.Module):
    """fla's ShortConvolution: depthwise causal conv1d without bias, then SiLU."""

    def __init__(self, channels, kernel):
        super().__init__()
        bound = 1 / math.sqrt(kernel)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel).uniform_(-bound, bound))
        self.kernel = kernel

    def forward(self, x):  # [B, T, C]
        y = F.conv1d(x.transpose(1, 2), self.weight, padding=self.kernel - 1, groups=x.shape[-1])
        return F.silu(y[..., : x.shape[1]].transpose(1, 2))


def recurrent_gated_delta_rule(q, k, v, g, beta, scale):
    """One token at a time: q, k [B, T, H, K], v [B, T, H, V], g, beta [B, T, H]."""
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


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg["hidden_size"]
        self.H = cfg["num_heads"]
        self.dk = cfg["head_dim"]
        self.dv = int(self.dk * cfg["expand_v"])
        kd, vd = self.H * self.dk, self.H * self.dv
        self.q_proj = nn.Linear(D, kd, bias=False)
        self.k_proj = nn.Linear(D, kd, bias=False)
        self.v_proj = nn.Linear(D, vd, bias=False)
        self.a_proj = nn.Linear(D, self.H, bias=False)
        self.b_proj = nn.Linear(D, self.H, bias=False)
        # fla's initialisation: A ~ U(0, 16), dt ~ logU(1e-3, 0.1), dt_bias = softplus^-1(dt)
        self.A_log = nn.Parameter(torch.empty(self.H).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(self.H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.q_conv1d = ShortConv(kd, cfg["conv_size"])
        self.k_conv1d = ShortConv(kd, cfg["conv_size"])
        self.v_conv1d = ShortConv(vd, cfg["conv_size"])
        self.g_proj = nn.Linear(D, vd, bias=False)
        self.o_norm = RMSNorm(self.dv, cfg["norm_eps"])
        self.o_proj = nn.Linear(vd, D, bias=False)

    def forward(self, x, recurrent=False):
        B, T, _ = x.shape
        q = l2norm(self.q_conv1d(self.q_proj(x)).reshape(B, T, self.H, self.dk))
        k = l2norm(self.k_conv1d(self.k_proj(x)).reshape(B, T, self.H, self.dk))
        v = self.v_conv1d(self.v_proj(x)).reshape(B, T, self.H, self.dv)
        beta = torch.sigmoid(self.b_proj(x))
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        rule = recurrent_gated_delta_rule if recurrent else chunk_gated_delta_rule
        o = rule(q, k, v, g, beta, self.dk**-0.5)
        o = self.o_norm(o) * F.silu(self.g_proj(x).reshape(B, T, self.H, self.dv))
        return self.o_proj(o.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, D, inter):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg["hidden_size"]
        inter = cfg["intermediate_size"]
        if inter is None:  # fla's GatedMLP default
            inter = 256 * math.ceil(int(D * cfg["hidden_ratio"] * 2 / 3) / 256)
        self.attn_norm = RMSNorm(D, cfg["norm_eps"])
        self.attn = GatedDeltaNet(cfg)
        self.mlp_norm = RMSNorm(D, cfg["norm_eps"])
        self.mlp = MLP(D, inter)

    def forward(self, h, recurrent=False):
        h = h + self.attn(self.attn_norm(h), recurrent)
        return h + self.mlp(self.mlp_norm(h))


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])


class GatedDeltaNetForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Inner(cfg)
        std = cfg["initializer_range"]
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std)

    def forward(self, ids, recurrent=False):
        """Logits and the hidden states as transformers' output_hidden_states gives them."""
        h = self.model.embeddings(ids)
        hidden = [h]
        for i, blk in enumerate(self.model.layers):
            h = blk(h, recurrent)
            if i + 1 < len(self.model.layers):
                hidden.append(h)
        h = self.model.norm(h)
        hidden.append(h)
        return h @ self.model.embeddings.weight.t(), hidden


def load(out):
    cfg = json.load(open(os.path.join(out, "config.json")))
    model = GatedDeltaNetForCausalLM(cfg)
    sd = {k: v.float() for k, v in load_file(os.path.join(out, "model.safetensors")).items()}
    model.load_state_dict(sd, strict=True)
    return model.eval(), cfg


def tokenizer(out):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(out, "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# Commands


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def eval_ppl(model, ids, seqlen, windows):
    """statecut eval's protocol: window i is ids[i*L .. i*L+L+1], the last L tokens predicted."""
    n = min((len(ids) - 1) // seqlen, windows)
    nll = 0.0
    with torch.no_grad():
        for i in range(n):
            w = torch.tensor(ids[i * seqlen : i * seqlen + seqlen + 1])[None]
            nll += F.cross_entropy(model(w[:, :-1])[0][0], w[0, 1:], reduction="sum").item()
    return math.exp(nll / (n * seqlen)), n


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_golden(out, fixture, facts=None):
    """Goldens from the stored bf16 weights, in float32, with the token-by-token recurrence;
    the chunked form used in training must agree with it."""
    model, cfg = load(out)
    tok = tokenizer(out)
    eos = cfg["eos_token_id"]
    eval_ids = encode(tok, [read(EVAL_FILE)], eos)
    x = torch.tensor(eval_ids[:GOLDEN_TOKENS])[None]
    with torch.no_grad():
        logits, hidden = model(x, recurrent=True)
        chunked, _ = model(x)
    rel = ((chunked - logits).norm() / logits.norm()).item()
    print(f"golden: chunked vs token-by-token logits, relative difference {rel:.2e}")
    assert rel < 1e-5, rel
    os.makedirs(fixture, exist_ok=True)
    save_file(
        {
            "input_ids": x.to(torch.int64).contiguous(),
            "logits": logits.float().contiguous(),
            "hidden_states": torch.stack(hidden).float().contiguous(),
        },
        os.path.join(fixture, "golden.safetensors"),
        metadata={"note": f"float32 forward of the bf16 weights, first {GOLDEN_TOKENS} tokens of assets/eval.txt"},
    )
    ppl, n = eval_ppl(model, eval_ids, EVAL_SEQLEN, EVAL_WINDOWS)
    assert n == EVAL_WINDOWS, f"assets/eval.txt holds only {n} windows of {EVAL_SEQLEN}"
    path = os.path.join(fixture, "reference.json")
    ref = json.load(open(path)) if os.path.exists(path) else {}
    ref.update(facts or {})
    ref[f"eval_ppl_f32_{EVAL_SEQLEN}x{EVAL_WINDOWS}"] = ppl
    ref["model_sha256"] = sha256(os.path.join(out, "model.safetensors"))
    write_json(path, ref)
    print(f"assets/eval.txt perplexity {ppl:.4f} ({n} x {EVAL_SEQLEN} tokens); wrote {fixture}")


def cmd_train(args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()
    train_text = "".join(read(p) for p in TRAIN_FILES)
    docs = chapters(train_text)
    tok = train_tokenizer(docs, args.vocab)
    cfg = dict(CONFIG, vocab_size=tok.get_vocab_size())
    eos = tok.token_to_id("</s>")
    ids = encode(tok, docs, eos)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; training text {len(train_text)} chars, {len(ids)} tokens")
    data = torch.tensor(ids)

    model = GatedDeltaNetForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params} parameters")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    L, bs = args.seqlen, args.batch
    t0, loss = time.time(), torch.tensor(float("nan"))
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, args.steps // 10)
    for step in range(args.steps):
        # linear warm-up over the first tenth, cosine decay to 5% of the peak
        frac = step / args.steps
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for gr in opt.param_groups:
            gr["lr"] = lr
        starts = torch.randint(0, len(data) - L - 1, (bs,), generator=gen)
        batch = torch.stack([data[s : s + L + 1] for s in starts])
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} {time.time() - t0:.0f}s lr {lr:.2e} loss {loss.item():.3f}", flush=True)
    train_seconds = time.time() - t0

    os.makedirs(args.out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(args.out, "config.json"), cfg)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    write_json(os.path.join(args.out, "tokenizer_config.json"), TOKENIZER_CONFIG)
    write_json(os.path.join(args.out, "special_tokens_map.json"), SPECIAL_TOKENS_MAP)
    write_json(os.path.join(args.out, "generation_config.json"), GENERATION_CONFIG)
    facts = {
        "arch": "gated_deltanet",
        "params": params,
        "vocab": tok.get_vocab_size(),
        "train_text_tokens": len(ids),
        "train_steps": args.steps,
        "train_tokens": args.steps * bs * L,
        "batch": bs,
        "seqlen": L,
        "lr": args.lr,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "threads": torch.get_num_threads(),
        "final_train_loss": loss.item(),
        "seed": args.seed,
        "torch": torch.__version__,
    }
    write_golden(args.out, args.fixture, facts)
    print(f"done in {time.time() - t_start:.0f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", choices=["train", "golden"], default="train")
    ap.add_argument("--out", default=OUT, help="model directory")
    ap.add_argument("--fixture", default=FIXTURE, help="where the golden files go")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    # Subnormal floats (products of long decays) are 10-100x slower on the CPU; flushing them to
    # zero changes no result above 1e-38. One thread by default: on a busy machine, threads that
    # wait for each other at every operation are much slower than one.
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    if args.cmd == "golden":
        write_golden(args.out, args.fixture)
    else:
        cmd_train(args)


if __name__ == "__main__":
    main()
