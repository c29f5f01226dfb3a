#!/usr/bin/env bash
# Fetch the pinned NVRTC and nvJitLink wheels into .nvrtc/ (ignored by git) and
# unpack them; print the folder holding their libraries.
#
#   lib=$(scripts/fetch-nvrtc.sh)
#   METRALE_LIBNVRTC_PATH=$lib/libnvrtc.so.13 \
#   METRALE_LIBNVJITLINK_PATH=$lib/libnvJitLink.so.13 \
#     cargo test -p metrale-runtime --features nvrtc
#
# Downloads with `pip download` by package name; a second run reuses what is there.
set -euo pipefail

PINS=("nvidia-cuda-nvrtc==13.0.88" "nvidia-nvjitlink==13.0.88")

root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/.nvrtc/13.0.88
lib=$dest/nvidia/cu13/lib
need=(libnvrtc.so.13 libnvrtc-builtins.so.13.0 libnvJitLink.so.13)

complete() {
  for f in "${need[@]}"; do [ -f "$lib/$f" ] || return 1; done
}

if ! complete; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.12 \
    -d "$wheels" "${PINS[@]}" >&2
  mkdir -p "$dest"
  for w in "$wheels"/*.whl; do
    python3 -m zipfile -e "$w" "$dest"
  done
fi
complete || { echo "fetch-nvrtc: $lib lacks one of: ${need[*]}" >&2; exit 1; }
printf '%s\n' "$lib"
