#!/usr/bin/env bash
# Runs a command against a throwaway PostgreSQL server for the benches:
#
#   bench/with-postgres.sh cargo bench -p idempotency-bench --bench postgres
#
# initdb, pg_ctl and postgres must be on PATH. The server gets its own temp
# data directory (under $IDEMPOTENCY_BENCH_DIR, else target/tmp: the real
# disk, not a tmpfs where fsync is free), listens on 127.0.0.1 on a free
# port with trust auth for user postgres, and runs with fsync=on,
# synchronous_commit=on and max_connections=200 (the bench holds 64 pooled
# engine connections and 64 baseline connections at once). As root, it runs
# as the `postgres` OS user. It is stopped and deleted on every exit path.
# The command sees IDEMPOTENCY_BENCH_PG (and IDEMPOTENCY_TEST_PG) set to its
# connection string, and runs in the current directory.
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi
for tool in initdb pg_ctl postgres; do
    command -v "$tool" >/dev/null || { echo "$0: $tool is not on PATH" >&2; exit 1; }
done

root="$(cd "$(dirname "$0")/.." && pwd)"
base="${IDEMPOTENCY_BENCH_DIR:-$root/target/tmp}"
mkdir -p "$base"
data="$(mktemp -d "$base/pg-bench.XXXXXX")"

as_owner=()
if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || { echo "$0: running as root needs an OS user 'postgres'" >&2; exit 1; }
    chown postgres "$data"
    chmod 700 "$data"
    as_owner=(runuser -u postgres --)
fi

started=0
cleanup() {
    if [ "$started" = 1 ]; then
        "${as_owner[@]}" pg_ctl -D "$data/db" -m immediate -w stop >/dev/null 2>&1 || true
    fi
    rm -rf "$data"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"${as_owner[@]}" initdb -D "$data/db" --auth=trust -U postgres -E UTF8 --no-instructions >"$data/initdb.log" 2>&1 ||
    { cat "$data/initdb.log" >&2; exit 1; }
started=1
"${as_owner[@]}" pg_ctl -D "$data/db" -l "$data/server.log" -w -t 60 start \
    -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$data \
        -c max_connections=200 -c fsync=on -c synchronous_commit=on -c full_page_writes=on" >/dev/null ||
    { cat "$data/server.log" >&2; exit 1; }

export IDEMPOTENCY_BENCH_PG="host=127.0.0.1 port=$port user=postgres dbname=postgres"
export IDEMPOTENCY_TEST_PG="$IDEMPOTENCY_BENCH_PG"
echo "with-postgres: server on 127.0.0.1:$port, data in $data/db ($(postgres --version))" >&2
"$@"
