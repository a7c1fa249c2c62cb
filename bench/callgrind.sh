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
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CARGO_TARGET_DIR:-target}/release
OUT=${1:-/dev/stdout}
N1=${CALLGRIND_N1:-500}
N2=${CALLGRIND_N2:-2500}
work=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" --dump-instr=no \
  "$BIN/idem-trivial" --listen 127.0.0.1:0 --store memory > "$work/server.out" 2> "$work/valgrind.err" &
PID=$!
for _ in $(seq 1 600); do grep -q "listening on" "$work/server.out" && break; sleep 0.1; done
URL=$(sed -n 's/^.* listening on //p' "$work/server.out")
[ -n "$URL" ] || { cat "$work/valgrind.err"; exit 1; }

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
  awk '/^summary:/ {print $2}' "$part"
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
  python3 -c "import json,sys; a,b,n1,n2=map(int,sys.argv[2:]); print(json.dumps({'scenario': sys.argv[1], 'instructions_per_request': (b-a)/(n2-n1)}))" \
    "$1" "$a" "$b" "$N1" "$N2"
}

{
  measure bare /bare/payments nokey=100
  measure new /payments new=100
  measure replay /payments replay=100
} > "$work/result.jsonl"
kill -INT "$PID" 2>/dev/null || true
cat "$work/result.jsonl" > "$OUT"
