#!/bin/bash
# perf profiles of the engine and of the hand-written baseline, each alone:
# system-wide (-a -g, for the server's share and its functions) and the
# bench process only (dwarf call graphs, for the client), 6 s inside a
# 12 s criterion measurement:
#
#   OUT=/tmp/pg-prof scripts/with-postgres bench/pg-speed/profile.sh
#   perf report -i /tmp/pg-prof/engine.sys.data --sort comm -g none
#   perf report -i /tmp/pg-prof/engine.client.data --children --sort sym
#
# Per-request CPU = share of samples x 2 cores / the criterion req/s
# printed at the end of each run.
set -uo pipefail
OUT=${OUT:-/tmp/pg-prof}
mkdir -p "$OUT"
for which in engine/pool hand-written; do
  tag=${which%%/*}
  cargo bench -p idempotency-bench --bench postgres -- "$which" --warm-up-time 2 --measurement-time 12 \
    >"$OUT/$tag.bench.log" 2>&1 &
  until grep -q "PG server" "$OUT/$tag.bench.log" 2>/dev/null; do sleep 0.2; done
  sleep 4
  bpid=$(pgrep -n -f 'target/release/deps/postgres-')
  uptime >"$OUT/$tag.uptime"
  perf record -a -F 999 -g -o "$OUT/$tag.sys.data" -- sleep 6 >/dev/null 2>&1 &
  sys=$!
  perf record -p "$bpid" -F 1999 --call-graph dwarf,16384 -o "$OUT/$tag.client.data" -- sleep 6 >/dev/null 2>&1
  wait "$sys"
  uptime >>"$OUT/$tag.uptime"
  wait
  echo "$which: $(grep -m1 -E 'thrpt:' "$OUT/$tag.bench.log")"
done
