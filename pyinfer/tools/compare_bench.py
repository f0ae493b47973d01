"""Side-by-side table of `pyinfer bench -o json` and `llama-bench -o json` results on the same files:
medians, our/llama.cpp ratio, and for generation the GB/s of weights streamed per token.

    python -m pyinfer.tools.compare_bench --ours a.json b.json --llamacpp c.json d.json [--bandwidth 3000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def _load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += json.load(f)
    return rows


def _test(row: dict) -> str:
    if "test" in row:
        return row["test"]
    return f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row['n_gen']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", nargs="+", required=True)
    p.add_argument("--llamacpp", nargs="+", required=True)
    p.add_argument("--bandwidth", type=float, default=0.0, help="measured copy bandwidth, GB/s (for the % column)")
    a = p.parse_args(argv)
    theirs = {(r["model_type"].split()[-1].lower(), _test(r)): r for r in _load(a.llamacpp)}
    print("| model | test | pyinfer t/s | llama.cpp t/s | ratio | pyinfer GB/s | % of copy bw |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in _load(a.ours):
        ftype = r["model"].split()[-1].lower()
        other = theirs.get((ftype, r["test"]))
        ours = r["median_ts"]
        ref = statistics.median(other["samples_ts"]) if other else float("nan")
        gbs = ours * r["size_gib"] * 2**30 / 1e9 if r["test"].startswith("tg") else float("nan")
        pct = f"{100 * gbs / a.bandwidth:.0f}%" if a.bandwidth and gbs == gbs else ""
        print(f"| {r['model']} | {r['test']} | {ours:.1f} | {ref:.1f} | {ours / ref:.2f} | "
              f"{'' if gbs != gbs else f'{gbs:.0f}'} | {pct} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
