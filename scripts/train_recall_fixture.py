#!/usr/bin/env python3
"""Train a small Gated DeltaNet (fla `gated_deltanet` checkpoint format) on a mix of text and
multi-query associative recall (MQAR) sequences, so that recall numbers before and after
pruning mean something (the shared reference models never learned to retrieve).

The MQAR sequences follow `statecut eval --task mqar` (src/recall/mqar.rs) exactly in format:
`pairs` key-value pairs, keys distinct from [1, V/2), values distinct from [V/2, V) with
V = --mqar-vocab, then the query section where each key appears once at an even offset drawn
with Zoology's power-law (a = 0.01) and every other token is uniform noise from [0, V). The loss
on MQAR sequences is taken at the query positions only (the key's value is the target), as in
Zoology; text sequences get the ordinary next-token loss.

The layer is fla's GatedDeltaNet (fla/layers/gated_deltanet.py): q/k/v projections, SiLU short
convolutions, L2-normalised q and k, beta = sigmoid(b_proj x), g = -exp(A_log) softplus(a_proj x
+ dt_bias), the gated delta rule, then the gated RMSNorm o_norm(o) * silu(g_proj x) and o_proj.
It reuses the building blocks of scripts/sse_reference.py.

On a GPU (--device cuda) for a few minutes, or on the CPU with one or two threads:

    python3 scripts/train_recall_fixture.py --out tests/fixtures/gdn_recall --minutes 6 --device cuda
"""

import argparse
import glob
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sse_reference import MLP, RMSNorm, ShortConv, gdn_recurrent, l2norm, shared_dir, stream, tokenizer  # noqa: E402

CONFIG = {
    "architectures": ["GatedDeltaNetForCausalLM"],
    "model_type": "gated_deltanet",
    "attn": None,
    "attn_mode": "chunk",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_heads": 2,
    "head_dim": 64,
    "expand_v": 1,
    "num_v_heads": None,
    "use_gate": True,
    "use_short_conv": True,
    "conv_size": 4,
    "conv_bias": False,
    "allow_neg_eigval": False,
    "hidden_ratio": 4,
    "intermediate_size": 256,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "fuse_cross_entropy": True,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "use_cache": True,
}


class SiluConv(ShortConv):
    """fla ShortConvolution with activation='silu' (q_conv1d, k_conv1d, v_conv1d)."""

    def forward(self, x):
        return F.silu(super().forward(x))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, dk = cfg["hidden_size"], cfg["num_heads"], cfg["head_dim"]
        dv = int(dk * cfg["expand_v"])
        self.H, self.dk, self.dv = H, dk, dv
        self.q_proj = nn.Linear(D, H * dk, bias=False)
        self.k_proj = nn.Linear(D, H * dk, bias=False)
        self.v_proj = nn.Linear(D, H * dv, bias=False)
        self.a_proj = nn.Linear(D, H, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        # fla's initialisation of the decay: A in [0, 16], dt in [1e-3, 0.1]
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(0, 16)))
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        k = cfg["conv_size"]
        self.q_conv1d, self.k_conv1d, self.v_conv1d = SiluConv(H * dk, k), SiluConv(H * dk, k), SiluConv(H * dv, k)
        self.g_proj = nn.Linear(D, H * dv, bias=False)
        self.o_norm = RMSNorm(dv, cfg["norm_eps"])
        self.o_proj = nn.Linear(H * dv, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = l2norm(self.q_conv1d(self.q_proj(x)).view(B, T, self.H, self.dk))
        k = l2norm(self.k_conv1d(self.k_proj(x)).view(B, T, self.H, self.dk))
        v = self.v_conv1d(self.v_proj(x)).view(B, T, self.H, self.dv)
        beta = torch.sigmoid(self.b_proj(x))
        g = (-self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias))[..., None]
        o, _ = gdn_recurrent(q, k, v, g, beta, self.dk**-0.5)
        gate = self.g_proj(x).view(B, T, self.H, self.dv)
        o = self.o_norm(o) * F.silu(gate)
        return self.o_proj(o.reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg["hidden_size"]
        self.attn_norm = RMSNorm(D, cfg["norm_eps"])
        self.attn = GatedDeltaNet(cfg)
        self.mlp_norm = RMSNorm(D, cfg["norm_eps"])
        self.mlp = MLP(D, cfg["intermediate_size"])

    def forward(self, h):
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["norm_eps"])


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Inner(cfg)

    def forward(self, ids):
        h = self.model.embeddings(ids)
        for blk in self.model.layers:
            h = blk(h)
        return self.model.norm(h) @ self.model.embeddings.weight.t()


def power_law_slots(rng, length, n, a=0.01):
    w = [a * (i + 1) ** (a - 1) for i in range(length)]
    out = []
    for _ in range(n):
        x = rng.random() * sum(w)
        pick = length - 1
        for i, wi in enumerate(w):
            if x < wi and wi > 0:
                pick = i
                break
            x -= wi
        if w[pick] == 0:
            pick = max(i for i, wi in enumerate(w) if wi > 0)
        w[pick] = 0.0
        out.append(pick)
    return out


def mqar(rng, vocab, pairs, length):
    """(tokens, targets) with targets -100 except at the query positions."""
    half = vocab // 2
    keys = rng.sample(range(1, half), pairs)
    values = rng.sample(range(half, vocab), pairs)
    toks = [t for kv in zip(keys, values) for t in kv]
    start = len(toks)
    slots = power_law_slots(rng, (length - start) // 2, pairs)
    section = [None] * (length - start)
    targets = [-100] * length
    for p, s in enumerate(slots):
        section[2 * s] = keys[p]
        targets[start + 2 * s] = values[p]
    toks += [t if t is not None else rng.randrange(vocab) for t in section]
    return toks, targets


@torch.no_grad()
def mqar_accuracy(model, vocab, pairs, length, n, seed):
    rng = random.Random(seed)
    batch = [mqar(rng, vocab, pairs, length) for _ in range(n)]
    ids = torch.tensor([b[0] for b in batch])
    tgt = torch.tensor([b[1] for b in batch])
    pred = model(ids).argmax(-1)
    m = tgt != -100
    return (pred[m] == tgt[m]).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mqar-vocab", type=int, default=512)
    ap.add_argument("--max-pairs", type=int, default=8)
    ap.add_argument("--mqar-share", type=float, default=0.5, help="fraction of each batch that is MQAR")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer", help="tokenizer.json [default: the shared gated_deltanet model's]")
    ap.add_argument("--text", nargs="*", help=".jsonl or .txt training text [default: shared data/calib/*.jsonl]")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    shared = shared_dir() if not (args.tokenizer and args.text) else None
    tok_path = args.tokenizer or os.path.join(shared, "models/gated_deltanet/tokenizer.json")
    tok = tokenizer(tok_path)
    cfg = dict(CONFIG, vocab_size=tok.get_vocab_size())
    eos = tok.token_to_id("</s>")
    texts = args.text or sorted(glob.glob(os.path.join(shared, "data/calib/*.jsonl")))
    ids = []
    for t in texts:
        if t.endswith(".txt"):
            ids += tok.encode(open(t).read(), add_special_tokens=False).ids + [eos]
        else:
            ids += stream(tok, eos, [t], 10**9)
    ids = torch.tensor(ids)
    model = Model(cfg)
    for n, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    L, bs = args.seqlen, args.batch
    n_mqar = int(round(bs * args.mqar_share))
    t0, step, budget = time.time(), 0, args.minutes * 60
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for gr in opt.param_groups:
            gr["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, len(ids) - L - 1, (bs - n_mqar,))
        text = torch.stack([ids[s : s + L + 1] for s in starts])
        inputs, targets = [text[:, :-1]], [text[:, 1:]]
        if n_mqar:
            ex = [mqar(rng, args.mqar_vocab, rng.randint(1, args.max_pairs), L) for _ in range(n_mqar)]
            inputs.append(torch.tensor([e[0] for e in ex]))
            targets.append(torch.tensor([e[1] for e in ex]))
        x, y = torch.cat(inputs).to(dev), torch.cat(targets).to(dev)
        logits = model(x)
        text_loss = F.cross_entropy(logits[: bs - n_mqar].reshape(-1, cfg["vocab_size"]), y[: bs - n_mqar].reshape(-1))
        mq_loss = F.cross_entropy(logits[bs - n_mqar :].reshape(-1, cfg["vocab_size"]), y[bs - n_mqar :].reshape(-1))
        (text_loss + mq_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            print(f"step {step} {time.time() - t0:.0f}s text {text_loss.item():.3f} mqar {mq_loss.item():.3f}", flush=True)
        step += 1
    model.eval()
    model.cpu()
    acc = mqar_accuracy(model, args.mqar_vocab, args.max_pairs, L, 64, 12345)
    print(f"mqar accuracy ({args.max_pairs} pairs, {L} tokens, held-out seed): {acc:.3f}")
    os.makedirs(args.out, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    import shutil

    shutil.copy(tok_path, os.path.join(args.out, "tokenizer.json"))
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": step,
        "train_seconds": round(time.time() - t0, 1),
        "threads": args.threads,
        "train_device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "seqlen": L,
        "batch": bs,
        "mqar_share": args.mqar_share,
        "mqar_vocab": args.mqar_vocab,
        "max_pairs": args.max_pairs,
        "final_text_loss": text_loss.item(),
        "final_mqar_loss": mq_loss.item(),
        "mqar_accuracy_torch_f32": acc,
        "torch": torch.__version__,
        "seed": args.seed,
        "text": [os.path.basename(t) for t in texts],
    }
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(facts, f, indent=2)
        f.write("\n")
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
