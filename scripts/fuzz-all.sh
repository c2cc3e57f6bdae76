#!/usr/bin/env bash
# Runs every fuzz target for a bounded time, one after another.
#
#   scripts/fuzz-all.sh [SECONDS_PER_TARGET] [TARGET...]
#
# SECONDS_PER_TARGET defaults to 60; the targets default to all of them.
# Needs `cargo install cargo-fuzz`. Works on stable: it builds without a
# sanitizer unless FUZZ_SANITIZER is set (e.g. FUZZ_SANITIZER=address, which
# needs nightly or RUSTC_BOOTSTRAP=1).
#
# The seed corpus under fuzz/corpus/<target> is read, never written: inputs
# libFuzzer finds go to $FUZZ_WORK/<target> (default fuzz/target/corpus), and
# crashes to fuzz/artifacts/<target>. Logs go to $FUZZ_WORK/<target>.log.
# Exits non-zero if any target found a crash.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    targets=(canonicalize fingerprint_equivalence record_decode stored_structures)
fi
sanitizer="${FUZZ_SANITIZER:-none}"
work="${FUZZ_WORK:-fuzz/target/corpus}"
case "$work" in /*) ;; *) work="$PWD/$work" ;; esac

failed=()
for target in "${targets[@]}"; do
    mkdir -p "$work/$target"
    log="$work/$target.log"
    echo "== $target: ${seconds}s (sanitizer: $sanitizer), log: $log"
    # cargo fuzz runs from fuzz/; corpus paths are absolute.
    if (cd fuzz && cargo fuzz run --sanitizer "$sanitizer" "$target" \
        "$work/$target" "$PWD/corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1) >"$log" 2>&1; then
        grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || true
    else
        echo "!! $target failed; see $log and fuzz/artifacts/$target"
        tail -n 30 "$log"
        failed+=("$target")
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all targets ran ${seconds}s without a crash"
