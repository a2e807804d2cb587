#!/usr/bin/env python3
"""Reference gradients for statecut's backward pass, from PyTorch autograd in float32.

For each model: the mean next-token cross-entropy over its golden `input_ids` (the fixture's
golden.safetensors), `loss.backward()`, and the gradient of every parameter except the embeddings
and the LM head: the projections the Grad selector scores, every short conv, norm, bias and decay
parameter of the linear-attention and Mamba-2 mixers, the attention and MLA projections, the MoE
routers and the MLPs. Models:

  transformers' own classes (eager attention):   qwen3_5, mamba2 (../shared), qwen3_5_moe,
                                                 nemotron_h, granite_h, falcon_h1, kimi_linear
                                                 (tests/fixtures)
  plain PyTorch with fla's tensor names:         delta_net, gated_deltanet (../shared), gdn_moby
                                                 (the shipped model), sse_gla, sse_gdn, sse_h

fla's own layers need Triton, so DeltaNet / Gated DeltaNet / SSE run as plain-PyTorch modules with
fla's names and math (reference_torch.py); their recurrences run token by token.

Written to tests/fixtures/grad/NAME.safetensors: `loss` (float64 scalar as [1]), and for each
parameter `grad.NAME` (float32) and, for matrices of more than 4096 elements, `rows.NAME`: every
stride-th row of the gradient viewed as [-1, last dim] (8 rows at most, spread over the heads),
so the goldens stay small while every tensor is checked.

    python3 scripts/grad_reference.py --shared ../shared [--only NAME ...]
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_torch as ref  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
FULL_LIMIT = 4096
MAX_ROWS = 8

TRANSFORMERS = ["qwen3_5", "mamba2", "qwen3_5_moe", "nemotron_h", "granite_h", "falcon_h1",
                "kimi_linear"]
PLAIN = ["delta_net", "gated_deltanet", "gdn_moby", "sse_gla", "sse_gdn", "sse_h"]
SHARED = {"qwen3_5", "mamba2", "delta_net", "gated_deltanet"}


def model_dir(name, shared):
    if name in SHARED:
        return os.path.join(shared, "models", name)
    if name == "gdn_moby":
        return os.path.join(ROOT, "assets", "models", "gdn-moby")
    return os.path.join(FIXTURES, name)


def golden(name, shared):
    d = os.path.join(FIXTURES, "gdn_moby") if name == "gdn_moby" else model_dir(name, shared)
    return load_file(os.path.join(d, "golden.safetensors"))


def check_logits(name, logits, gold):
    """The model here is the one the golden logits came from (the upstream library's forward)."""
    want = gold["logits"].float()
    got = logits.detach()
    if "logit_positions" in gold:
        got = got[:, gold["logit_positions"].long()]
    got = got[..., : want.shape[-2], :] if got.shape != want.shape else got
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-3, f"{name}: logits differ from the golden ones by {rel:.2e}"
    return rel


def fla_model(name, d):
    """A plain-PyTorch model with fla's names, its weights loaded strictly, and a forward to logits."""
    if name.startswith("sse"):
        model, _ = ref.load_sse(d)
        return model, lambda ids: model(ids)[0]
    cfg, sd = ref.read_checkpoint(d)
    if name == "delta_net":
        model = ref.CausalLM(cfg, lambda cfg, i: ref.DeltaNet(cfg))
    else:
        model = ref.GatedDeltaNetForCausalLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval(), lambda ids: model(ids, "recurrent")[0]


def hf_model(name, d):
    """transformers' model in float32. The shared models' goldens come from transformers 5.17, which
    holds the RoPE `inv_freq` buffer in the checkpoint's dtype (bf16) as users of the released bf16
    checkpoints get it; 5.24 keeps it in float32, which moves Qwen3.5's logits by 1.7e-4 from its
    golden ones and its attention gradients by up to 3e-3. Rounding the buffer to bf16 gives the
    golden logits back to 4e-7."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    if name in SHARED:
        for module in model.modules():
            for buf in ("inv_freq", "original_inv_freq"):
                if isinstance(getattr(module, buf, None), torch.Tensor):
                    setattr(module, buf, getattr(module, buf).bfloat16().float())
    model.eval()
    return model, lambda ids: model(input_ids=ids).logits


def stored(d):
    tensors = {}
    for f in sorted(os.listdir(d)):
        if f.startswith("model") and f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as st:
                for k in st.keys():
                    tensors[k] = st.get_tensor(k).float()
    return tensors


def checkpoint_names(model, d):
    """The checkpoint name of each parameter. transformers renames some tensors when it loads them
    (Nemotron-H's `backbone.`, Qwen3.5-MoE's `language_model`), so a parameter is matched to the
    stored tensor of its shape and values, the name with the longest common ending among equals.
    A parameter made of several stored tensors (fused experts, Kimi's one conv of three) has none."""
    on_disk = stored(d)
    names = {}
    for pname, p in model.named_parameters():
        same = [k for k, t in on_disk.items() if t.shape == p.shape and torch.equal(t, p.detach())]
        if same:
            common = lambda k: len(os.path.commonprefix([k[::-1], pname[::-1]]))  # noqa: E731
            names[pname] = max(same, key=common)
    return names


def skipped(name):
    return "embed" in name or name.startswith("lm_head") or name.endswith("lm_head.weight")


def put_grad(tensors, name, g):
    """`grad.NAME`, and for a matrix of more than FULL_LIMIT elements only its sampled rows, listed
    in `rows.NAME`."""
    g = g.detach().float()
    if g.numel() > FULL_LIMIT:
        g2 = g.reshape(-1, g.shape[-1])
        stride = math.ceil(g2.shape[0] / MAX_ROWS)
        rows = torch.arange(0, g2.shape[0], stride)
        tensors[f"rows.{name}"] = rows.to(torch.int64)
        g = g2[rows]
    tensors[f"grad.{name}"] = g.contiguous()


def make(name, shared, out):
    d = model_dir(name, shared)
    torch.manual_seed(0)
    model, forward = hf_model(name, d) if name in TRANSFORMERS else fla_model(name, d)
    gold = golden(name, shared)
    ids = gold["input_ids"].long()
    logits = forward(ids).float()
    rel = check_logits(name, logits, gold)
    loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    names = checkpoint_names(model, d)
    tensors = {"loss": torch.tensor([loss.item()], dtype=torch.float64)}
    left_out = []
    for pname, p in model.named_parameters():
        if skipped(pname):
            continue
        if pname not in names or p.grad is None:
            left_out.append(pname)
            continue
        put_grad(tensors, names[pname], p.grad)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.safetensors")
    save_file(tensors, path, metadata={"model": name, "tokens": str(ids.shape[1]), "torch": torch.__version__})
    kept = sum(1 for k in tensors if k.startswith("grad."))
    print(f"{path}: loss {loss.item():.6f} (logits {rel:.1e} from the golden ones), {kept} gradients, {os.path.getsize(path) / 1e3:.0f} kB"
          + (f"; not stored as one tensor: {left_out}" if left_out else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", required=True, help="the shared reference data folder")
    ap.add_argument("--out", default=os.path.join(FIXTURES, "grad"))
    ap.add_argument("--only", nargs="*", default=TRANSFORMERS + PLAIN)
    a = ap.parse_args()
    torch.set_num_threads(2)
    for name in a.only:
        make(name, a.shared, a.out)


if __name__ == "__main__":
    main()
