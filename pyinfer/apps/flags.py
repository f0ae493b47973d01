"""The model and sampling flags that `pyinfer run|chat|serve|bench` and `pyinfer perplexity` share, with
llama.cpp's names, and what they become: Model() keyword arguments, sampler parameters, a loaded model."""

from __future__ import annotations

import argparse

from pyinfer.errors import PyInferError

AUTO_MARGIN_TEXT = "1 GiB"  # pyinfer.engine.driver.AUTO_MARGIN, named here without loading the engine for --help


def add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("-m", "--model", required=model_required,
                   help="GGUF / PowerGGUF file or Hugging Face checkpoint folder (default: the pulled default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per batch (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: one a core, one fewer from 8 cores)")
    p.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache type (default f16)")
    add_precise_arg(p)
    add_placement_args(p)
    p.add_argument("--sparse", choices=["auto", "on", "off"], default="auto",
                   help="predicted-neuron FFN: auto = on when the model file has predictors")
    p.add_argument("--sparsity-threshold", type=float, default=0.0,
                   help="added to the predictors' threshold: higher skips more neurons (default 0)")


def add_template_args(p: argparse.ArgumentParser) -> None:
    """The chat template and how it treats control tokens spelled in a message (pyinfer chat and serve)."""
    p.add_argument("--chat-template-file", default=None, help="Jinja chat template to use instead of the model's")
    p.add_argument("--content-control-tokens", action="store_true",
                   help="let a message's content spell control tokens such as <|im_end|> (the old behaviour; by "
                        "default they stay text, so untrusted text cannot forge a turn)")


def add_precise_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precise", choices=["auto", "on", "off"], default="auto",
                   help="CPU matmuls over 16-bit activations instead of 8-bit ones (about 1e-5 relative instead "
                        "of 4e-3, for 1.1-1.4x the time; off: llama.cpp's arithmetic). auto = on for models of at "
                        "most 256 MiB")


def precise_option(args) -> bool | str:
    return {"auto": "auto", "on": True, "off": False}[args.precise]


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """Where the model runs: a VRAM budget (the placement), llama.cpp-style layer offload, or one device."""
    p.add_argument("--vram-budget", default=None, metavar="SIZE|auto",
                   help="GPU memory the model may use, e.g. 8GiB: per layer the attention and the hot FFN neurons "
                        "go to the GPU, the rest is computed on the CPU at the same time. Default with a GPU: auto, "
                        f"its free memory less {AUTO_MARGIN_TEXT}; 0: CPU only")
    p.add_argument("--machine", default=None, metavar="NAME|FILE",
                   help="speed figures the placement plans with: a preset or a profile file (default: measured "
                        "on this machine once, then cached)")
    p.add_argument("-ngl", "--n-gpu-layers", type=gpu_layers, default=None, metavar="N|auto|all",
                   help="instead of a budget: whole layers on the GPU, as llama.cpp counts them: N holds the "
                        "output head and the last N - 1 layers; all (or -2): the whole model; auto (or -1): the "
                        "default, --vram-budget's placement")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu, or cuda for the whole model on the GPU (same as -ngl all)")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                   help="with -ngl: the experts of the first N layers of a mixture of experts stay in host memory and "
                        "run on the CPU, as llama.cpp's")


ALL_LAYERS = 999  # -ngl all: more than any model's layers and head


def gpu_layers(value: str) -> int | str:
    """-ngl's value as llama.cpp reads it: a count, auto (-1) or all (-2 and below)."""
    word = {"auto": -1, "all": -2}.get(value.strip().lower())
    try:
        n = word if word is not None else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers, auto or all, not {value!r}") from None
    return "auto" if n == -1 else ALL_LAYERS if n <= -2 else n


def placement_options(args) -> dict:
    """Model() placement keywords from add_placement_args' flags."""
    from pyinfer.engine.placement import parse_bytes
    from pyinfer.native.ggml import cuda_available

    # -ngl auto, llama.cpp's default, fits the model to the GPU's free memory: the default placement here too
    ngl = None if args.n_gpu_layers == "auto" else args.n_gpu_layers
    if ngl is not None and args.device == "cpu" and ngl > 0:
        raise PyInferError("--device cpu contradicts -ngl > 0")
    layers = ngl is not None or args.device == "cuda"
    if layers and args.vram_budget is not None:
        raise PyInferError("--vram-budget and -ngl/--device cuda exclude each other: give one")
    if args.n_cpu_moe and not layers:
        raise PyInferError("--n-cpu-moe goes with -ngl (a VRAM budget places the experts itself)")
    if layers:
        return dict(n_gpu_layers=ngl if ngl is not None else ALL_LAYERS,
                    n_cpu_moe=args.n_cpu_moe)
    if args.device == "cpu" or (args.vram_budget is None and not cuda_available()):
        return dict(n_gpu_layers=0)
    budget = args.vram_budget or "auto"
    budget = budget if budget == "auto" else parse_bytes(budget)
    if budget and not cuda_available():
        raise PyInferError("--vram-budget needs a CUDA build and a GPU, and none is available here (0 runs on the "
                           "CPU; pyinfer plan plans for another machine)")
    return dict(vram_budget=budget, machine=args.machine)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    from pyinfer.engine.sampling import SamplerParams

    d = SamplerParams()
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (default -1: random)")
    p.add_argument("--temp", type=float, default=d.temperature,
                   help=f"temperature; <= 0 is greedy (default {d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"top-k, 0 = off (default {d.top_k})")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"top-p, 1.0 = off (default {d.top_p})")
    p.add_argument("--min-p", type=float, default=d.min_p, help=f"min-p, 0.0 = off (default {d.min_p})")
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty,
                   help=f"penalty on recent tokens, 1.0 = off (default {d.repeat_penalty})")
    p.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n,
                   help=f"how many recent tokens the penalty covers (default {d.repeat_last_n})")


def seed(args) -> int | None:
    """-s as the sampler's seed: -1 (llama.cpp's LLAMA_DEFAULT_SEED) draws a random one."""
    return None if args.seed == -1 else args.seed


def sampler_params(args):
    from pyinfer.engine.sampling import SamplerParams

    return SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                         repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n)


def model_options(args) -> dict:
    """Model() keyword arguments from the shared model flags."""
    return dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_threads=args.threads, kv_type=args.kv_type,
                precise=precise_option(args), sparse={"auto": None, "on": True, "off": False}[args.sparse],
                sparsity_threshold=args.sparsity_threshold, **placement_options(args))


def load_model(args, **extra):
    """(resolved path, Model) for the -m argument and the shared model flags."""
    from pyinfer.engine.driver import Model
    from pyinfer.hub.model_files import resolve_model

    options = model_options(args)  # bad flags are named before the model file is looked for
    path = resolve_model(args.model)
    return path, Model(path, **options, **extra)
