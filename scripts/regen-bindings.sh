#!/usr/bin/env bash
# Regenerate the committed bindings of metrale-cuda-sys from the pinned headers:
#   src/bindings.rs            cuda.h       (nvidia-cuda-runtime)
#   src/nvrtc_bindings.rs      nvrtc.h      (nvidia-cuda-nvrtc, feature nvrtc)
#   src/nvjitlink_bindings.rs  nvJitLink.h  (nvidia-nvjitlink, feature nvrtc)
#   src/nccl_bindings.rs       nccl.h       (nvidia-nccl-cu13, feature nccl)
#   src/nvtx_bindings.rs       nvToolsExt.h (nvidia-nvtx, feature nvtx; types only)
#   src/cublas_bindings.rs     cublas_api.h (nvidia-cublas, feature cublas)
#   src/cublaslt_bindings.rs   cublasLt.h   (nvidia-cublas, feature cublas)
#
#   scripts/regen-bindings.sh          rewrite the committed bindings
#   scripts/regen-bindings.sh --check  fail if any committed file differs
#   ... --only nvtx                    only those headers (names: cuda, nvrtc,
#                                      nvjitlink, nccl, nvtx, cublas (both of its
#                                      headers); comma-separated);
#                                      the others' committed files are used as is
#
# Each header comes from its PyPI package (pinned below), fetched with
# `pip download` into .cuda-header/ (ignored by git; only the wheels' include
# folders are unpacked, the NCCL and cuBLAS wheels are large). nccl.h and the
# cuBLAS headers include CUDA runtime headers; metrale-cuda-sys/nccl_stub/ and
# cublas_stub/ stand in for them. The bindings are produced by
# the crate's own build script (features `bindgen` and `nvrtc`), so a feature
# build and the committed files share one bindgen configuration. Needs libclang
# (Debian: libclang-dev) and rustfmt.
set -euo pipefail

# name package version header include-folder-in-the-wheel file include-variable
PINS=(
  "cuda nvidia-cuda-runtime 13.0.96 cuda.h nvidia/cu13/include bindings.rs METRALE_CUDA_INCLUDE_DIR"
  "nvrtc nvidia-cuda-nvrtc 13.0.88 nvrtc.h nvidia/cu13/include nvrtc_bindings.rs METRALE_NVRTC_INCLUDE_DIR"
  "nvjitlink nvidia-nvjitlink 13.0.88 nvJitLink.h nvidia/cu13/include nvjitlink_bindings.rs METRALE_NVJITLINK_INCLUDE_DIR"
  "nccl nvidia-nccl-cu13 2.28.9 nccl.h nvidia/nccl/include nccl_bindings.rs METRALE_NCCL_INCLUDE_DIR"
  "nvtx nvidia-nvtx 13.0.85 nvtx3/nvToolsExt.h nvidia/cu13/include nvtx_bindings.rs METRALE_NVTX_INCLUDE_DIR"
  "cublas nvidia-cublas 13.1.0.3 cublas_api.h nvidia/cu13/include cublas_bindings.rs METRALE_CUBLAS_INCLUDE_DIR"
  "cublas nvidia-cublas 13.1.0.3 cublasLt.h nvidia/cu13/include cublaslt_bindings.rs METRALE_CUBLAS_INCLUDE_DIR"
)

root=$(cd "$(dirname "$0")/.." && pwd)

mode=write
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) mode=check ;;
    --only) [ $# -ge 2 ] || { echo "--only needs a list of names" >&2; exit 2; }; only=$2; shift ;;
    *) echo "usage: $0 [--check] [--only cuda,nvrtc,nvjitlink,nccl,nvtx,cublas]" >&2; exit 2 ;;
  esac
  shift
done

# fetch PACKAGE VERSION HEADER SUBDIR: print the include folder holding HEADER.
fetch() {
  local package=$1 version=$2 header=$3 subdir=$4
  local cache=$root/.cuda-header/$package-$version
  local include=$cache/$subdir
  if [ ! -f "$include/$header" ]; then
    local wheels
    wheels=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_18_x86_64 \
      --platform manylinux_2_27_x86_64 \
      --python-version 3.12 \
      -d "$wheels" "$package==$version" >&2
    mkdir -p "$cache"
    python3 - "$wheels" "$cache" <<'PY'
import glob, sys, zipfile
wheels, cache = sys.argv[1], sys.argv[2]
for wheel in glob.glob(wheels + "/*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if "/include/" in name:
                z.extract(name, cache)
PY
    rm -rf "$wheels"
  fi
  [ -f "$include/$header" ] || { echo "$header not found in $include" >&2; exit 1; }
  printf '%s\n' "$include"
}

FILES=()
SELECTED=()
envs=()
for pin in "${PINS[@]}"; do
  read -r name p v h d file var <<<"$pin"
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
    continue
  fi
  include=$(fetch "$p" "$v" "$h" "$d")
  envs+=("$var=$include")
  FILES+=("$file")
  [[ " ${SELECTED[*]} " == *" $p==$v "* ]] || SELECTED+=("$p==$v")
done
[ "${#FILES[@]}" -gt 0 ] || { echo "--only $only names no header" >&2; exit 2; }
if [ -n "$only" ]; then
  # The files left out are taken from the committed ones by the build script.
  envs+=("METRALE_BINDINGS_ONLY=$(IFS=,; echo "${FILES[*]}")")
fi

generated=$(mktemp -d)
trap 'rm -rf "$generated"' EXIT
(cd "$root" && env "${envs[@]}" METRALE_BINDINGS_OUT_DIR="$generated" \
  cargo build --quiet -p metrale-cuda-sys --features bindgen,nvrtc,nccl,nvtx,cublas)

pins=$(printf '%s, ' "${SELECTED[@]}" | sed 's/, $//')
stale=0
for file in "${FILES[@]}"; do
  rustfmt --edition 2021 "$generated/$file"
  committed=$root/metrale-cuda-sys/src/$file
  if [ "$mode" = check ]; then
    if ! diff -q "$committed" "$generated/$file" >/dev/null 2>&1; then
      echo "metrale-cuda-sys/src/$file is stale; run scripts/regen-bindings.sh" >&2
      diff -u "$committed" "$generated/$file" | head -40 >&2 || true
      stale=1
    fi
  else
    cat "$generated/$file" > "$committed"
    echo "wrote $committed"
  fi
done
[ "$stale" = 0 ] || exit 1
if [ "$mode" = check ]; then
  echo "bindings are fresh ($pins)"
else
  echo "from $pins"
fi
