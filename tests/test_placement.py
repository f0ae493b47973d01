"""The placement solver against brute force, its monotonicity in the budget, and the budget checks."""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.engine.placement import (
    BudgetTooSmallError,
    LayerCosts,
    MachineProfile,
    ModelCosts,
    evaluate,
    format_bytes,
    minimum_budget,
    parse_bytes,
    solve,
)
from pyinfer.errors import InvalidArgumentError
from pyinfer.native.ggml import WEIGHT_TYPES, type_name
from pyinfer.native.ggml import cuda_available as ggml_cuda_available


@st.composite
def instances(draw):
    """A small model (1-3 layers of up to 4 neuron groups) and a machine, all numbers random."""
    n_layer = draw(st.integers(1, 3))
    group_rows = draw(st.integers(1, 4))
    n_ff = draw(st.integers(1, 4 * group_rows))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layer):
        freq = np.sort(rng.uniform(0, 1, n_ff))[::-1] if draw(st.booleans()) else np.ones(n_ff)
        layers.append(LayerCosts(attn_bytes=int(rng.integers(1, 1000)), kv_bytes=int(rng.integers(0, 300)),
                                 pred_bytes=int(rng.integers(0, 100)), neuron_bytes=int(rng.integers(1, 200)),
                                 freq=freq, sparse=bool(freq[-1] < 1), group_rows=group_rows))
    costs = ModelCosts(layers, head_bytes=int(rng.integers(1, 2000)), reserve_bytes=int(rng.integers(0, 200)))
    machine = MachineProfile("random", *rng.uniform(0.01, 5.0, 4), *rng.uniform(0.0, 50.0, 3))
    total = costs.reserve_bytes + costs.head_bytes + sum(
        la.attn_bytes + la.kv_bytes + la.pred_bytes + la.n_ff * la.neuron_bytes for la in layers)
    return costs, machine, total


def brute_force(costs: ModelCosts, machine: MachineProfile, budget: int):
    """Every placement: per layer CPU, or attention on the GPU with 0..all groups; the head either way."""
    per_layer = [[(False, 0)] + [(True, n) for n in range(len(la.groups()) + 1)] for la in costs.layers]
    best = None
    for choice in itertools.product(*per_layer):
        for head in (False, True):
            plan = evaluate(costs, machine, [c[0] for c in choice], [c[1] for c in choice], head, budget)
            if plan.device_bytes <= budget and (best is None or plan.token_us < best.token_us):
                best = plan
    return best


@given(instances(), st.floats(0.0, 1.0))
def test_solver_optimum_equals_brute_force(instance, fraction):
    costs, machine, total = instance
    budget = int(fraction * total)
    if 0 < budget < minimum_budget(costs):
        with pytest.raises(BudgetTooSmallError, match="below the minimum"):
            solve(costs, machine, budget)
        return
    plan = solve(costs, machine, budget)
    want = brute_force(costs, machine, budget)
    assert plan.device_bytes <= budget
    assert plan.gap == 0.0
    assert plan.token_us == pytest.approx(want.token_us, rel=1e-6, abs=1e-9)
    # what the plan says equals what its choices cost
    groups = [_n_groups(la, k) for la, k in zip(costs.layers, plan.hot_rows, strict=True)]
    again = evaluate(costs, machine, plan.attn_gpu, groups, plan.head_gpu, budget)
    assert again.token_us == pytest.approx(plan.token_us) and again.device_bytes == plan.device_bytes


def _n_groups(layer: LayerCosts, rows: int) -> int:
    return sum(1 for _, end in layer.groups() if end <= rows)


@given(instances(), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4))
def test_more_budget_is_never_slower(instance, fractions):
    costs, machine, total = instance
    budgets = sorted({int(f * total) for f in fractions} - set(range(1, minimum_budget(costs))))
    times = [solve(costs, machine, b).token_us for b in budgets]
    assert all(t1 <= t0 * (1 + 1e-9) + 1e-9 for t0, t1 in zip(times, times[1:], strict=False)), (budgets, times)


def test_plan_respects_structure():
    """Hot rows are a prefix in whole groups, only in layers whose attention is on the GPU."""
    rng = np.random.default_rng(3)
    layers = [LayerCosts(400, 100, 50, 30, np.sort(rng.uniform(0, 1, 200))[::-1], True, group_rows=64)
              for _ in range(6)]
    costs = ModelCosts(layers, head_bytes=800, reserve_bytes=100)
    machine = MachineProfile("m", 1.0, 0.5, 20.0, 10.0, 5.0, 1.0, 1.0)
    full = costs.reserve_bytes + costs.head_bytes + sum(la.attn_bytes + la.kv_bytes + la.pred_bytes
                                                        + la.n_ff * la.neuron_bytes for la in layers)
    for budget in np.linspace(minimum_budget(costs), full, 9).astype(int):
        plan = solve(costs, machine, int(budget))
        assert plan.device_bytes <= budget
        for a, k in zip(plan.attn_gpu, plan.hot_rows, strict=True):
            assert k in (0, 64, 128, 192, 200) and (a or k == 0)
    everything = solve(costs, machine, full)
    assert all(everything.attn_gpu) and everything.head_gpu


def test_budget_zero_is_cpu_only_and_too_small_is_one_line():
    layers = [LayerCosts(1000, 10, 0, 10, np.ones(8), False)]
    costs = ModelCosts(layers, head_bytes=5000, reserve_bytes=300)
    machine = MachineProfile("m", 1.0, 1.0, 10.0, 10.0, 1.0, 1.0, 1.0)
    plan = solve(costs, machine, 0)
    assert not plan.uses_gpu and plan.device_bytes == 0 and not any(plan.attn_gpu)
    with pytest.raises(BudgetTooSmallError) as exc:
        solve(costs, machine, 1000)
    assert str(exc.value).count("\n") == 0 and format_bytes(1310) in str(exc.value)
    with pytest.raises(InvalidArgumentError):
        solve(costs, machine, -1)


def test_machine_profile_rejects_bad_numbers():
    with pytest.raises(InvalidArgumentError, match="gpu_dense_gbps"):
        MachineProfile("m", 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(InvalidArgumentError, match="xfer_us"):
        MachineProfile("m", 1.0, 1.0, 1.0, 1.0, float("nan"), 1.0, 1.0)


@pytest.mark.parametrize("text,want", [("8GiB", 8 << 30), ("8G", 8 << 30), ("24GB", 24 * 10**9), ("512MiB", 512 << 20),
                                       ("0", 0), ("1.5 GiB", 3 << 29), ("100", 100)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "abc", "-1G", "8XB", "nan", "inf"])
def test_parse_bytes_rejects(text):
    with pytest.raises(InvalidArgumentError, match="not a size"):
        parse_bytes(text)


# ---------------------------------------------------------------------------------------------------
# pyinfer plan: on a real file, for a stated machine, without a GPU

# every figure of a MachineProfile: on a GPU machine `pyinfer plan` starts from the measured profile, whose step_us
# had stayed in where the tests' own profile had 0 (test_input_sparsity's plan test failed on the H200)
FLAGS = ["--cpu-dense-bw", "20", "--cpu-sparse-bw", "8", "--gpu-dense-bw", "2000", "--gpu-sparse-bw", "900",
         "--xfer-us", "25", "--gpu-layer-us", "20", "--cpu-layer-us", "40", "--step-us", "0"]


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfer", "plan", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def tiny_sparse(tmp_path_factory) -> str:
    from hf_tiny import build

    import pyinfer.converters.convert_hf_to_powergguf as conv
    from pyinfer.sparsity.synthetic_predictors import add_predictors

    folder = tmp_path_factory.mktemp("plan")
    build("llama_relu", str(folder / "hf"))
    dense, sparse = str(folder / "m.gguf"), str(folder / "sparse.gguf")
    assert conv.main([str(folder / "hf"), "-o", dense, "--outtype", "f16"]) == 0
    add_predictors(dense, sparse, density=0.3, rank=16, n_calib=64)
    return sparse


def test_plan_command_prints_and_matches_the_solver(tiny_sparse):
    from pyinfer.engine.placement import model_costs
    from pyinfer.formats.gguf_file import GGUFFile

    f = GGUFFile(tiny_sparse)
    costs = model_costs(f, 64, 2, True, 32)
    budget = costs.reserve_bytes + sum(la.attn_bytes + la.kv_bytes + la.pred_bytes + 40 * la.neuron_bytes
                                       for la in costs.layers)
    res = _plan_cli("-m", tiny_sparse, "--vram-budget", str(budget), "-c", "64", "-b", "32", *FLAGS)
    assert res.returncode == 0, res.stderr
    assert "| layer | attention | hot rows on GPU |" in res.stdout and "tokens per second" in res.stdout
    res = _plan_cli("-m", tiny_sparse, "--vram-budget", str(budget), "-c", "64", "-b", "32", "--json", *FLAGS)
    got = json.loads(res.stdout)
    machine = MachineProfile("given figures", *(float(v) for v in FLAGS[1::2]))
    want = solve(costs, machine, budget)
    assert got["device_bytes"] == want.device_bytes <= budget
    assert tuple(got["hot_rows"]) == want.hot_rows and got["token_us"] == pytest.approx(want.token_us)
    assert any(0 < k for k in want.hot_rows)


def test_plan_command_says_what_a_smaller_prompt_batch_buys(tiny_sparse):
    # a 4096-token batch's reserve crowds a tight budget: half of it leaves room for more of the model
    from pyinfer.engine.placement import model_costs
    from pyinfer.formats.gguf_file import GGUFFile

    costs = model_costs(GGUFFile(tiny_sparse), 64, 2, True, 4096)
    budget = costs.reserve_bytes + sum(la.attn_bytes + la.kv_bytes + la.pred_bytes + 40 * la.neuron_bytes
                                       for la in costs.layers)
    res = _plan_cli("-m", tiny_sparse, "--vram-budget", str(budget), "-c", "64", "-b", "4096", *FLAGS)
    assert res.returncode == 0, res.stderr
    hint = re.search(r"^hint: -b 2048 reserves .* modelled ([\d.]+) tokens per second instead of ([\d.]+);",
                     res.stdout, re.M)
    assert hint, res.stdout
    half = json.loads(_plan_cli("-m", tiny_sparse, "--vram-budget", str(budget), "-c", "64", "-b", "2048", "--json",
                                *FLAGS).stdout)
    full = json.loads(_plan_cli("-m", tiny_sparse, "--vram-budget", str(budget), "-c", "64", "-b", "4096", "--json",
                                *FLAGS).stdout)
    assert float(hint[1]) == pytest.approx(half["tokens_per_second"], abs=0.05)
    assert float(hint[2]) == pytest.approx(full["tokens_per_second"], abs=0.05) and float(hint[1]) > float(hint[2])
    roomy = _plan_cli("-m", tiny_sparse, "--vram-budget", "64GiB", "-c", "64", "-b", "4096", *FLAGS)
    assert roomy.returncode == 0 and "hint:" not in roomy.stdout


@pytest.mark.parametrize("args,message", [
    (["--vram-budget", "1KiB", *FLAGS], "below the minimum"),
    (["--vram-budget", "lots", *FLAGS], "not a size"),
    (["--vram-budget", "1GiB", "--machine", "no-such-machine"], "unknown machine"),
    (["--vram-budget", "1GiB", *FLAGS, "--gpu-dense-bw", "0"], "positive number"),
])
def test_plan_command_bad_input_is_one_line(tiny_sparse, args, message):
    res = _plan_cli("-m", tiny_sparse, *args)
    assert res.returncode == 1 and message in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.skipif(ggml_cuda_available(), reason="checks the message on a machine without a GPU")
def test_plan_command_without_gpu_asks_for_a_target(tiny_sparse):
    res = _plan_cli("-m", tiny_sparse, "--vram-budget", "1GiB")
    assert res.returncode == 1 and "--machine" in res.stderr and "--gpu-dense-bw" in res.stderr


@pytest.mark.parametrize("load, spread, cached", [(0.0, 1.05, True), (100.0, 1.05, False), (0.0, 1.6, False)])
def test_machine_figures_from_a_busy_host_are_not_cached(tmp_path, monkeypatch, capsys, load, spread, cached):
    # a profile measured while llama.cpp compiled (load 9 on 16 cores) planned every later run of the machine
    from pyinfer.engine import machine
    from pyinfer.native import ggml

    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path))
    figures = MachineProfile("here", 50.0, 40.0, 2000.0, 500.0, 20.0, 22.0, 45.0)
    monkeypatch.setattr(machine, "measure", lambda weight_type, n_threads: (figures, spread))
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (load, load, load))
    assert machine.profile_for(ggml.F16, 4) == figures
    assert machine.cache_path("f16", 4).is_file() == cached
    assert ("not cached" in capsys.readouterr().err) != cached


def _cache(root, cpu, index, level, size, shared, kind="Unified"):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, text in (("level", str(level)), ("shared_cpu_list", shared), ("type", kind), ("size", size)):
        if text is not None:
            (d / name).write_text(text + "\n")


def test_last_level_cache_counts_each_instance_once(tmp_path):
    from pyinfer.engine import machine

    # an EPYC-like part: per core L1/L2, one 32 MiB L3 per complex of four cores (cpus 0-3, 4-7)
    for cpu in range(8):
        _cache(tmp_path, cpu, 0, 1, "32K", str(cpu), "Data")
        _cache(tmp_path, cpu, 1, 1, "64K", str(cpu), "Instruction")
        _cache(tmp_path, cpu, 2, 2, "1024K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "32768K", "0-3" if cpu < 4 else "4-7")
    assert machine.last_level_cache(tmp_path, range(8)) == 64 << 20
    assert machine.last_level_cache(tmp_path, range(4)) == 32 << 20  # the process may run on one complex
    # the H100 host: one L3 for all 16 cores; an index without a size and one with garbage are skipped
    host = tmp_path / "host"
    for cpu in range(16):
        _cache(host, cpu, 2, 2, "2048K", str(cpu))
        _cache(host, cpu, 3, 3, "307200K", "0-15")
        _cache(host, cpu, 4, 4, None, "0-15")
        _cache(host, cpu, 5, 4, "garbage", "0-15")
    assert machine.last_level_cache(host, range(16)) == 300 << 20
    assert machine.last_level_cache(tmp_path / "absent", range(4)) == 0


def test_measure_reads_the_plans_rates_beyond_the_cache_and_subtracts_the_small_models_at_theirs(monkeypatch):
    """measure(): the profile's CPU rates come from a read of cpu_working_set() bytes; the fixed costs, timed on
    small models a large cache may hold, subtract their bytes at the rates of a WORKING_SET read."""
    from pyinfer.engine import machine
    from pyinfer.native import ggml

    monkeypatch.setattr(ggml, "cuda_available", lambda: True)
    monkeypatch.setattr(machine, "cpu_working_set", lambda: 4 * machine.WORKING_SET)
    rates = {4 * machine.WORKING_SET: (90.0, 80.0, 1.1), machine.WORKING_SET: (180.0, 170.0, 1.9)}
    monkeypatch.setattr(machine, "_cpu_figures", lambda type_, n_threads, rng, working_set: rates[working_set])
    monkeypatch.setattr(machine, "_gpu_figures", lambda type_, rng: (2000.0, 700.0))
    subtracted = []

    def fixed_costs(type_, n_threads, profile):
        subtracted.append((profile.cpu_dense_gbps, profile.cpu_sparse_gbps))
        return {"gpu_layer_us": 50.0, "xfer_us": 30.0, "cpu_layer_us": 60.0, "step_us": 20.0}

    monkeypatch.setattr(machine, "_fixed_costs", fixed_costs)
    profile, spread = machine.measure(ggml.F16, 4)
    assert (profile.cpu_dense_gbps, profile.cpu_sparse_gbps, spread) == (90.0, 80.0, 1.1)
    assert subtracted == [(180.0, 170.0)] and profile.cpu_layer_us == 60.0


@pytest.mark.parametrize("cache, want", [(0, 256 << 20), (32 << 20, 256 << 20), (300 << 20, 1200 << 20),
                                         (1 << 30, 2 << 30)])
def test_cpu_measurements_read_well_beyond_the_last_level_cache(monkeypatch, cache, want):
    # the H100 host's 300 MiB L3 held the 256 MiB a measurement read: CPU rates came out 1.5-2x DRAM's and
    # 1.3-1.9x apart between rounds, and plans put too much on the CPU
    from pyinfer.engine import machine

    monkeypatch.setattr(machine, "last_level_cache", lambda: cache)
    assert machine.cpu_working_set() == want


@pytest.mark.parametrize("type_name_, n", [("f16", 50), ("q4_0", 50), ("f16", 5)])
def test_measured_bundle_repeats_its_drawn_neurons_and_every_one_fires(monkeypatch, type_name_, n):
    """A bundle larger than DISTINCT_BYTES repeats the neurons drawn (its bytes, not its values, are what a
    bandwidth measurement needs), and the sparse FFN over it reads every selected neuron: all of them fire."""
    from pyinfer.engine import machine
    from pyinfer.native import ggml

    type_ = getattr(ggml, type_name_.upper())
    k = 256
    row = ggml.row_size(type_, k)
    monkeypatch.setattr(machine, "DISTINCT_BYTES", 7 * 3 * row)  # 7 neurons drawn, n made
    ctx = ggml.Context(4 << 20)
    bundle = machine._bundle(ctx, type_, n, k, np.random.default_rng(0))
    raw = bundle.raw().reshape(n, 3 * row)
    assert len({raw[i].tobytes() for i in range(min(n, 7))}) == min(n, 7)
    assert all((raw[i] == raw[i % 7]).all() for i in range(n))
    rng = np.random.default_rng(1)
    x = ctx.tensor_from_numpy(np.abs(rng.standard_normal(k)).astype(np.float32))
    selected = rng.random(n) < 0.5
    mask = ctx.tensor_from_numpy(np.where(selected, 1.0, -1.0).astype(np.float32))
    out = ctx.sparse_ffn(bundle, x, mask, "reglu")
    graph = ggml.Graph(ctx, [out])  # owns out's memory: kept until out is read
    graph.compute(ggml.ThreadPool(1))
    weights = dequantize(bundle.raw(), GGMLQuantizationType[type_name_.upper()]).astype(np.float64)
    weights = weights.reshape(n, 3, k)
    gate, up = weights[:, 0] @ x.numpy(), weights[:, 1] @ x.numpy()
    assert (gate[selected] > 0).all()
    want = (np.where(selected, np.maximum(gate, 0) * up, 0.0)[:, None] * weights[:, 2]).sum(0)
    np.testing.assert_allclose(out.numpy()[:k], want, rtol=0.05, atol=0.02 * np.abs(want).max())
    np.testing.assert_array_equal(out.numpy()[k:], selected)  # the kernel's own count: every selected one fired


@pytest.mark.parametrize("type_", WEIGHT_TYPES, ids=type_name)
def test_machine_layer_models_of_every_weight_type(tmp_path, type_):
    """The machine profile decodes synthetic models of the weight type it profiles: they are written and run for
    every type a model's FFN can have (Q4_K had no file type name, so profiling for a Q4_K_M model raised)."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import machine
    from pyinfer.engine.driver import Model

    path = str(tmp_path / "m.gguf")
    synthetic.make_llama(path, machine.LAYER_SHAPE, synthetic.Q(type_), ffn_kind="reglu", n_layer=1,
                         share_weights=True)
    assert np.isfinite(Model(path, n_ctx=16).eval([1])).all()


def test_fixed_costs_are_what_decoding_takes_beyond_the_modelled_bytes(monkeypatch, tmp_path):
    """machine.excess_costs: a CPU decode's time beyond what the placement charges for its bytes, per layer and
    per step. With rates at which the head's bytes cost 20 ms, the per-step excess falls by those 20 ms against
    rates at which bytes are free, and the per-layer one by a layer's bytes at that rate (units, the per-layer
    division, the subtractions); and the two predict a model of another depth."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import machine
    from pyinfer.engine.placement import evaluate, model_costs
    from pyinfer.formats.gguf_file import GGUFFile
    from pyinfer.native import ggml

    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path / "cache"))

    monkeypatch.setattr(machine, "DECODE_STEPS", 8)
    one_gbps = MachineProfile("1 GB/s", 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    bytes_us = []  # each decoded model's bytes per token at 1 GB/s, on the CPU
    make_llama = synthetic.make_llama

    def make_and_cost(path, *args, n_layer, **kwargs):
        make_llama(path, *args, n_layer=n_layer, **kwargs)
        costs = model_costs(GGUFFile(path), 16, 2, True, 1)
        bytes_us.append(evaluate(costs, one_gbps, [False] * n_layer, [0] * n_layer, False, 0).token_us)

    monkeypatch.setattr(synthetic, "make_llama", make_and_cost)
    free_rates = MachineProfile("free", 1e9, 1e9, 1e9, 1e9, 0, 0, 0)
    free_layer, free_step = machine.excess_costs(ggml.Q4_0, 1, free_rates, ("cpu",))
    layer_us = (bytes_us[1] - bytes_us[0]) / (machine.MANY_LAYERS - machine.FEW_LAYERS)  # a layer at 1 GB/s
    head_us = bytes_us[0] - machine.FEW_LAYERS * layer_us  # the rest (the head) at 1 GB/s
    slow = head_us / 20e3  # GB/s at which the head's bytes take 20 ms (only the model's charge: runs are as fast)
    paid_layer, paid_step = machine.excess_costs(ggml.Q4_0, 1, MachineProfile("slow", slow, slow, 1e9, 1e9, 0, 0, 0),
                                                 ("cpu",))
    noise = 0.3 * free_layer["cpu"] + 1e3  # the two decodes' spread, per layer; the step's is a few times that
    assert free_layer["cpu"] > 0
    assert paid_layer["cpu"] == pytest.approx(free_layer["cpu"] - layer_us / slow, abs=noise)
    assert paid_step["cpu"] == pytest.approx(free_step["cpu"] - 20e3, abs=machine.MANY_LAYERS * noise)

    path = str(tmp_path / "four.gguf")
    monkeypatch.setattr(synthetic, "make_llama", make_llama)
    make_llama(path, machine.LAYER_SHAPE, synthetic.Q(ggml.Q4_0), ffn_kind="reglu", n_layer=4, share_weights=True)
    plan = evaluate(model_costs(GGUFFile(path), 16, 2, True, 1), free_rates, [False] * 4, [0] * 4, False, 0)
    predicted_ms = (free_step["cpu"] + 4 * free_layer["cpu"]) / 1e3
    # a wrong split between step and layers is off by layers (~25 % each); this box's speed drifts up to ~30 %
    assert machine._decode_ms(path, plan, 1) == pytest.approx(predicted_ms, rel=0.4)


def test_fixed_costs_time_every_model_in_each_round(monkeypatch, tmp_path):
    """excess_costs times its models round by round, each model once a round, and keeps each one's median: a slow
    spell hits one round of every model (back to back, a split layer's cost had once read 131 us, once 0)."""
    from pyinfer.engine import machine
    from pyinfer.native import ggml

    monkeypatch.setenv("PYINFER_CACHE", str(tmp_path))
    order, spell, pools = [], {3}, []  # the host is slow in the fourth of the timed calls

    def decoder(path, plan, n_threads, pool):
        pools.append(pool)
        return path

    monkeypatch.setattr(machine, "_decoder", decoder)

    def round_ms(path):
        order.append(path)
        return (9.0 if len(order) in spell else 1.0) * (2.0 if path.endswith(f"{machine.MANY_LAYERS}.gguf") else 1.0)

    monkeypatch.setattr(machine, "_round_ms", round_ms)
    free = MachineProfile("free", 1e9, 1e9, 1e9, 1e9, 0, 0, 0)
    per_layer, per_step = machine.excess_costs(ggml.Q4_0, 1, free, ("cpu",))
    few, many = (f"{n}.gguf" for n in (machine.FEW_LAYERS, machine.MANY_LAYERS))
    assert [p.rsplit("/", 1)[-1] for p in order] == [few, many] * machine.DECODE_ROUNDS
    assert pools[0] is not None and all(p is pools[0] for p in pools)  # one pool: no idle one polls beside
    assert per_layer["cpu"] == pytest.approx(1e3 / (machine.MANY_LAYERS - machine.FEW_LAYERS), rel=1e-6)
    assert per_step["cpu"] == pytest.approx(1e3 - machine.FEW_LAYERS * per_layer["cpu"], rel=1e-6)


# what a 512-token prompt batch (and 256, 128) took beyond the loaded model on an H100, by the driver's count, at
# a third (F16) and 0.9 (Q4_0) of the budget (docs/BENCHMARKS.md, "The prompt batch's reserve"): the SYNTHETIC
# shapes (n_ff, n_embd, n_vocab), their type, batch, MB. Q4_0 at 0.9 had taken more than the reserve then held
# (the GEMM's 64 MiB of dequantized rows were not counted) and the driver's count passed a budget.
MEASURED_PROMPT_BYTES = [((13824, 5120, 32000), "f16", 512, 226), ((13824, 5120, 32000), "f16", 256, 215),
                         ((13824, 5120, 32000), "f16", 128, 160), ((28672, 8192, 32000), "f16", 512, 292),
                         ((28672, 8192, 32000), "f16", 256, 253), ((28672, 8192, 32000), "f16", 128, 162),
                         ((13824, 5120, 32000), "q4_0", 512, 319), ((28672, 8192, 32000), "q4_0", 512, 446)]
# the same for a file of input sparsity (H200, 2026-11-27): the 13B SwiGLU F16 file at 50 %, a third of its bytes
MEASURED_INPUT_PROMPT_BYTES = [((13824, 5120, 32000), "f16", 512, 462)]


@pytest.mark.parametrize("shape, type_, n_batch, measured_mb, input_ffn", [(*m, False) for m in MEASURED_PROMPT_BYTES]
                         + [(*m, True) for m in MEASURED_INPUT_PROMPT_BYTES])
def test_the_reserve_holds_what_prompt_batches_took_on_a_gpu(shape, type_, n_batch, measured_mb, input_ffn):
    from types import SimpleNamespace

    from pyinfer.engine.placement import GEMM_CHUNK, reserve_bytes

    n_ff, n_embd, n_vocab = shape
    row = n_embd * 2 if type_ == "f16" else n_embd // 32 * 18  # bytes of one weight row
    largest_attention = n_embd * row
    dequantized = 0 if type_ == "f16" else min(GEMM_CHUNK, 2 * n_vocab * n_embd)  # the output head: the largest
    reserve = reserve_bytes(SimpleNamespace(widest_ff=n_ff, n_embd=n_embd, n_vocab=n_vocab), n_batch, largest_attention,
                            row, dequantized, input_ffn)
    assert reserve >= 1.15 * measured_mb * 1e6, reserve / 1e6


@pytest.mark.parametrize("type_name_", ["f16", "q4_0"])
def test_the_reserve_counts_the_dequantized_rows_of_non_f16_weights(tmp_path, monkeypatch, type_name_):
    """model_costs passes the GEMM's F16 copy of a non-F16 weight's rows (2 bytes a value of the largest such
    matrix, at most GEMM_CHUNK) to the reserve; an all-F16 model has none to make."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import placement
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "m.gguf")
    synthetic.make_llama(path, "small", synthetic.Q[type_name_.upper()], ffn_kind="reglu", n_layer=1,
                         share_weights=True)
    n_ff, n_embd = 4096, 1024  # synthetic.SHAPES["small"]: the FFN's matrices are the largest
    seen = []
    real = placement.reserve_bytes
    monkeypatch.setattr(placement, "reserve_bytes", lambda *args: seen.append(args[4]) or real(*args))
    costs = placement.model_costs(GGUFFile(path), 64, 2, True, 512)
    monkeypatch.setattr(placement, "GEMM_CHUNK", 1 << 20)
    placement.model_costs(GGUFFile(path), 64, 2, True, 512)
    assert placement.model_costs(GGUFFile(path), 64, 2, True, 8).dequantized_bytes == 0  # GEMVs: no GEMM
    assert seen[:2] == ([0, 0] if type_name_ == "f16" else [2 * n_ff * n_embd, 1 << 20])
    assert costs.dequantized_bytes == seen[0]  # what bench_hybrid leaves out of llama.cpp's reserve


def test_q_k_and_v_fuse_only_when_alike_and_their_norms_are_read_per_head():
    """placement.fusable_qkv, offload.fuse_qkv's rule: the three present and of one type, their biases all there
    (of one type) or none, q or k norms only where the graph norms the fused projection's heads (models.
    reads_fused_qkv: llama's and Gemma 3's builders, not OLMoE's whole-projection norms nor Gemma 4's and Qwen3.5's
    builders); otherwise they stay three matrices."""
    from types import SimpleNamespace

    from pyinfer.engine import placement

    def layer(types=("a", "a", "a"), biases=(None, None, None), norm=None) -> dict:
        t = {f"blk.0.attn_{p}.weight": SimpleNamespace(type=ty) for p, ty in zip("qkv", types, strict=True)}
        t |= {f"blk.0.attn_{p}.bias": SimpleNamespace(type=ty) for p, ty in zip("qkv", biases, strict=True) if ty}
        return t | ({f"blk.0.{norm}.weight": SimpleNamespace(type="f32")} if norm else {})

    assert placement.fusable_qkv(layer(), 0)["bias"] == [None] * 3
    assert len(placement.fusable_qkv(layer(biases=("f32",) * 3), 0)["bias"]) == 3
    refused = [layer(types=("a", "a", "b")), layer(biases=("f32", "f32", None)), layer(biases=("f32", "f32", "f16")),
               layer(norm="attn_q_norm"), layer(norm="attn_k_norm"), {}]
    assert [placement.fusable_qkv(t, 0) for t in refused] == [None] * len(refused)
    assert placement.fusable_qkv(layer(), 1) is None  # no such layer
    for norm in ("attn_q_norm", "attn_k_norm"):
        assert placement.fusable_qkv(layer(norm=norm), 0, head_norms=True) is not None

    from pyinfer.models import reads_fused_qkv

    def cfg(arch, whole=False):
        return SimpleNamespace(arch=arch, qk_norm_whole=whole)

    assert [reads_fused_qkv(cfg(a)) for a in ("qwen3", "qwen3moe", "llama", "gemma3", "falcon")] == [True] * 5
    assert [reads_fused_qkv(c) for c in (cfg("olmoe", True), cfg("gemma4"), cfg("qwen35"), cfg("qwen35moe"))] == [
        False] * 4


def test_the_dequantized_rows_count_q_k_and_v_as_one_matrix(tmp_path, monkeypatch):
    """Where a layer's attention is on the GPU its q, k and v are one matrix (offload.fuse_qkv), which a prompt's
    GEMM dequantizes as one: with a narrow FFN that matrix is the largest."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import placement
    from pyinfer.formats.gguf_file import GGUFFile

    monkeypatch.setitem(synthetic.SHAPES, "narrow", (1024, 2, 512, 16, 16, 512))  # q + k + v: 3072 rows of 1024
    path = str(tmp_path / "m.gguf")
    synthetic.make_llama(path, "narrow", synthetic.Q.Q4_0, ffn_kind="reglu", share_weights=True)
    assert placement.model_costs(GGUFFile(path), 64, 2, True, 512).dequantized_bytes == 2 * 3072 * 1024


def test_the_gemm_scratch_takes_what_the_placement_leaves(tmp_path, monkeypatch):
    """The reserve counts the least dequantized rows (GEMM_CHUNK_MIN), so that a tight budget's weights get the
    room; what a plan leaves of its budget goes to them, up to a full GEMM_CHUNK (ggml_set_gemm_scratch)."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import placement
    from pyinfer.formats.gguf_file import GGUFFile

    monkeypatch.setitem(synthetic.SHAPES, "wide", (2048, 2, 8192, 16, 16, 512))  # down: 2048 rows of 8192
    path = str(tmp_path / "m.gguf")
    synthetic.make_llama(path, "wide", synthetic.Q.Q4_0, ffn_kind="reglu", share_weights=True)
    costs = placement.model_costs(GGUFFile(path), 64, 2, True, 512)
    assert (costs.dequantized_bytes, costs.dequantized_most) == (placement.GEMM_CHUNK_MIN, 2 * 8192 * 2048)
    more = costs.dequantized_most - costs.dequantized_bytes
    full = dataclasses.replace(costs, reserve_bytes=costs.reserve_bytes + more)  # the full chunk counted up front
    machine = MachineProfile("m", 1.0, 1.0, 10.0, 10.0, 1.0, 1.0, 1.0)
    total = placement.minimum_budget(full) + sum(layer.attn_bytes + layer.kv_bytes + layer.pred_bytes
                                                 + layer.neuron_bytes * len(layer.freq) for layer in costs.layers)
    gained = False
    for budget in np.linspace(placement.minimum_budget(costs), total + costs.head_bytes, 40).astype(int):
        plan = solve(costs, machine, int(budget))
        assert plan.device_bytes <= budget
        assert costs.dequantized_bytes <= plan.gemm_scratch <= costs.dequantized_most
        weights = plan.device_bytes - plan.gemm_scratch - (costs.reserve_bytes - costs.dequantized_bytes)
        assert plan.gemm_scratch == costs.dequantized_most or plan.device_bytes == budget  # the leftover is its
        if budget >= placement.minimum_budget(full):  # which left the weights less
            counted = solve(full, machine, int(budget))
            assert plan.token_us <= counted.token_us * (1 + 1e-9)
            gained |= weights > counted.device_bytes - full.reserve_bytes
    assert gained
    assert solve(costs, machine, 0).gemm_scratch == 0
    tight = solve(costs, machine, placement.minimum_budget(costs) + (1 << 20))  # 1 MiB beyond the head: scratch
    assert tight.gemm_scratch == costs.dequantized_bytes + (1 << 20)
    assert placement.plan_reserve(tight, costs) == costs.reserve_bytes + (1 << 20)  # what describe and the hint say
    assert f"of it {placement.format_bytes(tight.gemm_scratch)} for the prompt GEMM's" in placement.describe(
        tight, costs, machine)


@pytest.mark.parametrize("type_name_", ["f16", "q4_0"])
def test_a_mixtures_reserve_counts_its_attentions_dequantized_rows(tmp_path, monkeypatch, type_name_):
    """A mixture's attention GEMMs dequantize non-F16 rows for cuBLAS as a dense model's do (its experts' kernels
    read the blocks as they are), and its reserve had left their scratch out."""
    from pyinfer.converters import synthetic
    from pyinfer.engine import placement
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "m.gguf")
    synthetic.make_moe(path, "tiny-moe", synthetic.Q[type_name_.upper()], n_layer=1, share_weights=True)
    seen = []
    real = placement.reserve_bytes
    monkeypatch.setattr(placement, "reserve_bytes", lambda *args: seen.append(args[4]) or real(*args))
    costs = placement.model_costs(GGUFFile(path), 64, 2, True, 512)
    # tiny-moe (n_embd 256, 32 experts, 512 tokens): Q4_0's largest such matrix is the output head or the fused q, k
    # and v, 512 rows of 256; an F16 file's is its F32 router, 32 rows (the CUDA GEMM sizes a chunk for any weight
    # that is not F16, used or not)
    want = 2 * 256 * (512 if type_name_ == "q4_0" else 32)
    assert seen == [costs.dequantized_bytes] == [want]
    assert costs.dequantized_most == want  # below GEMM_CHUNK_MIN: least and most alike


@pytest.mark.parametrize("step_us", [0.0, 250.0])
def test_a_steps_own_cost_adds_to_every_plan_and_moves_nothing(step_us):
    """MachineProfile.step_us (the graph's launch and sync, the host's work between tokens) is the same for every
    placement: each plan's modelled time grows by it, the placement stays the one chosen without it."""
    costs = ModelCosts([LayerCosts(100, 10, 5, 30, np.linspace(1.0, 0.01, 256), True)] * 3, head_bytes=500,
                       reserve_bytes=50)
    base = MachineProfile("m", 1.0, 0.5, 20.0, 10.0, 5.0, 1.0, 1.0)
    for budget in (0, 400, 5000, 30000):
        want = solve(costs, base, budget)
        got = solve(costs, dataclasses.replace(base, step_us=step_us), budget)
        assert (got.attn_gpu, got.hot_rows, got.head_gpu) == (want.attn_gpu, want.hot_rows, want.head_gpu)
        assert got.token_us == pytest.approx(want.token_us + step_us)


def test_bench_hybrid_runs_ours_with_the_profile_it_modelled(tiny_sparse, tmp_path, monkeypatch):
    # a host too unsteady for the profile cache measured a new profile for every run of ours: one run planned
    # with a split layer's fixed cost at 0 and ran at 220 t/s beside a 269 t/s round (docs/BENCHMARKS.md)
    import pyinfer.apps.bench
    import tools.bench_hybrid as bench_hybrid
    from pyinfer.engine import machine

    measured = iter(MachineProfile(f"measurement {i}", 50.0, 40.0, 2000.0, 500.0, 20.0 - i, 22.0, 45.0)
                    for i in range(20))
    monkeypatch.setattr(machine, "resolve", lambda spec, weight_type, n_threads: next(measured))
    used = []

    def bench(path, pp, tg, reps, output, options):
        used.append(options["machine"])
        return json.dumps([{"test": "tg8", "median_ts": 1.0, "modelled_ts": 1.0, "device_bytes": 0,
                            "device_peak_bytes": 0, "driver_bytes": 0}])

    monkeypatch.setattr(pyinfer.apps.bench, "bench", bench)
    monkeypatch.setattr(bench_hybrid, "run_llama", lambda *args: {"tg": 1.0})
    out = tmp_path / "run.json"
    assert bench_hybrid.main(["--ours", tiny_sparse, "--dense", tiny_sparse, "--llama-bench", "unused", "--budgets",
                              "1000,2000", "--rounds", "2", "--pp", "0", "--tg", "8", "--json", str(out)]) == 0
    assert len(used) == 4 and all(m is used[0] for m in used)
    assert json.loads(out.read_text())["machine"]["name"] == used[0].name == "measurement 0"


def test_bench_hybrid_gives_both_sides_the_same_prompt_batch(tiny_sparse, tmp_path, monkeypatch):
    # a smaller batch shrinks the reserve, so both sides must have it: ours as -b, llama.cpp as -ub
    import subprocess

    import pyinfer.apps.bench
    import tools.bench_hybrid as bench_hybrid
    from pyinfer.engine import machine

    profile = MachineProfile("preset", 50.0, 40.0, 2000.0, 500.0, 20.0, 22.0, 45.0)
    monkeypatch.setattr(machine, "resolve", lambda spec, weight_type, n_threads: profile)
    batches, commands = [], []

    def bench(path, pp, tg, reps, output, options):
        batches.append(options["n_batch"])
        return json.dumps([{"test": "tg8", "median_ts": 1.0, "modelled_ts": 1.0, "device_bytes": 0,
                            "device_peak_bytes": 0, "driver_bytes": 0}])

    def run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps([{"n_prompt": 0, "n_gen": 8, "avg_ts": 2.0}]), "")

    monkeypatch.setattr(pyinfer.apps.bench, "bench", bench)
    monkeypatch.setattr(bench_hybrid.subprocess, "run", run)
    out = tmp_path / "run.json"
    assert bench_hybrid.main(["--ours", tiny_sparse, "--dense", tiny_sparse, "--llama-bench", "llama-bench",
                              "--budgets", "5000", "--rounds", "1", "--pp", "0", "--tg", "8", "-b", "128",
                              "--json", str(out)]) == 0
    assert batches == [128]
    assert commands and all(cmd[cmd.index("-ub") + 1] == "128" for cmd in commands)
    assert json.loads(out.read_text())["batch_size"] == 128


@pytest.mark.parametrize("driver, over", [(990, False), (1010, True)])
def test_bench_hybrid_marks_a_row_over_its_budget(driver, over):
    # the driver's count passed two budgets in a run where the allocator's peak did not (docs/BENCHMARKS.md)
    from tools.bench_hybrid import table

    ours = {"tg": 10.0, "pp": 100.0, "device_bytes": 900, "device_peak_bytes": 950, "driver_bytes": driver}
    row = {"fraction": 0.5, "budget": 1000, "ours": [ours], "llama": {"-ngl 1": [{"tg": 5.0, "pp": 50.0}]},
           "modelled_ts": 11.0, "bound_ts": 12.0}
    line = table([row], 2000, "model").splitlines()[-1]
    assert ("OVER" in line) == over and "2.00x" in line


def test_bench_hybrid_leaves_our_dequantized_rows_out_of_llamas_reserve(tmp_path, monkeypatch):
    import pyinfer.apps.bench
    import tools.bench_hybrid as bench_hybrid
    from pyinfer.converters import synthetic
    from pyinfer.engine import machine
    from pyinfer.engine.placement import model_costs
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "q4.gguf")
    synthetic.make_llama(path, "small", synthetic.Q.Q4_0, ffn_kind="reglu", n_layer=1, share_weights=True)

    monkeypatch.setattr(machine, "resolve", lambda spec, weight_type, n_threads: MachineProfile(
        "preset", 50.0, 40.0, 2000.0, 500.0, 20.0, 22.0, 45.0))
    monkeypatch.setattr(pyinfer.apps.bench, "bench", lambda *args: json.dumps(
        [{"test": "tg8", "median_ts": 1.0, "modelled_ts": 1.0, "device_bytes": 0, "device_peak_bytes": 0,
          "driver_bytes": 0}]))
    reserves = []
    monkeypatch.setattr(bench_hybrid, "llama_configs",
                        lambda dense, budget, reserve: reserves.append(reserve) or [("-ngl 0", ["-ngl", "0"])])
    monkeypatch.setattr(bench_hybrid, "run_llama", lambda *args: {"tg": 1.0})
    out = str(tmp_path / "r.json")
    assert bench_hybrid.main(["--ours", path, "--dense", path, "--llama-bench", "unused", "--budgets", "5000",
                              "--rounds", "1", "--pp", "64", "--tg", "8", "--json", out]) == 0
    costs = model_costs(GGUFFile(path), 64 + 8 + 16, 2, True, 512)
    assert costs.dequantized_bytes > 0  # Q4_0 weights: our GEMM dequantizes them
    assert reserves == [costs.reserve_bytes - costs.dequantized_bytes]


def test_bench_hybrid_counts_the_head_in_llama_cpps_ngl(tmp_path):
    # llama.cpp's -ngl N puts the output head and the last N - 1 layers on the GPU (the head counts as the layer
    # after the last): counting N layers had given it a head larger than a layer (Qwen3.5's) beyond the budget,
    # and a smaller one less than the budget allows
    import tools.bench_hybrid as bench_hybrid
    from pyinfer.converters import synthetic
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "dense.gguf")
    synthetic.make_llama(path, "small", synthetic.Q.Q4_0, n_layer=2, dense=True, share_weights=True)
    g = GGUFFile(path)
    nbytes = {n: t.data.nbytes for n, t in g.tensors.items()}
    layer = [sum(v for n, v in nbytes.items() if n.startswith(f"blk.{il}.")) for il in range(2)]
    head = sum(v for n, v in nbytes.items() if n.startswith("output"))
    assert "output.weight" in nbytes and head < layer[0]
    assert dict(bench_hybrid.llama_configs(g, head - 1, 0)) == {"-ngl 0": ["-ngl", "0"]}
    assert dict(bench_hybrid.llama_configs(g, head + layer[1], 0))["-ngl 2"] == ["-ngl", "2"]
    both = dict(bench_hybrid.llama_configs(g, layer[0] + layer[1], 0))  # not with the head as well
    assert both["-ngl 2"] == ["-ngl", "2"]
    assert both["-ngl 3, the head on the CPU"] == ["-ngl", "3", "-ot", "output\\.weight=CPU"]
    assert bench_hybrid.llama_configs(g, head + sum(layer), 0) == [("-ngl 3", ["-ngl", "3"])]


def test_bench_hybrid_gives_llama_cpp_a_mixtures_experts_by_layer(tmp_path):
    # a mixture's llama.cpp configurations had counted its router (ffn_gate_inp) as FFN weight and kept the
    # experts on the CPU by -ot patterns that match no expert tensor
    import tools.bench_hybrid as bench_hybrid
    from pyinfer.converters import synthetic
    from pyinfer.formats.gguf_file import GGUFFile

    path = str(tmp_path / "moe.gguf")
    synthetic.make_moe(path, "tiny-moe", synthetic.Q.Q4_0)
    g = GGUFFile(path)
    nbytes = {n: t.data.nbytes for n, t in g.tensors.items()}
    experts = [sum(v for n, v in nbytes.items() if n.startswith(f"blk.{il}.") and "_exps" in n) for il in range(3)]
    total = sum(nbytes.values())
    budget = total - experts[0] - experts[1] // 2  # the experts of two layers have to leave the GPU
    configs = dict(bench_hybrid.llama_configs(g, budget, 0))
    assert configs["-ngl 99 -ncmoe 2"] == ["-ngl", "99", "-ncmoe", "2"]
    assert len(configs) == 2 and configs[next(iter(configs))][0] == "-ngl"
