#!/usr/bin/env python3
"""The recovery fine-tune of *On State Reduction in Linear Attention* in PyTorch + PEFT + fla,
timed on a GPU as the baseline for `statecut recover`.

    python3 scripts/recover_reference.py --student PRUNED --teacher ORIGINAL --kernel fla \\
        --batch 16 --seqlen 2048 --steps 6 --warmup 2 --json OUT.json
    python3 scripts/recover_reference.py --self-test [--device cuda]

The recipe:
  * student: the pruned fla checkpoint; PEFT LoRA r=32, alpha=64, dropout 0 on q_proj, k_proj,
    v_proj; besides, every parameter whose name contains `conv1d`, `norm` or `bias` trains whole
    (in fla's DeltaNet / Gated DeltaNet: the short convs, the layer and output norms, the final
    norm and Gated DeltaNet's dt_bias);
  * teacher: a second copy of the unpruned model, eval mode, no gradients;
  * loss = CE(next token) + w * T^2 * KL(softmax(teacher / T) || softmax(student / T)), w = 1,
    T = 2, the KL over the full vocabulary, summed over the vocabulary and averaged over all
    B * seqlen token rows ("batchmean" over the flattened rows); CE averaged over the
    B * (seqlen - 1) predicted tokens;
  * AdamW lr 1e-4 (constant: no schedule in a handful of timed steps), weight decay 0.1 on every
    trained tensor, eps 1e-15, betas (0.9, 0.95); gradients clipped to global norm 1.0.

Precision:
  * both models' weights are bf16 (loaded with dtype=bfloat16); no autocast;
  * LoRA A and B are float32 (PEFT's autocast_adapter_dtype=True): the adapter path runs in
    float32 and its sum with the bf16 base output is cast back to bf16;
  * the tensors trained whole are bf16 in the model (their gradients too); AdamW steps float32
    copies of them (--whole-master float32, the default; moments float32) and the model's bf16
    tensors are rounded from those after every step. bf16 alone (--whole-master bf16: weights
    and moments bf16) drops every update of lr = 1e-4 to a weight near 1, whose bf16 spacing is
    2^-7 (the float32 copy gathers them, and the bf16 weight moves once they add up to half a
    spacing, after some 40 steps); the JSON's whole_fraction_changed says which tensors moved.
    The adapters' moments are float32;
  * logits come out of the bf16 head; the loss is computed from them upcast to float32;
  * --kernel fla: fla's Triton chunk kernels (bf16 in and out, float32 accumulation inside);
    --kernel torch: the delta rule in plain PyTorch with autograd, float32 throughout (L2 norms,
    gates, the chunk solve and the state), output cast back to bf16. float32 matmuls at torch's
    default precision (no TF32).

Timing: --warmup untimed steps, then --steps timed steps. One step is the teacher's forward, the
student's forward, the loss, the backward, clipping, the AdamW update and zeroing the gradients;
the batch is on the device before the clock starts, and torch.cuda.synchronize() closes both
ends. Tokens are random ids in the vocabulary from a fixed seed (speed only). The JSON has
seconds per timed step (median, mean, each), tokens/s = batch * seqlen / step time, the rate over
all steps including warm-up (as statecut's own figure counts its first step), peak
max_memory_allocated / max_memory_reserved over the whole run (over the checkpointed run after a
retry, below), the trainable parameter count and every step's loss.

--kernel fla: fla 0.6.0's gated chunk backward refuses to run on Hopper with Triton >= 3.4 and
< 3.7.1 (in the first step's backward); any exception is written as {"error": ...} and the
script exits 0.
--kernel torch: fla's chunk_gated_delta_rule / chunk_delta_rule are replaced, in the fla layer
modules that call them, by the chunked (UT-transform) form in plain PyTorch below; the short
convs and fused norms stay fla's.

--checkpointing auto (the default) runs without activation checkpointing and, if the first step
runs out of memory, once more with transformers' per-layer checkpointing; the JSON says which.

--device cpu (with --kernel torch) swaps fla's Triton-only modules for PyTorch equivalents so that
a tiny model can be smoke-tested without a GPU.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6  # fla's l2norm_fwd default


# ---------------------------------------------------------------------------------------------
# The delta rule in plain PyTorch


def _l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(q, k, v, beta, g=None, scale=1.0, initial_state=None, chunk=CHUNK):
    """o_t = S_t^T (scale q_t) with S_t = exp(g_t) S_{t-1} + k_t u_t^T,
    u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t), in chunks of C tokens (g = None: no decay).

    q, k [B, T, H, K], v [B, T, H, V], beta and g [B, T, H], initial_state [B, H, K, V], all in
    one floating dtype (the compute dtype). Returns o [B, T, H, V] and the final state.

    With b_t the cumulative log decay from the chunk's start and S the state before the chunk,
    the chunk's updates solve the unit lower-triangular system
        u_t + sum_{s<t} beta_t exp(b_t - b_s) (k_t . k_s) u_s = beta_t v_t - beta_t exp(b_t) S^T k_t,
    i.e. u = U0 - W S with (I + A) [U0 | W] = [beta v | beta exp(b) k] (the WY / UT form);
    then o_t = exp(b_t) S^T q_t + sum_{s<=t} exp(b_t - b_s) (q_t . k_s) u_s and the next
    S = exp(b_C) S + sum_s exp(b_C - b_s) k_s u_s^T."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # k = 0 and beta = 0 leave the state alone; g = 0 decays nothing
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, 0, 0, pad))
        if g is not None:
            g = F.pad(g, (0, 0, 0, pad))
    n = (T + pad) // chunk

    def split(x):  # [B, T, H, D] -> [B, H, n, C, D]
        return x.reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v = split(q * scale), split(k), split(v)
    beta = split(beta[..., None])[..., 0]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    if g is None:
        decay = causal.to(k.dtype)
        gain = tail = torch.ones_like(beta)
    else:
        b = split(g[..., None])[..., 0].cumsum(-1)
        # -inf above the diagonal before exp: exp(b_t - b_s) for s > t could overflow
        decay = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        gain = b.exp()
        # exp(b_C - b_s) from b, not as a ratio of gains that may have underflowed
        tail = (b[..., -1:] - b).exp()
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([beta[..., None] * v, (beta * gain)[..., None] * k], -1)
    u0, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([V, K], -1)
    qk = (q @ k.transpose(-1, -2)) * decay
    qg = q * gain[..., None]
    kt = (k * tail[..., None]).transpose(-1, -2)
    last = gain[..., -1, None, None]  # [B, H, n, 1, 1]
    # only the state crosses chunks: one short sequential loop
    S = k.new_zeros(B, H, K, V) if initial_state is None else initial_state
    outs = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ S
        outs.append(qg[:, :, i] @ S + qk[:, :, i] @ u)
        S = last[:, :, i] * S + kt[:, :, i] @ u
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, V)
    return o[:, :T], S


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reject(cu_seqlens, cp_context=None):
    if cu_seqlens is not None or cp_context is not None:
        raise NotImplementedError("the plain-PyTorch delta rule takes equal-length batches only")


def torch_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                 allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                 cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):
    """fla 0.6.0's chunk_gated_delta_rule, same arguments and results: q, k [B, T, H, K],
    v [B, T, HV, V] (HV a multiple of H: value head i reads key head i // (HV / H)), g and beta
    [B, T, HV]; with use_gate_in_kernel=True (kwargs, as fla's GatedDeltaNet layer calls it) g is
    the raw a_proj output and the decay is -exp(A_log) * softplus(g + dt_bias); states
    [N, HV, K, V], or [N, HV, V, K] with state_v_first."""
    _reject(cu_seqlens, cp_context)
    if "transpose_state_layout" in kwargs:
        state_v_first = kwargs.pop("transpose_state_layout")
    ct, out_dtype = _compute_dtype(q), q.dtype
    if scale is None:
        scale = k.shape[-1] ** -0.5
    q, k, v, g, beta = (x.to(ct) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if kwargs.get("use_gate_in_kernel", False):
        dt_bias = kwargs.get("dt_bias")
        if dt_bias is not None:
            g = g + dt_bias.to(ct)
        g = -kwargs["A_log"].to(ct).exp() * F.softplus(g)
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    h0 = None if initial_state is None else initial_state.to(ct)
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    o, S = chunked_delta_rule(q, k, v, beta, g, scale, h0, kwargs.get("chunk_size", CHUNK))
    if not output_final_state:
        S = None
    elif state_v_first:
        S = S.transpose(-1, -2).contiguous()
    return o.to(out_dtype), S


def torch_chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla 0.6.0's chunk_delta_rule (no decay): q, k [B, T, H, K], v [B, T, H, V], beta
    [B, T, H] (already through the sigmoid), states [N, H, K, V]."""
    _reject(cu_seqlens)
    ct, out_dtype = _compute_dtype(q), q.dtype
    if scale is None:
        scale = k.shape[-1] ** -0.5
    q, k, v, beta = (x.to(ct) for x in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    h0 = None if initial_state is None else initial_state.to(ct)
    o, S = chunked_delta_rule(q, k, v, beta, None, scale, h0, kwargs.get("chunk_size", CHUNK))
    return o.to(out_dtype), (S if output_final_state else None)


CALLS = {"chunk_gated_delta_rule": 0, "chunk_delta_rule": 0}


def _counted(name, fn):
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return wrapper


def patch_fla_rules():
    """Points the name each fla layer module calls at the plain-PyTorch rule (the layers look the
    name up in their module at call time). Returns the patched modules."""
    import importlib

    for m in ("fla.layers.gated_deltanet", "fla.layers.delta_net"):
        importlib.import_module(m)
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    swaps = {chunk_gated_delta_rule: ("chunk_gated_delta_rule", torch_chunk_gated_delta_rule),
             chunk_delta_rule: ("chunk_delta_rule", torch_chunk_delta_rule)}
    patched = []
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith(("fla.layers.", "fla.models.")) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if any(value is f for f in swaps):
                name, fn = swaps[value]
                setattr(mod, attr, _counted(name, fn))
                patched.append(f"{modname}.{attr}")
    return sorted(patched)


# ---------------------------------------------------------------------------------------------
# Plain-PyTorch stand-ins for fla's Triton-only modules (--device cpu only)


def cpu_fallbacks():
    import fla.layers.delta_net
    import fla.layers.gated_deltanet
    import fla.modules.causal_conv1d.ops as conv_ops
    from fla.modules import FusedRMSNormGated, GatedMLP, RMSNorm

    def rms(x, w, eps):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return y * w.float() if w is not None else y

    def rmsnorm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        y = rms(x, self.weight, self.eps).to(x.dtype)
        return (y, x) if prenorm else y

    def gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        act = torch.sigmoid(g.float()) if self.activation == "sigmoid" else F.silu(g.float())
        y = (rms(x, self.weight, self.eps) * act).to(x.dtype)
        return (y, x) if prenorm else y

    def mlp_forward(self, x, **kwargs):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, cu_seqlens=None, **kwargs):
        if initial_state is not None or output_final_state or cu_seqlens is not None:
            raise NotImplementedError("the CPU stand-in convolves whole equal-length batches only")
        w = weight.shape[-1]
        y = F.conv1d(F.pad(x.transpose(1, 2), (w - 1, 0)), weight[:, None, :].to(x.dtype),
                     None if bias is None else bias.to(x.dtype), groups=x.shape[-1]).transpose(1, 2)
        if activation in ("silu", "swish"):
            y = F.silu(y)
        if residual is not None:
            y = y + residual
        return y, None

    RMSNorm.forward = rmsnorm_forward
    FusedRMSNormGated.forward = gated_forward
    GatedMLP.forward = mlp_forward
    for mod in (conv_ops, fla.layers.gated_deltanet, fla.layers.delta_net):
        if hasattr(mod, "causal_conv1d"):
            mod.causal_conv1d = causal_conv1d


# ---------------------------------------------------------------------------------------------
# The recovery step


def kd_loss(student_logits, teacher_logits, ids, temperature, kd_weight):
    """CE + w T^2 KL(teacher || student) at temperature T, in float32: CE over the B (S - 1)
    next-token predictions, KL summed over the vocabulary and averaged over all B S rows."""
    vocab = student_logits.shape[-1]
    s = student_logits.float()
    # the last position predicts nothing: ignored, so the logits need no shifted copy
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    ce = F.cross_entropy(s.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
    log_s = F.log_softmax(s.reshape(-1, vocab) / temperature, -1)
    log_t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, -1)
    kd = F.kl_div(log_s, log_t, reduction="batchmean", log_target=True) * temperature**2
    return ce + kd_weight * kd, ce, kd


def load(path, device, trainable):
    import fla  # noqa: F401  registers fla's models with transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def wrap_student(model, args):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    cfg = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj"], bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)  # autocast_adapter_dtype=True: adapters in float32
    for name, p in model.named_parameters():
        if any(s in name for s in ("conv1d", "norm", "bias")):
            p.requires_grad_(True)
    model.train()
    return model


def kind(name):
    """q_conv1d, o_norm, dt_bias, ...: the module (or parameter) a trained tensor belongs to."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def describe_trainable(model):
    lora = [(n, p) for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    whole = [(n, p) for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    kinds = {}
    for n, p in whole:
        kinds[kind(n)] = kinds.get(kind(n), 0) + p.numel()
    base = [p for n, p in model.named_parameters() if "base_layer" in n]
    return {
        "trainable_params": sum(p.numel() for _, p in lora + whole),
        "lora_params": sum(p.numel() for _, p in lora),
        "lora_tensors": len(lora),
        "whole_params": sum(p.numel() for _, p in whole),
        "whole_tensors": len(whole),
        "whole_by_kind": kinds,
        "lora_dtype": str(lora[0][1].dtype) if lora else None,
        "whole_dtypes": sorted({str(p.dtype) for _, p in whole}),
        "base_dtype": str(base[0].dtype) if base else None,
    }


def run(args):
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    result = {"tool": "recover_reference", "kernel": args.kernel, "device": args.device,
              "student": args.student, "teacher": args.teacher, "batch": args.batch, "seqlen": args.seqlen,
              "warmup_steps": args.warmup, "timed_steps": args.steps, "tokens_per_step": args.batch * args.seqlen,
              "recipe": {"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "lora_dropout": 0.0,
                         "lora_targets": ["q_proj", "k_proj", "v_proj"], "whole": ["conv1d", "norm", "bias"],
                         "lr": args.lr, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-15, "clip": 1.0,
                         "kd_temperature": args.temperature, "kd_weight": args.kd_weight}}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(dev)
    import fla
    import peft
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "fla": getattr(fla, "__version__", None), "peft": peft.__version__}
    try:
        import triton

        result["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    if args.kernel == "torch":
        result["patched"] = patch_fla_rules()
    if not cuda:
        if args.kernel != "torch":
            raise SystemExit("--device cpu needs --kernel torch (fla's chunk kernels are Triton)")
        cpu_fallbacks()

    teacher = load(args.teacher, dev, trainable=False)
    student = wrap_student(load(args.student, dev, trainable=True), args)
    result.update(describe_trainable(student))
    vocab = student.config.vocab_size
    if cuda:
        torch.cuda.synchronize()
        result["memory_after_load_gib"] = torch.cuda.memory_allocated(dev) / 2**30
    lora = [p for n, p in student.named_parameters() if p.requires_grad and "lora_" in n]
    named_whole = [(n, p) for n, p in student.named_parameters() if p.requires_grad and "lora_" not in n]
    whole = [p for _, p in named_whole]
    initial = [p.detach().clone() for p in whole]
    if args.whole_master == "float32":
        # bf16 cannot hold an update of lr = 1e-4 to a weight near 1 (its spacing there is
        # 2^-7): the optimizer steps float32 copies, and the bf16 weights are rounded from them.
        masters = [p.detach().to(torch.float32, copy=True) for p in whole]
    else:
        masters = whole
    params = lora + masters
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, eps=1e-15, betas=(0.9, 0.95))
    result["whole_master_dtype"] = args.whole_master

    gen = torch.Generator().manual_seed(args.seed)
    total = args.warmup + args.steps
    batches = [torch.randint(0, vocab, (args.batch, args.seqlen), generator=gen) for _ in range(total)]

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def step(ids):
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits
        s_logits = student(input_ids=ids, use_cache=False).logits
        loss, ce, kd = kd_loss(s_logits, t_logits, ids, args.temperature, args.kd_weight)
        del s_logits, t_logits
        loss.backward()
        if masters is not whole:
            for m, p in zip(masters, whole):
                if p.grad is not None:
                    m.grad, p.grad = p.grad.float(), None
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if masters is not whole:
            with torch.no_grad():
                for m, p in zip(masters, whole):
                    p.copy_(m)
        opt.zero_grad(set_to_none=True)
        return loss.detach(), ce.detach(), kd.detach(), norm.detach()

    mode = args.checkpointing
    result["checkpointing"] = mode == "on"
    if mode == "on":
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def timed_step(ids):
        sync()
        t0 = time.perf_counter()
        out = step(ids)
        sync()
        return out, time.perf_counter() - t0

    history = []
    for i in range(total):
        ids = batches[i].to(dev)
        retry = None
        try:
            out, seconds = timed_step(ids)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if i > 0 or mode != "auto" or "out of memory" not in str(e):
                raise
            retry = str(e).splitlines()[0]
        if retry is not None:
            # Out of memory without checkpointing: with the exception gone, what the step held is
            # free; redo it with per-layer activation checkpointing.
            opt.zero_grad(set_to_none=True)
            student.zero_grad(set_to_none=True)
            result["oom_without_checkpointing"] = retry
            result["checkpointing"] = True
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            out, seconds = timed_step(ids)
        loss, ce, kd, norm = (x.item() for x in out)
        history.append({"step": i, "warmup": i < args.warmup, "seconds": seconds, "loss": loss, "ce": ce,
                        "kd": kd, "grad_norm": norm})
        print(f"step {i}{' (warm-up)' if i < args.warmup else ''}: {seconds:.3f} s, loss {loss:.4f} "
              f"(ce {ce:.4f}, kd {kd:.4f}), grad norm {norm:.3f}", file=sys.stderr, flush=True)

    timed = [h["seconds"] for h in history if not h["warmup"]]
    tokens = args.batch * args.seqlen
    med, mean = statistics.median(timed), statistics.fmean(timed)
    result.update({
        "seconds_per_step": {"median": med, "mean": mean, "timed": timed},
        "tokens_per_second": tokens / med,
        "tokens_per_second_mean": tokens / mean,
        "tokens_per_second_all_steps": tokens * total / sum(h["seconds"] for h in history),
        "history": history,
    })
    # which tensors trained whole moved: a bf16 weight near 1 stays put for many steps
    changed = {}
    for (n, p), p0 in zip(named_whole, initial):
        c = changed.setdefault(kind(n), [0, 0])
        c[0] += (p.detach() != p0).sum().item()
        c[1] += p.numel()
    result["whole_fraction_changed"] = {k: c / t for k, (c, t) in changed.items()}
    if cuda:
        result["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        result["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
    if args.kernel == "torch":
        result["torch_rule_calls"] = dict(CALLS)
    return result


# ---------------------------------------------------------------------------------------------
# Self-test: the chunked form against the token-by-token recurrence


def recurrent(q, k, v, beta, g, scale, h0):
    """One token at a time, the definition: S = exp(g_t) S; u = beta_t (v_t - S^T k_t);
    S += k_t u^T; o_t = S^T (scale q_t)."""
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if h0 is None else h0.clone()
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, 1), S


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def self_test(device):
    torch.manual_seed(0)
    dev = torch.device(device)
    f64 = dict(dtype=torch.float64, device=dev)
    rows = []

    def check(name, err, tol):
        passed = err <= tol
        rows.append({"test": name, "max_rel_err": err, "tol": tol, "pass": passed})
        print(f"{'ok  ' if passed else 'FAIL'} {name}: max relative error {err:.2e} (tol {tol:.0e})", flush=True)

    def inputs(B, T, H, K, V, decay, strength=0.5):
        q = torch.randn(B, T, H, K, **f64)
        k = _l2norm(torch.randn(B, T, H, K, **f64))
        v = torch.randn(B, T, H, V, **f64)
        beta = torch.rand(B, T, H, **f64)
        g = -torch.rand(B, T, H, **f64) * strength if decay else None
        h0 = torch.randn(B, H, K, V, **f64) * 0.1
        return q, k, v, beta, g, h0

    # the core form, float64: T not a multiple of the chunk, d_k != d_v, with and without decay
    for decay in (True, False):
        for T, chunk in ((150, 64), (37, 16), (64, 64), (5, 64)):
            q, k, v, beta, g, h0 = inputs(2, T, 3, 12, 20, decay)
            o, S = chunked_delta_rule(q, k, v, beta, g, 0.3, h0, chunk)
            ro, rS = recurrent(q, k, v, beta, g, 0.3, h0)
            tag = f"{'gated' if decay else 'plain'} T={T} C={chunk} K=12 V=20"
            check(f"output {tag}", _rel(o, ro), 1e-10)
            check(f"final state {tag}", _rel(S, rS), 1e-10)

    # gradients through the chunk solve (autograd) against the recurrence's
    for decay in (True, False):
        q, k, v, beta, g, h0 = inputs(1, 70, 2, 8, 6, decay)
        leaves = [x.requires_grad_() for x in (q, k, v, beta, h0) + ((g,) if decay else ())]
        w_o = torch.randn(1, 70, 2, 6, **f64)
        w_s = torch.randn(1, 2, 8, 6, **f64)

        def grads(fn):
            o, S = fn(q, k, v, beta, g, 0.5, h0)
            return torch.autograd.grad((o * w_o).sum() + (S * w_s).sum(), leaves)

        ga = grads(lambda *a: chunked_delta_rule(*a, chunk=32))
        gb = grads(recurrent)
        check(f"gradients {'gated' if decay else 'plain'} T=70 C=32", max(_rel(a, b) for a, b in zip(ga, gb)), 1e-9)

    # fla's calling conventions: raw gate with A_log/dt_bias, beta logits, in-kernel L2 norm,
    # grouped value heads, state_v_first
    B, T, H, HV, K, V = 2, 100, 2, 4, 16, 24
    q, k = torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, K, **f64)
    v = torch.randn(B, T, HV, V, **f64)
    a_raw, b_raw = torch.randn(B, T, HV, **f64), torch.randn(B, T, HV, **f64)
    A_log, dt_bias = torch.rand(HV, **f64).log(), torch.randn(HV, **f64) * 0.1
    h0 = torch.randn(B, HV, K, V, **f64) * 0.1
    o, S = torch_chunk_gated_delta_rule(q, k, v, a_raw, b_raw, initial_state=h0.transpose(-1, -2).contiguous(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, state_v_first=True,
                                        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    rg = -A_log.exp() * F.softplus(a_raw + dt_bias)
    rq, rk = (_l2norm(x).repeat_interleave(HV // H, 2) for x in (q, k))
    ro, rS = recurrent(rq, rk, v, b_raw.sigmoid(), rg, K**-0.5, h0)
    check("fla conventions (gate in kernel, beta sigmoid, l2norm, GVA 2->4, state_v_first): output", _rel(o, ro), 1e-10)
    check("fla conventions: final state", _rel(S.transpose(-1, -2), rS), 1e-10)
    q, k = torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, K, **f64)
    v, beta = torch.randn(B, T, H, V, **f64), torch.rand(B, T, H, **f64)
    o, _ = torch_chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    ro, _ = recurrent(_l2norm(q), _l2norm(k), v, beta, None, K**-0.5, None)
    check("chunk_delta_rule wrapper (l2norm, default scale)", _rel(o, ro), 1e-10)

    # float32 at a training length (what --kernel torch computes in) against float64; strong
    # decay underflows exp(b) within a chunk in float32
    for strength in (0.5, 20.0):
        q, k, v, beta, g, _ = inputs(1, 2048 if dev.type == "cuda" else 512, 2, 64, 96, True, strength)
        o32, _ = chunked_delta_rule(*(x.float() for x in (q, k, v, beta, g)), scale=64**-0.5)
        o64, _ = chunked_delta_rule(q, k, v, beta, g, 64**-0.5)
        check(f"float32 vs float64, T={q.shape[1]} K=64 V=96, g in (-{strength:g}, 0]", _rel(o32.double(), o64), 1e-4)

    _fla_naive(check, f64)
    if dev.type == "cuda":
        _fla_parity(check)
    ok = all(r["pass"] for r in rows)
    print(f"{sum(r['pass'] for r in rows)} passed, {sum(not r['pass'] for r in rows)} failed", flush=True)
    return ok, rows


def _fla_naive(check, f64):
    """The recurrence and the gate against fla's own plain-PyTorch references (they compute in
    float32), where fla imports."""
    try:
        from fla.ops.delta_rule.naive import delta_rule_recurrence
        from fla.ops.gated_delta_rule.gate import naive_gdn_gate
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"skip fla's reference functions: {e}", flush=True)
        return
    B, T, H, K, V = 2, 90, 3, 16, 8
    q, k, v = torch.randn(B, T, H, K, **f64), _l2norm(torch.randn(B, T, H, K, **f64)), torch.randn(B, T, H, V, **f64)
    beta = torch.rand(B, T, H, **f64)
    a_raw, A_log, dt_bias = torch.randn(B, T, H, **f64), torch.rand(H, **f64).log(), torch.randn(H, **f64)
    h0 = torch.randn(B, H, K, V, **f64) * 0.1
    g = naive_gdn_gate(a_raw, A_log, dt_bias, output_dtype=torch.float64)
    ref, ref_s = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    mine, mine_s = torch_chunk_gated_delta_rule(q, k, v, a_raw, beta, initial_state=h0, output_final_state=True,
                                                use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    check("vs fla naive_recurrent_gated_delta_rule + naive_gdn_gate (float32 there): output",
          _rel(mine, ref.double()), 1e-5)
    check("vs fla naive_recurrent_gated_delta_rule: final state", _rel(mine_s, ref_s.double()), 1e-5)
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  fla's delta_rule_recurrence is head-first
    ref, ref_s = delta_rule_recurrence(tr(q), tr(k), tr(v), tr(beta), initial_state=h0)
    mine, mine_s = torch_chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    check("vs fla delta_rule_recurrence (float32 there): output", _rel(mine, tr(ref).double()), 1e-5)
    check("vs fla delta_rule_recurrence: final state", _rel(mine_s, ref_s.double()), 1e-5)


def _fla_parity(check):
    """On a GPU: the plain-PyTorch rules against fla's own kernels, called as the layers call them
    (bf16 inputs; forward, and the ungated rule's backward)."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print(f"skip fla parity: {e}", flush=True)
        return
    torch.manual_seed(1)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    B, T, H, K, V = 2, 1000, 4, 64, 128
    q, k, v = torch.randn(B, T, H, K, **bf), torch.randn(B, T, H, K, **bf), torch.randn(B, T, H, V, **bf)
    a_raw, b_raw = torch.randn(B, T, H, **bf), torch.randn(B, T, H, **bf)
    # bf16 like every parameter of a model loaded with dtype=bfloat16
    A_log = torch.rand(H, device="cuda").log().to(torch.bfloat16)
    dt_bias = (torch.randn(H, device="cuda") * 0.1).to(torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
              use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    ref, _ = chunk_gated_delta_rule(q, k, v, a_raw, b_raw, **kw)
    mine, _ = torch_chunk_gated_delta_rule(q, k, v, a_raw, b_raw, **kw)
    check("fla chunk_gated_delta_rule forward (bf16, as GatedDeltaNet calls it)", _rel(mine.float(), ref.float()), 2e-2)
    beta = b_raw.float().sigmoid().to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta)]
    w = torch.randn(B, T, H, V, **bf)
    outs = []
    for fn in (chunk_delta_rule, torch_chunk_delta_rule):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o, _ = fn(*xs, use_qk_l2norm_in_kernel=True)
        (o.float() * w.float()).sum().backward()
        outs.append((o, [x.grad for x in xs]))
    (ro, rg), (mo, mg) = outs
    check("fla chunk_delta_rule forward (bf16)", _rel(mo.float(), ro.float()), 2e-2)
    check("fla chunk_delta_rule gradients (bf16)", max(_rel(a.float(), b.float()) for a, b in zip(mg, rg)), 5e-2)


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--student", help="the pruned fla checkpoint")
    ap.add_argument("--teacher", help="the unpruned fla checkpoint")
    ap.add_argument("--kernel", choices=["fla", "torch"], default="fla")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--whole-master", choices=["float32", "bf16"], default="float32",
                    help="the optimizer's copy of the tensors trained whole (conv1d, norm, bias)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lora-alpha", type=float, default=64.0)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--kd-weight", type=float, default=1.0)
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--self-test", action="store_true",
                    help="check the plain-PyTorch delta rule against the token-by-token recurrence (float64), "
                         "and on a GPU against fla's kernels")
    args = ap.parse_args()

    if args.self_test:
        ok, rows = self_test(args.device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"self_test": rows, "pass": ok}, f, indent=1)
        sys.exit(0 if ok else 1)
    if not (args.student and args.teacher):
        ap.error("--student and --teacher are required")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")

    try:
        result = run(args)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  the error is the result (fla's refusal on Hopper)
        if isinstance(e, KeyboardInterrupt):
            raise
        import traceback

        traceback.print_exc()
        result = {"tool": "recover_reference", "kernel": args.kernel, "device": args.device,
                  "student": args.student, "teacher": args.teacher, "batch": args.batch, "seqlen": args.seqlen,
                  "error": f"{type(e).__name__}: {e}"}
    line = json.dumps(result, allow_nan=True)
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
