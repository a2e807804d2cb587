#!/usr/bin/env python3
"""Prove that `statecut recover`'s outputs reload in transformers and its adapters in PEFT.

For every model: prune with `statecut prune` (P), then recover twice: R with the default plan
and R2 with adapters only (`--train lora:PATTERN --save-adapters`). Then
1. reload P, R and R2 (and the teacher) with transformers in float32 and compare their
   perplexity on statecut's --eval windows with the numbers in statecut_recover.json;
2. load P with transformers, attach R2/adapters with `peft.PeftModel.from_pretrained`, and
   compare its logits with R2's: they differ only by the rounding of W + (alpha/r)·B·A into the
   stored dtype, which is shown by rounding PEFT's `merge_and_unload()` weights the same way
   (equal to R2's stored tensors, or 1 ulp off) and running the model on those. P and R2 load
   through AutoModelForCausalLM, the class PEFT's task_type CAUSAL_LM names: for a multimodal
   wrapper that is the text-only model, whose module names the adapters use;
3. check that R's and R2's config.json equal P's and that every tensor outside the report's
   trained lists is byte-identical to P's.

Runs on the CPU with torch, transformers and peft installed (a few minutes for the reference models):
    python3 scripts/verify_recover.py --bin target/release/statecut --shared ../shared --out verify-recover/
The Qwen3.5/3.6 MoE fixtures (hidden size 16, so a smaller rank):
    python3 scripts/verify_recover.py --bin target/release/statecut --shared ../shared --out verify-recover-moe/ \
        --model-dirs tests/fixtures/qwen3_5_moe,tests/fixtures/qwen3_5_moe_text --lora-rank 8
Writes verify_recover.json and verify_recover.md under --out and prints the table; exits
non-zero if any check fails.
"""
import argparse
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_torch import eval_windows, library_logits, perplexity  # noqa: E402

# the projections adapted by the adapters-only run: the ones pruning narrows
LORA_PATTERN = {"mamba2": "in_proj", "qwen3_5_text": "in_proj_qkv", "qwen3_5": "in_proj_qkv",
                "qwen3_5_moe_text": "in_proj_qkv", "qwen3_5_moe": "in_proj_qkv",
                "delta_net": "k_proj", "gated_deltanet": "k_proj"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd):
    log("+", " ".join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def model_class(path):
    import transformers

    cfg = json.load(open(os.path.join(path, "config.json")))
    # a multimodal wrapper reloads as the class its config names
    arch = (cfg.get("architectures") or [""])[0]
    if arch.endswith("ForConditionalGeneration"):
        return getattr(transformers, arch)
    return transformers.AutoModelForCausalLM


def load(path, cls=None):
    model, info = (cls or model_class(path)).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise AssertionError(f"{path}: missing {sorted(info['missing_keys'])[:4]}, "
                             f"mismatched {sorted(info['mismatched_keys'])[:4]}")
    return model.eval()


def raw_tensors(d):
    """{name: (dtype, shape, bytes)} of a checkpoint's safetensors files, read without conversion."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for fname in files:
        with open(os.path.join(d, fname), "rb") as f:
            buf = f.read()
        n = struct.unpack("<Q", buf[:8])[0]
        header = json.loads(buf[8:8 + n])
        header.pop("__metadata__", None)
        for name, h in header.items():
            s, e = h["data_offsets"]
            out[name] = (h["dtype"], h["shape"], buf[8 + n + s: 8 + n + e])
    return out


def ulps(a, b):
    """Per-element distance in units in the last place between two tensors of one float dtype."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    def ordered(t):
        # sign-magnitude to a monotone integer line, so that -0 and +0 are 0 apart
        i = t.view(bits).long()
        sign = i < 0
        mag = i & (0x7FFF if bits == torch.int16 else 0x7FFFFFFF)
        return torch.where(sign, -mag, mag)
    return (ordered(a) - ordered(b)).abs()


def diff(x, y):
    d = (x - y).abs().max().item()
    return {"max_abs": d, "rel": d / max(y.abs().max().item(), 1e-30)}


def check_files(p, r, report):
    """config.json equal to P's; every tensor outside the trained lists byte-identical to P's."""
    res = {}
    cp, cr = open(os.path.join(p, "config.json"), "rb").read(), open(os.path.join(r, "config.json"), "rb").read()
    res["config_bytes_equal"] = cp == cr
    res["config_equal"] = json.loads(cp) == json.loads(cr)
    tp, tr = raw_tensors(p), raw_tensors(r)
    trained = set(report["trained"]["adapted"]) | set(report["trained"]["whole"])
    res["same_names"] = set(tp) == set(tr)
    res["trained"] = len(trained)
    res["trained_missing"] = sorted(trained - set(tp))
    res["untouched"] = sum(1 for n in tp if n not in trained)
    res["untouched_differing"] = sorted(n for n in tp if n not in trained and tr.get(n) != tp[n])
    # trained tensors keep their dtype and shape; how many the training changed is for scale
    res["trained_layout_differing"] = sorted(n for n in trained & set(tp) if tr.get(n, (None, None))[:2] != tp[n][:2])
    res["trained_changed"] = sum(1 for n in trained & set(tp) if tr.get(n) != tp[n])
    res["ok"] = (res["config_equal"] and res["same_names"] and not res["trained_missing"]
                 and not res["untouched_differing"] and not res["trained_layout_differing"])
    return res


@torch.no_grad()
def check_peft(p, r2, ids, report):
    """P + R2/adapters through PEFT against R2 loaded plainly."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    res = {}
    adir = os.path.join(r2, "adapters")
    acfg = json.load(open(os.path.join(adir, "adapter_config.json")))
    aw = load_file(os.path.join(adir, "adapter_model.safetensors"))
    res["adapter_config"] = {k: acfg.get(k) for k in ("peft_type", "r", "lora_alpha")}
    res["adapter_tensors"] = len(aw)
    x = torch.tensor([ids])

    # PEFT's task_type CAUSAL_LM (AutoPeftModelForCausalLM) loads the causal-LM class; for a
    # multimodal wrapper that is the text-only model, whose modules drop `language_model.`.
    base = load(p, transformers.AutoModelForCausalLM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adir).eval()
    res["peft_warnings"] = [str(w.message)[:300] for w in caught if "adapter" in str(w.message).lower()]
    # every stored A and B must have landed, unchanged, on the module it names
    inner = model.base_model.model
    misplaced = []
    for key, t in aw.items():
        module, part = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        try:
            got = getattr(inner.get_submodule(module), part)["default"].weight
            if not torch.equal(got, t.to(got.dtype)):
                misplaced.append(f"{key}: loaded value differs")
        except (AttributeError, KeyError) as e:
            misplaced.append(f"{key}: {type(e).__name__}: {e}")
    res["misplaced"] = misplaced
    res["lora_layers"] = sum(1 for _, m in inner.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    res["expected_layers"] = len(report["trained"]["adapted"])

    peft_logits = model(input_ids=x).logits.float()
    with model.disable_adapter():
        base_logits = model(input_ids=x).logits.float()
    r2_model = load(r2, transformers.AutoModelForCausalLM)
    r2_logits = r2_model(input_ids=x).logits.float()
    res["peft_vs_r2"] = diff(peft_logits, r2_logits)
    res["adapter_effect"] = diff(peft_logits, base_logits)  # PEFT vs P alone: the adapters did something

    # PEFT's own merge in float32 runs as PEFT's adapters do, up to float noise
    merged = model.merge_and_unload()
    res["merge_f32_vs_peft"] = diff(merged(input_ids=x).logits.float(), peft_logits)
    # and rounded to the stored dtype it should be R2's stored tensors
    stored = {}
    for f in glob.glob(os.path.join(r2, "*.safetensors")):
        stored.update(load_file(f))
    msd = merged.state_dict()
    n_eq, n_off, worst, elems = 0, 0, 0, 0
    for name in report["trained"]["adapted"]:
        s = stored[name]
        name = causal_lm_name(name)
        rounded = msd[name].to(s.dtype)
        u = ulps(rounded, s)
        elems += u.numel()
        n_off += int((u > 0).sum())
        worst = max(worst, int(u.max()))
        n_eq += bool(torch.equal(rounded, s))
        # run the model on the rounded merge: this should be R2 exactly
        msd[name].copy_(rounded.float())
    res["merge_rounded_vs_stored"] = {"tensors": len(report["trained"]["adapted"]), "tensors_equal": n_eq,
                                      "elements": elems, "elements_off": n_off, "max_ulps": worst}
    rounded_logits = merged(input_ids=x).logits.float()
    res["rounded_merge_vs_r2"] = diff(rounded_logits, r2_logits)
    res["ok"] = (not misplaced and res["lora_layers"] == res["expected_layers"] == len(aw) // 2
                 and acfg.get("peft_type") == "LORA" and worst <= 1
                 # PEFT = its float32 merge; that merge rounded = R2: the rounding is the whole difference
                 and res["merge_f32_vs_peft"]["rel"] <= 1e-4 and res["rounded_merge_vs_r2"]["rel"] <= 1e-4
                 and res["adapter_effect"]["max_abs"] > res["peft_vs_r2"]["max_abs"])
    del model, merged, r2_model, base
    return res


def causal_lm_name(name):
    """A checkpoint tensor's name in the causal-LM class (a wrapper's `model.language_model.` is `model.`)."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--out", required=True, help="where verify_recover.json and verify_recover.md go")
    ap.add_argument("--work", help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--models", default="mamba2,qwen3_5")
    ap.add_argument("--model-dirs", help="model directories to use instead of --models (names under shared/models)")
    ap.add_argument("--steps", default="3")
    ap.add_argument("--batch-size", default="2")
    ap.add_argument("--seqlen", default="128")
    ap.add_argument("--lr", default="1e-3")
    ap.add_argument("--lora-rank", default="32", help="statecut's default; the MoE fixtures (hidden 16) need at most 16")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seqlen", type=int, default=256)
    ap.add_argument("--logit-tokens", type=int, default=128)
    ap.add_argument("--tol", type=float, default=1e-3, help="relative perplexity tolerance")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import peft
    import transformers

    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    work = a.work or tempfile.mkdtemp(prefix="statecut-verify-recover-")
    os.makedirs(work, exist_ok=True)
    evalf = os.path.join(a.shared, "data", "eval", "wiki.jsonl")
    calibf = os.path.join(a.shared, "data", "calib", "wiki.jsonl")
    mdirs = a.model_dirs.split(",") if a.model_dirs else [os.path.join(a.shared, "models", m) for m in a.models.split(",")]
    records = []
    for mdir in mdirs:
        m = os.path.basename(os.path.normpath(mdir))
        rec = {"model": m}
        t0 = time.time()
        try:
            cfg = json.load(open(os.path.join(mdir, "config.json")))
            mt = cfg.get("model_type")
            pattern = LORA_PATTERN[mt]
            P, R, R2 = (os.path.join(work, f"{m}-{s}") for s in ("P", "R", "R2"))
            run([a.bin, "prune", "-m", mdir, "--method", "drrqr", "--ratio", "0.5", "--nsamples", "8", "--seqlen", "256",
                 "-o", P, "-q", "--overwrite"])
            common = ["recover", "-m", P, "--teacher", mdir, "--data", calibf, "--steps", a.steps, "--batch-size",
                      a.batch_size, "--seqlen", a.seqlen, "--lr", a.lr, "--eval", evalf, "--eval-windows",
                      str(a.eval_windows), "--eval-seqlen", str(a.eval_seqlen), "--lora-rank", a.lora_rank, "-q",
                      "--overwrite"]
            run([a.bin, *common, "-o", R])
            run([a.bin, *common, "-o", R2, "--train", f"lora:{pattern}", "--save-adapters"])
            rep = {k: json.load(open(os.path.join(d, "statecut_recover.json"))) for k, d in (("R", R), ("R2", R2))}
            rec["trained"] = {k: {"adapted": len(v["trained"]["adapted"]), "whole": len(v["trained"]["whole"])}
                              for k, v in rep.items()}

            eos = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id", 2))
            tok_path = os.path.join(mdir, "tokenizer.json")
            wins = eval_windows(tok_path, evalf, a.eval_seqlen, a.eval_windows, eos)
            ids = eval_windows(tok_path, evalf, a.logit_tokens, 1, eos)[0]
            # 1. perplexity in transformers against statecut's report, for every checkpoint it evaluated
            ppl = {}
            for what, path, sc in (("teacher", mdir, rep["R"]["ppl"]["teacher"]), ("pruned", P, rep["R"]["ppl"]["pruned"]),
                                   ("R", R, rep["R"]["ppl"]["recovered"]), ("R2", R2, rep["R2"]["ppl"]["recovered"])):
                lib = perplexity(library_logits(load(path), "cpu"), wins, "cpu")
                ppl[what] = {"statecut": sc, "transformers": lib, "rel_diff": abs(lib - sc) / sc}
            rec["windows"] = len(wins)
            rec["ppl"] = ppl
            rec["ppl_ok"] = all(v["rel_diff"] <= a.tol for v in ppl.values())
            # 2. the adapters through PEFT
            try:
                rec["peft"] = check_peft(P, R2, ids[:a.logit_tokens], rep["R2"])
            except Exception as e:  # keep the other checks' results
                rec["peft"] = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
            # 3. the files
            rec["files"] = {k: check_files(P, d, rep[k]) for k, d in (("R", R), ("R2", R2))}
            rec["ok"] = rec["ppl_ok"] and rec["peft"]["ok"] and all(v["ok"] for v in rec["files"].values())
        except Exception as e:  # a failure is a result, not a crash
            rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"
        rec["seconds"] = round(time.time() - t0, 1)
        log(json.dumps(rec))
        records.append(rec)

    env = (f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, CPU float32; "
           f"prune drrqr 0.5; recover {a.steps} steps x {a.batch_size} x {a.seqlen} at lr {a.lr}; "
           f"perplexity on {a.eval_windows} windows x {a.eval_seqlen} tokens of eval/wiki; "
           f"logits on its first {a.logit_tokens} tokens")
    md = ["| model | checkpoint | statecut ppl | transformers ppl | rel. diff |", "|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            md.append(f"| {r['model']} | - | - | - | failed: {' '.join(r['error'].split())[:300]} |")
            continue
        for what, v in r["ppl"].items():
            md.append(f"| {r['model']} | {what} | {v['statecut']:.4f} | {v['transformers']:.4f} | {v['rel_diff']:.2e} |")
    md += ["", "| model | PEFT(P + adapters) vs R2 logits, max abs (rel) | adapters' own effect, max abs | "
               "PEFT f32 merge vs PEFT logits, max abs | PEFT merge rounded vs R2 stored | "
               "rounded merge vs R2 logits, max abs | lora layers | ok |",
           "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            continue
        p = r["peft"]
        if "error" in p:
            md.append(f"| {r['model']} | failed: {p['error']} | | | | | | NO |")
            continue
        mr = p["merge_rounded_vs_stored"]
        md.append(f"| {r['model']} | {p['peft_vs_r2']['max_abs']:.3e} ({p['peft_vs_r2']['rel']:.1e}) | "
                  f"{p['adapter_effect']['max_abs']:.3e} | {p['merge_f32_vs_peft']['max_abs']:.1e} | "
                  f"{mr['tensors_equal']}/{mr['tensors']} tensors equal, "
                  f"{mr['elements_off']}/{mr['elements']} elements off, max {mr['max_ulps']} ulp | "
                  f"{p['rounded_merge_vs_r2']['max_abs']:.3e} | {p['lora_layers']}/{p['expected_layers']} | "
                  f"{'yes' if p['ok'] else 'NO'} |")
    md += ["", "| model | output | config.json = P's | trained (changed) | untouched tensors byte-identical | ok |",
           "|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            continue
        for k, f in r["files"].items():
            md.append(f"| {r['model']} | {k} | {'yes' if f['config_equal'] else 'NO'}"
                      f"{'' if f['config_bytes_equal'] else ' (not byte-equal)'} | {f['trained']} ({f['trained_changed']}) | "
                      f"{f['untouched'] - len(f['untouched_differing'])}/{f['untouched']} | {'yes' if f['ok'] else 'NO'} |")
    text = f"Environment: {env}.\n\n" + "\n".join(md) + "\n"
    with open(os.path.join(a.out, "verify_recover.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "verify_recover.json"), "w") as f:
        json.dump({"environment": env, "tol": a.tol, "records": records}, f, indent=1)
    print(text)
    failures = sum(not r["ok"] for r in records)
    log(f"{len(records) - failures}/{len(records)} models passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
