#!/usr/bin/env python3
"""Train the small Gated DeltaNet that ships in assets/models/gdn-moby, from text the repository
ships, in plain PyTorch on the CPU (no flash-linear-attention needed to rebuild it).

Text (Herman Melville, *Moby-Dick*, 1851, public domain):
  assets/calibration.txt + assets/train.txt   chapters 1-118 in order: tokenizer and model training
  assets/eval.txt                             chapters 119-135: held out, never trained on

Steps, all seeded:
  1. a byte-level BPE tokenizer (the `tokenizers` package, VOCAB tokens, `<unk>` `<s>` `</s>` = 0 1 2)
     trained on the training text;
  2. a Gated DeltaNet causal LM with flash-linear-attention's module names, config keys and
     forward math (fla `fla/layers/gated_deltanet.py`, `fla/models/gated_deltanet/`), trained for
     --steps on random windows of the training text;
  3. the bf16 weights, config.json and tokenizer files written to --out, in the layout fla's
     `save_pretrained` gives (`GatedDeltaNetForCausalLM`, tied embeddings);
  4. tests/fixtures/gdn_moby/golden.safetensors: `input_ids` [1, 64] (the first tokens of
     assets/eval.txt), float32 `logits` [1, 64, V] and `hidden_states` [L+1, 1, 64, D] of the
     float32 forward of the stored bf16 weights (token-by-token recurrence), and
     tests/fixtures/gdn_moby/reference.json: training facts and the perplexity of that forward on
     assets/eval.txt with `statecut eval`'s protocol (the file as one document followed by `</s>`,
     64 windows of 512 predicted tokens).

Per layer (pre-norm, RMSNorm with a plain weight, eps norm_eps):
  q, k, v = silu(causal depthwise conv(x W_{q,k,v}));  q, k L2-normalised per head (eps 1e-6 in the sqrt)
  beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (q / sqrt(head_dim))
  out = o_proj(rmsnorm(o) * w * silu(x W_g));  then a SwiGLU MLP, both with residuals.

Training uses the chunked form of the same recurrence (within a chunk of C tokens the delta-rule
updates are one unit lower-triangular solve); the goldens use the token-by-token form, and the
script checks that the two agree. The model, the text protocol and the training loop are
reference_torch.py's, which the other reference scripts share.

Usage:
  python3 scripts/train_embedded_model.py              # everything: 400 steps, one thread; the
                                                       # committed model took 394 s of CPU time
  python3 scripts/train_embedded_model.py --steps 50   # a quick, worse model
  python3 scripts/train_embedded_model.py golden       # rewrite the golden files only
"""

import argparse
import hashlib
import json
import os
import random
import time

import torch
import torch.nn.functional as F
from reference_torch import GatedDeltaNetForCausalLM, encode, init_normal, perplexity, random_windows, read_checkpoint
from reference_torch import save_checkpoint, tokenizer, train, warmup_cosine, windows, write_json
from safetensors.torch import save_file

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
ASSETS = os.path.join(ROOT, "assets")
TRAIN_FILES = [os.path.join(ASSETS, "calibration.txt"), os.path.join(ASSETS, "train.txt")]
EVAL_FILE = os.path.join(ASSETS, "eval.txt")
OUT = os.path.join(ASSETS, "models", "gdn-moby")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gdn_moby")
SPECIALS = ["<unk>", "<s>", "</s>"]
GOLDEN_TOKENS = 64
EVAL_SEQLEN, EVAL_WINDOWS = 512, 64

# The key set of the config.json fla 0.6 saves for GatedDeltaNetForCausalLM, scaled down.
CONFIG = {
    "allow_neg_eigval": False,
    "architectures": ["GatedDeltaNetForCausalLM"],
    "attn": None,
    "attn_mode": "chunk",
    "attnres_block_size": None,
    "bos_token_id": 1,
    "conv_size": 4,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "expand_v": 2,
    "fuse_cross_entropy": True,
    "fuse_linear_cross_entropy": False,
    "fuse_norm": True,
    "fuse_swiglu": True,
    "head_dim": 64,
    "hidden_act": "swish",
    "hidden_ratio": 4,
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": None,
    "max_position_embeddings": 2048,
    "model_type": "gated_deltanet",
    "norm_eps": 1e-06,
    "num_heads": 2,
    "num_hidden_layers": 4,
    "num_v_heads": None,
    "output_gate_activation": "swish",
    "pad_token_id": None,
    "tie_word_embeddings": True,
    "transformers_version": "5.17.0",
    "use_cache": True,
    "use_gate": True,
    "use_l2warp": False,
    "use_short_conv": True,
    "vocab_size": 2048,
}

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "model_max_length": 1000000,
    "add_bos_token": False,
    "add_eos_token": False,
}
SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "transformers_version": "5.17.0",
    "use_cache": True,
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def chapters(text):
    """The training text as documents, one per chapter (as statecut splits its built-in text)."""
    return [("CHAPTER " + c) for c in text.split("CHAPTER ") if c.strip()]


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, s
    return tok


def load(out):
    cfg, sd = read_checkpoint(out)
    model = GatedDeltaNetForCausalLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval(), cfg


# ---------------------------------------------------------------------------------------------
# Commands


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def write_golden(out, fixture, facts=None):
    """Goldens from the stored bf16 weights, in float32, with the token-by-token recurrence;
    the chunked form used in training must agree with it."""
    model, cfg = load(out)
    tok = tokenizer(os.path.join(out, "tokenizer.json"))
    eos = cfg["eos_token_id"]
    eval_ids = encode(tok, [read(EVAL_FILE)], eos)
    x = torch.tensor(eval_ids[:GOLDEN_TOKENS])[None]
    with torch.no_grad():
        logits, hidden = model(x, "recurrent")
        chunked, _ = model(x)
    rel = ((chunked - logits).norm() / logits.norm()).item()
    print(f"golden: chunked vs token-by-token logits, relative difference {rel:.2e}")
    assert rel < 1e-5, rel
    os.makedirs(fixture, exist_ok=True)
    save_file(
        {
            "input_ids": x.to(torch.int64).contiguous(),
            "logits": logits.float().contiguous(),
            "hidden_states": torch.stack(hidden).float().contiguous(),
        },
        os.path.join(fixture, "golden.safetensors"),
        metadata={"note": f"float32 forward of the bf16 weights, first {GOLDEN_TOKENS} tokens of assets/eval.txt"},
    )
    wins = windows(eval_ids, EVAL_SEQLEN, EVAL_WINDOWS)
    ppl, n = perplexity(lambda ids: model(ids)[0], wins), len(wins)
    assert n == EVAL_WINDOWS, f"assets/eval.txt holds only {n} windows of {EVAL_SEQLEN}"
    path = os.path.join(fixture, "reference.json")
    ref = json.load(open(path)) if os.path.exists(path) else {}
    ref.update(facts or {})
    ref[f"eval_ppl_f32_{EVAL_SEQLEN}x{EVAL_WINDOWS}"] = ppl
    ref["model_sha256"] = sha256(os.path.join(out, "model.safetensors"))
    write_json(path, ref)
    print(f"assets/eval.txt perplexity {ppl:.4f} ({n} x {EVAL_SEQLEN} tokens); wrote {fixture}")


def cmd_train(args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()
    train_text = "".join(read(p) for p in TRAIN_FILES)
    docs = chapters(train_text)
    tok = train_tokenizer(docs, args.vocab)
    cfg = dict(CONFIG, vocab_size=tok.get_vocab_size())
    eos = tok.token_to_id("</s>")
    ids = encode(tok, docs, eos)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; training text {len(train_text)} chars, {len(ids)} tokens")
    data = torch.tensor(ids)

    model = GatedDeltaNetForCausalLM(cfg)
    init_normal(model, cfg["initializer_range"])
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params} parameters")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    L, bs = args.seqlen, args.batch
    gen = torch.Generator().manual_seed(args.seed)

    def batch_loss():
        batch = random_windows(data, L, bs, gen)
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        return loss, {"loss": loss}

    # linear warm-up over the first tenth, cosine decay to 5% of the peak
    lr_at = warmup_cosine(args.lr, max(1, args.steps // 10), 0.05)
    _, last, t0 = train(model, opt, batch_loss, lr_at, steps=args.steps, log_every=50, log_lr=True)
    train_seconds = time.time() - t0
    loss = last.get("loss", torch.tensor(float("nan")))

    save_checkpoint(model, cfg, args.out, tok)
    write_json(os.path.join(args.out, "tokenizer_config.json"), TOKENIZER_CONFIG)
    write_json(os.path.join(args.out, "special_tokens_map.json"), SPECIAL_TOKENS_MAP)
    write_json(os.path.join(args.out, "generation_config.json"), GENERATION_CONFIG)
    facts = {
        "arch": "gated_deltanet",
        "params": params,
        "vocab": tok.get_vocab_size(),
        "train_text_tokens": len(ids),
        "train_steps": args.steps,
        "train_tokens": args.steps * bs * L,
        "batch": bs,
        "seqlen": L,
        "lr": args.lr,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "threads": torch.get_num_threads(),
        "final_train_loss": loss.item(),
        "seed": args.seed,
        "torch": torch.__version__,
    }
    write_golden(args.out, args.fixture, facts)
    print(f"done in {time.time() - t_start:.0f}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", choices=["train", "golden"], default="train")
    ap.add_argument("--out", default=OUT, help="model directory")
    ap.add_argument("--fixture", default=FIXTURE, help="where the golden files go")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    # Subnormal floats (products of long decays) are 10-100x slower on the CPU; flushing them to
    # zero changes no result above 1e-38. One thread by default: on a busy machine, threads that
    # wait for each other at every operation are much slower than one.
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    if args.cmd == "golden":
        write_golden(args.out, args.fixture)
    else:
        cmd_train(args)


if __name__ == "__main__":
    main()
