#!/usr/bin/env python3
"""Reference SSE causal LM (Sparse State Expansion, arXiv 2507.16577) in plain PyTorch, with the
GLA (`linear_attn_type: "gla"`) or the Gated DeltaNet (`"gdn"`) transition in every partition.

The layer follows flash-linear-attention's `fla/layers/sse.py` (`SSEGLA`, `SSEGDN`) and the model
`fla/models/sse/` (config `model_type: "sse"`), with the same module names so that the
checkpoint's tensor names are fla's:

  model.embeddings.weight
  model.layers.{i}.attn_norm.weight, model.layers.{i}.mlp_norm.weight
  model.layers.{i}.attn.q_proj.weight, k_proj.weight, v_proj.weight         [key_dim|value_dim, D]
  model.layers.{i}.attn.lora_q_proj.{0,1}.weight, lora_k_proj.{0,1}.weight  D -> head_v_dim -> key_dim
  model.layers.{i}.attn.gk_proj.{0,1}.0.weight, gk_proj.{0,1}.1.{weight,bias}  D -> 16 -> key_dim
      (gk_proj.0 is the shared partition's decay, gk_proj.1 the sparse partitions'; GLA)
  model.layers.{i}.attn.a_proj.weight, b_proj.weight [2H, D], A_log, dt_bias [2H]
      (GDN; the first H outputs are the shared partition's, the last H the sparse ones')
  model.layers.{i}.attn.e_proj.weight                                        [N, D] router
  model.layers.{i}.attn.q_conv1d_shared.weight, k_conv1d_shared.weight      [key_dim, 1, K] (use_short_conv)
  model.layers.{i}.attn.g_proj.{0,1}.weight                                  D -> head_v_dim -> value_dim
  model.layers.{i}.attn.o_norm.weight, o_proj.weight
  model.layers.{i}.mlp.{gate,up,down}_proj.weight
  model.norm.weight, lm_head.weight (absent when tie_word_embeddings)

Per head, with q, k of width dk and the scale dk^-1/2:
  shared path:  q1 = silu(conv(x W_q)), k1 = softmax(conv(x W_k)), g1 = logsigmoid(gk_proj.0(x)) / 16
  sparse path:  q2 = silu(x W_q + lora_q(x)), k2 = softmax(x W_k + lora_k(x)), g2 = ... gk_proj.1
  v = silu(x W_v);  e = softmax(x W_e) over N partitions; T = top-k(e) (k = num_writer = num_reader)
  shared:  S0 <- diag(exp g1) S0 + k1 v^T                      (every token)
  p in T:  Sp <- diag(exp g2) Sp + e_p k2 v^T                   (unselected partitions: unchanged,
                                                                 no decay either)
  o = S0^T (scale q1) + sum_{p in T} e_p Sp^T (scale q2)
  out = o_proj(rmsnorm(o) * w * silu(g_proj(x)))

The GDN variant keeps everything but the transition and the key/query feature maps:
  q = l2norm(silu(.)), k = l2norm(silu(.)) (fla's Gated DeltaNet: SiLU, then the kernel's L2 norm),
  normalised before the routing weight scales them (otherwise the norm would undo emulq/emulk);
  g = -exp(A_log) * softplus(a_proj(x) + dt_bias) per head, beta = sigmoid(b_proj(x)) (x2 with
  allow_neg_eigval), each split into the shared half and the sparse half;
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T   (gated delta rule, per partition; e_p k for
  the routed ones, which leaves unselected partitions unchanged as k = 0 there).

SSE-H hybrids put fla's softmax `Attention` (q/k/v/o_proj, rotary, GQA) in the layers that the
config's `attn` dict lists (`{"layers": [...], "num_heads", "num_kv_heads", "qkv_bias",
"window_size", "rope_theta"}`), as every fla model does.

Three computations of the same layer, which must agree:
  mask:   (N+1)·H heads, sparse heads partition-major, q·e·read-mask, k·e·write-mask, v and g
          times the write mask, one GLA pass, outputs summed over the N+1 partitions;
  varlen: per (sequence, partition) the routed tokens are gathered in order, the recurrence runs
          on that subsequence, outputs are scattered back and added to the shared path;
  loop:   one token at a time with all N+1 states.

Reading of fla's code (flash-linear-attention PR #882 files `fla/layers/sse.py`,
`fla/models/sse/`, `fla/ops/sse/`, as carried by BICLab/SpikingBrain2.0's
`flash-linear-attention_dev`):
  - `gk_proj` is a ModuleList of two low-rank decays: index 0 for the shared partition, 1 for the
    routed ones; both are per key channel (GLA `chunk_gla(g=gk)`), `logsigmoid(.) / 16`.
  - the LoRA corrections have rank head_v_dim and feed only the routed partitions; the short convs
    (`q_conv1d_shared`, `k_conv1d_shared`, no activation) only the shared one.
  - `use_k_softmax=True`, `use_q_softmax=False` (SiLU queries), `emulq=emulk=True`, v = silu(v);
    these, `gate_logit_normalizer=16` and `gate_low_rank_dim=16` are layer defaults, not config
    fields.
  - routing weights are the top-k softmax probabilities, not renormalised; the mask form masks
    v and g with the write mask (no decay for unselected partitions) and lays the sparse heads
    out partition-major; the varlen form needs num_writer == num_reader.
  - GLA's default scale dk^-1/2 applies to every partition.

The layers and the model are in reference_torch.py, which the other reference scripts share;
this script trains, initialises, writes the goldens and evaluates.

Usage:
  sse_reference.py train --out DIR [--minutes 4] [--device cpu|cuda]   train, write goldens and reference.json
  sse_reference.py init --out DIR --linear-attn-type gdn               random tiny model + goldens (test fixture)
  sse_reference.py init --out DIR --layers 3 --attn-layers 1            an SSE-H hybrid
  sse_reference.py golden --out DIR                                     rewrite goldens (and reference.json)
  sse_reference.py --eval DIR [--eval-file F] [--eval-windows 8] [--eval-seqlen 512]
"""

import argparse
import glob
import json
import math
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from reference_torch import SSE, SSEForCausalLM, first_tokens, init_normal, load_sse, perplexity, random_windows
from reference_torch import save_checkpoint, shared_dir, stream, tokenizer, train, warmup_cosine, windows, write_json
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))

# The reference data (shared_dir()) is needed only by the trained fixture and its text goldens;
# `init` and the random fixtures' goldens do without.

CONFIG = {
    "model_type": "sse",
    "architectures": ["SSEForCausalLM"],
    "attn_mode": "chunk",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_heads": 2,
    "num_v_heads": None,
    "head_dim": 64,
    "expand_v": 1.0,
    "use_output_gate": True,
    "use_short_conv": False,
    "conv_size": 4,
    "allow_neg_eigval": False,
    "num_sparse_partition": 4,
    "num_writer": 2,
    "num_reader": 2,
    "linear_attn_type": "gla",
    "sse_implementation": "mask",
    "aux_loss_coef": 0.01,
    "max_position_embeddings": 2048,
    "hidden_ratio": 4,
    "intermediate_size": 256,
    "hidden_act": "swish",
    "norm_eps": 1e-6,
    "attn": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "tie_word_embeddings": True,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "fuse_cross_entropy": True,
    "vocab_size": 4096,
}


# The random GDN test fixture: small enough to commit (a byte-sized vocabulary, no tokenizer).
TINY = {
    "hidden_size": 64,
    "num_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "use_short_conv": True,
    "vocab_size": 256,
    "sse_implementation": "varlen",
}


def cmd_eval(args):
    model, cfg = load_sse(args.eval, args.device)
    tok = tokenizer(os.path.join(args.eval, "tokenizer.json"))
    eval_file = args.eval_file or os.path.join(shared_dir(), "data/eval/wiki.jsonl")
    ids = stream(tok, cfg["eos_token_id"], [eval_file], args.eval_windows * args.eval_seqlen + 1)
    ppl, n = eval_ppl(model, ids, args.eval_seqlen, args.eval_windows, args.device)
    hd = cfg["head_dim"]
    print(f"{args.eval}: head_dim {hd}, {n} windows x {args.eval_seqlen} tokens, perplexity {ppl:.4f}")


# The perplexity protocol of reference.json: the script's float32 forward on the first windows of
# data/eval/wiki.jsonl (documents joined with </s>), which `statecut eval` must reproduce.
REFERENCE_WINDOWS, REFERENCE_SEQLEN = 8, 512
REFERENCE_KEY = f"eval_wiki_ppl_f32_{REFERENCE_SEQLEN}x{REFERENCE_WINDOWS}"


def eval_ppl(model, ids, seqlen, n, device):
    """Perplexity on the first n windows of ids, and how many there were."""
    wins = windows(ids, seqlen, n)
    return perplexity(lambda x: model(x)[0], wins, device), len(wins)


def cmd_train(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dev = args.device
    cfg = dict(CONFIG)
    tok_path = os.path.join(shared_dir(), "models/delta_net/tokenizer.json")
    tok = tokenizer(tok_path)
    cfg["vocab_size"] = tok.get_vocab_size()
    eos = tok.token_to_id("</s>")
    cfg["eos_token_id"] = eos
    cfg["use_short_conv"] = args.short_conv
    cfg["linear_attn_type"] = args.linear_attn_type
    cfg["aux_loss_coef"] = args.aux_coef
    calib = sorted(glob.glob(os.path.join(shared_dir(), "data/calib/*.jsonl")))
    ids = stream(tok, eos, calib, 10**9)
    print(f"training tokens: {len(ids)} on {dev}")
    data = torch.tensor(ids)
    model = SSEForCausalLM(cfg).to(dev)
    init_normal(model, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    L, bs = args.seqlen, args.batch

    def batch_loss():
        batch = random_windows(data, L, bs).to(dev)
        logits, _, aux = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        return loss + cfg["aux_loss_coef"] * aux, {"loss": loss, "aux": aux}

    step, last, t0 = train(model, opt, batch_loss, warmup_cosine(args.lr, 50, 0.1), minutes=args.minutes)
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": step,
        "train_tokens": step * bs * L,
        "train_seconds": round(time.time() - t0, 1),
        "final_train_loss": last.get("loss", torch.tensor(float("nan"))).item(),
        "train_device": torch.cuda.get_device_name(0) if str(dev).startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "seed": args.seed,
    }
    # Store bf16 weights, and compute the golden outputs from those (rounded) weights in float32.
    save_checkpoint(model, cfg, args.out, tok_path)
    write_golden(args.out, text_ids(args.out))
    write_reference(args.out, facts)


def cmd_init(args):
    """A randomly initialised tiny model (no tokenizer) and its goldens: a parity fixture.

    Weights are scaled so that every mixer moves the residual stream as much as the embedding
    does (a 0.02 init would leave the logits to the embeddings alone), and the router is sharp,
    so that top-k routing is far from ties."""
    torch.manual_seed(args.seed)
    cfg = dict(CONFIG, **TINY, linear_attn_type=args.linear_attn_type)
    cfg["num_hidden_layers"] = args.layers
    if args.attn_layers:
        # SSE-H: fla's attn dict; GQA with 4 query and 2 key/value heads
        cfg["attn"] = {
            "layers": [int(i) for i in args.attn_layers.split(",")],
            "num_heads": 4,
            "num_kv_heads": 2,
            "qkv_bias": False,
            "window_size": None,
            "rope_theta": 10000.0,
        }
    model = SSEForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("embeddings.weight"):
                nn.init.normal_(p, std=1.0)
            elif n.endswith("e_proj.weight"):
                nn.init.normal_(p, std=3.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
            elif n.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    save_checkpoint(model, cfg, args.out)
    write_golden(args.out, torch.randint(0, cfg["vocab_size"], (1, 64)))


def text_ids(out):
    """The first 128 tokens of data/eval/wiki.jsonl (the reference models' golden input)."""
    tok_path = os.path.join(out, "tokenizer.json")
    eos = tokenizer(tok_path).token_to_id("</s>")
    return first_tokens(tok_path, os.path.join(shared_dir(), "data/eval/wiki.jsonl"), eos, 128)


def router_margin(model, hidden):
    """Smallest gap between the k-th and the (k+1)-th routing probability over tokens and layers."""
    gaps = []
    with torch.no_grad():
        for blk, h in zip(model.model.layers, hidden):
            if not isinstance(blk.attn, SSE):
                continue
            e = blk.attn.features(blk.attn_norm(h))[7]
            top = torch.topk(e, blk.attn.topk + 1, dim=-1).values
            gaps.append((top[..., -2] - top[..., -1]).min().item())
    return min(gaps)


def write_golden(out, x):
    model, cfg = load_sse(out)
    with torch.no_grad():
        logits, hidden, _ = model(x, "mask")
        lv, hv, _ = model(x, "varlen")
        ll, hl, _ = model(x, "loop")
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"mask vs varlen: logits rel {rel(lv, logits):.2e}; mask vs loop: logits rel {rel(ll, logits):.2e}")
    margin = router_margin(model, hidden)
    print(f"smallest router margin {margin:.2e}")
    if margin < 1e-5:
        print("warning: near-tie in top-k routing; float differences may route a token differently")
    for a, b in zip(hidden, hv):
        assert rel(b, a) < 1e-5
    for a, b in zip(hidden, hl):
        assert rel(b, a) < 1e-5
    assert rel(lv, logits) < 1e-5 and rel(ll, logits) < 1e-5
    save_file(
        {
            "input_ids": x.to(torch.int64).contiguous(),
            "logits": logits.float().contiguous(),
            "hidden_states": torch.stack(hidden).float().contiguous(),
            "last_hidden_varlen": hv[-1].float().contiguous(),
            "last_hidden_loop": hl[-1].float().contiguous(),
        },
        os.path.join(out, "golden.safetensors"),
    )
    print(f"wrote {out}/golden.safetensors")


def write_reference(out, facts=None):
    """reference.json: training facts and the perplexity of REFERENCE_KEY (kept facts of an
    earlier file when only the perplexity is recomputed)."""
    path = os.path.join(out, "reference.json")
    ref = json.load(open(path)) if os.path.exists(path) else {}
    ref.update(facts or {})
    model, cfg = load_sse(out)
    tok = tokenizer(os.path.join(out, "tokenizer.json"))
    want = REFERENCE_WINDOWS * REFERENCE_SEQLEN + 1
    ids = stream(tok, cfg["eos_token_id"], [os.path.join(shared_dir(), "data/eval/wiki.jsonl")], want)
    ppl, n = eval_ppl(model, ids, REFERENCE_SEQLEN, REFERENCE_WINDOWS, "cpu")
    assert n == REFERENCE_WINDOWS
    ref[REFERENCE_KEY] = ppl
    write_json(path, ref)
    print(f"{REFERENCE_KEY} = {ppl:.4f}; wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "cmd",
        nargs="?",
        choices=["train", "init", "golden"],
        help="train a tiny model, make a random one, or rewrite golden outputs",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "sse_gla"), help="model directory")
    ap.add_argument("--minutes", type=float, default=4.0, help="training time budget")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (training; goldens are always CPU float32)")
    ap.add_argument("--linear-attn-type", choices=["gla", "gdn"], default="gla", help="transition in every partition")
    ap.add_argument("--layers", type=int, default=2, help="init: number of layers")
    ap.add_argument("--attn-layers", help="init: comma-separated softmax attention layers (an SSE-H hybrid)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--short-conv", action="store_true", help="train with use_short_conv")
    ap.add_argument("--aux-coef", type=float, default=0.1, help="load-balance loss weight (config aux_loss_coef)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval", metavar="DIR", help="load a checkpoint and print perplexity")
    ap.add_argument("--eval-file", help="evaluation text (default: the reference data's data/eval/wiki.jsonl)")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.eval:
        cmd_eval(args)
    elif args.cmd == "train":
        cmd_train(args)
    elif args.cmd == "init":
        cmd_init(args)
    elif args.cmd == "golden":
        if os.path.exists(os.path.join(args.out, "tokenizer.json")):
            write_golden(args.out, text_ids(args.out))
            write_reference(args.out)
        else:
            write_golden(args.out, load_file(os.path.join(args.out, "golden.safetensors"))["input_ids"])
    else:
        ap.error("give `train`, `init`, `golden` or --eval DIR")


if __name__ == "__main__":
    main()
