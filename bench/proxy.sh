#!/usr/bin/env bash
# `idem proxy` in front of a trivial upstream (idem-trivial's
# `/bare/payments`: answer 201 with a fresh id), measured from outside with
# idem-load (HTTP/1.1, concurrency 32): the upstream alone and new keys
# through the proxy alternated in rounds (medians), then replays of completed
# keys and duplicates of an in-flight key; on SQLite, PostgreSQL and Redis
# alone; and the proxy passing requests through unguarded (the hop's own
# cost, the ceiling of the guarded rows). When ldclabs' idempotent-proxy (the Redis reverse proxy peer) is
# built, its new keys and replays are measured in the same rounds:
#
#   git clone https://github.com/ldclabs/idempotent-proxy && cd idempotent-proxy
#   cargo build --release -p idempotent-proxy-server
#   IDEMPOTENT_PROXY_BIN=$PWD/target/release/idempotent-proxy-server bash bench/proxy.sh
#
# Prints the Markdown rows of BENCHMARKS.md's proxy table.
#
#   bash bench/proxy.sh [requests] [rounds]      (default 5000 7)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS="${1:-5000}"
ROUNDS="${2:-7}"
PG=${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
REDIS=${IDEM_BENCH_REDIS_URL:-redis://127.0.0.1:6379}
PEER=${IDEMPOTENT_PROXY_BIN:-$HOME/.cache/idempotent-proxy-target/release/idempotent-proxy-server}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"
export PGOPTIONS="-c client_min_messages=warning"
# idem-trivial on its own, with only its own features (as bench/run.sh does)
cargo build --release -q -p idem-trivial
cargo build --release -q -p idem-cli -p idem-load
BIN="$CARGO_TARGET_DIR/release"
out=$(mktemp -d)
SCHEMA="bench_proxy_$(date +%s%N)"
PREFIX="bench-proxy-$(date +%s%N)"
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  wait 2>/dev/null || true
  psql "$PG" -qc "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null 2>&1 || true
  # SCAN, not KEYS: KEYS holds a shared server while it reads every key.
  redis-cli -u "$REDIS" --scan --pattern "$PREFIX:*" | xargs -r -d '\n' -n 1000 redis-cli -u "$REDIS" DEL >/dev/null 2>&1 || true
  rm -rf "$out"
}
trap cleanup EXIT

# Starts a server in the background, its output in $out/NAME.log; waits for
# its "listening on http://ADDR" line and prints ADDR's URL.
start() {
  local name=$1
  shift
  "$@" >"$out/$name.log" 2>"$out/$name.err" &
  for _ in $(seq 1 200); do
    if grep -qo 'listening on http://[0-9.:]*' "$out/$name.log"; then
      grep -o 'http://[0-9.:]*' "$out/$name.log" | head -1
      return
    fi
    sleep 0.05
  done
  echo "$name did not start:" >&2
  cat "$out/$name.err" >&2
  exit 1
}

upstream=$(start upstream "$BIN/idem-trivial" --listen 127.0.0.1:0)
psql "$PG" -qc "CREATE SCHEMA $SCHEMA"
declare -A proxy
proxy[sqlite]=$(start sqlite "$BIN/idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" \
  --database-url "sqlite:$out/proxy.db")
proxy[postgres]=$(start postgres "$BIN/idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" \
  --database-url "$PG?options=-c%20search_path%3D$SCHEMA")
proxy[redis]=$(start redis "$BIN/idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" \
  --database-url "$REDIS" --redis-prefix "$PREFIX")
# The same proxy guarding no method: POST passes through, so its row is the
# HTTP hop alone (the ceiling of every guarded row).
hop=$(start hop "$BIN/idem" proxy --listen 127.0.0.1:0 --upstream "$upstream" \
  --database-url "sqlite:$out/hop.db" --methods PUT)
stores=(sqlite postgres redis)
peer=""
if [ -x "$PEER" ]; then
  mkdir -p "$out/peer"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis_hostport=${REDIS#redis://}
  cat >"$out/peer/.env" <<EOF
SERVER_ADDR=127.0.0.1:$port
REDIS_URL=$redis_hostport
LOG_LEVEL=error
URL_BENCH=$upstream/bare/payments
EOF
  (cd "$out/peer" && exec "$PEER") >"$out/peer.log" 2>&1 &
  for _ in $(seq 1 100); do
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then break; fi
    sleep 0.05
  done
  peer="http://127.0.0.1:$port/URL_BENCH"
fi

results="$out/results.jsonl"
load() { # label url mix
  "$BIN/idem-load" --url "$2" --concurrency 32 --requests "$REQUESTS" --mix "$3" --label "$1" \
    >/dev/null 2>>"$results"
}
for round in $(seq 1 "$ROUNDS"); do
  load bare "$upstream/bare/payments" new=100
  load hop "$hop/bare/payments" new=100
  for s in "${stores[@]}"; do
    load "$s new" "${proxy[$s]}/bare/payments" new=100
  done
  if [ -n "$peer" ]; then load "idempotent-proxy new" "$peer" new=100; fi
done
for s in "${stores[@]}"; do
  load "$s replay" "${proxy[$s]}/bare/payments" replay=100
  load "$s inflight" "${proxy[$s]}/bare/payments" inflight=100
done
if [ -n "$peer" ]; then load "idempotent-proxy replay" "$peer" replay=100; fi

python3 - "$results" "$ROUNDS" <<'EOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    rows.setdefault(r["label"], []).append(r)
def med(label, field):
    return statistics.median(r[field] for r in rows[label])
bare_rps, bare_p50 = med("bare", "rps"), med("bare", "p50_ms")
print("| config | scenario | req/s | p50 ms | p99 ms | errors | vs upstream alone (req/s) | vs upstream alone (p50) | runs |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
def row(config, scenario, label):
    if label not in rows:
        return
    rps, p50, p99 = med(label, "rps"), med(label, "p50_ms"), med(label, "p99_ms")
    errors = sum(r["errors"] for r in rows[label])
    print(f"| {config} | {scenario} | {rps:.0f} | {p50:.2f} | {p99:.2f} | {errors} | {rps / bare_rps:.2f}× | {p50 / bare_p50:.2f}× | {len(rows[label])} |")
row("upstream alone", "no proxy", "bare")
row("idem proxy, guarding no method", "pass-through (the hop alone)", "hop")
for s, name in [("sqlite", "idem proxy, SQLite"), ("postgres", "idem proxy, PostgreSQL"), ("redis", "idem proxy, Redis alone")]:
    for scenario in ["new", "replay", "inflight"]:
        row(name, {"new": "new keys", "replay": "replays", "inflight": "in-flight duplicates (409)"}[scenario], f"{s} {scenario}")
row("idempotent-proxy (ldclabs), Redis", "new keys", "idempotent-proxy new")
row("idempotent-proxy (ldclabs), Redis", "replays", "idempotent-proxy replay")
EOF
