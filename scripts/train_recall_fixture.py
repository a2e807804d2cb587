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
The model is scripts/reference_torch.py's, with the rule computed as the SSE layers compute it.

On a GPU (--device cuda) for a few minutes, or on the CPU with one or two threads:

    python3 scripts/train_recall_fixture.py --out tests/fixtures/gdn_recall --minutes 6 --device cuda
"""

import argparse
import glob
import json
import os
import random
import time

import torch
import torch.nn.functional as F
from reference_torch import GatedDeltaNetForCausalLM, init_normal, random_windows, save_checkpoint, shared_dir, stream
from reference_torch import tokenizer, train, warmup_cosine, write_json

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


def recall_model(cfg):
    """Short convs drawn ~ N(0, 1/K), the delta rule in the SSE layers' form ("loop")."""
    return GatedDeltaNetForCausalLM(cfg, conv_init="normal", impl="loop")


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
    pred = model(ids)[0].argmax(-1)
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
    model = recall_model(cfg)
    init_normal(model, 0.02)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    L, bs = args.seqlen, args.batch
    n_mqar = int(round(bs * args.mqar_share))

    def batch_loss():
        text = random_windows(ids, L, bs - n_mqar)
        inputs, targets = [text[:, :-1]], [text[:, 1:]]
        if n_mqar:
            ex = [mqar(rng, args.mqar_vocab, rng.randint(1, args.max_pairs), L) for _ in range(n_mqar)]
            inputs.append(torch.tensor([e[0] for e in ex]))
            targets.append(torch.tensor([e[1] for e in ex]))
        x, y = torch.cat(inputs).to(dev), torch.cat(targets).to(dev)
        logits = model(x)[0]
        text_loss = F.cross_entropy(logits[: bs - n_mqar].reshape(-1, cfg["vocab_size"]), y[: bs - n_mqar].reshape(-1))
        mq_loss = F.cross_entropy(logits[bs - n_mqar :].reshape(-1, cfg["vocab_size"]), y[bs - n_mqar :].reshape(-1))
        return text_loss + mq_loss, {"text": text_loss, "mqar": mq_loss}

    step, last, t0 = train(model, opt, batch_loss, warmup_cosine(args.lr, 50, 0.1), minutes=args.minutes)
    text_loss, mq_loss = last["text"], last["mqar"]
    model.eval()
    acc = mqar_accuracy(model.cpu(), args.mqar_vocab, args.max_pairs, L, 64, 12345)
    print(f"mqar accuracy ({args.max_pairs} pairs, {L} tokens, held-out seed): {acc:.3f}")
    save_checkpoint(model, cfg, args.out, tok_path)
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
    write_json(os.path.join(args.out, "reference.json"), facts)
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
