#!/usr/bin/env bash
# Check that the published crates package, and that the packaged metrale-runtime
# builds and passes its own tests (unit, doc, and the GPU suites, which report
# ignored without a GPU), then dry-run the publication of both crates.
#
# Usage: scripts/check-package.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

cargo package --workspace --exclude metrale-fakecuda --exclude metrale-readme --exclude metrale-cli --quiet
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for crate in metrale-cuda-sys metrale-runtime; do
  file=$(ls -t target/package/"$crate"-[0-9]*.crate | head -1)
  tar -xzf "$file" -C "$work"
done
sys_dir=$(ls -d "$work"/metrale-cuda-sys-*)
cd "$work"/metrale-runtime-*/
# The packaged runtime names metrale-cuda-sys by version; use the packaged copy.
CARGO_TARGET_DIR="$root/target/packaged" cargo test --quiet \
  --config "patch.crates-io.metrale-cuda-sys.path=\"$sys_dir\""
# A downstream crate outside the workspace, on the packaged crates, compiles a
# program that uses the public API as users do (scripts/downstream/main.rs).
down="$work/downstream"
mkdir -p "$down/src"
cp "$root/scripts/downstream/main.rs" "$down/src/main.rs"
runtime_dir=$(ls -d "$work"/metrale-runtime-*)
cat > "$down/Cargo.toml" <<TOML
[package]
name = "metrale-downstream-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
metrale-runtime = { path = "$runtime_dir" }
anyhow = "1"

[patch.crates-io]
metrale-cuda-sys = { path = "$sys_dir" }

[workspace]
TOML
(cd "$down" && CARGO_TARGET_DIR="$root/target/packaged" cargo build --quiet)
echo "downstream: a crate on the packaged crates builds (prelude, owned blobs, anyhow in a capture)"
cd "$root"
cargo publish --workspace --exclude metrale-fakecuda --exclude metrale-readme --exclude metrale-cli --dry-run --quiet
echo "packaging: both crates package, the packaged runtime's tests pass, publish dry run ok"
