#!/usr/bin/env bash
# Replay latency and throughput with and without the fast tiers, side by
# side in one run: shop on SQLite, PostgreSQL, PostgreSQL + Redis, and
# PostgreSQL + the in-process cache, each driven with replays only.
#
# Usage: bash bench/replay.sh [requests] [concurrency]
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-20000}
CONCURRENCY=${2:-32}
PG=${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
REDIS=${IDEM_BENCH_REDIS_URL:-redis://127.0.0.1:6379}

cargo build --release -q -p shop -p idem-load
BIN=${CARGO_TARGET_DIR:-target}/release
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

run() { # label, then shop arguments
  local label=$1; shift
  local schema="bench_$(date +%s%N)"
  local args=("$@")
  if [[ " ${args[*]} " == *" PGSCHEMA "* ]]; then
    psql "$PG" -qc "CREATE SCHEMA $schema"
    args=("${args[@]/PGSCHEMA/$PG?options=-c%20search_path%3D$schema}")
  fi
  SHOP_LOG=warn "$BIN/shop" --listen 127.0.0.1:0 "${args[@]}" > "$tmp/out" 2>"$tmp/err" &
  local pid=$!
  for _ in $(seq 1 100); do grep -q "listening on" "$tmp/out" && break; sleep 0.1; done
  local url
  url=$(sed -n 's/^shop listening on //p' "$tmp/out")/payments
  "$BIN/idem-load" --url "$url" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --mix replay=100 --label "$label" 2>>"$tmp/json"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if [[ " ${args[*]} " == *"search_path"* ]]; then PGOPTIONS="-c client_min_messages=warning" psql "$PG" -qc "DROP SCHEMA $schema CASCADE"; fi
}

echo "replays only: $REQUESTS requests, concurrency $CONCURRENCY, $(nproc) cores"
run "sqlite"                  --database-url "sqlite:$tmp/bench.db"
run "postgres"                --database-url PGSCHEMA
run "postgres + redis"        --database-url PGSCHEMA --redis-url "$REDIS" --redis-prefix "bench-$$"
run "postgres + process cache" --database-url PGSCHEMA --replay-cache 10000
echo
cat "$tmp/json"
