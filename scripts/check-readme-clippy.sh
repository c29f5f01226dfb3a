#!/usr/bin/env bash
# Check that the README's Rust examples pass `cargo clippy -- -D warnings` as a
# user's code would: each ```rust block (hidden `# ` lines included, as rustdoc
# compiles them) becomes an example of a small crate outside the workspace that
# depends on metrale-runtime by path, with clippy's default lints and none of
# rustdoc's allowances (doctests run under `#![allow(unused)]`; user code does
# not). metrale-readme's doctests check that the blocks compile; this checks
# that copying one raises no warning.
#
# Usage: scripts/check-readme-clippy.sh [--features nvrtc,nccl]
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

[features]
nvrtc = ["metrale-runtime/nvrtc"]
nccl = ["metrale-runtime/nccl"]
EOF
echo "//! Not a library: the README's examples are under examples/." >"$crate/src/lib.rs"

# One example per ```rust block, named by the line it starts on.
awk -v dir="$crate/examples" '
  /^```rust/ {
    if ($0 ~ /ignore|compile_fail|should_panic/) { skip = 1 } else { skip = 0 }
    inside = 1; file = sprintf("%s/readme_line_%04d.rs", dir, NR); n++; next
  }
  inside && /^```/ { inside = 0; if (!skip) close(file); next }
  inside && !skip {
    line = $0
    if (line == "#") line = ""
    else if (substr(line, 1, 2) == "# ") line = substr(line, 3)
    print line > file
  }
  END { if (n == 0) { print "no rust blocks found" > "/dev/stderr"; exit 1 } }
' "$root/README.md"

count=$(find "$crate/examples" -name '*.rs' | wc -l)
echo "README: $count Rust blocks, each an example of $crate"
CARGO_TARGET_DIR="$root/target" cargo clippy --quiet --manifest-path "$crate/Cargo.toml" \
  --keep-going --examples "$@" -- -D warnings
echo "README: every block passes clippy -D warnings as user code"
