"""The hybrid executor on a real GPU: models placed under VRAM budgets from the minimum to everything, their
split layers computed by the GPU (hot rows) and the CPU (the rest) at once. Oracle: the same model on the
CPU alone. Skipped without a CUDA build and a GPU; run on the device machine (docs/GPU_TEST_LOG.md)."""
from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest
from split_harness import decode_steps

import pyinfer.converters.synthetic as syn
from pyinfer.engine import machine
from pyinfer.engine.driver import Model
from pyinfer.engine.placement import BudgetTooSmallError, MachineProfile, minimum_budget, model_costs
from pyinfer.engine.sampling import SamplerParams
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.native import ggml

pytestmark = pytest.mark.skipif(not ggml.cuda_available(), reason="no CUDA device")

TOKENS = np.random.default_rng(5).integers(0, 300, 40).tolist()  # >= 32: prompt batches stream host weights
# figures that make the GPU's neurons worth more than its attention, so small budgets split layers
SPLITTY = MachineProfile("test", cpu_dense_gbps=50.0, cpu_sparse_gbps=5.0, gpu_dense_gbps=2000.0,
                         gpu_sparse_gbps=1000.0, xfer_us=1.0, gpu_layer_us=1.0, cpu_layer_us=1.0)


# a prompt batch's predictor logits near 0 flip under TF32, and a flipped SiLU or GELU neuron adds or drops its
# whole output (3.5e-2 seen for gemma3); the streamed sparse graph itself equals the CPU's within 1e-5
# (test_split), and decode steps, which compute the predictor in F32, stay within 1e-4 here. One token may flip
# further: the tiny Llama 3 model's token 34 of 40 moved 0.39 of the largest logit on an H200 (the 34 before it
# within 1e-3, those after within 3e-2 through its keys and values), the same with batches of 16, unstreamed
BATCH_TOL_PREDICTED = 0.1
MAX_FLIPPED_TOKENS = 1


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())




def budgets(path: str, n_ctx: int, n_batch: int, sparse: bool) -> list[int]:
    """From the minimum to everything, in six steps, or two a layer and two more (a step less than a layer's bytes
    splits some layer: Qwen3.5's five layers in six steps had moved a whole one each)."""
    costs = model_costs(GGUFFile(path), n_ctx, 4, sparse, n_batch)
    full = costs.reserve_bytes + costs.head_bytes + sum(
        la.attn_bytes + la.kv_bytes + la.pred_bytes + la.n_ff * la.neuron_bytes for la in costs.layers)
    return [int(b) for b in np.linspace(minimum_budget(costs), full, max(6, 2 * len(costs.layers) + 2))]


# Qwen3.5 dense only: with predictors, a streamed prompt's batch differed from the CPU's by 0.28 at the smallest
# budget (the CPU's own batch equals its decode steps; not yet understood: the predictors' flips carried on by the
# recurrent states is the first guess), so its predicted FFN under a budget is not claimed
@pytest.mark.parametrize(("variant", "sparse"), [
    (v, s) for v in ["llama_relu", "llama_silu", "qwen2", "gemma3", "llama3_rope", "falcon_relu", "opt", "qwen35"]
    for s in (False, True) if not (v == "qwen35" and s)])
def test_budgets_from_minimum_to_everything_equal_the_cpu(tiny_files, variant, sparse):
    path = tiny_files(variant, sparse)
    cpu = Model(path, n_ctx=64, kv_type="f32", n_batch=32)
    want_steps, want_batch = decode_steps(cpu, TOKENS[:8]), cpu.logits(TOKENS)
    cpu.reset()
    greedy = list(cpu.generate_tokens(TOKENS[:3], 32, SamplerParams(temperature=0), stop_at_eos=False))
    split_seen = False
    for budget in budgets(path, 64, 32, sparse):
        _, free_before, _ = ggml.cuda_memory()
        model = Model(path, n_ctx=64, kv_type="f32", n_batch=32, vram_budget=budget, machine=SPLITTY)
        split_seen |= bool(model.hot_rows)
        step_err = rel_err(decode_steps(model, TOKENS[:8]), want_steps)
        batch = model.logits(TOKENS)
        batch_err = rel_err(batch, want_batch)  # cuBLAS: F32 weights as TF32
        token_errs = np.abs(batch - want_batch).max(axis=1) / np.abs(want_batch).max()
        model.reset()
        got = list(model.generate_tokens(TOKENS[:3], 32, SamplerParams(temperature=0), stop_at_eos=False))
        _, free_after, _ = ggml.cuda_memory()
        print(f"\n{variant} sparse={sparse} budget {budget >> 10} KiB: {sum(model.plan.attn_gpu)} attention, hot "
              f"rows {model.hot_rows or model.plan.hot_rows}, device {model.device_bytes >> 10} KiB (peak "
              f"{model.device_peak_bytes >> 10} KiB, driver "
              f"{(free_before - free_after) >> 10} KiB), decode err {step_err:.1e}, batch err {batch_err:.1e}"
              f"{' (prompt streamed)' if model.streams_prompts else ''}")
        assert model.device_bytes <= model.device_peak_bytes <= budget
        assert free_before - free_after <= budget  # what the driver saw, CUDA graphs included
        assert step_err < 1e-4
        if sparse:
            assert (token_errs > BATCH_TOL_PREDICTED).sum() <= MAX_FLIPPED_TOKENS, token_errs
        else:
            assert batch_err < 3e-2
        assert got == greedy
        del model
        gc.collect()  # its device memory goes back before the next budget's measurement
    assert split_seen, "no budget split a layer: the test does not test the split"


@pytest.mark.parametrize("variant", ["llama_relu", "llama_silu", "gemma3"])
def test_sparse_ffn_is_one_fused_group_on_the_gpu(tiny_files, variant):
    """A sparse model wholly on the GPU runs each layer's FFN (gate rows, act, up rows, mul, down_t rows) as one
    fused group, copies no mask back to the host (the host counts the masks of its own neurons only), and
    decodes what the CPU decodes."""
    sparse = Model(tiny_files(variant, True), n_ctx=64, kv_type="f32", n_gpu_layers=99)
    dense = Model(tiny_files(variant, False), n_ctx=64, kv_type="f32", n_gpu_layers=99)
    cpu = Model(tiny_files(variant, True), n_ctx=64, kv_type="f32")
    dense.eval([TOKENS[0]])
    assert rel_err(decode_steps(sparse, TOKENS[:8]), decode_steps(cpu, TOKENS[:8])) < 1e-4
    graph = sparse._graphs[(1, 1, False)]
    assert graph.mask_tensors == []
    # per layer, dense: the GLU fuses 3 nodes into its first; sparse: the FFN 4 and the residual add after it
    # (not Gemma 3's: its post-FFN norm comes first), the predictor's fc1 + relu 1 and fc2 + bias 1
    extra = graph.graph.n_fused - dense._graphs[(1, 1, False)].graph.n_fused
    assert extra == (3 if variant == "gemma3" else 4) * sparse.config.n_layer, extra


def test_overlap_is_measured(tmp_path):
    """A split model's decode steps: both devices busy, some of the time at once, and replayed."""
    path = str(tmp_path / "small.gguf")
    syn.make_llama(path, "small", syn.Q.F16, share_weights=True)
    costs = model_costs(GGUFFile(path), 256, 2, True, 32)
    half = costs.reserve_bytes + costs.head_bytes + sum(la.attn_bytes + la.kv_bytes + la.pred_bytes
                                                        + la.n_ff * la.neuron_bytes // 2 for la in costs.layers)
    model = Model(path, n_ctx=256, n_batch=32, vram_budget=half, machine=SPLITTY, timed=True)
    assert model.hot_rows, model.plan
    for t in range(24):
        model.eval([t])
    steps = model.step_stats[4:]  # from the third step on the GPU runs are replayed
    assert all(s["n_replayed"] == s["n_gpu_runs"] > 0 for s in steps)
    assert all(s["cpu_busy_ms"] > 0 and s["gpu_busy_ms"] > 0 for s in steps)
    med = {k: float(np.median([s[k] for s in steps])) for k in ("wall_ms", "cpu_busy_ms", "gpu_busy_ms", "overlap_ms")}
    print(f"\nsmall F16 split {model.hot_rows}: per token median {med}")
    assert med["overlap_ms"] > 0


def test_bench_reports_what_the_driver_saw_under_the_budget(tiny_files, tmp_path):
    """`pyinfer bench`'s JSON gives the driver's count beside the allocator's (CUDA graphs and the cuBLAS handle are
    not the allocator's), and under a budget both stay within it through a prompt and a generation. In a process
    of its own, as a user runs it: in this one, earlier tests' freed memory hides a tiny model's from the driver."""
    path = tiny_files("llama_relu", True)
    budget = budgets(path, 80, 32, True)[2]
    machine.save(SPLITTY, tmp_path / "splitty.json")
    run = subprocess.run([sys.executable, "-m", "pyinfer", "bench", "-m", path, "-p", "40", "-n", "32", "-b", "32",
                          "-r", "1", "-o", "json", "--vram-budget", str(budget), "--machine",
                          str(tmp_path / "splitty.json")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [r["test"] for r in rows] == ["pp40", "tg32"] and all(r["vram_budget"] == budget for r in rows)
    for row in rows:
        assert 0 < row["device_peak_bytes"] <= budget and 0 < row["driver_bytes"] <= budget, row


def test_auto_budget_and_too_small(tiny_files):
    path = tiny_files("llama_relu", True)
    model = Model(path, n_ctx=64, vram_budget="auto", machine=SPLITTY)
    assert all(model.plan.attn_gpu) and model.plan.head_gpu and not model.hot_rows  # a tiny model fits whole
    with pytest.raises(BudgetTooSmallError, match="below the minimum"):
        Model(path, n_ctx=64, vram_budget=1 << 20, machine=SPLITTY)


def test_machine_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path))
    # the GPU tests may run beside a build: cached whatever the load (test_placement checks that rule)
    monkeypatch.setattr(machine, "_busy", lambda: None)
    monkeypatch.setattr(machine, "UNSTEADY", float("inf"))
    p = machine.profile_for(ggml.F16, 4)
    print(f"\nmeasured: {p}")
    assert p.gpu_dense_gbps > p.cpu_dense_gbps > 0 and p.gpu_sparse_gbps > 0 and p.cpu_sparse_gbps > 0
    # a decode layer's launches and small kernels cost microseconds beyond its bytes. (A CPU layer's cost, the
    # difference of two decode times less its bytes at a measured rate, is within that difference's noise since
    # the barriers spin: it came out at 0 on the H100 host at 4 threads, so it is not asserted on)
    assert p.gpu_layer_us > 1
    assert machine.cache_path("f16", 4).is_file() and machine.profile_for(ggml.F16, 4) == p  # cached


def test_machine_times_the_fused_sparse_ffn():
    """The machine profile times the GPU's sparse FFN as a model runs it: each hot half one fused group (it had
    built them from views of one weight, whose view nodes split the groups, and timed the unfused row ops)."""
    ctx = ggml.Context(64 << 20)
    rng = np.random.default_rng(0)
    x = ctx.tensor_from_numpy(rng.standard_normal(256).astype(np.float32)).to_device()
    outs, picked = machine.hot_halves(ctx, ggml.F16, x, 512, 2, rng)
    assert 0 < picked < 2 * 512
    assert ggml.Graph(ctx, outs).plan().n_fused == 2 * 4


def test_cpu_node_reading_device_leaves():
    """A CPU node whose input is a weight on the GPU downloads it like any output (not as an upload)."""
    rng = np.random.default_rng(1)
    ctx = ggml.Context(1 << 20)
    w_host, x_dev, v_dev = rng.standard_normal((8, 16)), rng.standard_normal(16), rng.standard_normal(8)
    w = ctx.tensor_from_numpy(w_host.astype(np.float32))
    x = ctx.tensor_from_numpy(x_dev.astype(np.float32)).to_device()
    v = ctx.tensor_from_numpy(v_dev.astype(np.float32)).to_device()
    y = ctx.scale(ctx.add(ctx.mul_mat(w, x), v), 2.0)  # CPU GEMV of a device vector, then GPU ops
    graph = ggml.Graph(ctx, [y])
    pool = ggml.ThreadPool(2)
    for _ in range(4):  # op by op, captured, replayed
        graph.compute(pool)
        np.testing.assert_allclose(y.numpy(), 2 * (w_host @ x_dev + v_dev), rtol=1e-5)
    assert graph.replayed


def test_split_layer_downloads_come_before_the_hot_rows(tiny_files):
    """The stream copies x and the CPU's mask out before it runs the hot rows, so the CPU's half starts while
    the GPU's runs (a download placed after them made the two halves take turns)."""
    from pyinfer.native.binding import lib

    path = tiny_files("llama_relu", True)
    budget = budgets(path, 64, 32, True)[2]
    model = Model(path, n_ctx=64, kv_type="f32", n_batch=32, vram_budget=budget, machine=SPLITTY)
    assert model.hot_rows
    model.eval([1])
    graph = model._graphs[(1, 1, False)].graph
    nodes = [lib.ggml_graph_node(graph.ptr, i) for i in range(graph.n_nodes)]
    index = {int(ggml.ffi.cast("uintptr_t", t)): i for i, t in enumerate(nodes)}

    def weight_name(t) -> str:
        return ggml.ffi.string(lib.ggml_get_name(lib.ggml_get_src(t, 0))).decode()

    for il in model.hot_rows:
        hot = min(i for i, t in enumerate(nodes)
                  if lib.ggml_get_op(t) == lib.GGML_OP_MUL_MAT_ROWS and weight_name(t).startswith(f"blk.{il}.ffn_"))
        cold = next(t for t in nodes if lib.ggml_get_op(t) == lib.GGML_OP_SPARSE_FFN
                    and weight_name(t).startswith(f"blk.{il}."))
        inputs = [lib.ggml_get_src(cold, s) for s in (1, 2)]  # x and the CPU's part of the mask: downloads
        assert all(lib.ggml_get_op(t) == lib.GGML_OP_TRANSFER for t in inputs)
        assert max(index[int(ggml.ffi.cast("uintptr_t", t))] for t in inputs) < hot, il
