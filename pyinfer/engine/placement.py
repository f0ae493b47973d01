"""Where each part of a model runs under a VRAM budget: per layer, attention + KV cache on the GPU or the CPU,
and k_l, how many of its hot-first FFN neurons live on the GPU (rows [0, k_l); the CPU computes the rest at
the same time). Solved exactly as a mixed-integer program (scipy.optimize.milp, HiGHS).

Cost model, microseconds per decoded token (docs/ARCHITECTURE.md, "Placement"):
    layer l = attention + predictor (where the attention is) + max(GPU FFN, CPU FFN + transfer)
    FFN part = sum over its neurons of (expected activations of the neuron) * bytes per neuron / bandwidth
A neuron group g (group_rows consecutive rows) is on the GPU only if the group before it is (prefix), and
only in a layer whose attention is on the GPU (the residual stream stays on the GPU there; a CPU layer runs
whole on the CPU). Every device byte (weights, KV cache, predictors, scratch) counts against the budget.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from gguf import GGMLQuantizationType
from scipy.optimize import Bounds, LinearConstraint, milp

from pyinfer.errors import InvalidArgumentError, PyInferError
from pyinfer.models import reads_fused_qkv
from pyinfer.models.common import STREAM_ROWS
from pyinfer.models.moe import stream_experts
from pyinfer.models.sparse_attention import PROJECTIONS
from pyinfer.native import ggml

GROUP_ROWS = 64


class BudgetTooSmallError(PyInferError):
    """The VRAM budget is below what any GPU placement needs."""


@dataclass(frozen=True)
class MachineProfile:
    """Measured speeds of one machine for one weight type (pyinfer/engine/machine.py measures and caches them).

    Bandwidths are GB/s of weight bytes read: dense for whole matrices (GEMV), sparse for the predicted
    rows of an FFN. *_layer_us: what a decode layer costs beyond its bytes on the GPU (launch gaps, small
    kernels) or on the CPU (the pool's barriers); xfer_us: what splitting a GPU layer's FFN adds (copies both
    ways, waking the pool, the sparse FFN's sums, the wait); step_us: what a decode step costs beyond its
    layers and head (the graph's launch and sync, the logits' copy, the host's work between tokens)."""

    name: str
    cpu_dense_gbps: float
    cpu_sparse_gbps: float
    gpu_dense_gbps: float
    gpu_sparse_gbps: float
    xfer_us: float
    gpu_layer_us: float
    cpu_layer_us: float
    step_us: float = 0.0

    def __post_init__(self):
        for key in ("cpu_dense_gbps", "cpu_sparse_gbps", "gpu_dense_gbps", "gpu_sparse_gbps"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidArgumentError(f"machine profile {key} must be a positive number, not {value!r}")
        for key in ("xfer_us", "gpu_layer_us", "cpu_layer_us", "step_us"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"machine profile {key} must be a number >= 0, not {value!r}")


@dataclass(frozen=True)
class LayerCosts:
    """What placing one layer costs: bytes on the device and bytes read per token.

    freq: (n_ff,) expected activations per token of each neuron, hot-first (non-increasing); all ones for
    a dense FFN. group_rows: granularity of the split (n_ff when the file cannot be split by neuron)."""

    attn_bytes: int  # attention weights, biases and the layer's norms: read whole every token
    kv_bytes: int  # the layer's K and V cache at the context size
    pred_bytes: int  # predictor weights (0 without predictors)
    neuron_bytes: int  # one neuron's rows of gate, up and down_t (and bias entries)
    freq: np.ndarray
    sparse: bool
    group_rows: int = GROUP_ROWS
    experts: bool = False  # the units are a mixture's experts: freq the expected routings, each read whole
    # sparse attention projections (models.sparse_attention): what the CPU reads of the attention a token whole,
    # if not attn_bytes, and of the projections' channel-major copies, row by row
    attn_host_dense: int | None = None
    attn_host_sparse: int = 0

    @property
    def n_ff(self) -> int:
        return len(self.freq)

    def groups(self) -> list[tuple[int, int]]:
        """[start, end) rows of each neuron group."""
        g = max(1, min(self.group_rows, self.n_ff))
        return [(s, min(s + g, self.n_ff)) for s in range(0, self.n_ff, g)]


@dataclass(frozen=True)
class ModelCosts:
    layers: list[LayerCosts]
    head_bytes: int  # output norm + vocabulary projection (a GPU copy of the embeddings when tied)
    reserve_bytes: int  # device bytes any GPU use costs: graph buffers, scratch, cuBLAS workspace
    n_ctx: int = 0
    type_name: str = ""
    dequantized_bytes: int = 0  # of the reserve: non-F16 weight rows our GEMM dequantizes for cuBLAS, at the least
    dequantized_most: int = 0  # what they would take at the full GEMM_CHUNK, which a plan gives where room is left


@dataclass(frozen=True)
class Plan:
    attn_gpu: tuple[bool, ...]
    hot_rows: tuple[int, ...]  # k_l: rows [0, k_l) of the layer's FFN on the GPU
    head_gpu: bool
    device_bytes: int  # everything the plan puts on the device, reserve included (0 without GPU use)
    budget: int
    layer_us: tuple[float, ...]  # modelled time of each layer per token
    head_us: float
    gpu_ffn_us: tuple[float, ...] = field(default=())  # modelled GPU and CPU halves of each FFN
    cpu_ffn_us: tuple[float, ...] = field(default=())
    gap: float = 0.0  # proven distance to the optimum, relative (0: optimal)
    step_us: float = 0.0  # the step's own cost beyond layers and head (MachineProfile.step_us)
    gemm_scratch: int = 0  # of device_bytes: the prompt GEMM's dequantized weight rows (ggml_set_gemm_scratch)

    @property
    def token_us(self) -> float:
        return float(sum(self.layer_us) + self.head_us + self.step_us)

    @property
    def tokens_per_second(self) -> float:
        return 1e6 / self.token_us if self.token_us > 0 else math.inf

    @property
    def uses_gpu(self) -> bool:
        return self.device_bytes > 0


def _us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e3)  # GB/s = 1e3 bytes per microsecond


@dataclass(frozen=True)
class _LayerTerms:
    """One layer's cost coefficients for the solver and for evaluating a plan."""

    attn_cpu: float  # attention + predictor on the CPU, us
    attn_gpu: float
    dev_bytes: int  # attention + KV + predictor on the device
    group_bytes: np.ndarray  # (n_groups,) device bytes of each neuron group
    gpu_us: np.ndarray  # (n_groups,) modelled GPU time of each group
    cpu_us: np.ndarray
    group_end: np.ndarray  # (n_groups,) row after each group


def _terms(layer: LayerCosts, m: MachineProfile) -> _LayerTerms:
    bounds = layer.groups()
    mass = np.array([float(np.sum(layer.freq[s:e], dtype=np.float64)) for s, e in bounds])
    group_bytes = np.array([(e - s) * layer.neuron_bytes for s, e in bounds], dtype=np.int64)
    read = layer.attn_bytes + layer.pred_bytes
    host_read = (layer.attn_bytes if layer.attn_host_dense is None else layer.attn_host_dense) + layer.pred_bytes

    def ffn_us(dense_gbps: float, sparse_gbps: float) -> np.ndarray:
        # the predicted rows at the sparse rate, but never slower than reading the whole group densely: hot
        # groups fire often, and the sparse rate was measured on scattered rows (machine.SPARSE_DENSITY); a
        # routed expert is megabytes read in one sweep, at the dense rate
        whole = group_bytes / (dense_gbps * 1e3)
        if layer.experts:
            return mass * layer.neuron_bytes / (dense_gbps * 1e3)
        return np.minimum(mass * layer.neuron_bytes / (sparse_gbps * 1e3), whole) if layer.sparse else whole

    return _LayerTerms(
        attn_cpu=_us(host_read, m.cpu_dense_gbps) + _us(layer.attn_host_sparse, m.cpu_sparse_gbps) + m.cpu_layer_us,
        attn_gpu=_us(read, m.gpu_dense_gbps) + m.gpu_layer_us,
        dev_bytes=layer.attn_bytes + layer.kv_bytes + layer.pred_bytes,
        group_bytes=group_bytes,
        gpu_us=ffn_us(m.gpu_dense_gbps, m.gpu_sparse_gbps),
        cpu_us=ffn_us(m.cpu_dense_gbps, m.cpu_sparse_gbps),
        group_end=np.array([e for _, e in bounds], dtype=np.int64),
    )


def _layer_time(t: _LayerTerms, attn_gpu: bool, n_groups_gpu: int, xfer_us: float) -> tuple[float, float, float]:
    """(total, GPU FFN, CPU FFN) us of one layer placed with its first n_groups_gpu groups on the GPU."""
    gpu = float(t.gpu_us[:n_groups_gpu].sum())
    cpu = float(t.cpu_us[n_groups_gpu:].sum())
    has_cpu_part = n_groups_gpu < len(t.gpu_us)
    attn = t.attn_gpu if attn_gpu else t.attn_cpu
    return attn + max(gpu, cpu + (xfer_us if has_cpu_part else 0.0)), gpu, cpu


def evaluate(costs: ModelCosts, machine: MachineProfile, attn_gpu, n_groups_gpu, head_gpu: bool,
             budget: int) -> Plan:
    """The plan for given per-layer choices (n_groups_gpu: how many neuron groups each layer has on the GPU)."""
    terms = [_terms(layer, machine) for layer in costs.layers]
    layer_us, gpu_us, cpu_us, hot_rows = [], [], [], []
    device = 0
    for t, a, n in zip(terms, attn_gpu, n_groups_gpu, strict=True):
        if n and not a:
            raise InvalidArgumentError("FFN neurons go to the GPU only in layers whose attention is there")
        total, g, c = _layer_time(t, a, n, machine.xfer_us)
        layer_us.append(total)
        gpu_us.append(g)
        cpu_us.append(c)
        hot_rows.append(int(t.group_end[n - 1]) if n else 0)
        device += (t.dev_bytes if a else 0) + int(t.group_bytes[:n].sum())
    head_us = _us(costs.head_bytes, machine.gpu_dense_gbps if head_gpu else machine.cpu_dense_gbps)
    device += costs.head_bytes if head_gpu else 0
    scratch = 0
    if device or head_gpu:
        device += costs.reserve_bytes
        scratch = costs.dequantized_bytes
    return Plan(tuple(bool(a) for a in attn_gpu), tuple(hot_rows), bool(head_gpu), device, budget,
                tuple(layer_us), head_us, tuple(gpu_us), tuple(cpu_us), step_us=machine.step_us, gemm_scratch=scratch)


def _scratch_takes_what_is_left(plan: Plan, costs: ModelCosts) -> Plan:
    """The plan with the budget's leftover given to the GEMM's dequantized rows, up to a full GEMM_CHUNK: the
    reserve counts the smallest chunk, so that a tight budget's weights get the room, and a roomier one's prompts
    their fewer, larger GEMMs."""
    if not plan.uses_gpu:
        return plan
    extra = max(0, min(costs.dequantized_most - costs.dequantized_bytes, plan.budget - plan.device_bytes))
    return dataclasses.replace(plan, device_bytes=plan.device_bytes + extra, gemm_scratch=plan.gemm_scratch + extra)


def minimum_budget(costs: ModelCosts) -> int:
    """The smallest budget with anything on the GPU: the reserve plus the smallest single placement."""
    smallest = [costs.head_bytes]
    for layer in costs.layers:
        smallest.append(layer.attn_bytes + layer.kv_bytes + layer.pred_bytes)
    return costs.reserve_bytes + min(smallest)


@dataclass(frozen=True)
class _Options:
    """Every layer's non-dominated choices: (device bytes, modelled us, (attention on GPU, GPU groups))."""

    us: list[list[float]]
    nbytes: list[list[float]]
    picks: list[list[tuple[bool, int]]]


def _options(costs: ModelCosts, machine: MachineProfile) -> _Options:
    """A layer runs on the CPU, or has its attention on the GPU with its first n = 0..n_groups neuron groups
    there. Each choice's time is exact (the max of the two FFN halves included); a choice that needs more
    bytes than another and is not faster is never optimal and is dropped."""
    all_us, all_bytes, all_picks = [], [], []
    for layer in costs.layers:
        t = _terms(layer, machine)
        n_groups = len(t.gpu_us)
        gpu = np.concatenate([[0.0], np.cumsum(t.gpu_us)])  # (n_groups + 1,) GPU FFN with n groups there
        cpu = float(t.cpu_us.sum()) - np.concatenate([[0.0], np.cumsum(t.cpu_us)])
        xfer = np.where(np.arange(n_groups + 1) < n_groups, machine.xfer_us, 0.0)
        us = [t.attn_cpu + float(t.cpu_us.sum()) + machine.xfer_us, *(t.attn_gpu + np.maximum(gpu, cpu + xfer))]
        nbytes = [0.0, *(t.dev_bytes + np.concatenate([[0], np.cumsum(t.group_bytes)]))]
        picks = [(False, 0), *((True, n) for n in range(n_groups + 1))]
        kept_us, kept_bytes, kept_picks, best = [], [], [], math.inf
        for i in sorted(range(len(us)), key=lambda i: (nbytes[i], us[i])):
            if us[i] < best:
                best = us[i]
                kept_us.append(float(us[i]))
                kept_bytes.append(float(nbytes[i]))
                kept_picks.append(picks[i])
        all_us.append(kept_us)
        all_bytes.append(kept_bytes)
        all_picks.append(kept_picks)
    return _Options(all_us, all_bytes, all_picks)


def _greedy(opt: _Options, head_bytes: int, head_saving: float, room: float) -> tuple[list[int], bool]:
    """Choice index per layer and the head: from everything on the CPU, repeatedly the move with the most
    time saved per byte that still fits (the released PowerInfer's kind of placement)."""
    us = [np.asarray(u) for u in opt.us]
    nb = [np.asarray(b) for b in opt.nbytes]
    chosen = [0] * len(us)

    def best_move(il: int) -> tuple[float, int]:
        c = chosen[il]
        extra = nb[il][c + 1:] - nb[il][c]
        ratio = np.where(extra <= room, (us[il][c] - us[il][c + 1:]) / np.maximum(extra, 1.0), -np.inf)
        if ratio.size == 0 or ratio.max() <= 0:
            return 0.0, -1
        k = int(ratio.argmax())
        return float(ratio[k]), c + 1 + k

    moves = [best_move(il) for il in range(len(us))]
    head = head_saving <= 0
    while True:
        il = max(range(len(us)), key=lambda i: moves[i][0], default=None)
        ratio = moves[il][0] if il is not None else 0.0
        if not head and head_bytes <= room and head_saving / max(head_bytes, 1) > ratio:
            head, room = True, room - head_bytes
        elif ratio > 0:
            n = moves[il][1]
            room -= nb[il][n] - nb[il][chosen[il]]
            chosen[il] = n
        else:
            return chosen, head and head_saving > 0
        # the room shrank: a layer's best move may no longer fit
        moves = [best_move(i) if i == il or (m[1] >= 0 and nb[i][m[1]] - nb[i][chosen[i]] > room) else m
                 for i, m in enumerate(moves)]


def solve(costs: ModelCosts, machine: MachineProfile, budget: int, *, time_limit_s: float = 5.0) -> Plan:
    """The placement that minimises the modelled time per token with every device byte <= budget.
    budget 0 means no GPU: everything on the CPU.

    A multiple-choice knapsack solved as a MILP: one binary per layer and non-dominated choice (the hot-first
    prefix of neuron groups is built into the choices), exactly one per layer, and one for the output head.
    HiGHS proves small and most real instances optimal at once; on large, nearly symmetric ones it may stop at
    the time limit with a proven gap (Plan.gap, a few tenths of a percent where seen). The greedy placement is
    the fallback should the solver have found nothing by then."""
    if budget < 0:
        raise InvalidArgumentError(f"VRAM budget must be >= 0, not {budget}")
    n_layer = len(costs.layers)
    if budget == 0:
        return evaluate(costs, machine, [False] * n_layer, [0] * n_layer, False, budget)
    need = minimum_budget(costs)
    if budget < need:
        raise BudgetTooSmallError(f"VRAM budget {format_bytes(budget)} is below the minimum {format_bytes(need)} "
                                  f"(scratch {format_bytes(costs.reserve_bytes)} plus the smallest layer part); "
                                  f"give at least that, or 0 to run on the CPU")
    opt = _options(costs, machine)
    layer_of = [il for il, us in enumerate(opt.us) for _ in us]
    first = np.concatenate([[0], np.cumsum([len(us) for us in opt.us])])
    n_opt = len(layer_of)
    head_cpu = _us(costs.head_bytes, machine.cpu_dense_gbps)
    head_delta = _us(costs.head_bytes, machine.gpu_dense_gbps) - head_cpu
    room = float(budget - costs.reserve_bytes)
    objective = np.array([u for us in opt.us for u in us] + [head_delta])
    one_each = sp.csr_array((np.ones(n_opt), (layer_of, np.arange(n_opt))), shape=(n_layer, n_opt + 1))
    # the budget row in units of the smallest neuron group: coefficients near 1 for the solver's tolerances,
    # which are absolute; a plan still over the budget by a rounding is dropped below
    unit = min([b for nb in opt.nbytes for b in np.diff(nb) if b > 0] or [1.0])
    weight = sp.csr_array(np.array([[b for nb in opt.nbytes for b in nb] + [costs.head_bytes]]) / unit)
    with _quiet_stdout():  # HiGHS prints progress lines on its own even when asked not to
        res = milp(objective, integrality=np.ones(n_opt + 1), bounds=Bounds(0.0, 1.0),
                   constraints=[LinearConstraint(one_each, 1.0, 1.0), LinearConstraint(weight, -np.inf, room / unit)],
                   options={"time_limit": time_limit_s, "mip_rel_gap": 1e-6, "disp": False})
    plans = []
    if res.x is not None:
        picked = sorted(np.flatnonzero(np.round(res.x[:n_opt]) == 1), key=lambda c: layer_of[c])
        plans.append(_plan_of(costs, machine, opt, [int(c - first[layer_of[c]]) for c in picked],
                              bool(round(res.x[n_opt])), budget))
    proven = res.status == 0 and plans and plans[0].device_bytes <= budget
    plans.append(_plan_of(costs, machine, opt, *_greedy(opt, costs.head_bytes, -head_delta, room), budget))
    plan = min((p for p in plans if p.device_bytes <= budget), key=lambda p: p.token_us)
    bound = getattr(res, "mip_dual_bound", None)
    gap = 0.0 if proven else (max(0.0, 1.0 - (bound + head_cpu + plan.step_us) / plan.token_us) if bound else math.nan)
    return _scratch_takes_what_is_left(dataclasses.replace(plan, gap=gap), costs)


def _plan_of(costs: ModelCosts, machine: MachineProfile, opt: _Options, chosen: list[int], head: bool,
             budget: int) -> Plan:
    picks = [opt.picks[il][c] for il, c in enumerate(chosen)]
    return evaluate(costs, machine, [p[0] for p in picks], [p[1] for p in picks], head, budget)


@contextlib.contextmanager
def _quiet_stdout():
    """Silences file descriptor 1 (C libraries' printf) for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


# ---------------------------------------------------------------------------------------------------
# a model file's costs

NEURON_MATRICES = ("ffn_gate", "ffn_up", "ffn_down_t")  # a neuron is row i of each (down_t: the transposed down)
FFN_MATRICES = (*NEURON_MATRICES, "ffn_down")  # what a layer's FFN reads: one of ffn_down_t and ffn_down is there
# what the FFN of a file of input sparsity (pyinfer.sparsity.input_sparsity) reads: a neuron is column i of the
# channel-major gate and up and row i of ffn_down_t; its row-major gate and up stay in host memory (a CPU layer's
# prompt batches read them, sparse_ffn.reads_row_major)
INPUT_FFN_MATRICES = ("ffn_gate_t", "ffn_up_t", "ffn_down_t")
EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a mixture's experts, one matrix each a slice
QKV_PARTS = ("attn_q", "attn_k", "attn_v")  # on the GPU one matrix where they share a type (offload.fuse_qkv)
ATTENTION_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "attn_q_norm", "attn_k_norm",
                   "post_attention_norm", "post_ffw_norm", "attn_qkv", "attn_norm_2", "attn_sinks",
                   # Qwen3.5's linear attention (its ssm_a, named without a suffix, is a few bytes); a mixture's shared
                   # expert goes with the attention (every token reads it)
                   "attn_gate", "ssm_conv1d", "ssm_dt", "ssm_beta", "ssm_alpha", "ssm_norm", "ssm_out",
                   "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                   "ffn_inp")  # a centred file's shift of the FFN's input (input_sparsity)
# what a mixture's layer reads beside its experts, placed with its attention: the router (Gemma 4's with a scale
# vector), Gemma 4's dense FFN and the norms around its two halves
MOE_COMMON_PARTS = ("ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down", "pre_ffw_norm_2", "post_ffw_norm_1",
                    "post_ffw_norm_2")
PART_SUFFIXES = (".weight", ".bias", ".scale", ".shift")  # .shift: a centred file's (input_sparsity)
STREAM_MIN_TOKENS = 32  # batches of at least this many tokens run there (llama.cpp's threshold too)
# a batch under a VRAM budget returns the logits of at most this many tokens (a prompt needs its last token's;
# perplexity, all of them, gets them this many at a time): 512 rows of a 152k vocabulary had taken 311 MB of the
# reserve, a third of a 4.4 GiB mixture's budget at a third, that no run of a prompt used
LOGIT_ROWS = 64
CUBLAS_WORKSPACE = 32 << 20
GEMM_CHUNK = 64 << 20  # ggml/src/cuda/gemm.cu's GEMM_CHUNK_BYTES: rows of a non-F16 weight dequantized for cuBLAS
# the least a plan gives them (ggml_set_gemm_scratch): 128 rows of up to 32768 values, the kernel's least; a 13B
# Q4_0 file's 56 MiB more at a third of its bytes hold one more layer's attention on the GPU
GEMM_CHUNK_MIN = 8 << 20
GEMV_MAX_COLS = 8  # ggml/src/cuda/gemv.cu: batches of at most this many tokens run as GEMVs, without GEMM scratch
# what the driver holds beyond the allocator: CUDA graphs, the cuBLAS handle (72-143 MB seen); with the logits of
# 512 tokens out of the reserve, 160 MiB keeps it 1.15x above every prompt batch measured (test_placement)
DEVICE_MARGIN = 160 << 20
# (n_batch, widest) activations charged for a prompt through an FFN of input sparsity: gate, up, their product and
# its down mask live at once, and the transposed GEMMs add more: a 13B file's 512-token batch took 462 MB beyond
# the loaded model at a third of its bytes on an H200 (four had let it pass the budget); seven keep the reserve
# 1.15x above that, as above every dense batch measured (test_placement), but on another H200 left the driver's
# count (cuBLAS's modules for the transposed GEMMs included) 4 MB over that budget, the allocator 96 MB under
INPUT_FFN_ACTIVATIONS = 8


def logit_rows(n_batch: int) -> int:
    """Tokens whose logits one batch of a budgeted model returns at most."""
    return min(n_batch, LOGIT_ROWS)


def fusable_qkv(tensors, il: int, head_norms: bool = False) -> dict[str, list] | None:
    """Layer il's q, k and v tensors {"weight": [q, k, v], "bias": [q, k, v] or [None] * 3} where they can be one
    matrix (and one bias): every part present, of one type, and no q or k norm unless head_norms (the graph then
    norms each head of the fused projection's views: models.reads_fused_qkv); else None."""
    parts = {suffix: [tensors.get(f"blk.{il}.{part}.{suffix}") for part in QKV_PARTS] for suffix in ("weight", "bias")}
    for infos in parts.values():
        if (None in infos and any(infos)) or len({i.type for i in infos if i is not None}) > 1:
            return None
    norms = any(f"blk.{il}.{part}.weight" in tensors for part in ("attn_q_norm", "attn_k_norm"))
    return None if parts["weight"][0] is None or (norms and not head_norms) else parts


def reserve_bytes(cfg, n_batch: int, largest_matrix: int = 0, neuron_row: int = 0, dequantized: int = 0,
                  input_ffn: bool = False) -> int:
    """Device bytes any GPU use needs besides weights and KV cache: the intermediates of a prompt batch of
    n_batch tokens (two (n_batch, n_ff) activations live at once; INPUT_FFN_ACTIVATIONS in an FFN of input
    sparsity; the logits of logit_rows tokens), the host weights a prompt batch streams
    in (the graph planner reuses one chunk's memory for the next: one chunk of STREAM_ROWS neurons of gate, up
    and down_t, or the largest attention matrix), the GEMM's scratch (the batch in 16 bits, and `dequantized`
    bytes of F16 rows of weights that are not F16), the cuBLAS workspace and a margin. The driver measured
    1.75-3.1x less than the earlier count of four activations and two chunks for F16 weights; Q4_0 weights,
    whose GEMM dequantizes 64 MiB of rows, used up to 1.06x the count without that scratch (docs/BENCHMARKS.md,
    "The prompt batch's reserve")."""
    widest = max(cfg.widest_ff, 3 * cfg.n_embd)
    activations = (4 * n_batch * ((INPUT_FFN_ACTIVATIONS if input_ffn else 2) * widest + 4 * cfg.n_embd)
                   + 4 * logit_rows(n_batch) * cfg.n_vocab)
    gemm = 2 * n_batch * widest + dequantized
    chunk = 3 * min(STREAM_ROWS, cfg.widest_ff) * neuron_row
    streamed = max(largest_matrix, chunk) if n_batch >= STREAM_MIN_TOKENS else 0
    return CUBLAS_WORKSPACE + DEVICE_MARGIN + activations + gemm + streamed


def _input_ffn_costs(file, il: int) -> tuple[int, np.ndarray, int]:
    """A layer of input sparsity: (its FFN's device bytes, per neuron the expected share of its bytes read a
    token, the split's granularity). Gate and up read a neuron's column wherever a channel passes t_x (the
    layer's input_density), down its row wherever its |h| passes t_h (ffn_act_freq, hot-first); a file without
    them is charged whole. A split falls on whole quant blocks of the channel-major rows."""
    cfg, tensors, p = file.config, file.tensors, f"blk.{il}."
    gate_up = sum(int(tensors[p + name + ".weight"].data.nbytes) for name in ("ffn_gate_t", "ffn_up_t"))
    down = int(tensors[p + "ffn_down_t.weight"].data.nbytes)
    group = math.lcm(GROUP_ROWS, ggml.block_size(int(tensors[p + "ffn_gate_t.weight"].type)))
    n_ff = cfg.layer_n_ff(il)
    freq = np.ones(n_ff)
    density = file.metadata.get("pyinfer.sparsity.input_density")
    info = tensors.get(p + "ffn_act_freq")
    if density is not None and len(density) == cfg.n_layer and info is not None and info.ne == (n_ff,):
        down_freq = np.clip(np.frombuffer(info.data, dtype=np.float32).astype(np.float64), 0.0, 1.0)
        freq = (gate_up * min(1.0, max(0.0, float(density[il]))) + down * down_freq) / (gate_up + down)
    return gate_up + down, freq, min(group, n_ff)


def _sparse_attention_read(file, il: int, attn: int) -> tuple[int | None, int]:
    """What the CPU reads of layer il's attention a decoded token where its projections read sparsely
    (models.sparse_attention): (the rest, norms and biases, whole; the channel-major copies at the shares of
    channels read on the calibration text, pyinfer.sparsity.attn_*_density); (None, 0) where they do not."""
    tensors, meta, p = file.tensors, file.metadata, f"blk.{il}."
    densities = [meta.get(f"pyinfer.sparsity.attn_{side}_density") for side in ("input", "output")]
    if any(d is None or len(d) != file.config.n_layer or d[il] < 0 for d in densities):
        return None, 0
    d_in, d_out = (min(1.0, float(d[il])) for d in densities)
    size = {m: int(tensors[f"{p}{m}.weight"].data.nbytes) for m in PROJECTIONS}
    copy = {m: int(tensors[f"{p}{m}_t.weight"].data.nbytes) for m in size}
    read = d_in * (copy["attn_q"] + copy["attn_k"] + copy["attn_v"]) + d_out * copy["attn_output"]
    return attn - sum(size.values()), math.ceil(read)


def ffn_weight_type(file) -> int:
    """The type of a file's FFN weights (its experts' for a mixture): what the machine's speeds are measured for."""
    info = file.tensors.get("blk.0.ffn_up.weight") or file.tensors["blk.0.ffn_up_exps.weight"]
    return int(info.type)


def expert_order(file, il: int) -> np.ndarray:
    """Layer il's experts, the most often routed first (`pyinfer profile`'s counts; without them, by index): the
    GPU takes a prefix of this order."""
    freq = file.expert_freq
    if freq is None:
        return np.arange(file.config.n_expert)
    return np.argsort(-freq[il], kind="stable")


def moe_scratch_bytes(cfg, n_batch: int) -> int:
    """A GPU moe_ffn's scratch for a batch (ggml/src/cuda/moe.cu's moe_scratch_of, in the same order): x as Q8_1,
    the pairs' activations in F32 and as Q8_1, their weighted down outputs, their weights, the batch's sort lists
    (each part rounded up to 256 bytes)."""
    def a(n: float) -> int:
        return -(-int(math.ceil(n)) // 256) * 256

    pairs, d, f = n_batch * cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp
    return (a(1.25 * n_batch * d) + a(4 * pairs * f) + a(1.25 * pairs * f) + a(4 * pairs * d) + a(4 * pairs)
            + a(4 * (cfg.n_expert + 1)) + a(4 * cfg.n_expert) + a(4 * pairs))


def _expert_costs(file, n_ctx: int, kv_bytes_per_value: int, n_batch: int) -> ModelCosts:
    """A mixture of experts: its units are experts, each on one device whole, weighted by its expected routings a
    token (`pyinfer profile`'s, else n_used / n_expert each), the most often routed first (expert_order), the
    router with the attention. Every unit has the same bytes, so placing the most often routed ones first is
    optimal for the model's cost."""
    cfg, tensors = file.config, file.tensors

    def nbytes(name: str) -> int:
        info = tensors.get(name)
        return int(info.data.nbytes) if info is not None else 0

    layers = []
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        # with the attention: the router (and Gemma 4's dense FFN), and the experts' biases (gpt-oss) and scales
        # (Gemma 4), which each side holds whole
        attn = sum(nbytes(p + part + suffix) for part in (*ATTENTION_PARTS, *MOE_COMMON_PARTS)
                   for suffix in PART_SUFFIXES) + sum(nbytes(p + m + suffix) for m in EXPERT_MATRICES
                                                      for suffix in PART_SUFFIXES[1:])
        expert = math.ceil(sum(nbytes(p + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down")) / cfg.n_expert)
        freq = (np.full(cfg.n_expert, cfg.n_expert_used / cfg.n_expert) if file.expert_freq is None
                else np.sort(file.expert_freq[il])[::-1])  # expert_order's order
        kv = kv_bytes(cfg, il, n_ctx, kv_bytes_per_value)
        layers.append(LayerCosts(attn_bytes=attn, kv_bytes=kv, pred_bytes=0, neuron_bytes=expert, freq=freq,
                                 sparse=True, group_rows=1, experts=True))
    head = (nbytes("output.weight") or nbytes("token_embd.weight")) + nbytes("output_norm.weight")
    # a prompt batch streams a layer's host experts to the GPU, a chunk of stream_experts at a time
    largest = max(max(nbytes(f"blk.{il}.{part}.weight") for part in (*ATTENTION_PARTS, *MOE_COMMON_PARTS))
                  for il in range(cfg.n_layer))
    expert = max(layer.neuron_bytes for layer in layers)
    largest = max(largest, stream_experts(expert) * expert)
    scratch = moe_scratch_bytes(cfg, n_batch)
    # the attention's (and shared experts') GEMMs dequantize rows as a dense model's do; the experts' kernels not
    least, most = _dequantized_rows(tensors, cfg, n_batch)
    return ModelCosts(layers, head_bytes=head, reserve_bytes=reserve_bytes(cfg, n_batch, largest, 0, least) + scratch,
                      n_ctx=n_ctx, type_name=GGMLQuantizationType(ffn_weight_type(file)).name.lower(),
                      dequantized_bytes=least, dequantized_most=most)


def _dequantized_rows(tensors, cfg, n_batch: int) -> tuple[int, int]:
    """(least, most) bytes of F16 rows a prompt GEMM dequantizes from a non-F16 matrix for cuBLAS: GEMM_CHUNK_MIN
    and GEMM_CHUNK, or less where the largest such matrix (q, k and v fused on the GPU count as one) is smaller;
    none for batches the GEMVs take."""
    if n_batch <= GEMV_MAX_COLS:
        return 0, 0
    not_f16 = [math.prod(info.ne) for info in tensors.values()
               if len(info.ne) == 2 and info.type != GGMLQuantizationType.F16]
    for il in range(cfg.n_layer):
        qkv = fusable_qkv(tensors, il, reads_fused_qkv(cfg))
        if qkv is not None and qkv["weight"][0].type != GGMLQuantizationType.F16:
            not_f16.append(sum(math.prod(i.ne) for i in qkv["weight"]))
    most = min(GEMM_CHUNK, 2 * max(not_f16, default=0))
    return min(GEMM_CHUNK_MIN, most), most


def kv_bytes(cfg, il: int, n_ctx: int, kv_bytes_per_value: int) -> int:
    """Layer il's K and V at the context size; none for a layer that reads another's (Gemma 4's shared KV); a
    linear-attention layer's F32 states, whatever the context (Qwen3.5)."""
    if cfg.recurrent(il):
        return 4 * sum(math.prod(shape) for shape in cfg.ssm_state_shapes)
    if cfg.kv_layer(il) != il:
        return 0
    return 2 * n_ctx * cfg.layer_n_head_kv(il) * cfg.layer_head_dim(il) * kv_bytes_per_value


def model_costs(file, n_ctx: int, kv_bytes_per_value: int, sparse: bool, n_batch: int) -> ModelCosts:
    """What placing each part of a GGUFFile costs, from its tensor table. sparse: the FFN computes only
    predicted neurons (their profiled frequencies weigh the neurons); else every neuron counts once."""
    cfg, tensors = file.config, file.tensors
    if cfg.is_moe:
        return _expert_costs(file, n_ctx, kv_bytes_per_value, n_batch)

    def nbytes(name: str) -> int:
        info = tensors.get(name)
        return int(info.data.nbytes) if info is not None else 0

    split = file.ffn_layout == "down_t"  # neurons are rows of every FFN matrix: a layer can split anywhere
    input_kind = sparse and file.metadata.get("pyinfer.sparsity.kind") == "input"
    layers = []
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        attn = sum(nbytes(p + part + suffix) for part in ATTENTION_PARTS for suffix in (".weight", ".bias"))
        ffn = sum(nbytes(p + part + suffix) for part in FFN_MATRICES for suffix in (".weight", ".bias"))
        n_ff = cfg.layer_n_ff(il)  # Gemma 4's shared-KV layers may be twice as wide
        freq = np.ones(n_ff)
        pred = 0
        group = GROUP_ROWS if split else n_ff
        host_dense, host_sparse = _sparse_attention_read(file, il, attn) if input_kind else (None, 0)
        if input_kind:
            ffn, freq, group = _input_ffn_costs(file, il)
            pred = 4 * (2 * n_ff + cfg.n_embd)  # the thresholds
        elif sparse:
            pred = nbytes(p + "fc1.weight") + nbytes(p + "fc2.weight") + 2 * 4 * n_ff  # + bias, thresholds
            info = tensors.get(p + "ffn_act_freq")
            if info is not None and info.ne == (n_ff,):
                freq = np.clip(np.frombuffer(info.data, dtype=np.float32).astype(np.float64), 0.0, 1.0)
        kv = kv_bytes(cfg, il, n_ctx, kv_bytes_per_value)
        layers.append(LayerCosts(attn_bytes=attn, kv_bytes=kv, pred_bytes=pred,
                                 neuron_bytes=math.ceil(ffn / n_ff), freq=freq, sparse=sparse, group_rows=group,
                                 attn_host_dense=host_dense, attn_host_sparse=host_sparse))
    head = nbytes("output.weight") or nbytes("token_embd.weight")  # tied: the GPU gets a copy of the embeddings
    head += nbytes("output_norm.weight") + nbytes("output_norm.bias")
    weight_type = GGMLQuantizationType(ffn_weight_type(file))
    largest = max(nbytes(f"blk.{il}.{part}.weight") for il in range(cfg.n_layer) for part in ATTENTION_PARTS)
    row = max(layer.neuron_bytes for layer in layers) // 3
    least, most = _dequantized_rows(tensors, cfg, n_batch)
    reserve = reserve_bytes(cfg, n_batch, largest, row, least, input_kind)
    return ModelCosts(layers, head_bytes=head, reserve_bytes=reserve, n_ctx=n_ctx, type_name=weight_type.name.lower(),
                      dequantized_bytes=least, dequantized_most=most)


# ---------------------------------------------------------------------------------------------------
# sizes

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'8GiB', '8G' (binary), '8GB' (decimal), '512MiB', '0' -> bytes."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"not a size: {text!r} (examples: 8GiB, 512MiB, 24GB, 0)")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


HINT_RESERVE_SHARE = 0.15  # a prompt batch's reserve above this share of the budget: say what a smaller one buys
HINT_MIN_GAIN = 1.05  # ... if the plan it leaves room for is modelled at least this much faster
HINT_MIN_BATCH = 64


def smaller_batch_hint(plan: Plan, costs: ModelCosts, n_batch: int, machine: MachineProfile,
                       costs_for_batch) -> str | None:
    """A line saying what half the prompt batch buys when its reserve takes much of a tight budget (the reserve
    grows with the batch; decoding reads only the weights), or None. costs_for_batch(n) -> ModelCosts."""
    half = n_batch // 2
    if not plan.uses_gpu or half < HINT_MIN_BATCH or costs.reserve_bytes <= HINT_RESERVE_SHARE * plan.budget:
        return None
    smaller = costs_for_batch(half)
    other = solve(smaller, machine, plan.budget)
    if other.tokens_per_second < HINT_MIN_GAIN * plan.tokens_per_second:
        return None
    return (f"hint: -b {half} reserves {format_bytes(plan_reserve(other, smaller))} instead of "
            f"{format_bytes(plan_reserve(plan, costs))}, modelled {other.tokens_per_second:.1f} tokens per second "
            f"instead of {plan.tokens_per_second:.1f}; prompts run in twice as many batches")


def plan_reserve(plan: Plan, costs: ModelCosts) -> int:
    """The device bytes a plan keeps for prompt batches: the reserve with the GEMM's scratch as the plan sized it."""
    return costs.reserve_bytes - costs.dequantized_bytes + plan.gemm_scratch if plan.uses_gpu else 0


def describe(plan: Plan, costs: ModelCosts, machine: MachineProfile) -> str:
    """The plan as a table: per layer where the attention runs, hot rows on the GPU, their share of the
    layer's activations, device bytes and modelled time; then the totals."""
    unit, reads = ("experts", "routings") if costs.layers[0].experts else ("hot rows", "activations")
    lines = [f"plan for a VRAM budget of {format_bytes(plan.budget)} on {machine.name}"
             + (f" ({costs.type_name}, context {costs.n_ctx})" if costs.type_name else ""),
             f"| layer | attention | {unit} on GPU | {reads} on GPU | device MiB | GPU FFN us | CPU FFN us "
             "| layer us |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for il, layer in enumerate(costs.layers):
        k = plan.hot_rows[il]
        mass = float(layer.freq.sum())
        share = float(layer.freq[:k].sum()) / mass if mass > 0 else 0.0
        dev = ((layer.attn_bytes + layer.kv_bytes + layer.pred_bytes) if plan.attn_gpu[il] else 0) \
            + k * layer.neuron_bytes
        lines.append(f"| {il} | {'GPU' if plan.attn_gpu[il] else 'CPU'} | {k} / {layer.n_ff} | {100 * share:.1f} % | "
                     f"{dev / 2**20:.1f} | {plan.gpu_ffn_us[il]:.1f} | {plan.cpu_ffn_us[il]:.1f} | "
                     f"{plan.layer_us[il]:.1f} |")
    n_gpu = sum(plan.attn_gpu)
    hot = sum(plan.hot_rows)
    total = sum(layer.n_ff for layer in costs.layers)
    lines += [
        f"output head: {'GPU' if plan.head_gpu else 'CPU'} ({format_bytes(costs.head_bytes)}, {plan.head_us:.1f} us); "
        f"the step itself {plan.step_us:.1f} us",
        f"attention on the GPU in {n_gpu} of {len(costs.layers)} layers; "
        f"{'experts' if costs.layers[0].experts else 'FFN neurons'} on the GPU: {hot} of {total} "
        f"({100 * hot / max(total, 1):.1f} %)",
        f"device bytes: {format_bytes(plan.device_bytes)} of {format_bytes(plan.budget)} "
        f"(reserve for scratch {format_bytes(plan_reserve(plan, costs))}, of it "
        f"{format_bytes(plan.gemm_scratch)} for the prompt GEMM's dequantized weight rows)",
        f"modelled: {plan.token_us / 1e3:.2f} ms per token, {plan.tokens_per_second:.1f} tokens per second",
    ]
    return "\n".join(lines)
