#!/usr/bin/env python3
"""GPU time by kernel from an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv
--print-units base`), summed by kernel name and by kind, largest first.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        statecut recover ... > ncu.csv
    python3 scripts/kernel_times.py ncu.csv [--top 40] [--json out.json]
"""

import argparse
import collections
import csv
import io
import json
import re

# Kinds, tried in order: the first pattern a kernel's name matches names its kind.
KINDS = [
    ("cuBLAS / cuBLASLt products", r"gemm|gemv|cutlass|sm90_xmma|nvjet|splitK|cublas"),
    ("statecut chunk kernels", r"^chunk_|to_chunks|from_chunks"),
    ("statecut other kernels", r"^(delta_|gated_|walk|recurrence|conv_|ssd_|mamba|kd_|fused_)"),
    ("candle casts", r"^cast_"),
    ("candle copies", r"^copy|ucopy|copy2d"),
    ("candle reductions", r"^(fast_)?(sum|max|min|argmax|argmin)|reduce|softmax|rmsnorm|layernorm"),
    ("candle binary ops", r"^b(add|sub|mul|div|maximum|minimum)|^(eq|ne|lt|le|gt|ge)_"),
    ("candle unary / affine ops", r"^u|^affine|^powf|^elu|^where|^fill|^const_set|^index|^gather|^scatter|^is_"),
]


def kind(name):
    for label, pat in KINDS:
        if re.search(pat, name):
            return label
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    text = open(args.csv, errors="replace").read()
    # ncu prints the program's own output before the table; the table starts at its header.
    start = text.find('"ID","Process ID"')
    if start < 0:
        raise SystemExit(f"{args.csv}: no ncu CSV table in it")
    by_name = collections.Counter()
    calls = collections.Counter()
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        name = row["Kernel Name"]
        by_name[name] += ns
        calls[name] += 1
    by_kind = collections.Counter()
    kind_calls = collections.Counter()
    for name, ns in by_name.items():
        by_kind[kind(name)] += ns
        kind_calls[kind(name)] += calls[name]
    total = sum(by_name.values())
    print(f"total GPU time {total / 1e6:.1f} ms over {sum(calls.values())} launches")
    print("\nby kind (ms, launches, share):")
    for k, ns in by_kind.most_common():
        print(f"  {ns / 1e6:10.1f}  {kind_calls[k]:8d}  {100 * ns / total:5.1f}%  {k}")
    print(f"\ntop {args.top} kernels (ms, launches, share):")
    for name, ns in by_name.most_common(args.top):
        print(f"  {ns / 1e6:10.1f}  {calls[name]:8d}  {100 * ns / total:5.1f}%  {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_ms": total / 1e6, "launches": sum(calls.values()),
                       "by_kind_ms": {k: v / 1e6 for k, v in by_kind.items()},
                       "by_kernel": {n: {"ms": v / 1e6, "launches": calls[n]} for n, v in by_name.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
