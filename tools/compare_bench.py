"""Side-by-side table of `pyinfer bench -o json` and `llama-bench -o json` results on the same files:
medians, our/llama.cpp ratio, and for generation the GB/s of weights streamed per token.

    python -m tools.compare_bench --ours a.json b.json --llamacpp c.json d.json [--bandwidth 3000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from pyinfer.console import run_cli
from pyinfer.errors import InvalidArgumentError


def _load(paths: list[str], keys: tuple[str, ...]) -> list[dict]:
    """The rows of bench JSON files, each a list of objects with `keys`."""
    rows = []
    for p in paths:
        with open(p) as f:
            try:
                data = json.load(f)
            except ValueError as exc:
                raise InvalidArgumentError(f"{p}: not JSON ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in data):
            raise InvalidArgumentError(f"{p}: not a bench result (a JSON list of rows with {', '.join(keys)})")
        rows += data
    return rows


def _test(row: dict) -> str:
    if "test" in row:
        return row["test"]
    return f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row['n_gen']}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compare_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", nargs="+", required=True, help="pyinfer bench -o json outputs")
    p.add_argument("--llamacpp", nargs="+", required=True, help="llama-bench -o json outputs")
    p.add_argument("--bandwidth", type=float, default=0.0, help="measured copy bandwidth, GB/s (for the %% column)")
    return p


def compare(a: argparse.Namespace) -> int:
    theirs = {(r["model_type"].split()[-1].lower(), _test(r)): r
              for r in _load(a.llamacpp, ("model_type", "samples_ts", "n_gen"))}
    print("| model | test | pyinfer t/s | llama.cpp t/s | ratio | pyinfer GB/s | % of copy bw |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in _load(a.ours, ("model", "test", "median_ts", "size_gib")):
        ftype = r["model"].split()[-1].lower()
        other = theirs.get((ftype, r["test"]))
        ours = r["median_ts"]
        ref = statistics.median(other["samples_ts"]) if other else float("nan")
        gbs = ours * r["size_gib"] * 2**30 / 1e9 if r["test"].startswith("tg") else float("nan")
        pct = f"{100 * gbs / a.bandwidth:.0f}%" if a.bandwidth and gbs == gbs else ""
        print(f"| {r['model']} | {r['test']} | {ours:.1f} | {ref:.1f} | {ours / ref:.2f} | "
              f"{'' if gbs != gbs else f'{gbs:.0f}'} | {pct} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("compare_bench", parser(), compare, argv)


if __name__ == "__main__":
    sys.exit(main())
