#!/usr/bin/env bash
# Check that the driver suites' runner (metrale-runtime/tests/support/harness.rs)
# runs what it is asked to run and reports it as libtest does:
#
# - fault_injection (the stand-in driver; runs everywhere): every test listed by
#   `--list` runs and passes, plainly and under `--test-threads 1`,
#   `--test-threads 4` (still one thread), `--format terse`, `--format json`
#   (stdout is JSON only) and `--include-ignored`; `--list --ignored` lists
#   nothing and `--ignored` runs nothing; `--exact NAME`, `--exact --skip NAME`
#   and a name filter select what they name; an unknown flag is an error, not a
#   name filter.
# - gpu and gpu_multi, pointed at a driver path that does not exist (so this
#   holds on any machine, with or without GPUs): every test is ignored, with the
#   reason printed once; `--list --ignored` lists them all; `--ignored` fails
#   them; METRALE_REQUIRE_GPU=1 (gpu) and METRALE_REQUIRE_GPUS=2 (gpu_multi) fail
#   them and the output names the setting.
#
# Exits non-zero on any mismatch, after printing what it saw.
# Usage: scripts/check-harness.sh
set -euo pipefail
cd "$(dirname "$0")/.."
unset METRALE_REQUIRE_GPU METRALE_REQUIRE_GPUS METRALE_TEST_CHILD
export CARGO_TERM_COLOR=never

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

failures=0
out="" err="" rc=0
# The GPU suites run with a driver that cannot be loaded: the no-GPU case, anywhere.
nodriver=METRALE_LIBCUDA_PATH=/nonexistent/metrale-check-harness/libcuda.so.1

# run [VAR=value...] EXE ARGS...: stdout in $out, stderr in $err, status in $rc.
run() {
  set +e
  out=$(env "$@" 2>"$tmp/err")
  rc=$?
  set -e
  err=$(<"$tmp/err")
}

saw() {
  printf '  command: %s\n  exit status: %s\n' "$*" "$rc" >&2
  printf '  stdout (last 15 lines):\n' >&2
  tail -n 15 <<<"$out" | sed 's/^/    | /' >&2
  printf '  stderr (last 15 lines):\n' >&2
  tail -n 15 <<<"$err" | sed 's/^/    | /' >&2
}

# check WHAT CONDITION-STATUS COMMAND...: report the check, and what was seen on
# a mismatch.
check() {
  local what=$1 status=$2
  shift 2
  if [ "$status" -eq 0 ]; then
    printf 'ok: %s\n' "$what"
  else
    printf 'MISMATCH: %s\n' "$what" >&2
    saw "$@"
    failures=$((failures + 1))
  fi
}

# expect_summary WANT_RC SUMMARY [VAR=value...] EXE ARGS...: run, then require the
# exit status and a `test result:` line starting with SUMMARY.
expect_summary() {
  local want_rc=$1 summary=$2
  shift 2
  run "$@"
  local good=0
  [ "$rc" -eq "$want_rc" ] || good=1
  grep -q "^test result: ${summary}" <<<"$out" || good=1
  check "$(label "$@"): exit $want_rc, \"$summary\"" "$good" "$@"
}

# label [VAR=value...] EXE ARGS...: the command with the executable's short name.
label() {
  local words=() w
  for w in "$@"; do
    if [ "$w" = "$fi_exe" ]; then w=fault_injection; fi
    if [ "$w" = "$gpu_exe" ]; then w=gpu; fi
    if [ "$w" = "$multi_exe" ]; then w=gpu_multi; fi
    if [ "$w" = "$nodriver" ]; then w="(no driver)"; fi
    words+=("$w")
  done
  printf '%s' "${words[*]}"
}

echo "==> building the three driver suites"
cargo test -p metrale-runtime --test fault_injection --test gpu --test gpu_multi \
  --no-run --message-format=json --quiet >"$tmp/build.json"
exe_of() {
  grep -F '"kind":["test"]' "$tmp/build.json" | grep -F "\"name\":\"$1\"" |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1
}
fi_exe=$(exe_of fault_injection)
gpu_exe=$(exe_of gpu)
multi_exe=$(exe_of gpu_multi)
for e in "$fi_exe" "$gpu_exe" "$multi_exe"; do
  if [ -z "$e" ] || [ ! -x "$e" ]; then
    echo "check-harness: could not find a test executable in cargo's output" >&2
    exit 1
  fi
done

echo "==> fault_injection (stand-in driver)"
run "$fi_exe" --list
n=$(grep -c ': test$' <<<"$out" || true)
others=$(grep -vc ': test$' <<<"$out" || true)
[ "$rc" -eq 0 ] && [ "$n" -gt 0 ] && [ "$others" -eq 0 ] && s=0 || s=1
check "fault_injection --list: $n tests, nothing else on stdout" $s "$fi_exe" --list
names=$(sed -n 's/: test$//p' <<<"$out")
first=$(head -n 1 <<<"$names")
module=${first%%::*}::
m=$(grep -c "^${module}" <<<"$names" || true)

run "$fi_exe" --list --ignored
[ "$rc" -eq 0 ] && [ -z "$out" ] && s=0 || s=1
check "fault_injection --list --ignored: lists nothing" $s "$fi_exe" --list --ignored

all_pass="ok. $n passed; 0 failed; 0 ignored; 0 measured; 0 filtered out;"
expect_summary 0 "$all_pass" "$fi_exe"
expect_summary 0 "$all_pass" "$fi_exe" --test-threads 1
expect_summary 0 "$all_pass" "$fi_exe" --test-threads=1
expect_summary 0 "$all_pass" "$fi_exe" --test-threads 4
grep -q 'one at a time' <<<"$err" && s=0 || s=1
check "fault_injection --test-threads 4: says on stderr that tests run one at a time" $s \
  "$fi_exe" --test-threads 4
expect_summary 0 "$all_pass" "$fi_exe" --format terse
expect_summary 0 "$all_pass" "$fi_exe" --include-ignored
expect_summary 0 "ok. 0 passed; 0 failed; 0 ignored; 0 measured; $n filtered out;" \
  "$fi_exe" --ignored
expect_summary 0 "ok. 1 passed; 0 failed; 0 ignored; 0 measured; $((n - 1)) filtered out;" \
  "$fi_exe" --exact "$first"
expect_summary 0 "ok. $((n - 1)) passed; 0 failed; 0 ignored; 0 measured; 1 filtered out;" \
  "$fi_exe" --exact --skip "$first"
expect_summary 0 "ok. $m passed; 0 failed; 0 ignored; 0 measured; $((n - m)) filtered out;" \
  "$fi_exe" "$module"

for args in "--format json" "-Z unstable-options --format json"; do
  # shellcheck disable=SC2086 # the flags are meant to split
  run "$fi_exe" $args
  good=0
  [ "$rc" -eq 0 ] || good=1
  if grep -qv '^{' <<<"$out"; then good=1; fi
  tail -n 1 <<<"$out" |
    grep -Eq "\"event\": *\"ok\", *\"passed\": *$n, *\"failed\": *0, *\"ignored\": *0, *\"measured\": *0, *\"filtered_out\": *0" ||
    good=1
  # shellcheck disable=SC2086
  check "fault_injection $args: exit 0, JSON lines only, suite ok with $n passed" "$good" \
    "$fi_exe" $args
done

run "$fi_exe" --no-such-flag
[ "$rc" -ne 0 ] && ! grep -q '^test result:' <<<"$out" && s=0 || s=1
check "fault_injection --no-such-flag: an error, not a name filter" $s "$fi_exe" --no-such-flag

for suite in gpu gpu_multi; do
  if [ "$suite" = gpu ]; then
    exe=$gpu_exe setting=METRALE_REQUIRE_GPU=1
  else
    exe=$multi_exe setting=METRALE_REQUIRE_GPUS=2
  fi
  echo "==> $suite without a driver ($nodriver)"
  run "$nodriver" "$exe" --list
  k=$(grep -c ': test$' <<<"$out" || true)
  [ "$rc" -eq 0 ] && [ "$k" -gt 0 ] && [ -z "$(grep -v ': test$' <<<"$out")" ] && s=0 || s=1
  check "$suite --list: $k tests, nothing else on stdout" $s "$nodriver" "$exe" --list
  run "$nodriver" "$exe" --list --ignored
  [ "$rc" -eq 0 ] && [ "$(grep -c ': test$' <<<"$out" || true)" -eq "$k" ] && s=0 || s=1
  check "$suite --list --ignored: lists all $k (ignored here)" $s \
    "$nodriver" "$exe" --list --ignored

  ignored="ok. 0 passed; 0 failed; $k ignored; 0 measured; 0 filtered out;"
  expect_summary 0 "$ignored" "$nodriver" "$exe"
  [ "$(grep -c 'ignored here: .*/nonexistent/metrale-check-harness/' <<<"$out" || true)" -eq 1 ] && s=0 || s=1
  check "$suite: the reason is printed once, before the run" $s "$nodriver" "$exe"
  expect_summary 0 "$ignored" "$nodriver" "$exe" --test-threads 1
  expect_summary 101 "FAILED. 0 passed; $k failed; 0 ignored; 0 measured; 0 filtered out;" \
    "$nodriver" "$exe" --ignored
  expect_summary 101 "FAILED. 0 passed; $k failed; 0 ignored; 0 measured; 0 filtered out;" \
    "$nodriver" "$setting" "$exe"
  grep -qF "(required: $setting)" <<<"$out" && s=0 || s=1
  check "$setting $suite: the failures name $setting" $s "$nodriver" "$setting" "$exe"

  run "$nodriver" "$exe" --format json
  good=0
  [ "$rc" -eq 0 ] || good=1
  if grep -qv '^{' <<<"$out"; then good=1; fi
  tail -n 1 <<<"$out" | grep -Eq "\"event\": *\"ok\", *\"passed\": *0, *\"failed\": *0, *\"ignored\": *$k," ||
    good=1
  grep -q 'ignored here:' <<<"$err" || good=1
  check "$suite --format json: JSON lines only, $k ignored, the reason on stderr" "$good" \
    "$nodriver" "$exe" --format json
done

if [ "$failures" -ne 0 ]; then
  echo "check-harness: $failures mismatch(es)" >&2
  exit 1
fi
echo "check-harness: the driver suites run what they are asked to run"
