#!/usr/bin/env bash
# Regenerate metrale-cuda-sys/src/bindings.rs from the pinned CUDA header.
#
#   scripts/regen-bindings.sh          rewrite the committed bindings
#   scripts/regen-bindings.sh --check  fail if the committed bindings differ
#
# The header comes from the PyPI package nvidia-cuda-runtime (pinned below),
# fetched with `pip download` into .cuda-header/ (ignored by git). The bindings
# are produced by the crate's own build script (feature `bindgen`), so a feature
# build and the committed file share one bindgen configuration. Needs libclang
# (Debian: libclang-dev) and rustfmt.
set -euo pipefail

PACKAGE=nvidia-cuda-runtime
VERSION=13.0.96

root=$(cd "$(dirname "$0")/.." && pwd)
committed=$root/metrale-cuda-sys/src/bindings.rs
cache=$root/.cuda-header/$PACKAGE-$VERSION
include=$cache/nvidia/cu13/include

mode=write
case "${1:-}" in
  --check) mode=check ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if [ ! -f "$include/cuda.h" ]; then
  wheels=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.12 \
    -d "$wheels" "$PACKAGE==$VERSION"
  mkdir -p "$cache"
  python3 -m zipfile -e "$wheels"/*.whl "$cache"
  rm -rf "$wheels"
fi
[ -f "$include/cuda.h" ] || { echo "cuda.h not found in $include" >&2; exit 1; }

generated=$(mktemp --suffix=.rs)
trap 'rm -f "$generated"' EXIT
(cd "$root" && METRALE_CUDA_INCLUDE_DIR=$include METRALE_BINDINGS_OUT=$generated \
  cargo build --quiet -p metrale-cuda-sys --features bindgen)
rustfmt --edition 2021 "$generated"

if [ "$mode" = check ]; then
  if ! diff -q "$committed" "$generated" >/dev/null; then
    echo "metrale-cuda-sys/src/bindings.rs is stale; run scripts/regen-bindings.sh" >&2
    diff -u "$committed" "$generated" | head -40 >&2 || true
    exit 1
  fi
  echo "bindings are fresh ($PACKAGE==$VERSION)"
else
  cat "$generated" > "$committed"
  echo "wrote $committed ($PACKAGE==$VERSION)"
fi
