#!/usr/bin/env bash
# Build the GPU suites and the benchmarks here (release, every optional feature)
# and copy the executables, named by target, into a folder for a GPU host that
# has no Rust toolchain:
#
#   scripts/gpu-bundle.sh .gpu/new      # then carry .gpu to the GPU host and run
#   .gpu/new/test-gpu                   # METRALE_REQUIRE_GPU=1 there
#   .gpu/new/bench-launch --quick
#
# Files are named `test-<name>`, `bench-<name>`, `example-<name>` and `bin-<name>`
# (metrale-decode's tests `test-decode-<name>`). The folder
# is emptied first. Tests embed their fixtures, so the files run from any folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-bundle.sh OUT_DIR}
features=${METRALE_BUNDLE_FEATURES:-nccl,nvrtc,cublas,nvtx}
rm -rf "$out"
mkdir -p "$out"
{
  cargo build --release -p metrale-runtime --features "$features" \
    --tests --benches --examples --message-format=json-render-diagnostics
  cargo build --release -p metrale-decode --features plot \
    --tests --bins --message-format=json-render-diagnostics
} 2>/dev/null |
  python3 -c '
import json, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    kind = t["kind"][0]
    if kind == "lib" or kind == "custom-build":
        continue
    if kind == "bin" and m.get("profile", {}).get("test"):
        continue  # the unit-test harness of a binary, not the command
    prefix = {"test": "test", "bench": "bench", "example": "example", "bin": "bin"}.get(kind)
    if prefix is None:
        continue
    pkg = m["package_id"].split("#")[0].rsplit("/", 1)[-1]
    name = t["name"] if pkg == "metrale-runtime" or prefix == "bin" else pkg.replace("metrale-", "") + "-" + t["name"]
    shutil.copy(m["executable"], out + "/" + prefix + "-" + name)

' "$out"
strip "$out"/* 2>/dev/null || true
ls "$out"
