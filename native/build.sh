#!/usr/bin/env bash
# Rebuild llama-cpp-python, at the version pyproject.toml pins, for one backend profile (native/profiles/*.env),
# or build one of llama.cpp's own programs from the same sources: ggml-rpc-server for the machines that lend a
# target their devices (--rpc-server), llama-speculative-simple for the side-by-side benchmark (--tool NAME).
#
#   native/build.sh [--dry-run] [--rpc] [--cuda-arch 89] [--source SDIST] PROFILE
#   native/build.sh [--dry-run] --rpc-server [--cuda-arch 89] [--source SDIST] PROFILE
#   native/build.sh [--dry-run] --tool llama-speculative-simple [--source SDIST] PROFILE
#   native/build.sh [--dry-run] --pack-source FILE.tar.gz [--source SDIST]
#
# PROFILE: cpu | cpu-portable | cuda | metal | vulkan | hip | sycl. --rpc adds llama.cpp's RPC backend (--rpc HOST:PORT).
# --source: an unpacked llama-cpp-python sdist or its .tar.gz, for machines without access to PyPI.
# --pack-source: write that sdist without git history, test vocabularies and docs (77 -> ~15 MB) to take along.
# Environment: PYTHON (interpreter; default: python on PATH), FSD_CMAKE_ARGS (more CMake flags), FSD_PIP_ARGS
# (more pip options), CMAKE_BUILD_PARALLEL_LEVEL (jobs; default: all cores), FSD_BUILD_DIR (ggml-rpc-server trees).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
die() { echo "build.sh: $*" >&2; exit 2; }

dry=0 rpc=0 rpc_server=0 cuda_arch="" source="" profile="" pack="" llama_tool=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --rpc) rpc=1 ;;
        --rpc-server) rpc_server=1 llama_tool=ggml-rpc-server ;;
        --tool) [ $# -ge 2 ] || die "--tool needs a llama.cpp CMake target, e.g. llama-speculative-simple"; llama_tool="$2"; shift ;;
        --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a value, e.g. 89 or \"86;89\""; cuda_arch="$2"; shift ;;
        --source) [ $# -ge 2 ] || die "--source needs a path"; source="$2"; shift ;;
        --pack-source) [ $# -ge 2 ] || die "--pack-source needs a FILE.tar.gz"; pack="$2"; shift ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$profile" ] || die "one PROFILE only"; profile="$1" ;;
    esac
    shift
done
version="$(sed -n 's/.*"llama-cpp-python==\([0-9][0-9.]*\)".*/\1/p' "$root/pyproject.toml" | head -n 1)"
[ -n "$version" ] || die "no llama-cpp-python==VERSION pin found in $root/pyproject.toml"
python="${PYTHON:-$(command -v python || command -v python3 || echo python3)}"
show() { local line; line="$(printf '%q ' "$@")"; echo "${line% }"; }

if [ -n "$pack" ]; then
    # what a build never reads: git history (only version strings come from it), the tokenizer test
    # vocabularies and the documentation
    skip=(--exclude='*/.git' --exclude='*/vendor/llama.cpp/models' --exclude='*/vendor/llama.cpp/docs')
    work="$(mktemp -d)"
    if [ -z "$source" ]; then
        fetch=("$python" -m pip download --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version")
        show "${fetch[@]}"
        [ "$dry" = 1 ] || "${fetch[@]}"
        source="$work/llama_cpp_python-$version.tar.gz"
    fi
    if [ "${source%.tar.gz}" = "$source" ]; then  # an unpacked directory
        repack=(tar -czf "$pack" "${skip[@]}" -C "$(dirname "$source")" "$(basename "$source")")
        show "${repack[@]}"
        [ "$dry" = 1 ] || "${repack[@]}"
    else
        show tar -xzf "$source" "${skip[@]}" -C "$work"
        show tar -czf "$pack" -C "$work" "llama_cpp_python-$version"
        [ "$dry" = 1 ] || { tar -xzf "$source" "${skip[@]}" -C "$work" &&
                            tar -czf "$pack" -C "$work" "llama_cpp_python-$version"; }
    fi
    rm -rf "$work"
    [ "$dry" = 1 ] || echo "packed $pack ($(du -h "$pack" | cut -f1)); build from it with --source $pack"
    exit 0
fi

profiles="$(cd "$here/profiles" && ls ./*.env | sed 's|^\./||; s|\.env$||' | tr '\n' ' ')"
[ -n "$profile" ] || die "give a PROFILE: $profiles"
profile_file="$here/profiles/$profile.env"
[ -f "$profile_file" ] || die "unknown profile '$profile': choose one of $profiles"

CMAKE_ARGS="" NEEDS="" EXPECT="" BACKEND_MODULES=0
# shellcheck disable=SC1090
. "$profile_file"
args="$CMAKE_ARGS"
[ "$rpc" = 1 ] || [ "$rpc_server" = 1 ] && args="$args -DGGML_RPC=on"
[ -n "$cuda_arch" ] && args="$args -DCMAKE_CUDA_ARCHITECTURES=$cuda_arch"
[ -n "${FSD_CMAKE_ARGS:-}" ] && args="$args $FSD_CMAKE_ARGS"
jobs="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 4)}"

if [ "$profile" = hip ] && command -v hipconfig >/dev/null 2>&1; then
    # ROCm's clang compiles the HIP kernels (llama.cpp docs/build.md)
    export HIPCXX="${HIPCXX:-$(hipconfig -l)/clang}" HIP_PATH="${HIP_PATH:-$(hipconfig -R)}"
fi

missing=""
for tool in $NEEDS; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    msg="profile $profile needs${missing} on PATH: $(grep '^# Needs' "$profile_file" | sed 's/^# //')"
    [ "$dry" = 1 ] && echo "warning: $msg" >&2 || die "$msg"
fi

if [ -n "$llama_tool" ]; then
    build_dir="${FSD_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fsd-local/build}/${llama_tool#ggml-}-$profile"
    src_root="$build_dir/src"
    echo "# $llama_tool from llama-cpp-python $version's llama.cpp ($profile)"
    if [ -z "$source" ]; then
        fetch=("$python" -m pip download --no-deps --no-binary :all: -d "$build_dir/sdist" "llama-cpp-python==$version")
        show "${fetch[@]}"
        [ "$dry" = 1 ] || "${fetch[@]}"
        source="$build_dir/sdist/llama_cpp_python-$version.tar.gz"
    fi
    if [ "${source%.tar.gz}" != "$source" ]; then
        echo "tar -xzf $source -C $src_root"
        [ "$dry" = 1 ] || { mkdir -p "$src_root" && tar -xzf "$source" -C "$src_root"; }
        llama_src="$src_root/llama_cpp_python-$version/vendor/llama.cpp"
    else
        llama_src="$source/vendor/llama.cpp"
    fi
    examples=off
    [ "$llama_tool" = ggml-rpc-server ] || examples=on  # llama.cpp's example programs need LLAMA_BUILD_EXAMPLES
    # shellcheck disable=SC2086  # args is a list of flags
    configure=(cmake -S "$llama_src" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release $args -DLLAMA_BUILD_TESTS=off
               -DLLAMA_BUILD_EXAMPLES=$examples -DLLAMA_BUILD_SERVER=off -DLLAMA_BUILD_APP=off -DLLAMA_OPENSSL=off)
    compile=(cmake --build "$build_dir" --config Release --target "$llama_tool" -j "$jobs")
    show "${configure[@]}"; show "${compile[@]}"
    [ "$dry" = 1 ] && exit 0
    "${configure[@]}" && "${compile[@]}"
    if [ "$llama_tool" = ggml-rpc-server ]; then
        echo "built $build_dir/bin/ggml-rpc-server; start it with: $build_dir/bin/ggml-rpc-server -H 0.0.0.0 -p 50052"
    else
        echo "built $build_dir/bin/$llama_tool"
    fi
    exit 0
fi

spec="llama-cpp-python==$version"
[ -n "$source" ] && spec="$source"
# --no-binary + --no-cache-dir: never reuse a prebuilt or previously built (CPU) wheel; --no-deps: keep numpy etc.
# shellcheck disable=SC2206  # FSD_PIP_ARGS is a list of pip options, e.g. --no-build-isolation (offline)
install=("$python" -m pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python -v
         ${FSD_PIP_ARGS:-} "$spec")
if [ "$BACKEND_MODULES" = 1 ]; then
    # GGML_BACKEND_DL builds each backend as a module (libggml-cpu-haswell.so, ...) that llama-cpp-python's
    # install step does not copy: keep the build tree and copy them next to libllama afterwards
    build_tree="${FSD_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fsd-local/build}/llama-cpp-python-$profile"
    install+=(--config-settings="build-dir=$build_tree")
fi
echo "# llama-cpp-python $version, profile $profile$([ "$rpc" = 1 ] && echo ' + RPC')"
echo "CMAKE_ARGS='${args# }' CMAKE_BUILD_PARALLEL_LEVEL=$jobs $(show "${install[@]}")"
[ "$dry" = 1 ] && exit 0

CMAKE_ARGS="${args# }" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "${install[@]}"

if [ "$BACKEND_MODULES" = 1 ]; then
    # found without importing llama_cpp (its import needs every dependency; the library needs none)
    lib_dir="$("$python" -c 'import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec("llama_cpp").origin), "lib"))')"
    modules="$(find "$build_tree" \( -name 'libggml-*.so' -o -name 'libggml-*.dylib' -o -name 'ggml-*.dll' \) \
               2>/dev/null | grep -E 'ggml-(cpu|cuda|vulkan|metal|hip|sycl|blas|rpc)' || true)"
    [ -n "$modules" ] || die "no backend modules found under $build_tree"
    for m in $modules; do cp -f "$m" "$lib_dir/"; echo "backend module: $(basename "$m") -> $lib_dir"; done
fi

# check that the new build has what the profile promised
expect="$EXPECT"; [ "$rpc" = 1 ] && expect="$expect|RPC"
"$python" - "$expect" <<'PY'
import sys
try:
    from fsd_local.backend import detect
except ImportError:
    import llama_cpp
    print("built; fsd-local is not installed here, so no check. System info:", llama_cpp.llama_print_system_info())
    sys.exit(0)
info = detect()
missing = [name for name in sys.argv[1].split("|") if name not in info.backends]
print(f"llama.cpp {info.llama_cpp}: backends {', '.join(info.backends)}; devices: "
      + ", ".join(f"{d.name} ({d.description})" for d in info.devices))
if missing:
    sys.exit(f"build.sh: the new build lacks {', '.join(missing)}; see the pip log above")
PY
