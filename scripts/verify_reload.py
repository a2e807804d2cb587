#!/usr/bin/env python3
"""Prove that statecut's pruned checkpoints reload in the models' own libraries.

For every model and every selector at ratios 0.5 and 0.75: run `statecut prune` (which reloads
its output and reports perplexity), then load the output with
`transformers.AutoModelForCausalLM.from_pretrained` (after `import fla` for the fla families),
check that the rebuilt layers have the pruned key width and the original value width, run it on
the GPU, and compare its perplexity with statecut's (same windows, same tokens).

Run on a GPU machine with torch, transformers and flash-linear-attention installed:
    python3 scripts/verify_reload.py --bin target/release/statecut --shared ../shared --out reload/
The hybrid fixtures (Nemotron-H, Granite 4.0-H, Falcon-H1), on the CPU:
    python3 scripts/verify_reload.py --bin target/release/statecut --shared ../shared --out reload-hybrids/ \
        --model-dirs tests/fixtures/nemotron_h,tests/fixtures/granite_h,tests/fixtures/granite_h_dense,tests/fixtures/falcon_h1 \
        --device cpu --nsamples 8 --seqlen 512 --windows 16
The Qwen3.5/3.6 MoE fixtures (the multimodal wrapper is reloaded as
Qwen3_5MoeForConditionalGeneration, the class its config names), on the CPU:
    python3 scripts/verify_reload.py --bin target/release/statecut --shared ../shared --out reload-moe/ \
        --model-dirs tests/fixtures/qwen3_5_moe,tests/fixtures/qwen3_5_moe_text --device cpu \
        --methods swanda,drrqr --nsamples 8 --seqlen 512 --windows 16
Writes reload.jsonl (one record per checkpoint) and reload.md (a table) under --out; exits non-zero
if any checkpoint fails to load or differs by more than --tol (relative).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from reference_torch import eval_windows, library_logits, perplexity

METHODS = ["l1", "swanda", "grad", "rand", "drrqr"]
RATIOS = ["0.5", "0.75"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def key_widths(model, cfg):
    """(d_k, d_v) of the first recurrent layer as the library rebuilt it."""
    mt = cfg.get("model_type")
    if mt in ("delta_net", "gated_deltanet"):
        attn = model.model.layers[0].attn
        return attn.head_k_dim, attn.head_v_dim
    if mt == "mamba2":
        mixer = model.backbone.layers[0].mixer
        return mixer.ssm_state_size, mixer.head_dim
    if mt in ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"):
        layers = model.model.layers if hasattr(model.model, "layers") else model.model.language_model.layers
        for layer in layers:
            if hasattr(layer, "linear_attn"):
                return layer.linear_attn.head_k_dim, layer.linear_attn.head_v_dim
    # Mamba-2 mixers of the hybrids (Nemotron-H, Granite 4.0-H, Falcon-H1)
    for mod in model.modules():
        if hasattr(mod, "ssm_state_size") and hasattr(mod, "head_dim"):
            return mod.ssm_state_size, mod.head_dim
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--out", required=True, help="where reload.jsonl and reload.md go")
    ap.add_argument("--work", help="where pruned checkpoints go (default: a temporary directory)")
    ap.add_argument("--models", default="delta_net,gated_deltanet")
    ap.add_argument("--model-dirs", help="model directories to use instead of --models (names under shared/models)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--ratios", default=",".join(RATIOS))
    ap.add_argument("--nsamples", default="16")
    ap.add_argument("--seqlen", default="1024")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--tol", type=float, default=0.02)
    ap.add_argument("--fla-mode", default="fused_recurrent",
                    help="attn_mode for fla models (fla's chunk kernel refuses float32 for DeltaNet)")
    ap.add_argument("--autocast", action="store_true", help="also measure perplexity under bf16 autocast")
    a = ap.parse_args()

    import transformers
    try:
        import fla  # noqa: F401  registers the fla model types
        fla_version = getattr(fla, "__version__", "?")
    except ImportError:
        fla_version = None
    from transformers import AutoModelForCausalLM

    os.makedirs(a.out, exist_ok=True)
    work = a.work or tempfile.mkdtemp(prefix="statecut-reload-")
    os.makedirs(work, exist_ok=True)
    evalf = os.path.join(a.shared, "data", "eval", "wiki.jsonl")
    calibf = os.path.join(a.shared, "data", "calib", "wiki.jsonl")
    records, failures = [], 0
    jl = open(os.path.join(a.out, "reload.jsonl"), "w")
    mdirs = a.model_dirs.split(",") if a.model_dirs else [os.path.join(a.shared, "models", m) for m in a.models.split(",")]
    for mdir in mdirs:
        m = os.path.basename(os.path.normpath(mdir))
        acts = os.path.join(work, f"{m}.safetensors")
        subprocess.run([a.bin, "calibrate", "-m", mdir, "--calib", calibf, "--nsamples", a.nsamples, "--seqlen",
                        a.seqlen, "--grad", "-o", acts, "-q"], check=True)
        cfg0 = json.load(open(os.path.join(mdir, "config.json")))
        eos = cfg0.get("eos_token_id", cfg0.get("text_config", {}).get("eos_token_id", 2))
        wins = eval_windows(os.path.join(mdir, "tokenizer.json"), evalf, 512, a.windows, eos)
        targets = [("none", "0", mdir)]
        for method in a.methods.split(","):
            for ratio in a.ratios.split(","):
                out = os.path.join(work, f"{m}-{method}-{ratio}")
                subprocess.run([a.bin, "prune", "-m", mdir, "--method", method, "--ratio", ratio, "--activations",
                                acts, "--eval", evalf, "--eval-windows", str(a.windows), "-o", out, "--overwrite", "-q"],
                               check=True)
                targets.append((method, ratio, out))
        for method, ratio, path in targets:
            rec = {"model": m, "method": method, "ratio": float(ratio)}
            t0 = time.time()
            try:
                cfg = json.load(open(os.path.join(path, "config.json")))
                kw = {}
                if cfg.get("model_type") in ("delta_net", "gated_deltanet") and a.fla_mode:
                    kw["attn_mode"] = a.fla_mode
                # a multimodal wrapper reloads as the class its config names
                arch = (cfg.get("architectures") or [""])[0]
                cls = getattr(transformers, arch) if arch.endswith("ForConditionalGeneration") else AutoModelForCausalLM
                model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kw)
                if info["missing_keys"] or info["mismatched_keys"]:
                    raise AssertionError(f"missing {sorted(info['missing_keys'])[:4]}, "
                                         f"mismatched {sorted(info['mismatched_keys'])[:4]}")
                model = model.to(a.device).eval()
                rec["class"] = type(model).__name__
                rec["dk"], rec["dv"] = key_widths(model, cfg)
                rec["ppl_fp32"] = perplexity(library_logits(model, a.device), wins, a.device)
                if a.autocast:
                    rec["ppl_bf16_autocast"] = perplexity(library_logits(model, a.device, autocast=True), wins, a.device)
                if method == "none":
                    r = json.loads(subprocess.run([a.bin, "eval", "-m", path, "--data", evalf, "--windows", str(a.windows),
                                                   "--json", "-q"],
                                                  check=True, capture_output=True, text=True).stdout)
                    rec["statecut_ppl"] = r["ppl"]
                else:
                    rep = json.load(open(os.path.join(path, "statecut_report.json")))
                    rec["statecut_ppl"] = rep["ppl"]["after"]
                    rec["expected_dk"] = rep["dk_after"]
                    if rec["dk"] != rep["dk_after"]:
                        raise AssertionError(f"library rebuilt d_k {rec['dk']}, statecut wrote {rep['dk_after']}")
                rec["rel_diff"] = abs(rec["ppl_fp32"] - rec["statecut_ppl"]) / rec["statecut_ppl"]
                rec["ok"] = rec["rel_diff"] <= a.tol
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception as e:  # a load failure is a result, not a crash
                rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"
            rec["seconds"] = round(time.time() - t0, 2)
            failures += not rec["ok"]
            records.append(rec)
            jl.write(json.dumps(rec) + "\n")
            jl.flush()
            log(json.dumps(rec))

    env = (f"torch {torch.__version__}, transformers {transformers.__version__}, fla {fla_version} "
           f"(fla attn_mode {a.fla_mode}), {torch.cuda.get_device_name() if a.device.startswith('cuda') else a.device}, "
           f"{a.windows} windows x 512 tokens of eval/wiki")
    md = ["| model | method | ratio | d_k / d_v rebuilt | statecut ppl | library ppl fp32 | library ppl bf16 autocast | rel. diff | ok |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            md.append(f"| {r['model']} | {r['method']} | {r['ratio']} | - | - | - | - | - | load failed: {r['error'][:80]} |")
        else:
            md.append(f"| {r['model']} | {r['method']} | {r['ratio']} | {r['dk']} / {r['dv']} | {r['statecut_ppl']:.3f} | "
                      f"{r['ppl_fp32']:.3f} | {r.get('ppl_bf16_autocast', float('nan')):.3f} | {100 * r['rel_diff']:.3f}% | {'yes' if r['ok'] else 'NO'} |")
    with open(os.path.join(a.out, "reload.md"), "w") as f:
        f.write(f"Environment: {env}.\n\n" + "\n".join(md) + "\n")
    log(f"{len(records) - failures}/{len(records)} checkpoints reloaded within {100 * a.tol:.0f}%")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
