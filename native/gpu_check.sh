#!/usr/bin/env bash
# The GPU check, on a Linux machine with an NVIDIA GPU, in one go (about 5-8 minutes on a 16-core machine):
#   1. build llama-cpp-python (pinned version) with CUDA for the compute capability nvidia-smi reports,
#   2. run the GPU-marked tests (tests/test_gpu.py: full offload of the demo pair, same greedy tokens as on the
#      CPU, the KV-cache contract on the GPU), failing rather than skipping if no GPU is seen,
#   3. `fsd-local bench` on the SmolLM2 demo pair, both models fully offloaded: ar / sd / fsd at tau 0.1 and 0.3,
#      8 prompts x 128 tokens x 3 repeats,
# writing everything to OUT (default $TMPDIR/fsd-gpu-check): build.log, doctor.txt, tests.txt, bench.json,
# bench.txt (the table), summary.txt.
#
#   native/gpu_check.sh [--dry-run] [--skip-build] [--source SDIST] [--out DIR]
#
# Needs: the NVIDIA driver (nvidia-smi), the CUDA toolkit with cuBLAS (nvcc, libcublas), a Python environment
# with fsd-local installed (pip install -e ".[test]"). Offline machines: make a source tarball where PyPI is
# reachable (native/build.sh --pack-source build/llama-src.tar.gz, ~13 MB) and pass it with --source (or
# FSD_LCP_SOURCE); with scikit-build-core installed, pip then builds without the network.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
dry=0 skip_build=0 source="${FSD_LCP_SOURCE:-}" out="${OUT_DIR:-${TMPDIR:-/tmp}/fsd-gpu-check}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --skip-build) skip_build=1 ;;
        --source) source="$2"; shift ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
python="${PYTHON:-$(command -v python || command -v python3)}"
start=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*"; }

# compute capability of every GPU, e.g. "8.9" -> 89; several different GPUs -> "86;89"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpus="$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader)"
    arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u | paste -sd ';' -)"
elif [ "$dry" = 1 ]; then
    gpus="(no NVIDIA GPU here: nvidia-smi missing or no device)" arch="<compute capability from nvidia-smi>"
else
    echo "gpu_check.sh: no NVIDIA GPU: nvidia-smi is missing or lists no device" >&2
    exit 3
fi
stamp "GPUs: $gpus; CUDA architectures: $arch"
# a toolkit without cuBLAS fails only after minutes of CMake and compiling: say so now
if [ "$dry" = 0 ] && ! ls ${CUDA_HOME:+"$CUDA_HOME"/lib64/libcublas.so*} /usr/local/cuda*/lib64/libcublas.so* \
        /usr/local/cuda*/targets/*/lib/libcublas.so* /usr/lib/*-linux-gnu/libcublas.so* >/dev/null 2>&1; then
    echo "gpu_check.sh: the CUDA toolkit here has no cuBLAS (libcublas.so); install it (e.g. libcublas-dev-13-0)" >&2
    exit 3
fi

build_args=(--cuda-arch "$arch" cuda)
[ -n "$source" ] && build_args=(--source "$source" "${build_args[@]}")
# offline-capable: without build isolation pip uses the scikit-build-core already installed
"$python" -c "import scikit_build_core" 2>/dev/null && export FSD_PIP_ARGS="${FSD_PIP_ARGS:-} --no-build-isolation"
# the multimodal library (mtmd) is not used by fsd-local: skipping it saves build minutes
export FSD_CMAKE_ARGS="${FSD_CMAKE_ARGS:+$FSD_CMAKE_ARGS }-DLLAVA_BUILD=off"
tests=("$python" -m pytest -m gpu tests/test_gpu.py -v -ra -s -p no:cacheprovider)
bench=("$python" -m fsd_local.cli bench --ngl -1 --draft-ngl -1 --modes fsd --taus 0.1,0.3 --max-tokens 128
       --repeats 3 --ignore-eos --json)
table=("$python" -c "import json, sys; from fsd_local.bench import format_table; print(format_table(json.load(open(sys.argv[1]))))")

if [ "$dry" = 1 ]; then
    "$here/build.sh" --dry-run "${build_args[@]}"
    echo "FSD_REQUIRE_GPU=1 ${tests[*]}"
    echo "${bench[*]} > $out/bench.json"
    exit 0
fi

mkdir -p "$out"
cd "$root"
if [ "$skip_build" = 0 ]; then
    stamp "building llama-cpp-python with CUDA (log: $out/build.log)"
    "$here/build.sh" "${build_args[@]}" >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 4; }
    tail -n 2 "$out/build.log"
fi
stamp "doctor"
"$python" -m fsd_local.cli doctor | tee "$out/doctor.txt"
stamp "GPU tests"
status=0
FSD_REQUIRE_GPU=1 "${tests[@]}" 2>&1 | tee "$out/tests.txt" || status=$?
stamp "bench on the demo pair"
if "${bench[@]}" >"$out/bench.json" 2>"$out/bench.log"; then
    "${table[@]}" "$out/bench.json" | tee "$out/bench.txt"
else
    tail -n 20 "$out/bench.log"; status=$((status ? status : 5))
fi
{
    echo "GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - start )) s"
    echo "GPUs: $gpus (CUDA architectures $arch)"
    grep -E "passed|failed|error" "$out/tests.txt" | tail -n 1 || true
    cat "$out/bench.txt" 2>/dev/null || echo "bench failed: see bench.log"
} | tee "$out/summary.txt"
exit "$status"
