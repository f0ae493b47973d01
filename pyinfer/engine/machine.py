"""What this machine does per second, for the placement solver (pyinfer.engine.placement.MachineProfile): dense and
sparse weight reads on the CPU and on the GPU for one weight type, and what a decode layer costs beyond its
bytes on the GPU, split between the two, and on the CPU (timed on small synthetic models). Measured once per
machine, weight type and thread count (a few seconds) and cached in
<cache>/machines/; named presets (machine_presets.json, measured on other machines) let `pyinfer plan`
plan for a machine it does not run on.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pyinfer.engine.placement import MachineProfile, parse_bytes
from pyinfer.errors import InvalidArgumentError, UnsupportedError

PRESETS_FILE = Path(__file__).with_name("machine_presets.json")
WORKING_SET = 256 << 20  # weight bytes read per GPU measurement, and per CPU one at least
CACHE_MULTIPLE = 4  # a CPU measurement reads this many times the last-level cache: a plan's weights do not fit
MAX_CPU_WORKING_SET = 2 << 30  # host memory a measurement may take; above a 512 MiB cache the multiple shrinks
DISTINCT_BYTES = 16 << 20  # quantized bytes of neurons drawn at random (as float32 up to 7x that); the rest repeats
SPARSE_DENSITY = 0.10  # share of neurons a sparse measurement selects, scattered at random (cold neurons)
SPARSE_MASKS = 8  # masks per sparse measurement, disjoint (SPARSE_MASKS x SPARSE_DENSITY <= 1)
ROUNDS = 3  # alternating rounds of the dense and sparse CPU measurements
DECODE_ROUNDS = 5  # rounds of the fixed costs' decodes, each round through every model and placement in turn
UNSTEADY = 1.25  # slowest / fastest round above which the figures are not cached
BUSY_LOAD = 0.25  # load average per core above which the host is too busy to be measured for the cache
LAYER_SHAPE = "small"  # synthetic.SHAPES: a real layer's ops (d 1024, n_ff 4096, 16 heads) over a few MB
FEW_LAYERS, MANY_LAYERS = 2, 6  # the fixed costs of a layer: decode time of MANY less FEW, per layer added
DECODE_STEPS = 32  # tokens timed per round
PLACEMENTS = {"gpu": (True, 1.0), "split": (True, 0.5), "cpu": (False, 0.0)}  # attention on the GPU, FFN share


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "cpu"
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else platform.processor() or "cpu"


CPUS = Path("/sys/devices/system/cpu")


def last_level_cache(root: Path = CPUS, cpus=None) -> int:
    """Bytes of the last-level cache the CPUs this process may run on share among them (sysfs), 0 if unknown:
    every instance of the highest level counted once (an EPYC has one L3 per core complex; the H100 host one of
    300 MiB)."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    instances: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it) -> bytes
    for cpu in cpus:
        for index in (root / f"cpu{cpu}" / "cache").glob("index*"):
            try:
                if (index / "type").read_text().strip() == "Instruction":
                    continue
                key = (int((index / "level").read_text()), (index / "shared_cpu_list").read_text().strip())
                instances[key] = parse_bytes((index / "size").read_text())  # sysfs writes "32768K": binary units
            except (OSError, ValueError, InvalidArgumentError):
                continue
    if not instances:
        return 0
    top = max(level for level, _ in instances)
    return sum(size for (level, _), size in instances.items() if level == top)


def cpu_working_set() -> int:
    """Weight bytes a CPU bandwidth measurement reads: well beyond the last-level cache, or the figure is the
    cache's (the H100 host's 300 MiB L3 held the 256 MiB a measurement read over and over: 1.5-2x DRAM's rate)."""
    return max(WORKING_SET, min(CACHE_MULTIPLE * last_level_cache(), MAX_CPU_WORKING_SET))


def host_key(type_name: str, n_threads: int) -> str:
    """Names this machine (CPU, cores, GPU), the weight type and the thread count, as a file name."""
    from pyinfer.native import ggml

    gpu = ggml.cuda_device_name() if ggml.cuda_available() else "no GPU"
    raw = f"{cpu_name()} {os.cpu_count()}c {gpu} {type_name} {n_threads}t"
    return re.sub(r"[^A-Za-z0-9.]+", "-", raw).strip("-").lower()


def presets() -> dict[str, dict]:
    return json.loads(PRESETS_FILE.read_text())


def preset(name: str, type_name: str) -> MachineProfile:
    """A named machine's profile for a weight type (falling back to the preset's f16 figures)."""
    table = presets()
    if name not in table:
        raise InvalidArgumentError(f"unknown machine {name!r}; known: {', '.join(sorted(table))} (or a profile file)")
    by_type = table[name]["types"]
    figures = by_type.get(type_name) or by_type["f16"]
    return MachineProfile(name=f"{name} ({table[name]['description']})", **figures)


def load(path: str | os.PathLike[str]) -> MachineProfile:
    try:
        data = json.loads(Path(path).read_text())
        return MachineProfile(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"{path}: not a machine profile ({exc})") from None


def save(profile: MachineProfile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")
    os.replace(tmp, path)


PROFILE_VERSION = 3  # 2: fixed costs from real decode steps; 3: CPU rates beyond the last-level cache.
# Profiles of another version are measured again


def cache_path(type_name: str, n_threads: int) -> Path:
    from pyinfer.hub.pull import cache_dir

    return cache_dir() / "machines" / f"{host_key(type_name, n_threads)}.v{PROFILE_VERSION}.json"


def _busy() -> str | None:
    """Why the host is too busy to measure it now (a build, another benchmark), or None."""
    try:
        load_1min = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    return f"load average {load_1min:.1f} on {cores} cores" if load_1min > BUSY_LOAD * cores else None


def profile_for(weight_type: int, n_threads: int) -> MachineProfile:
    """This machine's profile for a weight type: from the cache, else measured now and cached, unless the host
    was busy or the timing rounds disagreed: such figures serve this run only (a warning says so), since a
    cached profile decides every later placement on this machine."""
    from pyinfer.native import ggml

    name = ggml.type_name(weight_type)
    path = cache_path(name, n_threads)
    if path.is_file():
        return load(path)
    busy = _busy()
    print(f"pyinfer: measuring this machine for the placement ({name}, {n_threads} threads; once, some seconds)",
          file=sys.stderr)
    profile, spread = measure(weight_type, n_threads)
    why = busy or (f"its timing rounds differed by {100 * (spread - 1):.0f} %" if spread > UNSTEADY else None)
    if why:
        print(f"pyinfer: machine figures measured while the host was unsteady ({why}): used for this run, "
              "not cached", file=sys.stderr)
    else:
        save(profile, path)
    return profile


FIGURES = ("cpu_dense_gbps", "cpu_sparse_gbps", "gpu_dense_gbps", "gpu_sparse_gbps", "xfer_us", "gpu_layer_us",
           "cpu_layer_us", "step_us")


def resolve(spec: str | None, weight_type: int, n_threads: int, overrides: dict | None = None) -> MachineProfile:
    """The profile the placement uses: spec a profile file or a preset name, else this machine's (measured
    once, cached); figures in overrides (MachineProfile field -> value) replace the profile's. Without a GPU
    and without a spec the four bandwidths must all be given."""
    from pyinfer.native import ggml

    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    type_name = ggml.type_name(weight_type)
    if spec is not None:
        base = load(spec) if os.path.isfile(spec) else preset(spec, type_name)
    elif ggml.cuda_available():
        base = profile_for(weight_type, n_threads)
    else:
        missing = [f for f in FIGURES[:4] if f not in overrides]
        if missing:
            flags = ", ".join(f"--{figure_flag(f)}" for f in missing)
            raise InvalidArgumentError("no GPU here to measure: name a target with --machine NAME|FILE (known: "
                                       f"{', '.join(sorted(presets()))}) or give {flags}")
        base = MachineProfile("given figures", *(overrides.get(f, 0.0) for f in FIGURES))
    return dataclasses.replace(base, **overrides) if overrides else base


def figure_flag(figure: str) -> str:
    """The command-line flag of a MachineProfile figure: cpu_dense_gbps -> cpu-dense-bw."""
    return figure.replace("_gbps", "-bw").replace("_", "-")


# ---------------------------------------------------------------------------------------------------
# measuring


def _random_weight(ctx, type_: int, rows: int, k: int, rng):
    return ctx.tensor_from_numpy(rng.standard_normal((rows, k), dtype=np.float32) * 0.02, type_)


def _bundle(ctx, type_: int, n: int, k: int, rng):
    """n neurons' gate, up and down_t rows side by side, every gate row positive: with x >= 0 each selected
    neuron fires and all three of its rows are read, as a predicted neuron's are. At most DISTINCT_BYTES of
    neurons are drawn and repeated (quantizing gigabytes of random floats would take longer than the timing)."""
    from pyinfer.native import ggml

    if n <= 0:
        raise InvalidArgumentError(f"a bundle needs neurons, not {n}")
    distinct = min(n, max(1, DISTINCT_BYTES // (3 * ggml.row_size(type_, k))))
    w = rng.standard_normal((distinct, 3, k), dtype=np.float32) * 0.02
    w[:, 0] = np.abs(w[:, 0])
    drawn = ggml.Context(3 * distinct * ggml.row_size(type_, k) + (1 << 20))
    pattern = drawn.tensor_from_numpy(w.reshape(3 * distinct, k), type_).raw()
    bundle = ctx.new_tensor(type_, (3 * n, k))
    dst = bundle.raw()
    for offset in range(0, dst.nbytes, pattern.nbytes):
        end = min(dst.nbytes, offset + pattern.nbytes)
        dst[offset:end] = pattern[:end - offset]
    return bundle


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e6)


def _cpu_figures(type_: int, n_threads: int, rng, working_set: int) -> tuple[float, float, float]:
    """(dense GB/s, sparse GB/s, slowest / fastest round) on the CPU over working_set bytes of weights. Dense and
    sparse reads of the same bytes are timed in alternating rounds, medians kept: the shared host's speed drifts."""
    from pyinfer.native import ggml

    pool = ggml.ThreadPool(n_threads)
    k = 4096
    row = ggml.row_size(type_, k)
    n = max(64, working_set // (3 * row))
    ctx = ggml.Context(3 * n * row + (64 << 20))
    w = _bundle(ctx, type_, n, k, rng)  # (3 n, k): as a matrix for the dense reads
    x = ctx.tensor_from_numpy(np.abs(rng.standard_normal(k)).astype(np.float32))
    dense = ggml.Graph(ctx, [ctx.mul_mat(w, x)]).plan()
    # a scattered tenth of the neurons selected by each of several masks, no neuron by two (a mask would read
    # the rows the one before it left in the cache): together they read more than any cache holds
    owner = np.full(n, -1)
    per_mask = max(1, int(n * SPARSE_DENSITY))
    owner[rng.permutation(n)[:SPARSE_MASKS * per_mask]] = np.repeat(np.arange(SPARSE_MASKS), per_mask)[:n]
    picks = [owner == i for i in range(SPARSE_MASKS)]
    masks = [ctx.tensor_from_numpy(np.where(p, 1.0, -1.0).astype(np.float32)) for p in picks]
    sparse = ggml.Graph(ctx, [ctx.sparse_ffn(w, x, m, "reglu") for m in masks]).plan()
    dense_ms, sparse_ms = [], []
    for _ in range(ROUNDS):
        dense_ms.append(dense.median_ms(pool, 5))
        sparse_ms.append(sparse.median_ms(pool, 5))
    spread = max(max(dense_ms) / min(dense_ms), max(sparse_ms) / min(sparse_ms))
    return (_gbps(w.nbytes, float(np.median(dense_ms))),
            _gbps(sum(int(p.sum()) for p in picks) * 3 * row, float(np.median(sparse_ms))), spread)


def hot_halves(ctx, type_: int, x, rows: int, n: int, rng) -> tuple[list, int]:
    """n split layers' hot halves (rows neurons each) as sparse_ffn.rows_ffn builds them, one fused group each on
    CUDA: the rows of gate and up a scattered SPARSE_DENSITY of neurons select, the activation, the same rows of
    down_t. Each matrix is a tensor of its own, as a model's weights are (views of one would put view nodes
    between the group's ops, which then run unfused), and silu keeps every selected row (relu would drop those
    whose gate is negative from up and down). -> (outputs, neurons selected)."""
    outs, picked = [], 0
    k = x.shape[-1]
    for _ in range(n):
        gate_w, up_w, down_w = (_random_weight(ctx, type_, rows, k, rng).to_device() for _ in range(3))
        sel = rng.random(rows) < SPARSE_DENSITY
        picked += int(sel.sum())
        mask = ctx.tensor_from_numpy(np.where(sel, 1.0, -1.0).astype(np.float32)).to_device()
        gate = ctx.mul_mat_rows(gate_w, x, mask)
        up = ctx.mul_mat_rows(up_w, x, mask)
        outs.append(ctx.axpy_rows(down_w, ctx.mul(ctx.silu(gate), up), mask))
    return outs, picked


def _gpu_figures(type_: int, rng) -> tuple[float, float]:
    """(dense GB/s, sparse GB/s) on the GPU."""
    from pyinfer.native import ggml

    pool = ggml.ThreadPool(1)
    k = 4096
    row = ggml.row_size(type_, k)
    slices = 8  # GEMVs over different slices of one weight in one graph: nothing is read from a cache
    per = max(3, WORKING_SET // row // (3 * slices) * 3)
    third = slices * per // 6
    ctx = ggml.Context((slices * per + 6 * third) * row + (64 << 20))
    w = _random_weight(ctx, type_, slices * per, k, rng).to_device()
    x = ctx.tensor_from_numpy(rng.standard_normal(k).astype(np.float32)).to_device()

    def rows(r0: int, n: int):  # rows [r0, r0 + n) of the weight
        return ctx.view(w, (n, k), (row, 1), offset=r0 * row)

    dense = [ctx.mul_mat(rows(i * per, per), x) for i in range(slices)]
    dense_ms = ggml.Graph(ctx, dense).plan().median_ms(pool, 15)
    # each matrix as large as a big model's (tens of MB), or the fixed costs of the launches would dominate
    outs, picked = hot_halves(ctx, type_, x, third, 2, rng)
    sparse_ms = ggml.Graph(ctx, outs).plan().median_ms(pool, 15)
    return _gbps(w.nbytes, dense_ms), _gbps(picked * 3 * row, sparse_ms)


def _decoder(path: str, plan, n_threads: int, pool=None):
    """The model at path under plan, warmed up: its graphs built, captured and replayed. pool: a thread pool it
    shares with other models timed in turn (their idle workers would poll beside it)."""
    from pyinfer.engine.driver import Model

    # precise matmuls are for small models (driver.PRECISE_MAX_BYTES); the models a placement serves are large
    model = Model(path, n_ctx=2 * DECODE_STEPS, plan=plan, n_threads=n_threads, precise=False)
    if pool is not None:
        model.pool = pool
    for tok in range(DECODE_STEPS // 4):
        model.eval([tok])
    return model


def _round_ms(model) -> float:
    """Milliseconds per token of DECODE_STEPS decode steps after the warm-up's tokens and two untimed ones (the
    model timed before this one left its weights in the caches)."""
    model.truncate(DECODE_STEPS // 4)
    model.eval([0])
    model.eval([1])
    t0 = time.perf_counter()
    for tok in range(DECODE_STEPS):
        model.eval([tok])
    return 1e3 * (time.perf_counter() - t0) / DECODE_STEPS


def _decode_ms(path: str, plan, n_threads: int) -> float:
    """Milliseconds per decoded token of the model at path under plan: the median of DECODE_ROUNDS rounds."""
    model = _decoder(path, plan, n_threads)
    return float(np.median([_round_ms(model) for _ in range(DECODE_ROUNDS)]))


def excess_costs(type_: int, n_threads: int, rates: MachineProfile,
                 modes=tuple(PLACEMENTS)) -> tuple[dict[str, float], dict[str, float]]:
    """Microseconds real decoding costs beyond its bytes, per placement mode (PLACEMENTS: every layer on the GPU;
    split, its attention and half its FFN neurons on the GPU; on the CPU): (per layer, per step). Synthetic
    models of FEW_LAYERS and MANY_LAYERS layers are decoded under each, less what the placement charges for their
    bytes at the measured rates (`rates`, whose fixed costs are 0); a layer's cost is the difference per layer
    added, a step's what is left at zero layers. What remains is launch gaps, small kernels, copies, waking the
    pool, barriers, waits and the host's work between steps."""
    from pyinfer.converters import synthetic
    from pyinfer.engine.placement import evaluate, model_costs
    from pyinfer.formats.gguf_file import GGUFFile
    from pyinfer.hub.pull import cache_dir
    from pyinfer.native import ggml

    decoders = {}  # (mode, n_layer) -> (warmed-up model, what its plan charges for its bytes in ms)
    pool = ggml.ThreadPool(n_threads)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:  # a few hundred MB: not in a small /tmp
        for n_layer in (FEW_LAYERS, MANY_LAYERS):
            path = os.path.join(tmp, f"{n_layer}.gguf")
            synthetic.make_llama(path, LAYER_SHAPE, synthetic.Q(type_), ffn_kind="reglu", n_layer=n_layer,
                                 share_weights=True)
            costs = model_costs(GGUFFile(path), 2 * DECODE_STEPS, 2, True, 1)
            n_groups = len(costs.layers[0].groups())
            for mode in modes:
                on_gpu, share = PLACEMENTS[mode]
                plan = evaluate(costs, rates, [on_gpu] * n_layer, [round(share * n_groups)] * n_layer, on_gpu,
                                1 << 62)
                decoders[mode, n_layer] = _decoder(path, plan, n_threads, pool), plan.token_us / 1e3
        # every round times each model in turn: a slow spell of the shared host costs one round of each, where
        # back-to-back rounds had given one placement all of it (a split layer's cost once read 131 us, once 0)
        rounds = {key: [] for key in decoders}
        try:
            for _ in range(DECODE_ROUNDS):
                for key in decoders:
                    rounds[key].append(_round_ms(decoders[key][0]))
            excess = {mode: [float(np.median(rounds[mode, n])) - decoders[mode, n][1]
                             for n in (FEW_LAYERS, MANY_LAYERS)] for mode in modes}  # ms per token beyond the bytes
        finally:
            decoders.clear()  # the models' mappings go before their files do
    per_layer = {mode: 1e3 * (ms[1] - ms[0]) / (MANY_LAYERS - FEW_LAYERS) for mode, ms in excess.items()}
    per_step = {mode: 1e3 * ms[0] - FEW_LAYERS * per_layer[mode] for mode, ms in excess.items()}
    return per_layer, per_step


def _fixed_costs(type_: int, n_threads: int, rates: MachineProfile) -> dict[str, float]:
    """MachineProfile's fixed costs from real decode steps (excess_costs). Guessed from a chain of tiny kernels
    and one of split links, they had come out at a third to a half of this (docs/BENCHMARKS.md)."""
    per_layer, per_step = excess_costs(type_, n_threads, rates)
    gpu_layer_us = max(0.0, per_layer["gpu"])
    return {"gpu_layer_us": gpu_layer_us, "xfer_us": max(0.0, per_layer["split"] - gpu_layer_us),
            "cpu_layer_us": max(0.0, per_layer["cpu"]), "step_us": max(0.0, per_step["gpu"])}


def measure(weight_type: int, n_threads: int) -> tuple[MachineProfile, float]:
    """This machine's figures for weight_type with n_threads CPU threads (a few seconds), and how much the
    CPU's timing rounds disagreed (slowest / fastest)."""
    from pyinfer.native import ggml

    if not ggml.cuda_available():
        raise UnsupportedError("no GPU here: plan for another machine with --machine NAME|FILE or the bandwidth flags")
    if weight_type not in ggml.WEIGHT_TYPES:
        raise UnsupportedError(f"cannot measure weights of type {ggml.type_name(weight_type)}")
    rng = np.random.default_rng(0)
    working_set = cpu_working_set()
    cpu_dense, cpu_sparse, spread = _cpu_figures(weight_type, n_threads, rng, working_set)
    gpu_dense, gpu_sparse = _gpu_figures(weight_type, rng)
    rates = MachineProfile(name=host_key(ggml.type_name(weight_type), n_threads), cpu_dense_gbps=cpu_dense,
                           cpu_sparse_gbps=cpu_sparse, gpu_dense_gbps=gpu_dense, gpu_sparse_gbps=gpu_sparse,
                           xfer_us=0.0, gpu_layer_us=0.0, cpu_layer_us=0.0)
    # the small models that time the fixed costs (tens to ~200 MB) may sit in a large cache: their bytes are
    # subtracted at the rate of a WORKING_SET read, near their size, not at the rate of the plan's weights
    small = rates
    if working_set > WORKING_SET:
        small_dense, small_sparse, _ = _cpu_figures(weight_type, n_threads, rng, WORKING_SET)
        small = dataclasses.replace(rates, cpu_dense_gbps=small_dense, cpu_sparse_gbps=small_sparse)
    profile = dataclasses.replace(rates, **_fixed_costs(weight_type, n_threads, small))
    if not all(math.isfinite(v) for v in dataclasses.astuple(profile)[1:]):
        raise UnsupportedError(f"machine measurement gave non-finite figures: {profile}")
    return profile, spread
