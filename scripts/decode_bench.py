#!/usr/bin/env python3
"""Decode speed with the upstream library's own kernels (fla / transformers), the paper's
Table 17 setting: a 512-token prompt, then one token per step for every sequence of the batch.
Prints and writes median milliseconds per decode step for each model and batch size.

    python3 scripts/decode_bench.py --models ORIG PRUNED --batch-sizes 1,16,64 --json d.json
"""

import argparse
import json
import statistics
import time

import torch


def bench(path, batch, prompt, steps, vocab_cap):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    vocab = min(model.config.vocab_size if hasattr(model.config, "vocab_size") else vocab_cap, vocab_cap)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt), generator=g).cuda()
    times = []
    with torch.no_grad():
        for rep in range(2):  # the first pass compiles the kernels
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if rep == 1:
                    times.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return 1000 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--vocab-cap", type=int, default=4096)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    try:
        import fla  # noqa: F401  registers fla models with transformers
    except ImportError:
        pass
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for m in args.models:
            ms = bench(m, b, args.prompt_len, args.steps, args.vocab_cap)
            rows.append({"model": m, "batch": b, "decode_ms_per_step": ms})
            print(f"{m} batch {b}: {ms:.3f} ms/step", flush=True)
            json.dump(rows, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
