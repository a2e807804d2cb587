"""fla's chunk kernels alone, forward and forward + backward, at the shapes benches/recurrence.rs
times statecut's forms at: one JSON line per kernel and pass.

    python3 scripts/recurrence_reference.py --shape 16,2048,16,128,128 --decay none|head|channel [--grad sum|seed]

Inputs match the statecut bench: q and k L2-normalised before the clock starts (fla's
`use_qk_l2norm_in_kernel` is off), beta = sigmoid, log decay g = -0.1 sigmoid (per head, or per key
channel for KDA), bf16 q/k/v/beta, float32 g, no initial state. Timing: CUDA events around the call
(and its backward), the median of --iterations after 2 untimed runs (Triton compiles on the first).
A kernel that refuses on this machine prints its error instead of a time.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16,2048,16,128,128")
    ap.add_argument("--decay", default="none", choices=["none", "head", "channel"])
    ap.add_argument("--iterations", type=int, default=5)
    # sum: backward of sum(o.float() * w); seed: o.backward(w), the output gradient alone
    # (benches/recurrence.rs --grad takes the same two).
    ap.add_argument("--grad", default="sum", choices=["sum", "seed"])
    a = ap.parse_args()
    b, t, h, dk, dv = map(int, a.shape.split(","))
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(b, t, h, dk, device=dev), dim=-1).to(bf)
    k = F.normalize(torch.randn(b, t, h, dk, device=dev), dim=-1).to(bf)
    v = torch.randn(b, t, h, dv, device=dev).to(bf)
    beta = torch.sigmoid(torch.randn(b, t, h, device=dev)).to(bf)
    w = torch.randn(b, t, h, dv, device=dev)
    w_seed = w.to(bf)
    if a.decay == "none":
        from fla.ops.delta_rule import chunk_delta_rule

        name = "chunk_delta_rule"
        fn = lambda q, k, v, beta: chunk_delta_rule(q, k, v, beta, scale=dk**-0.5)
        extra = []
    elif a.decay == "head":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        name = "chunk_gated_delta_rule"
        g = (-0.1 * torch.sigmoid(torch.randn(b, t, h, device=dev))).float()
        fn = lambda q, k, v, beta, g: chunk_gated_delta_rule(q, k, v, g, beta, scale=dk**-0.5)
        extra = [g]
    else:
        from fla.ops.kda import chunk_kda

        name = "chunk_kda"
        g = (-0.1 * torch.sigmoid(torch.randn(b, t, h, dk, device=dev))).float()
        fn = lambda q, k, v, beta, g: chunk_kda(q, k, v, g, beta, scale=dk**-0.5)
        extra = [g]
    for backward in (False, True):
        xs = [x.detach().clone().requires_grad_(backward) for x in (q, k, v, beta, *extra)]

        def run():
            o = fn(*xs)[0]
            if backward and a.grad == "seed":
                o.backward(w_seed)
            elif backward:
                (o.float() * w).sum().backward()

        line = {"form": f"fla {name}", "pass": "forward+backward" if backward else "forward", "b": b, "t": t,
                "h": h, "dk": dk, "dv": dv, "decay": a.decay, "dtype": "bf16", "grad": a.grad}
        try:
            for _ in range(2):
                run()
            times = []
            for _ in range(a.iterations):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                run()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            line.update(ms=statistics.median(times), runs_ms=times)
        except Exception as err:  # a kernel that refuses on this GPU / Triton
            line.update(error=f"{type(err).__name__}: {err}"[:400])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
