#!/bin/bash
# Statements, commits and WAL per request of the engine and of the
# hand-written baseline (bench/benches/postgres.rs), one criterion bench
# each, counted by pg_stat_statements on a throwaway server:
#
#   scripts/with-postgres bench/pg-speed/count.sh
#
# Loads pg_stat_statements (ALTER SYSTEM + a restart of the throwaway
# server), then for each system resets the counters, runs its criterion
# bench alone and prints pg_stat_database's commits, the statements by
# calls, and pg_stat_wal. Divide by the calls of the completion UPDATE
# (one per request).
set -euo pipefail
# The newest installed PostgreSQL's tools (as scripts/with-postgres picks).
B="$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
U="$IDEMPOTENCY_TEST_PG"
D="$IDEMPOTENCY_TEST_PG_DATA"
PG_USER="${IDEMPOTENCY_TEST_PG_USER:-$(id -un)}"
as_pg() { if [ "$(id -u)" -eq 0 ]; then (cd /tmp && runuser -u "$PG_USER" -- "$@"); else "$@"; fi; }
"$B/psql" "$U" -qc "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"
as_pg "$B/pg_ctl" -D "$D" -w -t 60 restart -l "$D/../server.log" >/dev/null
"$B/psql" "$U" -qc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
for which in engine/pool hand-written; do
  "$B/psql" "$U" -qc "SELECT pg_stat_statements_reset(); SELECT pg_stat_reset(); SELECT pg_stat_reset_shared('wal');" >/dev/null
  cargo bench -p idempotency-bench --bench postgres -- "$which" 2>&1 | grep -E "thrpt:" || true
  echo "=== $which"
  "$B/psql" "$U" -c "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = current_database()"
  "$B/psql" "$U" -c "SELECT calls, rows, round(mean_exec_time::numeric, 3) AS mean_ms,
      left(regexp_replace(query, '\s+', ' ', 'g'), 120) AS query
    FROM pg_stat_statements ORDER BY calls DESC LIMIT 8"
  "$B/psql" "$U" -c "SELECT wal_records, wal_bytes, wal_fpi FROM pg_stat_wal"
done
