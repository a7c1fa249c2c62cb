#!/usr/bin/env bash
# A unary gRPC call with and without idem's layer (tonic, one HTTP/2
# connection, concurrency 32): bare and new keys alternated in rounds
# (medians), replays of completed keys and duplicates of in-flight ones
# once each; with the memory store and with PostgreSQL. Prints the
# Markdown rows of BENCHMARKS.md's gRPC table.
#
#   bash bench/grpc.sh [requests] [rounds]      (default 5000 7)
set -euo pipefail
cd "$(dirname "$0")/.."
requests="${1:-5000}"
rounds="${2:-7}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"
cargo build --release -q -p idem-grpc-bench
bin="$CARGO_TARGET_DIR/release/idem-grpc-bench"
echo "| config | scenario | calls/s | p50 ms | p99 ms | errors | vs bare (calls/s) | vs bare (p50) | runs |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
for store in memory postgres; do
  "$bin" --store "$store" --requests "$requests" --concurrency 32 --rounds "$rounds"
done
