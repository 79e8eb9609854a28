#!/usr/bin/env bash
# Build stock llama.cpp's llama-server, llama-speculative-simple and llama-bench from the
# llama.cpp that the pinned llama-cpp-python vendors (the same commit as the Python binding),
# once, into edgespec's cache: $EDGESPEC_CACHE/llama-tools/<version>/bin (default cache
# ~/.cache/edgespec), and print that folder. Its Hugging Face converter (convert_hf_to_gguf.py
# with its `conversion` package and gguf-py) goes beside it, in ../convert. Only the package
# registry is used (the llama-cpp-python sdist).
# One extra, clearly named tool: llama-server-nextn, the same server from the same source with
# scripts/patches/gemma3-nextn.patch applied (its gemma3 graph hands the post-norm hidden state
# to an MTP drafter, as its gemma4 graph does), for running `export llama-cpp`'s
# gemma4-assistant files on Gemma 3 targets. The stock tools stay stock.
#
#   scripts/build_llama_tools.sh [PYTHON]      (make llama-tools)
set -euo pipefail

PY=${1:-.venv/bin/python}
VERSION=$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)")
CACHE=${EDGESPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgespec}
# no AMX kernels (they crash on this llama.cpp): edgespec/llama_lib.py's CPU_FLAGS
CPU_FLAGS=$("$PY" -c "from edgespec.llama_lib import CPU_FLAGS; print(CPU_FLAGS)")
DEST="$CACHE/llama-tools/$VERSION"
TOOLS=(llama-server llama-speculative-simple llama-bench)

PATCH="$(cd "$(dirname "$0")" && pwd)/patches/gemma3-nextn.patch"

have_all() { for t in "${TOOLS[@]}"; do [ -x "$DEST/bin/$t" ] || return 1; done; }
have_convert() { [ -f "$DEST/convert/convert_hf_to_gguf.py" ]; }
have_nextn() { [ -x "$DEST/bin/llama-server-nextn" ]; }
if have_all && have_convert && have_nextn; then
    echo "llama.cpp tools $VERSION: already built" >&2
    echo "$DEST/bin"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/edgespec-llama-tools.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "llama.cpp tools $VERSION: fetching the llama-cpp-python sdist" >&2
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK" --wildcards \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/*"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

install_convert() {  # atomically, beside the tools
    mkdir -p "$DEST"
    local stage
    stage=$(mktemp -d "$CACHE/llama-tools/.convert.XXXXXX")
    cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$stage/"
    rm -rf "$DEST/convert"
    mv "$stage" "$DEST/convert"
}
configure() {  # source folder, build folder. No web UI assets (they would be downloaded), no
    # TLS, no tests: only what the tools need.
    cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$CPU_FLAGS" -DCMAKE_CXX_FLAGS="$CPU_FLAGS" \
        >"$2.configure.log" 2>&1 || { tail -30 "$2.configure.log" >&2; exit 1; }
}
build() {  # build folder, targets...
    local dir=$1; shift
    cmake --build "$dir" --target "$@" -j "$(nproc)" >"$dir.build.log" 2>&1 \
        || { tail -40 "$dir.build.log" >&2; exit 1; }
}

mkdir -p "$CACHE/llama-tools"
if have_all; then
    have_convert || { install_convert; echo "llama.cpp tools $VERSION: converter added" >&2; }
else
    configure "$SRC" "$WORK/build"
    echo "llama.cpp tools $VERSION: building ${TOOLS[*]} (several minutes on 2 cores)" >&2
    build "$WORK/build" "${TOOLS[@]}"
    # Install atomically: a half-copied folder is never taken for a built one.
    STAGE=$(mktemp -d "$CACHE/llama-tools/.staging.XXXXXX")
    mkdir -p "$STAGE/bin"
    for t in "${TOOLS[@]}"; do cp "$WORK/build/bin/$t" "$STAGE/bin/"; done
    [ -x "$DEST/bin/llama-server-nextn" ] && cp "$DEST/bin/llama-server-nextn" "$STAGE/bin/"
    cp "$SRC/LICENSE" "$STAGE/LICENSE-llama.cpp"
    rm -rf "$DEST"
    mv "$STAGE" "$DEST"
    install_convert
    echo "llama.cpp tools $VERSION: built" >&2
fi

if ! have_nextn; then
    cp -r "$SRC" "$WORK/patched"
    if command -v patch >/dev/null; then
        patch -d "$WORK/patched" -p1 --quiet < "$PATCH"
    else
        git -C "$WORK/patched" apply "$PATCH"
    fi || { echo "scripts/patches/gemma3-nextn.patch does not apply to llama.cpp $VERSION" >&2; exit 1; }
    configure "$WORK/patched" "$WORK/build-nextn"
    echo "llama.cpp tools $VERSION: building llama-server-nextn (the patched gemma3 graph)" >&2
    build "$WORK/build-nextn" llama-server
    cp "$WORK/build-nextn/bin/llama-server" "$DEST/bin/.llama-server-nextn.$$"
    mv "$DEST/bin/.llama-server-nextn.$$" "$DEST/bin/llama-server-nextn"
fi
echo "$DEST/bin"
