#!/usr/bin/env bash
# llama.cpp against transformers on a usaf export (bench/clients.py says what is measured).
#
#   bash bench/clients.sh                  # results in bench/results/clients-DATE.{json,md}
#   LLAMA_BUILD=DIR bash bench/clients.sh  # build llama.cpp in DIR (default /work/llama-build; outside the repo)
#
# llama.cpp is built from the llama-cpp-python source package, whose vendor/llama.cpp is the llama.cpp its Python
# bindings are written against: only llama-quantize and the shared libraries it needs (libllama, libggml), niced
# and on 2 jobs (a shared 2-core machine: about 20 minutes; done once, kept in LLAMA_BUILD). The bindings are the
# package's own Python files on that libllama (LLAMA_CPP_LIB_PATH), the converter's and bindings' few imports the
# venv lacks go to LLAMA_BUILD/pydeps: nothing is installed into the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
BUILD="${LLAMA_BUILD:-/work/llama-build}"
VERSION=0.3.36
PACKAGE="$BUILD/llama_cpp_python-$VERSION"
SRC="$PACKAGE/vendor/llama.cpp"

mkdir -p "$BUILD"
if [ ! -d "$PACKAGE" ]; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$BUILD"
    tar xzf "$BUILD/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD"
fi
if [ ! -x "$BUILD/build/bin/llama-quantize" ]; then
    nice -n 10 cmake -S "$SRC" -B "$BUILD/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF
    nice -n 10 cmake --build "$BUILD/build" -j2 --target llama-quantize
fi
# the converter imports sentencepiece (llama.cpp's requirements-convert_hf_to_gguf.txt), the bindings diskcache
[ -d "$BUILD/pydeps/diskcache" ] || "$PY" -m pip install -q --target "$BUILD/pydeps" sentencepiece diskcache

export LLAMA_CPP="$SRC" LLAMA_QUANTIZE="$BUILD/build/bin/llama-quantize" LLAMA_CPP_LIB_PATH="$BUILD/build/bin"
export PYTHONPATH="$ROOT/src:$BUILD/pydeps:$PACKAGE" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" "$ROOT/bench/clients.py" --work "$WORK" --out "$ROOT/bench/results/clients-$(date +%F)" "$@"
