#!/usr/bin/env python3
"""Decode speed with the upstream library's own kernels (fla / transformers), the paper's
Table 17 setting: a 512-token prompt, then one token per step for every sequence of the batch.
Prints and writes median milliseconds per decode step for each model and batch size; the
models take turns, `--rounds` times `--steps` steps each. fla models, Qwen3.5 and transformers'
Mamba-2.

    python3 scripts/decode_bench.py --models ORIG PRUNED --batch-sizes 1,16,64 --json d.json
"""

import argparse
import json
import statistics
import time

import torch


def load(path, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(model, ids, cache):
    """One forward with the model's cache (`past_key_values` for fla and Qwen3.5, `cache_params`
    for transformers' Mamba-2); returns (cache, next token ids)."""
    if getattr(model.config, "model_type", "") == "mamba2":
        out = model(ids, cache_params=cache, use_cache=True)
        cache = out.cache_params
    else:
        out = model(ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return cache, out.logits[:, -1:].argmax(-1)


def decode_round(model, ids, steps):
    """Prefill `ids`, then time `steps` single-token steps; seconds per step."""
    cache, nxt = step(model, ids, None)
    sync(ids.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cache, nxt = step(model, nxt, cache)
        sync(ids.device)
        times.append(time.perf_counter() - t0)
    return times


def bench(paths, batch, prompt, steps, rounds, vocab_cap, device):
    """Median ms per decode step of every model; the models take turns round by round, so that
    clock or thermal drift during the run hits all of them alike."""
    models = [load(p, device) for p in paths]
    g = torch.Generator().manual_seed(0)
    ids = []
    for m in models:
        vocab = min(getattr(m.config, "vocab_size", vocab_cap), vocab_cap)
        ids.append(torch.randint(0, vocab, (batch, prompt), generator=g).to(device))
    times = [[] for _ in models]
    with torch.no_grad():
        for m, x in zip(models, ids):  # the first pass compiles the kernels
            decode_round(m, x, 2)
        for _ in range(rounds):
            for k, (m, x) in enumerate(zip(models, ids)):
                times[k] += decode_round(m, x, steps)
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [1000 * statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per model, taken in turns")
    ap.add_argument("--vocab-cap", type=int, default=4096)
    ap.add_argument("--json", required=True)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    args = ap.parse_args()
    try:
        import fla  # noqa: F401  registers fla models with transformers
    except ImportError:
        pass
    rows = []
    dev = torch.device(args.device)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for m, ms in zip(args.models, bench(args.models, b, args.prompt_len, args.steps, args.rounds, args.vocab_cap, dev)):
            rows.append({"model": m, "batch": b, "decode_ms_per_step": ms})
            print(f"{m} batch {b}: {ms:.3f} ms/step", flush=True)
        json.dump(rows, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
