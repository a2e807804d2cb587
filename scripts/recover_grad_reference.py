#!/usr/bin/env python3
"""Reference gradients for `statecut recover`'s loss, from PyTorch autograd in float32.

The student is the embedded model (assets/models/gdn-moby) pruned by statecut itself
(`statecut prune --method l1 --ratio 0.5`, deterministic); the teacher is the unpruned model. Both
run as grad_reference.py's plain-PyTorch Gated DeltaNet with fla's names. On the first 130 tokens
of assets/eval.txt as ids [2, 65] (inputs ids[:, :-1], targets ids[:, 1:]) the loss is
src/recover/loss.rs's, the mean over the B*T tokens of

    lm * CE(student) + kd * T^2 * KL(softmax(teacher / T) || softmax(student / T)),  lm = kd = 1, T = 2,

differentiated with respect to every tensor of the default recovery plan (src/recover/plan.rs
`mixers`): q_proj, k_proj and v_proj of each pruned mixer, and every tensor under the mixer whose
name contains conv1d, norm or bias.

Written to tests/fixtures/grad/recover_gdn_moby.safetensors: `loss` (float64 scalar as [1]), `ids`
(int64 [2, 65]) and the gradients stored as grad_reference.py stores them (`grad.NAME`, with
`rows.NAME` for the sampled rows of a large matrix). tests/recover_parity.rs holds statecut's
training pass to them.

    cargo build --release && python3 scripts/recover_grad_reference.py [--bin target/release/statecut]

Any build of statecut prunes the same student (`cargo build` and `--bin target/debug/statecut`).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grad_reference as gr  # noqa: E402

TEACHER = os.path.join(gr.ROOT, "assets", "models", "gdn-moby")
BATCH, WINDOW = 2, 65
TEMPERATURE, KD_WEIGHT, LM_WEIGHT = 2.0, 1.0, 1.0
# src/recover/plan.rs: the substrings of a pruned mixer's tensors that train whole.
WHOLE = ("conv1d", "norm", "bias")


def prune(statecut, out):
    cmd = [statecut, "prune", "-m", TEACHER, "--method", "l1", "--ratio", "0.5", "-o", out, "-q"]
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))


def plan(model):
    """The default recovery plan by name. Every Gated DeltaNet mixer (`model.layers.N.attn`) is
    pruned; the Rust test checks that these are the names statecut's plan gives."""
    names = []
    for pname, _ in model.named_parameters():
        _, _, rest = pname.partition(".attn.")
        if not rest:
            continue
        if rest in ("q_proj.weight", "k_proj.weight", "v_proj.weight") or any(w in rest for w in WHOLE):
            names.append(pname)
    return names


def token_ids():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(TEACHER, "tokenizer.json"))
    text = open(os.path.join(gr.ROOT, "assets", "eval.txt")).read()
    ids = tok.encode(text, add_special_tokens=False).ids[: BATCH * WINDOW]
    assert len(ids) == BATCH * WINDOW
    return torch.tensor(ids, dtype=torch.int64).reshape(BATCH, WINDOW)


def recovery_loss(s_logits, t_logits, targets):
    """loss.rs's `chunk` over every row at once with scale 1 / rows."""
    s, t = s_logits.reshape(-1, s_logits.shape[-1]).float(), t_logits.reshape(-1, t_logits.shape[-1]).float()
    ce = -F.log_softmax(s, -1).gather(1, targets.reshape(-1, 1)).sum()
    logq = F.log_softmax(s / TEMPERATURE, -1)
    logp = F.log_softmax(t.detach() / TEMPERATURE, -1)
    kl = (logp.exp() * (logp - logq)).sum()
    return (LM_WEIGHT * ce + KD_WEIGHT * TEMPERATURE**2 * kl) / s.shape[0]


def main():
    ap = argparse.ArgumentParser()
    release = os.path.join(gr.ROOT, "target", "release", "statecut")
    ap.add_argument("--bin", default=release, help="the statecut binary that prunes the student")
    ap.add_argument("--out", default=os.path.join(gr.FIXTURES, "grad", "recover_gdn_moby.safetensors"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    teacher, t_forward = gr.fla_model("gdn_moby", TEACHER)
    # The teacher is the model the golden logits came from.
    gold = gr.golden("gdn_moby", None)
    with torch.no_grad():
        rel = gr.check_logits("gdn_moby", t_forward(gold["input_ids"].long()).float(), gold)
    with tempfile.TemporaryDirectory() as tmp:
        student_dir = os.path.join(tmp, "student")
        prune(a.bin, student_dir)
        student, s_forward = gr.fla_model("gdn_moby", student_dir)
    names = plan(student)
    params = dict(student.named_parameters())
    for p in student.parameters():
        p.requires_grad_(False)
    for n in names:
        params[n].requires_grad_(True)

    ids = token_ids()
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        t_logits = t_forward(inputs)
    loss = recovery_loss(s_forward(inputs), t_logits, targets)
    loss.backward()

    tensors = {"loss": torch.tensor([loss.item()], dtype=torch.float64), "ids": ids}
    for n in names:
        gr.put_grad(tensors, n, params[n].grad)
    meta = {
        "model": "gdn_moby pruned by statecut prune --method l1 --ratio 0.5",
        "temperature": str(TEMPERATURE),
        "kd_weight": str(KD_WEIGHT),
        "lm_weight": str(LM_WEIGHT),
        "torch": torch.__version__,
    }
    save_file(tensors, a.out, metadata=meta)
    print(f"{a.out}: loss {loss.item():.6f} (teacher logits {rel:.1e} from the golden ones), {len(names)} gradients, "
          f"{os.path.getsize(a.out) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
