#!/usr/bin/env python3
"""The recurrent-state part of a decode step, with fla's own fused recurrent kernels: for every
layer of each model, one token of the (gated) delta rule on a float32 state [B, H, d_k, d_v],
bf16 inputs, the state read and written in place of the model's other work. This is the cost a
smaller d_k cuts; the whole-model decode (scripts/decode_bench.py) adds the projections, MLPs and
per-token launch overhead on top. Head counts and widths come from each checkpoint's own
k_proj / v_proj shapes (so a pruned checkpoint is measured with its real d_k). Models take turns
(A B A B), `--rounds` rounds of `--steps` steps, median ms per decode step (all layers).

    python3 scripts/state_step_bench.py --models ORIG PRUNED --batch-sizes 1,16,64 --json s.json
"""

import argparse
import json
import statistics

import torch
from safetensors import safe_open


def shapes(path):
    """(kind, layers, heads, d_k, d_v) of an fla DeltaNet / Gated DeltaNet checkpoint."""
    cfg = json.load(open(f"{path}/config.json"))
    index = f"{path}/model.safetensors.index.json"
    try:
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    except FileNotFoundError:
        files = ["model.safetensors"]
    dims = {}
    for f in files:
        with safe_open(f"{path}/{f}", "pt") as st:
            for name in ("k_proj", "v_proj"):
                key = f"model.layers.0.attn.{name}.weight"
                if key in st.keys():
                    dims[name] = st.get_slice(key).get_shape()[0]
    h = cfg["num_heads"]
    return cfg["model_type"], cfg["num_hidden_layers"], h, dims["k_proj"] // h, dims["v_proj"] // h


def stepper(path, batch, device):
    from fla.ops.delta_rule import fused_recurrent_delta_rule
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    kind, layers, h, dk, dv = shapes(path)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, device=device, generator=g)

    q = rnd(batch, 1, h, dk).bfloat16()
    k = torch.nn.functional.normalize(rnd(batch, 1, h, dk), dim=-1).bfloat16()
    v = rnd(batch, 1, h, dv).bfloat16()
    beta = torch.sigmoid(rnd(batch, 1, h)).bfloat16()
    gate = -torch.nn.functional.softplus(rnd(batch, 1, h))
    states = [torch.zeros(batch, h, dk, dv, device=device) for _ in range(layers)]

    def step():
        for i in range(layers):
            if kind == "gated_deltanet":
                _, states[i] = fused_recurrent_gated_delta_rule(
                    q, k, v, g=gate, beta=beta, initial_state=states[i], output_final_state=True
                )
            else:
                _, states[i] = fused_recurrent_delta_rule(
                    q, k, v, beta=beta, initial_state=states[i], output_final_state=True
                )

    return step, (kind, layers, h, dk, dv)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        steppers = [stepper(p, batch, device) for p in args.models]
        for s, _ in steppers:  # compile and warm up
            for _ in range(3):
                s()
        times = [[] for _ in steppers]
        for _ in range(args.rounds):
            for i, (s, _) in enumerate(steppers):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    s()
                end.record()
                torch.cuda.synchronize()
                times[i].append(start.elapsed_time(end) / args.steps)
        for path, (_, dims), t in zip(args.models, steppers, times):
            ms = statistics.median(t)
            rows.append({"model": path, "batch": batch, "shape": dims, "ms_per_step": ms})
            kind, layers, h, dk, dv = dims
            print(f"{path} batch {batch}: {ms:.3f} ms/step ({layers} layers x {h} heads, d_k {dk}, d_v {dv})")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
