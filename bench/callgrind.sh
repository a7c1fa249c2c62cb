#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: a figure the
# machine's noise cannot move. idem-trivial with the memory store serves the
# same handler with idem's layer (`/payments`) and without it
# (`/bare/payments`); for each scenario the counters are zeroed, N1 requests
# run, the count is read, then N2 more, and the figure is the difference per
# request (so warm-up and the load tool's own set-up requests cancel out).
#
# Usage: bash bench/callgrind.sh [out.json]   (after building idem-trivial and
# idem-load in release mode; bench/run.sh does both and calls this)
#
#        bash bench/callgrind.sh --redis [out.json]
#   idem's Redis store beside aklanti's `idempotent` (its Valkey store) in
#   front of the same trivial endpoint, new keys, replays and in-flight
#   duplicates (answered `409`), needing Redis
#   (REDIS_URL, default redis://127.0.0.1:6379) and the peers built
#   (bench/rust-peers; bench/run.sh builds them). Each row also gives the
#   instructions SHA-256's block function took: valgrind does not pass the
#   CPU's SHA extensions through, so under callgrind `sha2` runs its portable
#   code, about ten times the instructions it takes on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CARGO_TARGET_DIR:-target}/release
MODE=memory
if [ "${1:-}" = --redis ]; then MODE=redis; shift; fi
OUT=${1:-/dev/stdout}
N1=${CALLGRIND_N1:-500}
N2=${CALLGRIND_N2:-2500}
REDIS=${REDIS_URL:-redis://127.0.0.1:6379}
PEERS_BIN=${IDEM_PEERS_TARGET_DIR:-$HOME/.cache/idem-peers-target}/release
work=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

PID=""
URL=""
SERVER=""
start() { # label, then the server's command line
  SERVER=$1; shift
  rm -f "$work"/cg.out* "$work/server.out"
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" --dump-instr=no \
    "$@" > "$work/server.out" 2> "$work/valgrind.err" &
  PID=$!
  for _ in $(seq 1 600); do grep -q "listening on" "$work/server.out" && break; sleep 0.1; done
  URL=$(sed -n 's/^.* listening on //p' "$work/server.out")
  [ -n "$URL" ] || { cat "$work/valgrind.err"; exit 1; }
}

stop() {
  kill -INT "$PID" 2>/dev/null || true
  # A server under valgrind may be slow to drain: it is not waited for.
  sleep 1
  kill -KILL "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
}

# The instructions counted since the last zeroing: callgrind_control -d
# writes a dump part whose `summary:` line holds them.
count() {
  local before after
  before=$(ls "$work" | grep -c '^cg.out' || true)
  callgrind_control -d "$PID" > /dev/null 2>&1
  for _ in $(seq 1 600); do
    after=$(ls "$work" | grep -c '^cg.out' || true)
    [ "$after" -gt "$before" ] && break
    sleep 0.1
  done
  local part
  part=$(ls -t "$work"/cg.out* | head -n 1)
  # The total and, for the Redis rows, SHA-256's block function's own
  # instructions (the memory rows report the total alone).
  local sha=0
  if [ "$MODE" = redis ]; then
    sha=$(callgrind_annotate --threshold=100 "$part" 2>/dev/null \
      | awk '/sha2::sha256::compress256/ {gsub(",", "", $1); print $1; exit}')
  fi
  echo "$(awk '/^summary:/ {print $2}' "$part") ${sha:-0}"
}

drive() { # path, mix, requests
  "$BIN/idem-load" --url "$URL$1" --requests "$3" --concurrency 4 --mix "$2" \
    --replay-keys 20 --label callgrind > /dev/null 2>&1
}

measure() { # name, path, mix
  drive "$2" "$3" 200 # warm-up: caches, pools, the allocator's arenas
  callgrind_control -z "$PID" > /dev/null 2>&1
  drive "$2" "$3" "$N1"
  local a b
  a=$(count)
  callgrind_control -z "$PID" > /dev/null 2>&1
  drive "$2" "$3" "$N2"
  b=$(count)
  # shellcheck disable=SC2086
  python3 -c "
import json, sys
name, server = sys.argv[1:3]
a, sa, b, sb, n1, n2 = map(int, sys.argv[3:])
row = {'scenario': name, 'instructions_per_request': (b - a) / (n2 - n1)}
if server != 'memory':
    row.update(server=server, sha256_instructions_per_request=(sb - sa) / (n2 - n1))
print(json.dumps(row))" "$1" "$SERVER" $a $b "$N1" "$N2"
}

if [ "$MODE" = memory ]; then
  start memory "$BIN/idem-trivial" --listen 127.0.0.1:0 --store memory
  {
    measure bare /bare/payments nokey=100
    measure new /payments new=100
    measure replay /payments replay=100
  } > "$work/result.jsonl"
  stop
else
  [ -x "$PEERS_BIN/idempotent-peer" ] || { echo "build the peers first (bench/rust-peers)" >&2; exit 1; }
  : > "$work/result.jsonl"
  prefix="callgrind-$$"
  for server in idem idempotent; do
    case $server in
      idem) start "idem (redis)" "$BIN/idem-trivial" --listen 127.0.0.1:0 --store redis \
              --redis-url "$REDIS" --redis-prefix "$prefix-idem" ;;
      idempotent) start "idempotent (redis)" "$PEERS_BIN/idempotent-peer" --listen 127.0.0.1:0 \
              --store redis --redis-url "$REDIS" --redis-prefix "$prefix-peer" ;;
    esac
    {
      measure new /payments new=100
      measure replay /payments replay=100
      measure inflight /payments inflight=100
    } >> "$work/result.jsonl"
    stop
  done
  # The records the runs left (they would expire by themselves).
  for p in "$prefix-idem" "$prefix-peer"; do
    redis-cli -u "$REDIS" --scan --pattern "$p*" | xargs -r redis-cli -u "$REDIS" DEL > /dev/null
  done
fi
cat "$work/result.jsonl" > "$OUT"
