#!/usr/bin/env bash
# The outbox relay's throughput through real brokers, one run, this machine:
# in process, RabbitMQ (publisher confirms) and NATS JetStream (acks), with
# one and two relays.
#
# Usage: bash bench/relay.sh [messages]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
cargo build --release -q -p idem-relay-bench
BIN=${CARGO_TARGET_DIR:-target}/release/idem-relay-bench
echo "outbox relay: $N committed messages, PostgreSQL, $(nproc) cores"
for broker in in-process "amqp://guest:guest@127.0.0.1:5672/%2f" "nats://127.0.0.1:4222"; do
  for relays in 1 2; do
    "$BIN" --broker "$broker" --messages "$N" --relays "$relays"
  done
done
