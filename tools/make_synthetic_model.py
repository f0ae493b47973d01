"""SYNTHETIC PowerGGUF models for speed benchmarks: random weights of a real model's shape, and predictor
weights built so that neuron i of every layer fires with a chosen frequency f_i (pyinfer.converters.synthetic says how).

    python -m tools.make_synthetic_model llama-7b -o /tmp/syn7b.gguf --type q4_0
    python -m tools.make_synthetic_model --from smollm2.gguf -o /tmp/smollm2-syn.gguf --density 0.5
    python -m tools.make_synthetic_model qwen3-30b-a3b --layers 8 -o /tmp/moe.gguf   (a mixture of experts: one
        file as llama.cpp stores it, which both engines run)
    python -m tools.make_synthetic_model llama-13b --type q4_k_m --dense --layers 8 -o /tmp/q4km.gguf   (the
        K-quant mix llama-quantize writes for Q4_K_M)
"""
from __future__ import annotations

import argparse
import sys

from gguf import GGMLQuantizationType as Q

from pyinfer.converters.synthetic import (
    GEMMA4_SHAPES,
    MIXES,
    MOE_SHAPES,
    QWEN35_SHAPES,
    SHAPES,
    TYPES,
    make_gemma4,
    make_llama,
    make_moe,
    make_qwen35,
)
from pyinfer.sparsity.synthetic_predictors import add_predictors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make_synthetic_model", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", nargs="?", choices=sorted([*SHAPES, *MOE_SHAPES, *QWEN35_SHAPES, *GEMMA4_SHAPES]),
                   help="random model of this shape")
    p.add_argument("--from", dest="src", help="add synthetic predictors to this PowerGGUF instead")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--type", default="q4_0", choices=sorted([*TYPES, *MIXES]),
                   help="weight type of a random model, or a mix as llama-quantize writes one (q4_k_m: Q4_K, Q6_K "
                        "for the output head and half of the layers' attn_v and ffn_down; llama shapes)")
    p.add_argument("--expert-type", choices=sorted(TYPES), help="a mixture's experts' type (default --type)")
    p.add_argument("--ffn-kind", default="swiglu", choices=("swiglu", "reglu", "drelu"))
    p.add_argument("--density", type=float, default=0.10, help="mean firing frequency")
    p.add_argument("--hot-frac", type=float, default=0.17)
    p.add_argument("--hot-share", type=float, default=0.80)
    p.add_argument("--rank", type=int, default=None, help="predictor rank (256 random, 64 --from)")
    p.add_argument("--threshold", type=float, default=0.0, help="|h| threshold of --from (threshold kind)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--dense", action="store_true", help="plain llama.cpp GGUF (ffn_down, no predictors)")
    p.add_argument("--no-predictors", action="store_true",
                   help="a PowerGGUF without predictors (for pyinfer sparsify --method input)")
    p.add_argument("--share-weights", action="store_true",
                   help="every layer reuses layer 0's random values (fast to make; for speed benchmarks)")
    p.add_argument("--router-skew", type=float, default=0.0,
                   help="a mixture of experts: log-normal spread of the router rows' scales (0: even routing; 0.2: "
                        "the top 20 %% of experts take ~35 %% of the routings)")
    a = p.parse_args(argv)
    if (a.shape is None) == (a.src is None):
        p.error("give a shape or --from FILE")
    if a.type in MIXES and a.shape not in SHAPES:
        p.error(f"--type {a.type} makes llama shapes only ({', '.join(sorted(SHAPES))})")
    common = dict(seed=a.seed, density=a.density, hot_frac=a.hot_frac, hot_share=a.hot_share)
    if a.shape in MOE_SHAPES:
        make_moe(a.output, a.shape, TYPES[a.type], seed=a.seed, n_layer=a.layers, share_weights=a.share_weights,
                 router_skew=a.router_skew, expert_type=TYPES[a.expert_type] if a.expert_type else None)
    elif a.shape in QWEN35_SHAPES:
        make_qwen35(a.output, a.shape, TYPES[a.type], seed=a.seed, n_layer=a.layers, share_weights=a.share_weights)
    elif a.shape in GEMMA4_SHAPES:
        make_gemma4(a.output, a.shape, TYPES[a.type], seed=a.seed, n_layer=a.layers, share_weights=a.share_weights)
    elif a.src:
        add_predictors(a.src, a.output, rank=a.rank or 64, threshold=a.threshold, **common)
    else:
        make_llama(a.output, a.shape, TYPES.get(a.type, Q.Q4_K), rank=a.rank or 256, ffn_kind=a.ffn_kind,
                   n_layer=a.layers, mix=a.type if a.type in MIXES else None,
                   dense=a.dense, share_weights=a.share_weights, predictors=not a.no_predictors, **common)
    print(f"wrote {a.output} (SYNTHETIC)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
