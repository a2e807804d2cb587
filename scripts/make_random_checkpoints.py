#!/usr/bin/env python3
"""Random-weight checkpoints with the real dimensions of the models users prune, saved by the
upstream libraries themselves (fla for DeltaNet / Gated DeltaNet, transformers for Qwen3.5), in
bf16. Speed depends on shapes, not on trained values; these are for benchmarks only.

  delta_net_1p3b   fla-hub/delta_net-1.3B-100B: hidden 2048, 24 layers, 16 heads x 128, vocab 32000
  gdn_1p3b         Gated DeltaNet 1.3B: hidden 2048, 24 layers, 8 heads x 256 (expand_v 1), vocab 32000
  qwen3_5_9b       Qwen3.5-9B text model: hidden 4096, 32 layers (every 4th full attention,
                   16 q / 4 kv heads x 256), linear attention 16 key heads x 128 and 32 value
                   heads x 128, MLP 12288, vocab 248320
  mamba2_7b        Mamba-2 at Mamba-Codestral-7B's shapes: hidden 4096, 64 layers, 128 heads x 64,
                   8 groups, state 128, vocab 32768 (transformers' Mamba2ForCausalLM)
  qwen3_5_35b_a3b  Qwen3.5/3.6-35B-A3B text model (Qwen3_5MoeForCausalLM): hidden 2048, 40 layers
                   (every 4th full attention, 16 q / 2 kv heads x 256), linear attention 16 key
                   heads x 128 and 32 value heads x 128, 256 experts (top 8) of 512 plus a shared
                   expert of 512, vocab 248320; about 1.6 GB of experts per layer in bf16, so
                   `--set num_hidden_layers=N` keeps a prefix that fits the disk

The tokenizer files are copied from --tokenizer-from (a small trained model's tokenizer: its ids
are valid in the larger vocabularies), so text-driven commands run unchanged.

    python3 scripts/make_random_checkpoints.py OUT --models delta_net_1p3b --tokenizer-from DIR
"""

import argparse
import json
import os
import shutil

import torch


def build(name, overrides):
    """The model NAME with config fields replaced by `overrides` (for small smoke tests)."""
    if name == "delta_net_1p3b":
        from fla.models import DeltaNetConfig as Config, DeltaNetForCausalLM as Model

        kw = dict(hidden_size=2048, num_hidden_layers=24, num_heads=16, expand_k=1, expand_v=1,
                  vocab_size=32000, use_short_conv=True, conv_size=4, qk_activation="silu",
                  qk_norm="l2", use_beta=True, use_gate=False, hidden_ratio=4,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    elif name == "gdn_1p3b":
        from fla.models import GatedDeltaNetConfig as Config, GatedDeltaNetForCausalLM as Model

        kw = dict(hidden_size=2048, num_hidden_layers=24, num_heads=8, head_dim=256, expand_v=1,
                  vocab_size=32000, use_short_conv=True, conv_size=4, use_gate=True,
                  hidden_ratio=4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    elif name == "qwen3_5_9b":
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config

        kw = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, vocab_size=248320,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    elif name == "mamba2_7b":
        from transformers import Mamba2Config as Config, Mamba2ForCausalLM as Model

        kw = dict(hidden_size=4096, num_hidden_layers=64, state_size=128, n_groups=8, head_dim=64,
                  num_heads=128, expand=2, conv_kernel=4, vocab_size=32768, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    elif name == "qwen3_5_35b_a3b":
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config

        kw = dict(hidden_size=2048, num_hidden_layers=40, vocab_size=248320, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                  linear_num_value_heads=32, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, attn_output_gate=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    else:
        raise SystemExit(f"unknown model {name}")
    kw.update(overrides)
    if name in ("qwen3_5_9b", "qwen3_5_35b_a3b"):
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Model(Config(**kw))


def parse_overrides(items):
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = json.loads(value) if value[:1] in "0123456789-[{tf\"" else value
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--models", default="delta_net_1p3b,gdn_1p3b,qwen3_5_9b")
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (JSON value), e.g. for a small smoke test")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    torch.manual_seed(0)
    for name in args.models.split(","):
        with torch.device(args.device):
            model = build(name, overrides).to(torch.bfloat16)
        dst = os.path.join(args.out, name)
        model.save_pretrained(dst, max_shard_size="5GB")
        for f in os.listdir(args.tokenizer_from):
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                shutil.copy(os.path.join(args.tokenizer_from, f), dst)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name}: {n / 1e9:.2f}B parameters -> {dst}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
