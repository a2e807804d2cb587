#!/usr/bin/env python3
"""Recovery on the reference models: prune with each selector at each ratio, recover with
`statecut recover`, and train the unpruned model with the same budget as a control, so that
what recovery buys is separated from what more training on the same text buys. Prints a
Markdown table (and writes every run's report under --out).

Usage: python3 scripts/recover_results.py [--shared ../shared] [--bin target/release/statecut]
           [--models gdn-moby,gated_deltanet] [--methods drrqr,grad] [--ratios 0.5,0.75]
           [--steps 60] [--batch 4] [--seqlen 256] [--lr 1e-4]
Training text: shared/data/calib/wiki.jsonl (the embedded model: assets/train.txt);
evaluation: shared/data/eval/wiki.jsonl (assets/eval.txt), disjoint from it.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def run(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"command failed:\n{out.stderr}")
    return out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default="../shared")
    ap.add_argument("--bin", default="target/release/statecut")
    ap.add_argument("--models", default="gdn-moby,gated_deltanet,delta_net,qwen3_5,mamba2")
    ap.add_argument("--methods", default="drrqr,grad")
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--steps", default="60")
    ap.add_argument("--batch", default="4")
    ap.add_argument("--seqlen", default="256")
    ap.add_argument("--lr", default="1e-4")
    ap.add_argument("--eval-windows", default="32")
    ap.add_argument("--eval-seqlen", default="512")
    ap.add_argument("--out", default="results/recover")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: f32 on the CPU, bf16 on GPUs)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    t0 = time.time()
    for m in a.models.split(","):
        if m == "gdn-moby":
            mdir, train, evalf = "assets/models/gdn-moby", "assets/train.txt", "assets/eval.txt"
        else:
            mdir = os.path.join(a.shared, "models", m)
            train = os.path.join(a.shared, "data", "calib", "wiki.jsonl")
            evalf = os.path.join(a.shared, "data", "eval", "wiki.jsonl")
        budget = ["--device", a.device, "--dtype", a.dtype, "--steps", a.steps, "--batch-size", a.batch, "--seqlen", a.seqlen, "--lr", a.lr, "--data", train,
                  "--eval", evalf, "--eval-windows", a.eval_windows, "--eval-seqlen", a.eval_seqlen, "-q"]
        # The control: the unpruned model, the same recipe and budget, its own teacher.
        ctrl = os.path.join(a.out, f"{m}-control")
        run([a.bin, "recover", "-m", mdir, "--teacher", mdir, "-o", ctrl, "--overwrite"] + budget)
        c = json.load(open(os.path.join(ctrl, "statecut_recover.json")))
        for method in a.methods.split(","):
            for ratio in a.ratios.split(","):
                pruned = os.path.join(a.out, f"{m}-{method}-{ratio}")
                run([a.bin, "prune", "-m", mdir, "--method", method, "--ratio", ratio, "--calib", train,
                     "--nsamples", "32", "--seqlen", "512", "-o", pruned, "--overwrite", "-q",
                     "--device", a.device, "--dtype", a.dtype])
                rec = pruned + "-recovered"
                run([a.bin, "recover", "-m", pruned, "--teacher", mdir, "-o", rec, "--overwrite"] + budget)
                r = json.load(open(os.path.join(rec, "statecut_recover.json")))
                p = r["ppl"]
                gap = p["pruned"] - p["teacher"]
                closed = (p["pruned"] - p["recovered"]) / gap if gap > 0 else float("nan")
                rows.append((m, method, ratio, p["teacher"], p["pruned"], p["recovered"], closed,
                             c["ppl"]["recovered"], r["tokens"], r["tokens_per_second"]))
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"| model | selector | ratio | base | pruned | recovered | gap closed | base + same training | tokens | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (m, method, ratio, base, pr, rc, closed, ctrl_ppl, tokens, tps) in rows:
        print(f"| {m} | {method} | {ratio} | {base:.2f} | {pr:.2f} | {rc:.2f} | {closed:.0%} | {ctrl_ppl:.2f} | {tokens} | {tps:.0f} |")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
