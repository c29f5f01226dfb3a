#!/usr/bin/env bash
# Check that the published crates package, and that the packaged metrale-runtime
# builds and passes its own tests (unit, doc, and the GPU suites, which report
# ignored without a GPU), then dry-run the publication of both crates.
#
# Usage: scripts/check-package.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

cargo package --workspace --exclude metrale-fakecuda --quiet
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
cd "$root"
cargo publish --workspace --exclude metrale-fakecuda --dry-run --quiet
echo "packaging: both crates package, the packaged runtime's tests pass, publish dry run ok"
