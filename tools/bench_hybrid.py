"""The hybrid benchmark: our engine under VRAM budgets against llama.cpp's best configuration for the same
budget, on the same shapes, in alternating rounds (docs/BENCHMARKS.md, "Hybrid executor").

    python -m tools.bench_hybrid --ours MODEL.gguf --dense DENSE.gguf --llama-bench BIN \\
        --budgets 0.333,0.667,0.9 [-t 16] [-b 512] [--tg 32] [--pp 512] [--rounds 2] [--machine NAME|FILE] \\
        [--json OUT.json]

A budget is a fraction of the model's bytes as llama.cpp loads them (the dense GGUF's tensors; our file holds
more: predictors, or the unread row-major gate and up beside input sparsity's channel-major copies). llama.cpp
gets the same bytes two ways and the faster one counts: -ngl N (the most whole layers that fit) and -ngl 99 with
the FFN weights of the first K layers kept on the CPU (-ot, the fewest K that fits; a mixture's experts by
-ncmoe K). Both sides keep the same
reserve for buffers, sized for the same prompt batch (-b: ours its batch, llama.cpp its -ub), less for llama.cpp
the quantized rows our GEMM dequantizes (its kernels read them as they are). Every row: t/s of each side (median
over rounds, with the range), the ratio, our plan's modelled t/s, the bytes bound at the measured bandwidths,
our device bytes (the allocator's now and peak, the driver's at the end) against the budget, and how the CPU and
GPU shared a token. Every run of ours places the model with one machine profile, the one the modelled column
used (a host too unsteady for the profile cache would otherwise measure a new one per run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import numpy as np

from pyinfer.console import run_cli
from pyinfer.engine.placement import EXPERT_MATRICES, ffn_weight_type, format_bytes
from pyinfer.engine.threads import default_threads
from pyinfer.formats.gguf_file import GGUFFile


def llama_configs(dense: GGUFFile, budget: int, reserve: int) -> list[tuple[str, list[str]]]:
    """(label, llama-bench flags) of the ways llama.cpp can use `budget` bytes of GPU memory: -ngl N, which counts
    the output head as the layer after the last (N puts the head and the last N - 1 layers on the GPU: a head larger
    than a layer, as Qwen3.5's 248k x 4096, had been given to llama.cpp beyond the budget); the most whole layers
    with the head on the CPU (-ot), where that differs; all but the FFN of the first K layers (a mixture's experts:
    -ncmoe K)."""
    n_layer = dense.config.n_layer

    def size(prefix: str, parts=None) -> int:
        return sum(t.data.nbytes for n, t in dense.tensors.items()
                   if n.startswith(prefix) and (parts is None or any(p in n for p in parts)))

    room = budget - reserve
    moe = "blk.0.ffn_up_exps.weight" in dense.tensors  # llama.cpp keeps a mixture's experts on the CPU by -ncmoe
    layer = [size(f"blk.{il}.") for il in range(n_layer)]
    ffn = [size(f"blk.{il}.", EXPERT_MATRICES if moe else ("ffn_up", "ffn_gate", "ffn_down")) for il in range(n_layer)]
    # a tied head is token_embd duplicated onto the output's device
    untied = "output.weight" in dense.tensors
    head = size("output") + (0 if untied else size("token_embd"))

    def last_layers(n: int) -> int:  # bytes of the last n layers
        return sum(layer[n_layer - n:]) if n else 0

    ngl = 0  # the head and ngl - 1 layers
    while ngl <= n_layer and head + last_layers(ngl) <= room:
        ngl += 1
    configs = [(f"-ngl {ngl}", ["-ngl", str(ngl)])]
    whole = 0  # layers without the head
    while whole < n_layer and last_layers(whole + 1) <= room:
        whole += 1
    if untied and whole > max(ngl - 1, 0):
        configs.append((f"-ngl {whole + 1}, the head on the CPU",
                        ["-ngl", str(whole + 1), "-ot", "output\\.weight=CPU"]))
    cpu_ffn = 0
    while cpu_ffn <= n_layer and sum(layer) + head - sum(ffn[:cpu_ffn]) > room:
        cpu_ffn += 1
    if 0 < cpu_ffn <= n_layer and moe:
        configs.append((f"-ngl 99 -ncmoe {cpu_ffn}", ["-ngl", "99", "-ncmoe", str(cpu_ffn)]))
    elif 0 < cpu_ffn <= n_layer:
        pattern = "blk\\.(" + "|".join(str(il) for il in range(cpu_ffn)) + ")\\.ffn_(up|gate|down)\\.weight=CPU"
        configs.append((f"-ngl 99, FFN of {cpu_ffn} layers on the CPU", ["-ngl", "99", "-ot", pattern]))
    return configs


def run_llama(bin_path: str, model: str, flags: list[str], threads: int, n_batch: int, pp: int, tg: int,
              reps: int) -> dict:
    """{'pp': t/s, 'tg': t/s} from llama-bench's JSON (each the mean of reps)."""
    cmd = [bin_path, "-m", model, "-p", str(pp), "-n", str(tg), "-r", str(reps), "-t", str(threads),
           "-ub", str(n_batch), "-o", "json", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    rows = json.loads(res.stdout[res.stdout.index("["):])
    out = {}
    for r in rows:
        kind = "pp" if r["n_prompt"] and not r["n_gen"] else "tg"
        out[kind] = float(r["avg_ts"])
    return out


def run_ours(model_path: str, budget: int, machine, threads: int, n_batch: int, pp: int, tg: int, reps: int) -> dict:
    from pyinfer.apps.bench import bench

    rows = json.loads(bench(model_path, [pp] if pp else [], [tg], reps, "json",
                            {"n_threads": threads, "n_batch": n_batch, "vram_budget": budget, "machine": machine}))
    out = {}
    for r in rows:
        out[r["test"][:2]] = r["median_ts"]
        if r["test"].startswith("tg"):
            out.update({k: r[k] for k in r if k.startswith("step_")})
            out.update({k: r[k] for k in ("device_bytes", "device_peak_bytes", "driver_bytes")},
                       modelled=r["modelled_ts"])
    return out


def bytes_bound(costs, plan, machine) -> float:
    """Tokens per second of the plan if every byte a token reads moved at the measured bandwidths, with no
    fixed costs."""
    from pyinfer.engine.placement import evaluate

    free = dataclasses.replace(machine, xfer_us=0.0, gpu_layer_us=0.0, cpu_layer_us=0.0, step_us=0.0)
    groups = [sum(1 for _, e in la.groups() if e <= k) for la, k in zip(costs.layers, plan.hot_rows, strict=True)]
    return evaluate(costs, free, plan.attn_gpu, groups, plan.head_gpu, plan.budget).tokens_per_second


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", required=True, help="our PowerGGUF (with predictors, or of input sparsity)")
    p.add_argument("--dense", required=True, help="the plain GGUF of the same shape that llama.cpp runs")
    p.add_argument("--llama-bench", required=True, help="path of llama-bench")
    p.add_argument("--budgets", default="0.333,0.667,0.9", help="fractions of the model's bytes")
    p.add_argument("-t", "--threads", type=int, default=default_threads())
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prompt tokens per batch, both sides (default 512): a smaller one leaves more of a tight "
                        "budget to weights, and prompts pay for it")
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--label", default="", help="what the model is (e.g. 'SYNTHETIC 13B, 8 of 40 layers')")
    p.add_argument("--machine", default=None, metavar="NAME|FILE",
                   help="the placement's figures: a preset or a profile file (default: this machine's, measured once)")
    p.add_argument("--json", default=None, help="write every measurement here")
    return p


def measure_all(a: argparse.Namespace) -> int:
    from pyinfer.engine.machine import resolve
    from pyinfer.engine.placement import model_costs, solve

    ours, dense = GGUFFile(a.ours), GGUFFile(a.dense)
    total = sum(t.data.nbytes for t in dense.tensors.values())
    machine = resolve(a.machine, ffn_weight_type(ours), a.threads)
    costs = model_costs(ours, a.pp + a.tg + 16, 2, True, a.batch_size)
    results = []
    for fraction in (float(f) for f in a.budgets.split(",")):
        budget = int(fraction * total)
        plan = solve(costs, machine, budget)
        # llama.cpp's quantized matmul kernels read the weights as they are: our GEMM's dequantized rows are ours
        configs = llama_configs(dense, budget, costs.reserve_bytes - costs.dequantized_bytes)
        row = {"fraction": fraction, "budget": budget, "ours": [], "llama": {label: [] for label, _ in configs},
               "modelled_ts": plan.tokens_per_second, "bound_ts": bytes_bound(costs, plan, machine),
               "plan": {"attn_gpu": sum(plan.attn_gpu), "hot_rows": sum(plan.hot_rows),
                        "n_ff_total": sum(la.n_ff for la in costs.layers)}}
        for _ in range(a.rounds):  # alternating: ours, then each llama.cpp configuration
            row["ours"].append(run_ours(a.ours, budget, machine, a.threads, a.batch_size, a.pp, a.tg, a.reps))
            for label, flags in configs:
                row["llama"][label].append(run_llama(a.llama_bench, a.dense, flags, a.threads, a.batch_size, a.pp,
                                                     a.tg, a.reps))
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if a.json:
        record = {"label": a.label, "machine": dataclasses.asdict(machine), "threads": a.threads,
                  "batch_size": a.batch_size, "total_bytes": total, "rows": results}
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    print(table(results, total, a.label))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("bench_hybrid", parser(), measure_all, argv)


def _median(values) -> float:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else float("nan")


def table(results: list[dict], total: int, label: str) -> str:
    lines = [f"{label}: {format_bytes(total)}",
             "| budget | ours tg t/s | llama.cpp best tg t/s (config) | ratio | modelled t/s | bytes bound t/s | "
             "device (peak; driver) / budget | CPU busy / GPU busy / overlap ms per token | ours pp t/s | "
             "llama.cpp pp t/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in results:
        ours_tg = [o.get("tg") for o in r["ours"]]
        best_label, best = max(((k, [x.get("tg") for x in v]) for k, v in r["llama"].items()),
                               key=lambda kv: _median(kv[1]) if kv[1] else -1)
        best_pp = max((_median([x.get("pp") for x in v]) for v in r["llama"].values()), default=float("nan"))
        o = r["ours"][-1]
        dev, peak, driver = (o.get(k) or 0 for k in ("device_bytes", "device_peak_bytes", "driver_bytes"))
        lines.append(
            f"| {r['fraction']:.2f} ({format_bytes(r['budget'])}) | {_median(ours_tg):.2f} ({_range(ours_tg)}) | "
            f"{_median(best):.2f} ({_range(best)}; {best_label}) | {_median(ours_tg) / _median(best):.2f}x | "
            f"{r['modelled_ts']:.1f} | {r['bound_ts']:.1f} | "
            f"{format_bytes(dev)} ({format_bytes(peak)}; {format_bytes(driver)}) / {format_bytes(r['budget'])}"
            f"{' OVER' if max(peak, driver) > r['budget'] else ''} | "
            f"{o.get('step_cpu_busy_ms', 0):.2f} / {o.get('step_gpu_busy_ms', 0):.2f} / "
            f"{o.get('step_overlap_ms', 0):.2f} | {_median([x.get('pp') for x in r['ours']]):.1f} | {best_pp:.1f} |")
    return "\n".join(lines)


def _range(values) -> str:
    values = [v for v in values if v is not None]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"


if __name__ == "__main__":
    sys.exit(main())
