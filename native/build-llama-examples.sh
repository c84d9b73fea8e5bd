#!/usr/bin/env bash
# Build llama.cpp's `llama-speculative-simple` example from the llama.cpp that llama-cpp-python vendors, for
# the side-by-side comparison (python -m fsd_local.compare_llamacpp). Usage: native/build-llama-examples.sh [OUT]
set -euo pipefail
out=${1:-/tmp/llcpp-build}
ver=$(python3 -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
src=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$src"
tar xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
llama="$src/llama_cpp_python-$ver/vendor/llama.cpp"
cmake -S "$llama" -B "$out" -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build "$out" --target llama-speculative-simple -j"$(nproc)"
echo "built $out/bin/llama-speculative-simple"
