#!/usr/bin/env bash
# Check that the README's and the guide's Rust examples pass `cargo clippy -- -D warnings` as a
# user's code would: each ```rust block (hidden `# ` lines included, as rustdoc
# compiles them) becomes an example of a small crate outside the workspace that
# depends on metrale-runtime by path, with clippy's default lints and none of
# rustdoc's allowances (doctests run under `#![allow(unused)]`; user code does
# not). metrale-readme's doctests check that the blocks compile; this checks
# that copying one raises no warning.
#
# Usage: scripts/check-readme-clippy.sh [--features nvrtc,nccl,cublas,nvtx]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
crate="$root/target/readme-clippy"
rm -rf "$crate"
mkdir -p "$crate/examples" "$crate/src"

cat >"$crate/Cargo.toml" <<EOF
[package]
name = "readme-clippy"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
metrale-runtime = { path = "$root/metrale-runtime" }
# The blas chapter's element types, as a user of the feature depends on them.
half = { version = "2", optional = true, default-features = false }

[features]
nvrtc = ["metrale-runtime/nvrtc"]
nccl = ["metrale-runtime/nccl"]
nvtx = ["metrale-runtime/nvtx"]
cublas = ["metrale-runtime/cublas", "dep:half"]
EOF
echo "//! Not a library: the README's examples are under examples/." >"$crate/src/lib.rs"

# One example per ```rust block, named by its file and the line it starts on: the
# README and every chapter of the guide (`guide/mod.rs` is read without its `//!`).
extract() { # name file
  awk -v dir="$crate/examples" -v name="$1" '
    /^```rust/ {
      if ($0 ~ /ignore|compile_fail|should_panic/) { skip = 1 } else { skip = 0 }
      inside = 1; file = sprintf("%s/%s_line_%04d.rs", dir, name, NR); next
    }
    inside && /^```/ { inside = 0; if (!skip) close(file); next }
    inside && !skip {
      line = $0
      if (line == "#") line = ""
      else if (substr(line, 1, 2) == "# ") line = substr(line, 3)
      print line > file
    }
  ' "$2"
}
extract readme "$root/README.md"
for chapter in "$root"/metrale-runtime/src/guide/*.md; do
  extract "guide_$(basename "$chapter" .md)" "$chapter"
done
sed -e 's#^//! \{0,1\}##' "$root/metrale-runtime/src/guide/mod.rs" >"$crate/guide_mod.md"
extract guide_mod "$crate/guide_mod.md"

count=$(find "$crate/examples" -name '*.rs' | wc -l)
if [ "$count" -eq 0 ]; then echo "no rust blocks found" >&2; exit 1; fi
echo "README and guide: $count Rust blocks, each an example of $crate"
CARGO_TARGET_DIR="$root/target" cargo clippy --quiet --manifest-path "$crate/Cargo.toml" \
  --keep-going --examples "$@" -- -D warnings
echo "README and guide: every block passes clippy -D warnings as user code"
