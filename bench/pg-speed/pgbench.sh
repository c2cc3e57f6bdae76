#!/bin/bash
# The server's cost of the engine's two hot statements against the
# baseline's, with the Rust clients out of the picture: pgbench (prepared
# statements, 8 clients, synchronous_commit=off so no request waits on an
# fsync) runs one request = claim + completion, each autocommitted, on
# the engine's table shape (pgbench-engine.sql: the one-statement claim
# of PgStore::claim_or_read, the compare-and-set UPDATE of in_place.rs,
# record bytes of 120 and 470 B) and on the baseline's
# (pgbench-baseline.sql: bench/benches/common/pg.rs's INSERT and UPDATE),
# alternating, 3 pairs of 8 s:
#
#   scripts/with-postgres bench/pg-speed/pgbench.sh
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
# The newest installed PostgreSQL's tools (as scripts/with-postgres picks).
B="$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
U="$IDEMPOTENCY_TEST_PG"
"$B/psql" "$U" -q -f "$HERE/pgbench-setup.sql"
export PGOPTIONS="-c synchronous_commit=off"
for i in 1 2 3; do
  for s in engine baseline; do
    tps=$("$B/pgbench" -n -M prepared -c 8 -j 2 -T 8 -f "$HERE/pgbench-$s.sql" "$U" 2>/dev/null |
      awk '/^tps/ {print $3}')
    echo "pair $i: $s $tps requests/s (load $(cut -d' ' -f1 /proc/loadavg))"
  done
done
