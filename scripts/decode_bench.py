#!/usr/bin/env python3
"""Decode speed with the upstream library's own kernels (fla / transformers), the paper's
Table 17 setting: a 512-token prompt, then one token per step for every sequence of the batch.
Prints and writes median milliseconds per decode step for each model and batch size; the
models take turns, `--rounds` times `--steps` steps each. fla models, Qwen3.5 and transformers'
Mamba-2.

With `--graphs` (fla models) the whole decode step is captured once in a CUDA graph and
replayed, the paper's protocol: `--warmup` replays, then `--steps` timed replays per round, the
median over `--rounds` rounds of the mean step time. The recurrent and conv states live in fixed
buffers that every replay updates in place.

    python3 scripts/decode_bench.py --models ORIG PRUNED --batch-sizes 1,16,64 --json d.json
    python3 scripts/decode_bench.py --graphs --steps 100 --warmup 10 --models ORIG PRUNED --json g.json
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


def prompts(models, batch, prompt, vocab_cap, device):
    """One random [batch, prompt] prompt per model, from a fixed seed, below each vocabulary."""
    g = torch.Generator().manual_seed(0)
    ids = []
    for m in models:
        vocab = min(getattr(m.config, "vocab_size", vocab_cap), vocab_cap)
        ids.append(torch.randint(0, vocab, (batch, prompt), generator=g).to(device))
    return ids


def tensors(state):
    """The tensors of a nested cache state (dicts, tuples, lists), in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in tensors(state[k])]
    if isinstance(state, (tuple, list)):
        return [t for x in state for t in tensors(x)]
    return []


def shell(state):
    """A copy of a nested state's containers holding the same tensor objects."""
    if isinstance(state, dict):
        return {k: shell(v) for k, v in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(shell(x) for x in state)
    return state


class GraphedStep:
    """One decode step of an fla model (its `Cache` of per-layer states) captured in a CUDA
    graph. The step's new states are copied into the buffers the cache held at capture, and the
    cache is pointed back at them, so every replay continues from the last one."""

    def __init__(self, model, ids, cache, warmup=3):
        if not all(hasattr(layer, "state") for layer in getattr(cache, "layers", [None])):
            raise RuntimeError("CUDA graphs here need an fla Cache")
        self.model, self.ids, self.cache = model, ids.clone(), cache
        self.shells = [shell(layer.state) for layer in cache.layers]
        self.seen = [layer._seen_tokens for layer in cache.layers]
        self.buffers = [t for layer in cache.layers for t in tensors(layer.state)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.body()

    def body(self):
        out = self.model(self.ids, past_key_values=self.cache, use_cache=True)
        new = [t for layer in self.cache.layers for t in tensors(layer.state)]
        if len(new) != len(self.buffers):
            raise RuntimeError("the cache changed shape during a step")
        for old, t in zip(self.buffers, new):
            if t is not old:
                old.copy_(t)
        for layer, sh, seen in zip(self.cache.layers, self.shells, self.seen):
            layer.state, layer._seen_tokens = shell(sh), seen
        return out.logits

    def replay(self):
        self.graph.replay()


def graphed_round(model, ids, steps, warmup):
    """Prefill `ids`, capture the step, replay it `warmup` times, then time `steps` replays;
    the mean seconds per step."""
    cache, nxt = step(model, ids, None)
    g = GraphedStep(model, nxt, cache)
    for _ in range(warmup):
        g.replay()
    sync(ids.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        g.replay()
    sync(ids.device)
    return (time.perf_counter() - t0) / steps


def bench_graphs(paths, batch, prompt, steps, rounds, warmup, vocab_cap, device):
    """Median over rounds of the mean ms per graphed step of every model, models in turns."""
    models = [load(p, device) for p in paths]
    ids = prompts(models, batch, prompt, vocab_cap, device)
    times = [[] for _ in models]
    failed = [None for _ in models]
    with torch.no_grad():
        for _ in range(rounds):
            for k, (m, x) in enumerate(zip(models, ids)):
                if failed[k] is None:
                    try:
                        times[k].append(graphed_round(m, x, steps, warmup))
                    except Exception as e:  # a model whose step cannot be captured is reported, not timed
                        failed[k] = f"{type(e).__name__}: {e}"
                        print(f"{paths[k]}: CUDA graph capture failed: {failed[k]}", flush=True)
    del models
    torch.cuda.empty_cache()
    return [None if f else 1000 * statistics.median(t) for t, f in zip(times, failed)]


def bench(paths, batch, prompt, steps, rounds, vocab_cap, device):
    """Median ms per decode step of every model; the models take turns round by round, so that
    clock or thermal drift during the run hits all of them alike."""
    models = [load(p, device) for p in paths]
    ids = prompts(models, batch, prompt, vocab_cap, device)
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
    ap.add_argument("--graphs", action="store_true", help="capture each step in a CUDA graph (fla models)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed replays before each timed round (--graphs)")
    args = ap.parse_args()
    try:
        import fla  # noqa: F401  registers fla models with transformers
    except ImportError:
        pass
    rows = []
    dev = torch.device(args.device)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        if args.graphs:
            ms_all = bench_graphs(args.models, b, args.prompt_len, args.steps, args.rounds, args.warmup,
                                  args.vocab_cap, dev)
        else:
            ms_all = bench(args.models, b, args.prompt_len, args.steps, args.rounds, args.vocab_cap, dev)
        for m, ms in zip(args.models, ms_all):
            rows.append({"model": m, "batch": b, "decode_ms_per_step": ms, "cuda_graphs": args.graphs})
            if ms is not None:
                print(f"{m} batch {b}: {ms:.3f} ms/step{' (CUDA graph)' if args.graphs else ''}", flush=True)
        json.dump(rows, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
