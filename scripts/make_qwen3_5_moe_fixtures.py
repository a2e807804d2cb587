#!/usr/bin/env python3
"""Small Qwen3.5/3.6 MoE checkpoints saved by transformers itself, with golden outputs.

  tests/fixtures/qwen3_5_moe/       Qwen3_5MoeForConditionalGeneration (the released wrapper:
                                    text_config, model.language_model.*, model.visual.*, and an
                                    mtp.* block with one tensor per expert, as the releases store it)
  tests/fixtures/qwen3_5_moe_text/  Qwen3_5MoeForCausalLM (flat text-only export, model.layers.*)

Both keep the released structure of Qwen3.6-35B-A3B (REAL-CHECKPOINTS.md §2.2) at a small width:
layer_types 3 linear : 1 full, linear key/value head dim 128 with twice as many value heads as key
heads, attention head_dim 256 with attn_output_gate and GQA, mrope rope_parameters with
partial_rotary_factor 0.25, 8 experts top-2 with a shared expert, bf16 weights, untied head.
save_pretrained writes the experts one tensor per expert; the script fuses the decoder layers'
experts into the 3-D tensors the bf16 releases store (checking that transformers computes the same
logits from both), and leaves the MTP experts per expert. The weights are seeded random, scaled
by 1/sqrt(fan_in) so that activations, routing and logits are far from trivial.

golden.safetensors holds transformers' float32 forward of the stored bf16 weights on the first
128 tokens of eval/wiki.jsonl: `input_ids` [1, 128], `hidden_states` [L + 1, 1, 128, H] (as
output_hidden_states returns them) and `logits` at positions `logit_positions` (every 8th: the
full [128, 4096] float32 logits alone would be 2 MB).

    python3 scripts/make_qwen3_5_moe_fixtures.py --shared ../shared --out tests/fixtures
"""

import argparse
import json
import math
import os
import re
import shutil

import torch
from reference_torch import first_tokens
from safetensors.torch import load_file, save_file

TEXT = dict(
    vocab_size=4096, hidden_size=16, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=256, attn_output_gate=True,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
    shared_expert_intermediate_size=24, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=None, max_position_embeddings=4096,
    partial_rotary_factor=0.25,
    rope_parameters=dict(mrope_interleaved=True, mrope_section=[11, 11, 10], partial_rotary_factor=0.25,
                         rope_theta=10000000, rope_type="default"),
    mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, out_hidden_size=16, num_position_embeddings=16,
              deepstack_visual_indexes=[])
SEQ = 128


@torch.no_grad()
def randomise(model, gen):
    """Every weight ~ N(0, 1/fan_in) (norm offsets ~ N(0, 0.1²), the GDN decay parameters as
    transformers initialises them), so that the outputs are not trivial."""
    for name, p in model.named_parameters():
        if name.endswith("A_log") or name.endswith("dt_bias"):
            continue
        if p.dim() == 1:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1] if p.dim() <= 3 else math.prod(p.shape[1:])
            scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0  # decisive routing
            p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(fan_in))


def mtp_tensors(t, gen):
    """The MTP block of the releases (transformers does not build it): one full-attention decoder
    layer whose experts are stored one tensor per expert, plus its fc and norms."""
    h, e, i, s, hd = (t["hidden_size"], t["num_experts"], t["moe_intermediate_size"],
                      t["shared_expert_intermediate_size"], t["head_dim"])
    q, kv = t["num_attention_heads"], t["num_key_value_heads"]
    shapes = {
        "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,), "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * q * hd, h), "mtp.layers.0.self_attn.k_proj.weight": (kv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (kv * hd, h), "mtp.layers.0.self_attn.o_proj.weight": (h, q * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate.weight": (e, h), "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h),
        "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (s, h),
        "mtp.layers.0.mlp.shared_expert.up_proj.weight": (s, h),
        "mtp.layers.0.mlp.shared_expert.down_proj.weight": (h, s),
    }
    for x in range(e):
        p = f"mtp.layers.0.mlp.experts.{x}."
        shapes.update({p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)})
    return {k: (torch.randn(v, generator=gen) / math.sqrt(v[-1])).to(torch.bfloat16) for k, v in shapes.items()}


def fuse_experts(w):
    """`mlp.experts.{e}.{gate,up,down}_proj.weight` of the decoder layers into the released
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I]."""
    out, layers = {}, {}
    for k, v in w.items():
        m = re.fullmatch(r"(.*\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", k)
        if m and not k.startswith("mtp."):
            layers.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    for p, t in layers.items():
        n = 1 + max(e for e, _ in t)
        out[p + ".gate_up_proj"] = torch.stack([torch.cat([t[e, "gate"], t[e, "up"]]) for e in range(n)]).contiguous()
        out[p + ".down_proj"] = torch.stack([t[e, "down"] for e in range(n)]).contiguous()
    return out


@torch.no_grad()
def forward(cls, path, ids):
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model(input_ids=ids, output_hidden_states=True)


def input_ids(tokenizer, data):
    return first_tokens(tokenizer, data, TEXT["eos_token_id"], SEQ)


def make(kind, out, shared, seed):
    import transformers
    from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig)

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if kind == "wrapper":
        cfg = Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False)
        cls = Qwen3_5MoeForConditionalGeneration
    else:
        cfg = Qwen3_5MoeTextConfig(**TEXT)
        cls = Qwen3_5MoeForCausalLM
    model = cls(cfg).eval()
    randomise(model, gen)
    model = model.to(torch.bfloat16)
    if os.path.exists(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok_dir = os.path.join(shared, "models", "qwen3_5")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(os.path.join(tok_dir, f), os.path.join(out, f))
    ids = input_ids(os.path.join(out, "tokenizer.json"), os.path.join(shared, "data", "eval", "wiki.jsonl"))
    saved = forward(cls, out, ids)
    # save_pretrained writes one tensor per expert; the bf16 releases store them fused
    weights = os.path.join(out, "model.safetensors")
    w = fuse_experts(load_file(weights))
    if kind == "wrapper":
        w.update(mtp_tensors(TEXT, gen))
    save_file(w, weights, metadata={"format": "pt"})

    # transformers' float32 forward of the stored bf16 weights, which the fusion leaves unchanged
    o = forward(cls, out, ids)
    assert torch.equal(o.logits, saved.logits), "fused and per-expert layouts load differently"
    hidden = torch.stack([h.float() for h in o.hidden_states]).contiguous()
    assert hidden.shape[0] == TEXT["num_hidden_layers"] + 1, hidden.shape
    pos = torch.arange(7, SEQ, 8)
    logits = o.logits.float()[:, pos].contiguous()
    save_file({"input_ids": ids.to(torch.int64).contiguous(), "hidden_states": hidden, "logits": logits,
               "logit_positions": pos.to(torch.int64)}, os.path.join(out, "golden.safetensors"))
    probs = o.logits.float().softmax(-1)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()
    print(f"{out}: transformers {transformers.__version__}, logits std {o.logits.std().item():.3f}, "
          f"mean entropy {ent:.2f} nats (uniform {math.log(TEXT['vocab_size']):.2f}), "
          f"{sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 1e6:.2f} MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", required=True, help="the shared reference data folder (tokenizer, eval text)")
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make("wrapper", os.path.join(a.out, "qwen3_5_moe"), a.shared, a.seed)
    make("text", os.path.join(a.out, "qwen3_5_moe_text"), a.shared, a.seed + 1)


if __name__ == "__main__":
    main()
