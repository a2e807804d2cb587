#!/usr/bin/env python3
"""CPU speed of the release build on the reference models: `statecut eval` tokens/s (64 windows
of 512 tokens of eval/wiki, the reference protocol) and `statecut bench` prefill/decode, each for
the original model and a DRRQR-pruned copy (50% of key channels). Prints a Markdown section.

Usage: python3 scripts/bench_cpu.py [--bin target/release/statecut] [--shared ../shared] > section.md
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

MODELS = ["delta_net", "gated_deltanet", "mamba2", "qwen3_5"]


def run(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/statecut")
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--batch-sizes", default="1,16")
    a = ap.parse_args()
    evalf = os.path.join(a.shared, "data", "eval", "wiki.jsonl")
    calib = os.path.join(a.shared, "data", "calib", "wiki.jsonl")
    tmp = tempfile.mkdtemp(prefix="statecut-bench-")
    cpu = platform.processor() or platform.machine()
    ncpu = os.cpu_count()
    lines = [f"CPU: {ncpu} cores ({cpu}), release build, float32. Commands: `statecut eval -m MODEL --data "
             "eval/wiki.jsonl --json` (64 x 512 tokens) and `statecut bench -m MODEL --compare PRUNED "
             f"--batch-sizes {a.batch_sizes} --prompt-len 512 --decode-steps 32 --iterations 3 --json`; PRUNED is "
             "`statecut prune --method drrqr --ratio 0.5` of the same model. Medians of 3 after 1 warm-up.", "",
             "| model | eval tokens/s | batch | prefill tok/s (orig / pruned) | decode ms/token (orig / pruned) | decode speedup | state+cache elements (orig / pruned) |",
             "|---|---|---|---|---|---|---|"]
    for m in MODELS:
        mdir = os.path.join(a.shared, "models", m)
        ev = json.loads(run([a.bin, "eval", "-m", mdir, "--data", evalf, "--json", "-q"]))
        pruned = os.path.join(tmp, m)
        run([a.bin, "prune", "-m", mdir, "--method", "drrqr", "--ratio", "0.5", "--calib", calib, "--nsamples", "16",
             "--seqlen", "512", "-o", pruned, "-q"])
        rep = json.loads(run([a.bin, "bench", "-m", mdir, "--compare", pruned, "--batch-sizes", a.batch_sizes,
                              "--prompt-len", "512", "--decode-steps", "32", "--iterations", "3", "--json", "-q"]))
        for i, (x, y) in enumerate(zip(rep[0]["rows"], rep[1]["rows"])):
            lines.append(
                f"| {m} | {ev['tokens_per_second']:.0f} | {x['batch']} | {x['prefill_tokens_per_s']:.0f} / "
                f"{y['prefill_tokens_per_s']:.0f} | {x['decode_ms_per_token']:.2f} / {y['decode_ms_per_token']:.2f} | "
                f"{x['decode_ms_per_token'] / y['decode_ms_per_token']:.2f}x | {x['cache_elems']} / {y['cache_elems']} |"
                if i == 0 else
                f"| | | {x['batch']} | {x['prefill_tokens_per_s']:.0f} / {y['prefill_tokens_per_s']:.0f} | "
                f"{x['decode_ms_per_token']:.2f} / {y['decode_ms_per_token']:.2f} | "
                f"{x['decode_ms_per_token'] / y['decode_ms_per_token']:.2f}x | {x['cache_elems']} / {y['cache_elems']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
