"""ReLU-fy a SwiGLU LLaMA GGUF: silu(gate) becomes relu(gate) (ReGLU), then a short distillation from the
original model (KL of the next-token distributions) with an L1 push on relu(gate), ProSparse's recipe, makes
the FFN exactly and highly sparse. Predictors need that: on SwiGLU no predictor cheaper than the FFN skips
half the rows within +3 % perplexity (docs/notes/predictor_study.md).

Embeddings and norms stay frozen and keep their bytes; attention and FFN matrices are trained and stored back
as Q8_0 (or their float type). Needs torch and transformers;
a GPU for real models (SmolLM2-135M: ~5 min on one H100).

    python -m pyinfer.sparsity.relufy SmolLM2.gguf -o smol-relu.gguf --tokens train.npy --eval-tokens eval.npy \\
        --self-samples 2048 --steps 2000 --batch 32 --l1 0.05 --device cuda

--tokens: a (n_chunks, ctx) integer .npy of training text, --eval-tokens: one of held-out text; both written
by `python -m pyinfer.sparsity.relufy MODEL --dump-tokens N --corpus builtin|FILE -o FILE.npy`
(pyinfer/sparsity/corpus.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from pyinfer.console import run_cli
from pyinfer.converters.convert_hf_to_powergguf import rope_half_rows, rope_pair_rows, tensor_map
from pyinfer.errors import PyInferError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import FLOAT_TYPES, OutFile, OutTensor, encode, write_atomically
from pyinfer.sparsity.corpus import document_start

TRAINED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _hp(g: GGUFFile) -> dict:
    """The converter's hyperparameter dict, as far as tensor_map needs it."""
    c = g.config
    return {"n_layer": c.n_layer, "qkv_bias": c.qkv_bias, "out_bias": c.attn_out_bias, "ffn_bias": c.ffn_bias,
            "tied": c.tied_embeddings, "n_head": c.n_head, "n_head_kv": c.n_head_kv, "qk_norm": c.qk_norm}


def check_source(g: GGUFFile) -> None:
    """Only what to_hf and write_relu_gguf handle: a plain SwiGLU llama GGUF without rope scaling."""
    c = g.config
    if c.arch != "llama" or c.ffn_kind != "swiglu":
        raise UnsupportedError(f"{g.path}: relufy takes a SwiGLU llama model, not {c.arch} with {c.ffn_kind}")
    if g.ffn_layout != "down":
        raise UnsupportedError(f"{g.path}: a PowerGGUF; give the plain llama.cpp GGUF it was converted from")
    if c.rope_scale != 1.0:
        raise UnsupportedError(f"{g.path}: rope scaling is not supported here")


def to_hf(g: GGUFFile):
    """A float32 transformers LlamaForCausalLM with the GGUF's (dequantized) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = g.config
    config = LlamaConfig(vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff,
                         num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                         num_key_value_heads=c.n_head_kv, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
                         max_position_embeddings=c.n_ctx_train, tie_word_embeddings=c.tied_embeddings,
                         attention_bias=c.qkv_bias, mlp_bias=c.ffn_bias, hidden_act="silu",
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_base})
    model = LlamaForCausalLM(config)
    hp = _hp(g)
    state = {}
    for gname, hname, transform in tensor_map("llama", hp):
        w = g.dequantize(gname).astype(np.float32)
        if transform in ("perm_q", "perm_k"):
            w = rope_half_rows(w, hp["n_head"] if transform == "perm_q" else hp["n_head_kv"])
        state[hname] = torch.from_numpy(w)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (c.tied_embeddings and m == "lm_head.weight")]:
        raise RuntimeError(f"internal error: weights missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


class RecordingReLU(torch.nn.Module):
    """relu(gate) that keeps, of its last call, the mean activation (the L1 term) and the density."""

    def forward(self, gate: torch.Tensor) -> torch.Tensor:
        act = torch.relu(gate)
        self.l1 = act.float().mean()
        self.density = (act > 0).float().mean().detach()
        return act


def student_of(teacher):
    """A copy of the teacher with ReLU gates; only attention and FFN matrices train."""
    student = copy.deepcopy(teacher)
    student.config.hidden_act = "relu"
    acts = []
    for layer in student.model.layers:
        layer.mlp.act_fn = RecordingReLU()
        acts.append(layer.mlp.act_fn)
    for name, p in student.named_parameters():
        p.requires_grad = "layers." in name and "layernorm" not in name
    return student, acts


def kl_per_token(student_logits, teacher_logits):
    """KL(teacher || student) of each position's next-token distribution, (batch, ctx)."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


def self_samples(teacher, n: int, ctx: int, start_id: int, batch: int, device: str) -> np.ndarray:
    """n sequences of ctx tokens sampled from the teacher (temperature 1, no truncation) after start_id."""
    out = []
    for i in range(0, n, batch):
        b = min(batch, n - i)
        start = torch.full((b, 1), start_id, dtype=torch.long, device=device)
        seq = teacher.generate(start, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                               max_new_tokens=ctx - 1, min_new_tokens=ctx - 1, pad_token_id=start_id)
        out.append(seq[:, :ctx].cpu().numpy())
        print(f"self-samples {i + b}/{n}", file=sys.stderr, flush=True)
    return np.concatenate(out)


def evaluate(teacher, student, acts, chunks: np.ndarray, device: str) -> dict:
    """Perplexities of both models, KL(teacher || student) and the ReLU density per layer on chunks."""
    nll_t = nll_s = kl = 0.0
    density = np.zeros(len(acts))
    n = 0
    with torch.no_grad(), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
        for row in chunks:
            x = torch.from_numpy(row.astype(np.int64))[None].to(device)
            lt, ls = teacher(x).logits.float(), student(x).logits.float()
            nll_t += F.cross_entropy(lt[0, :-1], x[0, 1:], reduction="sum").item()
            nll_s += F.cross_entropy(ls[0, :-1], x[0, 1:], reduction="sum").item()
            kl += kl_per_token(ls, lt)[0, :-1].sum().item()
            density += np.array([a.density.item() for a in acts])
            n += x.shape[1] - 1
    return {"ppl_teacher": math.exp(nll_t / n), "ppl_student": math.exp(nll_s / n), "kl": kl / n,
            "density": float(density.mean() / len(chunks)),
            "density_per_layer": [round(float(d), 4) for d in density / len(chunks)]}


def train(teacher, student, acts, data: np.ndarray, *, steps: int, batch: int, micro: int, lr: float,
          l1: float, device: str, seed: int, seconds: float | None = None) -> None:
    """AdamW on KL(teacher || student) + l1 * mean relu(gate), l1 ramped up over the first 30 % of steps.
    With `seconds`, the step count shrinks to what fits, timed over steps 5-15."""
    rng = np.random.default_rng(seed)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = [steps]  # the schedule reads it, so a time budget can shorten it after the timing steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, total[0] // 20)) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / total[0])))))
    student.train()
    t0 = time.time()
    step = 0
    while step < total[0]:
        if step == 5:
            t5 = time.time()  # the first steps pay for CUDA's warm-up: time the next ten
        if seconds and step == 15:
            per_step = (time.time() - t5) / 10
            total[0] = max(16, min(steps, 15 + int((seconds - (time.time() - t0)) / per_step)))
            print(f"{per_step:.3f} s/step: {total[0]} steps", file=sys.stderr, flush=True)
        lam = l1 * min(1.0, step / max(1, 0.3 * total[0]))
        opt.zero_grad(set_to_none=True)
        rows = data[rng.integers(0, len(data), batch)].astype(np.int64)
        kl_sum = l1_sum = 0.0
        for i in range(0, batch, micro):
            x = torch.from_numpy(rows[i:i + micro]).to(device)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                with torch.no_grad():
                    lt = teacher(x).logits
                ls = student(x).logits
                kl = kl_per_token(ls, lt).mean()
                reg = torch.stack([a.l1 for a in acts]).mean()
                loss = (kl + lam * reg) * (x.shape[0] / batch)
            loss.backward()
            kl_sum += kl.item() * x.shape[0] / batch
            l1_sum += reg.item() * x.shape[0] / batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == total[0] - 1:
            dens = float(np.mean([a.density.item() for a in acts]))
            print(f"step {step:5d}  kl {kl_sum:.4f}  l1 {l1_sum:.4f}  lambda {lam:.3g}  density {dens:.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        step += 1
    student.eval()


def _out_type(qtype: Q) -> Q:
    """Trained matrices keep float types and Q8_0; anything coarser becomes Q8_0: the fine-tuning moves
    weights by less than a 4-bit step, and requantizing SmolLM2 to Q4_1 rounded the training away
    (held-out PPL 41.5 in transformers, ~800 from the Q4_1 file)."""
    return qtype if qtype in FLOAT_TYPES else Q.Q8_0


def write_relu_gguf(g: GGUFFile, student, out_path: str) -> None:
    """The source file with the trained matrices re-encoded and pyinfer.ffn_kind = reglu."""
    hp = _hp(g)
    params = {n: p for n, p in student.named_parameters()}
    kv = [kv for kv in g.typed_metadata()
          if kv[0] not in ("general.architecture", "general.alignment", "pyinfer.ffn_kind")]
    kv.append(("pyinfer.ffn_kind", "reglu", GGUFValueType.STRING, None))
    tensors = []
    for gname, hname, transform in tensor_map("llama", hp):
        info = g.tensors[gname]
        shape = tuple(reversed(info.ne))
        if not (gname.startswith("blk.") and gname.split(".")[2] in TRAINED):
            tensors.append(OutTensor(gname, shape, Q(info.type), lambda info=info: info.data))
            continue
        w = params[hname].detach().float().cpu().numpy()
        if transform in ("perm_q", "perm_k"):
            w = rope_pair_rows(w, hp["n_head"] if transform == "perm_q" else hp["n_head_kv"])
        qtype = _out_type(Q(info.type))
        tensors.append(OutTensor(gname, shape, qtype, lambda w=w, qtype=qtype: encode(w, qtype)))
    write_atomically([OutFile(out_path, "llama", kv, tensors)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", help="SwiGLU llama GGUF (plain llama.cpp layout)")
    p.add_argument("-o", "--output", required=True, help="ReGLU GGUF to write (or the .npy with --dump-tokens)")
    p.add_argument("--dump-tokens", type=int, metavar="N", default=0,
                   help="only tokenize N tokens of --corpus into (chunks, --ctx) and save them to -o")
    p.add_argument("--corpus", action="append", help="for --dump-tokens: builtin, shakespeare, bible, self or a file")
    p.add_argument("--tokens", help="(n_chunks, ctx) .npy of training text")
    p.add_argument("--eval-tokens", help=".npy of held-out text for the report")
    p.add_argument("--self-samples", type=int, default=0, help="add N sequences sampled from the teacher")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seconds", type=float, help="train at most this long (fewer steps than --steps)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--micro", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--l1", type=float, default=0.05, help="weight of mean relu(gate) in the loss")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="write the evaluation as JSON here")
    return p


def _dump_tokens(args: argparse.Namespace) -> int:
    from pyinfer.sparsity.profiler import calibration_chunks

    chunks, desc = calibration_chunks(args.model, args.corpus, args.dump_tokens, args.ctx)
    np.save(args.output, np.stack([c for c in chunks if len(c) == args.ctx]).astype(np.int32))
    print(desc, file=sys.stderr)
    return 0


def _relufy(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PyInferError("no CUDA device here: pass --device cpu (slow beyond tiny models)")
    g = GGUFFile(args.model)
    check_source(g)
    if not args.tokens and not args.self_samples:
        raise PyInferError("no training text: give --tokens and/or --self-samples")
    teacher = to_hf(g).to(args.device)
    student, acts = student_of(teacher)
    teacher = teacher.to(torch.bfloat16)
    parts = [np.load(args.tokens)[:, :args.ctx]] if args.tokens else []
    if args.self_samples:
        start = document_start(g.metadata)
        with torch.no_grad():
            parts.append(self_samples(teacher, args.self_samples, args.ctx, start, 512, args.device))
    data = np.concatenate(parts)
    rng = np.random.default_rng(args.seed)
    held = data[rng.permutation(len(data))[:16]]
    train(teacher, student, acts, data, steps=args.steps, batch=args.batch, micro=args.micro, lr=args.lr,
          l1=args.l1, device=args.device, seed=args.seed, seconds=args.seconds)
    report = {"train_held_in": evaluate(teacher, student, acts, held, args.device)}
    if args.eval_tokens:
        ev = np.load(args.eval_tokens).reshape(-1)
        n = len(ev) // args.ctx
        report["eval"] = evaluate(teacher, student, acts, ev[:n * args.ctx].reshape(n, args.ctx), args.device)
    report["args"] = {k: v for k, v in vars(args).items()}
    print(json.dumps(report, indent=1))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    write_relu_gguf(g, student, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("relufy", _parser(), lambda args: _dump_tokens(args) if args.dump_tokens else _relufy(args), argv)


if __name__ == "__main__":
    sys.exit(main())
