#!/usr/bin/env bash
# The GPU session on the device machine: one script, sourced by each call, whose steps build, check and
# time the engine (docs/GPU_TEST_LOG.md, docs/BENCHMARKS.md). W is the machine's scratch folder.
#   . tools/gpu_session.sh; setup; build; llama_bg; tests; ...
# Carried (git-ignored): .whl (`pip download --only-binary :all: --python-version 312 --platform manylinux2014_x86_64
# -d .whl cffi pycparser gguf tqdm`), .carry/llamacpp-baseline.sh, .carry/llama-src.tar.xz (`tar cJf ... -C /work
# --exclude='llama-src/build*' llama-src`: a bare 'build*' also drops cmake/build-info.cmake, and cmake then fails)
# Issue 13's table in two calls: `table_bg; collect` in the first, `collect` in the next (within the warm window).
W=${W:-/root/w}
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYINFER_CACHE=$W/cache
export LD_LIBRARY_PATH=$W/llama-src/build/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # llama.cpp's shared libraries
mkdir -p "$W" "$OUT"

setup() {  # the wheels the image lacks (cffi, pycparser, gguf)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
}

build() { python3 setup.py build_native 2>&1 | tail -3; }

llama_bg() {  # llama.cpp's CUDA build (~6 min) in the background: $W/llama-src/build/bin; or, where a session
    # carries an earlier build's bin/ as .carry/llb/llb.part.* (split tar.xz), that one in seconds
    # $W/llama.done marks the end: the script builds llama-bench first and its other targets after, on every core
    [ -x "$W/llama-src/build/bin/llama-bench" ] && return
    tar xJf .carry/llama-src.tar.xz -C "$W"
    if compgen -G ".carry/llb/llb.part.*" > /dev/null; then
        mkdir -p "$W/llama-src/build"
        (set -o pipefail; cat .carry/llb/llb.part.* | xz -d | tar xf - -C "$W/llama-src/build") &&
            [ -x "$W/llama-src/build/bin/llama-bench" ] && touch "$W/llama.done" && return
        echo "the carried llama.cpp build did not unpack: building it"
    fi
    setsid bash -c "bash .carry/llamacpp-baseline.sh build $W/llama-src cuda && touch $W/llama.done" \
        > "$W/llama-build.log" 2>&1 < /dev/null &
}

llama_cpu_bg() {  # llama.cpp's CPU-only build (~2 min on 16 cores) for the CPU rows, where its CUDA build's 6 minutes
    # buy nothing: $W/llama-src/build/bin as llama_bg's, $W/llama.done at the end
    [ -x "$W/llama-src/build/bin/llama-bench" ] && return
    tar xJf .carry/llama-src.tar.xz -C "$W"
    setsid bash -c "bash .carry/llamacpp-baseline.sh build $W/llama-src && touch $W/llama.done" \
        > "$W/llama-build.log" 2>&1 < /dev/null &
}

base_build() {  # TAR [cuda]: an earlier tree's engine (`git archive REV ggml native setup.py | xz > .carry/base.tar.xz`
    # here) built in $W/base, CPU-only unless `cuda`, so that cpu_ab / whole_ab can swap its library in: the Python
    # side must be the same
    rm -rf "$W/base"; mkdir -p "$W/base/pyinfer"
    xz -dc "$1" | tar x -C "$W/base"
    if [ "$2" = cuda ]; then (cd "$W/base" && python3 setup.py build_native 2>&1 | tail -1)
    else (cd "$W/base" && PYINFER_NO_CUDA=1 python3 setup.py build_native 2>&1 | tail -1); fi
}

cpu_ab() {  # NAME [ROUNDS] [BENCH ARGS...]: $W/NAME.gguf on this host's CPU, base_build's engine, this tree's and
    # llama.cpp alternating (one thread a physical core; default -p 0 -n 64 -r 3), appended to $OUT/NAME-ab.md
    local name=$1 rounds=${2:-2} lb=$W/llama-src/build/bin/llama-bench t r v; shift 2
    local a="${*:--p 0 -n 64 -r 3}" so
    so=$(ls pyinfer/_pyinfer_native*.so)
    wait_for "$W/$name.done" && wait_for "$lb" || return 1
    cp "$so" "$W/new.so"
    t=$(python3 -c "from pyinfer.engine.threads import physical_cores; print(physical_cores())")
    for r in $(seq "$rounds"); do
        for v in base new; do
            if [ $v = base ]; then cp "$W"/base/pyinfer/_pyinfer_native*.so "$so"; else cp "$W/new.so" "$so"; fi
            python3 -m pyinfer bench -m "$W/$name.gguf" --device cpu -t "$t" $a 2>&1 |
                grep -E "\| (pp|tg)[0-9]|rror" | sed "s|^|$v round $r |"
        done
        CUDA_VISIBLE_DEVICES= "$lb" -m "$W/$name.gguf" -ngl 0 -t "$t" $a 2>&1 | grep -E "\| +(pp|tg)[0-9]|rror" |
            sed "s|^|llama.cpp round $r |"
    done | tee -a "$OUT/$name-ab.md"
    cp "$W/new.so" "$so"
}

llama_pack() {  # llama-bench and its libraries as $OUT/llb/llb.part.* (15 MiB each, what $OUT brings back): copied
    # to .carry/llb/ here, a later session's llama_bg unpacks them in seconds
    wait_for "$W/llama.done" 500 || return 1
    mkdir -p "$OUT/llb"
    (cd "$W/llama-src/build" && tar cf - bin/llama-bench bin/*.so*) | xz -T0 -6 | split -b 15M -d - "$OUT/llb/llb.part."
    du -ch "$OUT"/llb/* | tail -1
}

models_bg() {  # synthetic models: NAME SHAPE TYPE LAYERS (a PowerGGUF and the dense GGUF llama.cpp runs)
    local name=$1 shape=$2 type=$3 layers=$4
    setsid bash -c "python3 -m tools.make_synthetic_model $shape --type $type --layers $layers --ffn-kind reglu \
        --share-weights -o $W/$name.gguf && python3 -m tools.make_synthetic_model $shape --type $type \
        --layers $layers --ffn-kind reglu --share-weights --dense -o $W/$name-dense.gguf && touch $W/$name.done || touch $W/$name.failed" \
        > "$W/$name.log" 2>&1 < /dev/null &
}

input_models_bg() {  # NAME SHAPE TYPE LAYERS TARGET [ATTN_SKIP]: a SwiGLU PowerGGUF without predictors, calibrated
    # by `pyinfer sparsify --method input --target TARGET [--attn-skip ATTN_SKIP]` on 512 tokens of .carry/calib.txt
    # (the machine reaches no corpus: carry a text file there; nor the held-out text, hence --eval-tokens 0), as
    # $W/NAME.gguf, and the dense GGUF llama.cpp runs
    local name=$1 shape=$2 type=$3 layers=$4 target=$5 attn=${6:-0}
    local common="$shape --type $type --layers $layers --ffn-kind swiglu --share-weights"
    setsid bash -c "python3 -m tools.make_synthetic_model $common --no-predictors -o $W/$name-power.gguf &&
        python3 -m pyinfer sparsify $W/$name-power.gguf --method input --target $target --attn-skip $attn \
            --tokens 512 --corpus .carry/calib.txt --eval-tokens 0 -o $W/$name.gguf && rm $W/$name-power.gguf &&
        python3 -m tools.make_synthetic_model $common --dense -o $W/$name-dense.gguf && touch $W/$name.done || touch $W/$name.failed" \
        > "$W/$name.log" 2>&1 < /dev/null &
}

input_cpu_gemm() {  # [TYPES]: one prompt GEMM of 512 columns on this host's CPU, 4 x 4 tiles against AMX where it has
    # it (tools.bench_kernels --prompt), appended to $OUT/cpu-gemm.md; a CPU-only build (PYINFER_NO_CUDA=1 build)
    # takes seconds where these rows are all a call needs
    local t
    t=$(python3 -c "from pyinfer.engine.threads import physical_cores; print(physical_cores())")
    python3 -m tools.bench_kernels --threads "$t" --prompt 512 --sizes 4096x11008,11008x4096 \
        --types "${1:-q4_0,q8_0,q4_K,q6_K}" | tee -a "$OUT/cpu-gemm.md"
}

moe_bg() {  # NAME SHAPE TYPE LAYERS [FLAGS...]: a synthetic mixture of experts (one file both engines run),
    # $W/NAME.gguf (flags: --router-skew S)
    local name=$1 shape=$2 type=$3 layers=$4; shift 4
    setsid bash -c "python3 -m tools.make_synthetic_model $shape --type $type --layers $layers --share-weights $* \
        -o $W/$name.gguf && touch $W/$name.done || touch $W/$name.failed" > "$W/$name.log" 2>&1 < /dev/null &
}

random_profile() {  # SRC OUT: SRC with the expert counts `pyinfer profile -o` stores, taken over random tokens (what
    # both engines' benchmarks decode) instead of text: a synthetic file's text is a few byte tokens
    python3 - "$1" "$2" <<'EOF' | tee -a "$OUT/random-profile.log"
import sys
import numpy as np
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.expert_profile import routing_freq, top_share, write_profiled
src, out = sys.argv[1:3]
rng = np.random.default_rng(7)
n_vocab = GGUFFile(src).config.n_vocab
freq = routing_freq(src, [rng.integers(0, n_vocab, 512, dtype=np.int32) for _ in range(4)], progress=False)
write_profiled(src, out, freq)
print(src, "the most routed 20 % of experts' share, per layer:", " ".join(f"{top_share(f):.2f}" for f in freq))
EOF
}

moe_table_bg() {  # [NAME...] (default moe12 moe12s): issue 28's rows in the background (`collect` fetches them):
    # each file (made by moe_bg NAME, see moe_model) at a third and two thirds against llama.cpp's best of -ngl N
    # and -ngl 99 -ncmoe K, once llama.cpp's whole build is done; a skewed file's rows run its profiled copy
    # (random_profile); then both engines whole on the GPU on $W/moe12
    rm -rf "$W/out"
    setsid bash -c "W=$W; . tools/gpu_session.sh; OUT=$W/out; mkdir -p \$OUT; wait_for $W/llama.done 500 || exit 1
        for name in ${*:-moe12 moe12s}; do moe_rows \$name; done
        [ -e $W/moe12.gguf ] && whole moe12 2 > /dev/null; touch \$OUT/ALL.done" > "$W/table.log" 2>&1 < /dev/null &
}

moe_model() {  # NAME: the shape, type, layers, maker flags and label of a table file
    case $1 in
    moe12) echo "qwen3-30b-a3b q4_0 12 - Qwen3-30B-A3B Q4_0, 12 of 48 layers, even routing" ;;
    moe12s) echo "qwen3-30b-a3b q4_0 12 --router-skew=0.2 Qwen3-30B-A3B Q4_0, 12 of 48 layers, skewed routing" ;;
    mix4) echo "mixtral-8x7b q4_0 4 - Mixtral-8x7B Q4_0, 4 of 32 layers, even routing" ;;
    oss8) echo "gpt-oss-20b q8_0 8 --expert-type=mxfp4 gpt-oss-20b, MXFP4 experts, Q8_0 rest, 8 of 24 layers" ;;
    *) echo "no table file $1" >&2; return 1 ;;
    esac
}

moe_make_bg() {  # NAME...: the table files in the background, one after another ($W/NAME.done each)
    local name
    for name in "$@"; do
        read -r shape type layers flags _ <<< "$(moe_model "$name")"
        [ "$flags" = - ] && flags=
        moe_bg "$name" "$shape" "$type" "$layers" ${flags//=/ }
        wait_for "$W/$name.done" 400
    done
}

moe_rows() {  # NAME: one file's rows (bench_hybrid), its profiled copy where the routing is skewed
    local name=$1 ours
    read -r _ _ _ flags label <<< "$(moe_model "$name")"
    wait_for "$W/$name.done" 500 || return 1
    ours=$name
    if [[ $flags == --router-skew* ]]; then random_profile "$W/$name.gguf" "$W/$name-prof.gguf"; ours=$name-prof; fi
    idle
    python3 -m tools.bench_hybrid --ours "$W/$ours.gguf" --dense "$W/$name.gguf" --budgets 0.333,0.667 \
        --llama-bench "$W/llama-src/build/bin/llama-bench" --machine h100 --pp 512 --tg 64 --rounds 2 --reps 2 \
        --label "SYNTHETIC $label" --json "$OUT/$name.json" 2> "$OUT/$name.log" | tee "$OUT/$name.md"
}

whole() {  # NAME [ROUNDS] [BENCH ARGS...]: $W/NAME.gguf whole on the GPU, ours and llama.cpp alternating (default
    # -p 512 -n 64 -r 2), in $OUT/NAME-whole.md (the MoE table's: whole moe12)
    local name=$1 rounds=${2:-2} lb=$W/llama-src/build/bin/llama-bench; shift; shift
    local a="${*:--p 512 -n 64 -r 2}"
    for r in $(seq "$rounds"); do
        python3 -m pyinfer bench -m "$W/$name.gguf" -ngl 99 $a 2>&1 | grep -E "\| (pp|tg)[0-9]|rror" | sed "s|^|ours round $r |"
        "$lb" -m "$W/$name.gguf" -ngl 99 $a 2>&1 | grep -E "\| +(pp|tg)[0-9]|rror" | sed "s|^|llama.cpp round $r |"
    done | tee "$OUT/$name-whole.md"
}

whole_ab() {  # NAME [ROUNDS] [BENCH ARGS...]: $W/NAME.gguf whole on the GPU: base_build's engine (built with cuda),
    # this tree's and llama.cpp alternating (default -p 512 -n 128 -r 2), appended to $OUT/NAME-whole-ab.md
    local name=$1 rounds=${2:-2} lb=$W/llama-src/build/bin/llama-bench r v so; shift 2
    local a="${*:--p 512 -n 128 -r 2}"
    so=$(ls pyinfer/_pyinfer_native*.so)
    wait_for "$W/$name.done" && wait_for "$W/llama.done" 500 || return 1
    cp "$so" "$W/new.so"
    for r in $(seq "$rounds"); do
        for v in base new; do
            if [ $v = base ]; then cp "$W"/base/pyinfer/_pyinfer_native*.so "$so"; else cp "$W/new.so" "$so"; fi
            python3 -m pyinfer bench -m "$W/$name.gguf" -ngl 99 $a 2>&1 | grep -E "\| (pp|tg)[0-9]|rror" |
                sed "s|^|$v round $r |"
        done
        "$lb" -m "$W/$name.gguf" -ngl 99 $a 2>&1 | grep -E "\| +(pp|tg)[0-9]|rror" | sed "s|^|llama.cpp round $r |"
    done | tee -a "$OUT/$name-whole-ab.md"
    cp "$W/new.so" "$so"
}

synthetic_bg() {  # NAME SHAPE TYPE LAYERS [FLAGS...]: a random model of make_synthetic_model's SHAPE (one file both
    # engines run: the Qwen3.5, Gemma 4 and MoE shapes; a llama shape with --dense) as $W/NAME.gguf in the background,
    # $W/NAME.done at the end; after `build` on a fresh machine (the maker imports the engine: started beside the
    # build, it had failed)
    local name=$1 shape=$2 type=$3 layers=$4; shift 4
    setsid bash -c "python3 -m tools.make_synthetic_model $shape --type $type --layers $layers --share-weights $* \
        -o $W/$name.gguf && touch $W/$name.done || touch $W/$name.failed" > "$W/$name.log" 2>&1 < /dev/null &
}
long_context() {  # NAME [ROUNDS]: issue 30's whole-GPU rows: pp512, pp4096, tg128 and tg128 at depth 4096, ours and
    # llama.cpp (flash attention on, its best for these) alternating, in $OUT/NAME-long.md
    local name=$1 rounds=${2:-2} lb=$W/llama-src/build/bin/llama-bench r a
    wait_for "$W/$name.done" && wait_for "$lb" || return 1
    for r in $(seq "$rounds"); do
        for a in "-p 512,4096 -n 128" "-p 0 -n 128 -d 4096"; do
            python3 -m pyinfer bench -m "$W/$name.gguf" -ngl 99 $a -r 4 2>&1 | grep -E "\| (pp|tg)[0-9]|rror" |
                sed "s|^|ours round $r |"
            "$lb" -m "$W/$name.gguf" -ngl 99 -fa 1 $a -r 4 2>&1 | grep -E "\| +(pp|tg)[0-9]|rror" |
                sed "s|^|llama.cpp round $r |"
        done
    done | tee "$OUT/$name-long.md"
}

shape_rows() {  # NAME SHAPE [TYPE] [LAYERS]: a family's rows (docs/BENCHMARKS.md, "Qwen3.5", "Gemma 4"): a synthetic
    # file of SHAPE (qwen3.5-9b, qwen3.5-35b-a3b, gemma4-26b-a4b; default q4_0, 8 layers) whole on the GPU (`whole`), then
    # under a third and two thirds of its bytes (bench_hybrid; a dense shape as its PowerGGUF, the plain neuron split)
    # in $OUT/NAME-hybrid.md; a file synthetic_bg is making (NAME.done to come) is waited for, not made again
    local name=$1 shape=$2 ours=$W/$1.gguf
    if [ -e "$W/$name.log" ]; then wait_for "$W/$name.done" 500 || return 1; else
        python3 -m tools.make_synthetic_model "$shape" --type "${3:-q4_0}" --layers "${4:-8}" --share-weights \
            -o "$W/$name.gguf" 2>&1 | tail -1; fi
    if [[ $shape != *-a3b && $shape != *-a4b ]]; then  # a dense shape
        ours=$W/$name-power.gguf
        python3 -m pyinfer.converters.convert_hf_to_powergguf "$W/$name.gguf" -o "$ours" --down-type same | tail -1
    fi
    wait_for "$W/llama.done" 500 || return 1
    whole "$name" 2 -p 512 -n 128 -r 2
    python3 -m tools.bench_hybrid --ours "$ours" --dense "$W/$name.gguf" --budgets 0.333,0.667 \
        --llama-bench "$W/llama-src/build/bin/llama-bench" --machine h100 --pp 512 --tg 64 --rounds 1 --reps 2 \
        --label "SYNTHETIC $shape ${3:-q4_0}, ${4:-8} layers" 2> "$OUT/$name-hybrid.log" | tee "$OUT/$name-hybrid.md"
}

sanitize() {  # LOG "PYTEST ARGS"...: those tests under compute-sanitizer memcheck and racecheck, summed up in $OUT/LOG
    # (the MoE and attention kernels': sanitize moe-sanitizer.log "tests/test_moe_ops.py -k 'fuses or signed'" \
    # "tests/test_cuda_ops.py -k attention"; the recurrent ones': "tests/test_recurrent_ops.py -k cuda"). Each
    # string is split as a shell line (quotes keep a -k expression whole); a string that selects no test says so
    local log=$1 tool args; shift
    for tool in memcheck racecheck; do
        for args in "$@"; do
            echo "$tool $args: $(eval "compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q \
                -p no:cacheprovider $args" 2>&1 | grep -E 'passed|failed|no tests ran|deselected|ERROR SUMMARY|RACECHECK SUMMARY' |
                tr '\n' ' ')"
        done
    done | tee "$OUT/$log"
}

wait_for() {  # FILE [SECONDS]: until FILE exists, at most SECONDS (default 420); at once where a background step
    # that makes NAME.done left NAME.failed instead (a session lost 7 device minutes waiting on a model that had failed
    # at its first line)
    local t=0 failed=${1%.done}.failed
    while [ ! -e "$1" ] && [ ! -e "$failed" ] && [ $t -lt "${2:-420}" ]; do sleep 2; t=$((t + 2)); done
    [ -e "$1" ] || { echo "gave up waiting for $1$([ -e "$failed" ] && echo ": it failed")"; return 1; }
}

tests() {  # the GPU tests, log in $OUT
    python3 -m pytest -q -s -p no:cacheprovider tests/test_hybrid.py tests/test_gpu_engine.py tests/test_cuda_ops.py \
        tests/test_input_sparsity.py tests/test_moe_ops.py tests/test_moe_split.py tests/test_recurrent_ops.py \
        tests/test_split.py tests/test_sparse_attention.py "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
}

profiles() {  # [THREADS]: this machine's placement figures (default: pyinfer's thread count), as
    # $W/machine-f16.json and $W/machine-q4_0.json for --machine FILE, and in $OUT with the rounds' spread in
    # $OUT/profiles.log; measure them before anything else loads the host
    for t in ${PROFILE_TYPES:-f16 q4_0}; do
        rm -f "$W/machine-$t.json"  # a failed measurement leaves none, not an earlier call's
        python3 - "$t" "$W/machine-$t.json" "${1:-0}" <<'EOF' | tee -a "$OUT/profiles.log"
import sys
from pathlib import Path
from pyinfer.engine import machine
from pyinfer.engine.threads import default_threads
from pyinfer.native import ggml
type_name, path, threads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) or default_threads()
profile, spread = machine.measure(getattr(ggml, type_name.upper()), threads)
machine.save(profile, path)
print(f"{path.read_text().strip()} ({threads} threads, rounds {spread:.3f} apart)")
EOF
        cp "$W/machine-$t.json" "$OUT/"
    done
}

idle() {  # until the 1-minute load average is below 2, at most 300 s: builds and model writes skew timings
    local t=0
    while awk '{exit !($1 >= 2)}' /proc/loadavg && [ $t -lt 300 ]; do sleep 5; t=$((t + 5)); done
    echo "load $(cut -d' ' -f1-3 /proc/loadavg) after ${t} s"
}

compare() {  # NAME LABEL [bench_hybrid flags...]: ours under budgets against llama.cpp's best
    local name=$1 label=$2; shift 2
    wait_for "$W/$name.done" && wait_for "$W/llama-src/build/bin/llama-bench" || return 1
    idle
    python3 -m tools.bench_hybrid --ours "$W/$name.gguf" --dense "$W/$name-dense.gguf" \
        --llama-bench "$W/llama-src/build/bin/llama-bench" --label "$label" --json "$OUT/$name.json" "$@" \
        2> "$OUT/$name.log" | tee "$OUT/$name.md"
}

sparse_vs_dense() {  # NAME [ROUNDS]: the whole model on the GPU, its PowerGGUF (sparse) and dense GGUF alternating
    local name=$1 rounds=${2:-2}
    wait_for "$W/$name.done" || return 1
    for r in $(seq "$rounds"); do
        for f in "$name" "$name-dense"; do
            echo "$f round $r: $(python3 -m pyinfer bench -m "$W/$f.gguf" -ngl 99 -p 0 -n 128 -r 3 2>/dev/null |
                grep tg128)"
        done
    done | tee "$OUT/$name-sparse-vs-dense.md"
}

whole_profile() {  # NAME: where a decoded token's GPU time goes, the whole model on the GPU, its PowerGGUF (sparse)
    # and its dense GGUF ($OUT/NAME-profile.md)
    local name=$1
    wait_for "$W/$name.done" || return 1
    for f in "$name" "$name-dense"; do
        python3 -m tools.profile_decode -m "$W/$f.gguf" -ngl 99 -n 32 2>/dev/null
    done | tee "$OUT/$name-profile.md"
}

steadiness() {  # NAME [ROUNDS]: CPU-only decode of the dense GGUF, ours and llama.cpp alternating, quiet and beside
    # one busy process (issue 13, item 5): ours with its default thread count (one fewer than the cores here)
    # and with one a core, llama.cpp with one a core (its default)
    local name=$1 rounds=${2:-3} f=$W/$1-dense.gguf busy cores
    wait_for "$W/$name.done" && wait_for "$W/llama-src/build/bin/llama-bench" || return 1
    idle
    cores=$(python3 -c "from pyinfer.engine.threads import physical_cores; print(physical_cores())")
    samples() { python3 -c 'import json, sys; d = json.load(sys.stdin)[0]; print(d.get("threads", d.get("n_threads")),
        "threads:", *[round(x, 1) for x in d["samples_ts"]])'; }
    ours_tg() { python3 -m pyinfer bench -m "$f" -ngl 0 -p 0 -n 32 -r 3 "$@" -o json 2>/dev/null | samples; }
    for load in quiet busy; do
        [ $load = busy ] && { python3 -c 'while True: pass' & busy=$!; }
        for r in $(seq "$rounds"); do
            echo "$load round $r: ours $(ours_tg) | ours $(ours_tg -t "$cores") | llama.cpp $("$W/llama-src/build/bin/llama-bench" \
                -m "$f" -ngl 0 -p 0 -n 32 -r 3 -t "$cores" -o json 2>/dev/null | samples)"
        done
        [ $load = busy ] && kill "$busy"
    done | tee "$OUT/$name-steadiness.md"
}

cpu_rows() {  # NAME [ROUNDS] [BENCH ARGS...]: $W/NAME.gguf on this host's CPU alone (issue 30's 16-thread rows): ours
    # with --device cpu, llama.cpp with no GPU visible (else it sends a prompt's matmuls to the GPU), one thread a
    # physical core each, alternating (default -p 512 -n 128 -r 3), appended to $OUT/NAME-cpu.md
    local name=$1 rounds=${2:-2} lb=$W/llama-src/build/bin/llama-bench t r; shift 2
    local a="${*:--p 512 -n 128 -r 3}"
    wait_for "$W/$name.done" && wait_for "$lb" || return 1
    t=$(python3 -c "from pyinfer.engine.threads import physical_cores; print(physical_cores())")
    for r in $(seq "$rounds"); do
        python3 -m pyinfer bench -m "$W/$name.gguf" --device cpu -t "$t" $a 2>&1 | grep -E "\| (pp|tg)[0-9]|rror" |
            sed "s|^|ours round $r |"
        CUDA_VISIBLE_DEVICES= "$lb" -m "$W/$name.gguf" -ngl 0 -t "$t" $a 2>&1 | grep -E "\| +(pp|tg)[0-9]|rror" |
            sed "s|^|llama.cpp round $r |"
    done | tee -a "$OUT/$name-cpu.md"
}

table_bg() {  # [NAME...]: the hybrid tables in the background (a device call lasts at most 10 minutes): the build,
    # the profiles on the quiet host first, the synthetic models (default issue 13's four: l13f16 l70f16 l13q4 l70q4;
    # l13in: issue 27's SwiGLU file of input sparsity; l13ia: the same with sparse attention projections), the GPU
    # tests, then every budget of each model against llama.cpp with those profiles; results in $W/out, fetched by
    # `collect`
    rm -rf "$W/out"; rm -f "$W"/*.done "$W"/*.failed  # an earlier run's results and models are not this one's
    local names="${*:-l13f16 l70f16 l13q4 l70q4}"
    setsid bash -c "W=$W; . tools/gpu_session.sh; OUT=$W/out; mkdir -p \$OUT; setup > \$OUT/setup.log 2>&1
        build > \$OUT/build.log 2>&1; profiles > /dev/null 2>> \$OUT/profiles.err; llama_bg > \$OUT/llama.log 2>&1
        for name in $names; do table_model \$name models_bg; done
        tests > /dev/null
        for name in $names; do table_model \$name compare_table; done; touch \$OUT/ALL.done" > "$W/table.log" 2>&1 < /dev/null &
}

table_model() {  # NAME STEP: STEP (models_bg or compare_table) with the table's arguments for model NAME
    case $1 in
    l13f16) "$2" l13f16 llama-13b f16 8 "13B F16, 8 of 40 layers" ;;
    l70f16) "$2" l70f16 llama-70b f16 4 "70B-like GQA F16, 4 of 80 layers" ;;
    l13q4) "$2" l13q4 llama-13b q4_0 8 "13B Q4_0, 8 of 40 layers" ;;
    l70q4) "$2" l70q4 llama-70b q4_0 4 "70B-like GQA Q4_0, 4 of 80 layers" ;;
    l13in) if [ "$2" = models_bg ]; then input_models_bg l13in llama-13b f16 8 0.5
           else "$2" l13in llama-13b f16 8 "13B SwiGLU F16, 8 of 40 layers, input sparsity 50 %"; fi ;;
    l13ia) if [ "$2" = models_bg ]; then input_models_bg l13ia llama-13b f16 8 0.5 0.5
           else "$2" l13ia llama-13b f16 8 "13B SwiGLU F16, 8 of 40 layers, input sparsity 50 %, attention 50 %"; fi ;;
    l70ia) if [ "$2" = models_bg ]; then input_models_bg l70ia llama-70b f16 4 0.5 0.5
           else "$2" l70ia llama-70b f16 4 "70B-like GQA SwiGLU F16, 4 of 80 layers, input sparsity 50 %, attention 50 %"; fi ;;
    *) echo "no table model $1"; return 1 ;;
    esac
}

compare_table() {  # NAME SHAPE TYPE LAYERS LABEL: one model's rows, planned with this machine's profile of TYPE
    compare "$1" "SYNTHETIC $5" --rounds 2 --reps 2 --machine "$W/machine-$3.json"
}

collect() {  # [SECONDS]: waits for table_bg's end (default 560 s), then packs $W/out into $OUT/table.tgz
    wait_for "$W/out/ALL.done" "${1:-560}"
    tar czf "$OUT/table.tgz" -C "$W/out" .
    cat "$W/out"/*.md 2>/dev/null
}
