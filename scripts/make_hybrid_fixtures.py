#!/usr/bin/env python3
"""Small Mamba-2 / KDA hybrid checkpoints saved by transformers itself, with golden outputs.

  tests/fixtures/nemotron_h/        NemotronHForCausalLM: hybrid_override_pattern "M-M*EM" (Mamba-2, relu² MLP,
                                    NoPE GQA attention, Nemotron-3 MoE with sigmoid router, e_score_correction_bias,
                                    group-limited top-k, routed_scaling_factor and a shared expert). The Mamba inner
                                    width mamba_num_heads·mamba_head_dim = 96 differs from expand·hidden_size = 64.
  tests/fixtures/granite_h/         GraniteMoeHybridForCausalLM (Granite 4.0-H-Tiny layout): layer_types
                                    "mamba"/"attention", position_embedding_type "nope", muP multipliers, a softmax
                                    top-k MoE (fused 3-D input_linear/output_linear) plus shared_mlp, tied head.
  tests/fixtures/granite_h_dense/   the same family without experts (num_local_experts 0, shared_mlp only) and
                                    position_embedding_type "rope".
  tests/fixtures/falcon_h1/         FalconH1ForCausalLM: attention and Mamba-2 in parallel in every layer,
                                    mamba_d_ssm 48 (≠ mamba_expand·hidden_size 64), every muP multiplier set,
                                    mamba_rms_norm true with norm_before_gate false, head_dim ≠ hidden/heads.
  tests/fixtures/kimi_linear/       KimiLinearForCausalLM: KDA layers and MLA layers (linear_attn_config with
                                    1-based kda_layers / full_attn_layers), first layer dense, the other layers a
                                    sigmoid-routed MoE with correction bias, routed scaling and a shared expert.

Every Mamba-2 mixer has n_groups 2 and state size 64; the KDA key (= value) head dim is 64. The weights are
seeded random, matrices ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1²), Mamba A = U(1, 16), dt_bias the inverse
softplus of a log-uniform dt in [0.01, 0.1] (KDA: [0.001, 0.1] as transformers initialises it), routers doubled
so that routing is decisive, MoE correction biases ~ N(0, 0.2²). They are stored in bf16 as the releases are
(router correction biases, and KDA dt_bias, in float32). config.json is written in the released spelling
(hybrid_override_pattern, "mamba"/"attention", linear_attn_config) and must reload to the same logits.

golden.safetensors holds transformers' float32 forward of the stored weights on the first 128 tokens of
eval/wiki.jsonl: `input_ids` [1, 128], `hidden_states` [L + 1, 1, 128, H] as output_hidden_states returns
them (entry 0 = the input of layer 0, i.e. the embeddings after any embedding multiplier; entry L = the output
of the final norm, not the raw residual of the last layer), `logits` at positions `logit_positions` (every 8th),
`logits_decode`: the same positions computed one token at a time with use_cache=True, and `logits_bf16`:
transformers' bfloat16 forward at those positions (the scale of an acceptable bf16 error). reference.json holds
the perplexity of the full forward on the 128 tokens (127 predictions) and the parity numbers.

    python3 scripts/make_hybrid_fixtures.py --shared ../shared --out tests/fixtures
"""

import argparse
import json
import math
import os
import shutil

import torch
from reference_torch import first_tokens
from safetensors.torch import load_file, save_file

SEQ = 128
COMMON = dict(vocab_size=4096, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096)

NEMOTRON_H = dict(
    COMMON, hidden_size=32, hybrid_override_pattern="M-M*EM", num_hidden_layers=6, pad_token_id=0,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
    intermediate_size=64, mlp_hidden_act="relu2", mlp_bias=False,
    ssm_state_size=64, mamba_num_heads=6, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=128,
    use_conv_bias=True, mamba_proj_bias=False, use_bias=False, mamba_hidden_act="silu",
    time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, mamba_ssm_cache_dtype="float32",
    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, moe_shared_expert_intermediate_size=32,
    n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=True,
    moe_latent_size=None, layer_norm_epsilon=1e-5, residual_in_fp32=False, rescale_prenorm_residual=True,
    tie_word_embeddings=False, num_nextn_predict_layers=0,
)
GRANITE = dict(
    COMMON, hidden_size=32, num_hidden_layers=5, layer_types=["mamba", "mamba", "attention", "mamba", "mamba"],
    pad_token_id=None, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
    attention_multiplier=0.125, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
    intermediate_size=16, shared_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
    position_embedding_type="nope", rope_theta=10000, hidden_act="silu", normalization_function="rmsnorm",
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5,
    router_aux_loss_coef=0.0, tie_word_embeddings=True,
)
GRANITE_DENSE = dict(
    GRANITE, layer_types=["mamba", "attention", "mamba", "mamba", "attention"], num_local_experts=0,
    num_experts_per_tok=0, shared_intermediate_size=64, position_embedding_type="rope", rope_theta=10000000,
    mamba_n_heads=2, mamba_d_head=32, attention_multiplier=0.2, logits_scaling=5.0,
)
FALCON_H1 = dict(
    COMMON, hidden_size=32, num_hidden_layers=4, pad_token_id=None, intermediate_size=64, hidden_act="silu",
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False, mlp_bias=False,
    projectors_bias=False, rope_theta=1e11, rms_norm_eps=1e-5, tie_word_embeddings=False,
    mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=64, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False,
    mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_use_mlp=True,
    embedding_multiplier=5.656854249492381, lm_head_multiplier=1.5, key_multiplier=0.390625,
    attention_in_multiplier=0.8, attention_out_multiplier=0.9375,
    ssm_in_multiplier=1.25, ssm_out_multiplier=0.23570226039551587,
    ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    mlp_multipliers=[0.8838834764831844, 0.5859375], attn_layer_indices=None,
)
KIMI_LINEAR = dict(
    COMMON, hidden_size=32, num_hidden_layers=5, pad_token_id=None, intermediate_size=64, hidden_act="silu",
    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
    num_attention_heads=2, num_key_value_heads=2, head_dim=16,  # head_dim: a legacy key, unused
    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True,
    first_k_dense_replace=1, moe_layer_freq=1, moe_intermediate_size=16, moe_renormalize=True,
    moe_router_activation_func="sigmoid", num_experts=8, num_experts_per_token=2, num_shared_experts=1,
    routed_scaling_factor=2.446, use_grouped_topk=True, num_expert_group=1, topk_group=1,
    num_nextn_predict_layers=0,
    linear_attn_config=dict(full_attn_layers=[3, 5], kda_layers=[1, 2, 4], head_dim=64, num_heads=2,
                            short_conv_kernel_size=4),
)


def released_nemotron_h(cfg):
    """hybrid_override_pattern and num_hidden_layers instead of layers_block_type, as the releases write it."""
    cfg.pop("layers_block_type", None)
    cfg.pop("mtp_layers_block_type", None)
    cfg["hybrid_override_pattern"] = NEMOTRON_H["hybrid_override_pattern"]
    cfg["num_hidden_layers"] = len(NEMOTRON_H["hybrid_override_pattern"])
    return cfg


def released_granite(cfg):
    """The released layer_types spelling ("mamba" / "attention")."""
    cfg["layer_types"] = [{"linear_attention": "mamba", "full_attention": "attention"}[t] for t in cfg["layer_types"]]
    return cfg


def released_kimi(cfg):
    """linear_attn_config (1-based layer lists) and first_k_dense_replace decide the layers, as released."""
    for k in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
              "qk_head_dim"):
        cfg.pop(k, None)
    cfg["head_dim"] = KIMI_LINEAR["head_dim"]
    cfg["linear_attn_config"] = KIMI_LINEAR["linear_attn_config"]
    return cfg


FAMILIES = {
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", NEMOTRON_H, released_nemotron_h),
    "granite_h": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", GRANITE, released_granite),
    "granite_h_dense": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", GRANITE_DENSE, released_granite),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", FALCON_H1, None),
    "kimi_linear": ("KimiLinearForCausalLM", "KimiLinearConfig", KIMI_LINEAR, released_kimi),
}
FP32_ON_DISK = ("e_score_correction_bias", "forget_gate.dt_bias", "self_attn.dt_bias")


def inv_softplus(x):
    return x + torch.log(-torch.expm1(-x))


@torch.no_grad()
def randomise(model, gen):
    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    tensors = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, p in tensors:
        leaf = name.rsplit(".", 1)[-1]
        kda = "forget_gate" in name
        if leaf == "A_log":
            p.copy_(uniform(p.shape, 1.0, 16.0).log())
        elif leaf == "dt_bias":
            lo, hi = (1e-3, 1e-1) if kda else (1e-2, 1e-1)
            p.copy_(inv_softplus(uniform(p.shape, math.log(lo), math.log(hi)).exp()))
        elif leaf == "D":
            p.copy_(uniform(p.shape, 0.5, 1.5))
        elif leaf == "e_score_correction_bias":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        elif p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
        elif p.dim() == 1:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1] if p.dim() <= 3 else math.prod(p.shape[1:])
            router = name.endswith("mixer.gate.weight") or name.endswith("mlp.gate.weight") or "router" in name
            p.copy_(torch.randn(p.shape, generator=gen) * (2.0 if router else 1.0) / math.sqrt(fan_in))


def input_ids(tokenizer, data):
    return first_tokens(tokenizer, data, COMMON["eos_token_id"], SEQ)


def final_norm(model):
    base = model.model
    return getattr(base, "norm_f", None) or getattr(base, "final_layernorm", None) or base.norm


@torch.no_grad()
def full_forward(model, ids):
    seen = {}
    h = final_norm(model).register_forward_hook(lambda m, a, o: seen.update(inp=a[0], out=o))
    o = model(input_ids=ids, output_hidden_states=True)
    h.remove()
    hs = o.hidden_states
    last_is_normed = torch.equal(hs[-1], seen["out"])
    assert last_is_normed and not torch.equal(hs[-1], seen["inp"]), "hidden_states[-1] is not the final norm output"
    return o


@torch.no_grad()
def decode(model, ids, pos):
    cache, rows = None, {}
    for t in range(ids.shape[1]):
        o = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = o.cache
        rows[t] = o.logits[0, -1].float()
    return torch.stack([rows[int(p)] for p in pos])[None].contiguous()


def scrub(cfg):
    """The released spelling of what transformers 5 writes differently: `rope_theta` (+ `rope_scaling` null) at
    the top level instead of `rope_parameters`, and no `time_step_limit` (its default (0, inf) is not JSON)."""
    if cfg.get("time_step_limit") is not None and any(not isinstance(v, (int, float)) or math.isinf(v)
                                                      for v in cfg["time_step_limit"]):
        del cfg["time_step_limit"]
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        assert set(rope) == {"rope_theta", "rope_type"} and rope["rope_type"] == "default", rope
        cfg["rope_theta"] = rope["rope_theta"]
    if "rope_theta" in cfg:
        cfg.setdefault("rope_scaling", None)
    return cfg


def make(name, out, shared, seed):
    import transformers

    cls_name, cfg_name, spec, released = FAMILIES[name]
    cls, cfg_cls = getattr(transformers, cls_name), getattr(transformers, cfg_name)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg_cls(**spec)
    model = cls(cfg).eval()
    randomise(model, gen)
    model = model.to(torch.bfloat16)
    for n, b in list(model.named_parameters()) + list(model.named_buffers()):
        if n.endswith(FP32_ON_DISK):
            b.data = b.data.float()
    if os.path.exists(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        c = json.load(f)
    c = scrub(released(c) if released else c)
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    tok_dir = os.path.join(shared, "models", "gated_deltanet")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(os.path.join(tok_dir, f), os.path.join(out, f))
    ids = input_ids(os.path.join(out, "tokenizer.json"), os.path.join(shared, "data", "eval", "wiki.jsonl"))
    pos = torch.arange(7, SEQ, 8)

    # the saved weights in a float32 model built from the in-memory config (fresh non-persistent buffers:
    # RoPE inv_freq, Falcon-H1's mup_vector) against the reloaded directory (released-style config.json)
    mem = cls(cfg).eval()
    mem.set_attn_implementation("eager")
    mem.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=True)
    ref = full_forward(mem, ids)
    loaded = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert loaded.config.layer_types == mem.config.layer_types, (loaded.config.layer_types, mem.config.layer_types)
    o = full_forward(loaded, ids)
    reload_diff = (o.logits - ref.logits).abs().max().item()
    sd_mem, sd_disk = mem.state_dict(), loaded.state_dict()
    assert sd_mem.keys() == sd_disk.keys()
    assert all(torch.equal(sd_mem[k], sd_disk[k]) for k in sd_mem), "weights differ after reload"
    dec = decode(loaded, ids, pos)
    logits = o.logits.float()[:, pos].contiguous()
    decode_diff = (dec - logits).abs().max().item()

    bf16 = cls.from_pretrained(out, dtype=torch.bfloat16, attn_implementation="eager").eval()
    logits_bf16 = full_forward(bf16, ids).logits.float()[:, pos].contiguous()
    hidden = torch.stack([h.float() for h in o.hidden_states]).contiguous()
    assert hidden.shape == (cfg.num_hidden_layers + 1, 1, SEQ, cfg.hidden_size), hidden.shape
    save_file({"input_ids": ids.to(torch.int64).contiguous(), "hidden_states": hidden, "logits": logits,
               "logits_decode": dec, "logits_bf16": logits_bf16, "logit_positions": pos.to(torch.int64)}, os.path.join(out, "golden.safetensors"))
    nll = torch.nn.functional.cross_entropy(o.logits[0, :-1].float(), ids[0, 1:]).item()
    probs = o.logits.float().softmax(-1)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()
    params = sum(p.numel() for p in loaded.parameters())
    files = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    ref_json = {
        "arch": name, "class": cls_name, "params": params, "seed": seed, "tokens": SEQ, "predictions": SEQ - 1,
        "mean_nll": nll, "ppl": math.exp(nll), "logits_std": o.logits.std().item(), "mean_entropy_nats": ent,
        "reload_max_abs_diff": reload_diff,
        "bf16_logits_rel_err": ((logits_bf16 - logits).norm() / logits.norm()).item(), "decode_vs_full_max_abs_diff": decode_diff,
        "hidden_states_first": "input of layer 0 (embeddings after any embedding multiplier)",
        "hidden_states_last": "output of the final norm",
        "weights_dtype": "bfloat16", "golden_dtype": "float32",
        "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref_json, f, indent=2)
        f.write("\n")
    files["reference.json"] = os.path.getsize(os.path.join(out, "reference.json"))
    print(f"{out}: {params} params, ppl {math.exp(nll):.2f} (uniform {COMMON['vocab_size']}), logits std "
          f"{o.logits.std().item():.3f}, entropy {ent:.2f} nats, reload diff {reload_diff:.3g}, decode-vs-full "
          f"{decode_diff:.3g}, {sum(files.values()) / 1e6:.2f} MB {files}")
    w = load_file(os.path.join(out, "model.safetensors"))
    for k in sorted(w):
        print(f"  {k} {list(w[k].shape)} {str(w[k].dtype).replace('torch.', '')}")
    return ref_json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", required=True, help="the shared reference data folder (tokenizer, eval text)")
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=list(FAMILIES))
    a = ap.parse_args()
    torch.set_num_threads(1)
    for i, name in enumerate(FAMILIES):
        if name in a.only:
            make(name, os.path.join(a.out, name), a.shared, a.seed + i)


if __name__ == "__main__":
    main()
