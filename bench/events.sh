#!/usr/bin/env bash
# Events end to end: from the business write (a payment, committed with its
# `PaymentAuthorized` event in the outbox) to the inbox's effect (the
# confirmation email, committed once by the `send-email` consumer), through
# the relay and a real broker: in process, RabbitMQ (publisher confirms,
# manual acks) and NATS JetStream (acks). shop on PostgreSQL does all of it.
#
# Two loads for each broker: a steady RATE of payments per second for
# STEADY_SECONDS, and as many as shop takes (REQUESTS at concurrency 32). Lag is an
# email's `created_at` minus its payment's (both milliseconds of shop's clock:
# the payment's is stamped in its transaction, the email's when the consumer
# starts on it, just before its own commit), read from the tables once every
# payment has its email; messages/s is payments over the time from the first
# payment to the last email.
#
# Each broker runs with each consumer concurrency in CONSUMER_CONCURRENCY
# (events a consumer handles at once; 1 is one at a time, in order).
#
# Usage: bash bench/events.sh     RATE=200 STEADY_SECONDS=20 REQUESTS=10000 CONSUMER_CONCURRENCY="1 4 16"
#        BROKERS="inprocess rabbitmq nats" (which to run); SHOP=path (another
#        shop binary, e.g. one built from an older commit; LABEL= is added to
#        each row's broker name)
# Prints a Markdown table and keeps the figures in bench/events.json.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-200}
STEADY_SECONDS=${STEADY_SECONDS:-20}
REQUESTS=${REQUESTS:-10000}
# each consumer's concurrency (shop --consumer-concurrency), one run each
CONSUMER_CONCURRENCY=${CONSUMER_CONCURRENCY:-1 4 16}
BROKERS=${BROKERS:-inprocess rabbitmq nats}
LABEL=${LABEL:-}
PG=${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
AMQP=${IDEM_BENCH_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
NATS=${IDEM_BENCH_NATS_URL:-nats://127.0.0.1:4222}
export PGOPTIONS="-c client_min_messages=warning"

cargo build --release -q -p shop -p idem-load
BIN=${CARGO_TARGET_DIR:-target}/release
SHOP=${SHOP:-$BIN/shop}
out=$(mktemp -d)
SCHEMA=""
PID=""
cleanup() {
  [ -n "$PID" ] && kill "$PID" 2>/dev/null || true
  if [ -n "$SCHEMA" ]; then
    forget_broker || true
    psql "$PG" -qc "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" || true
  fi
  rm -rf "$out"
}
trap cleanup EXIT
: > "$out/results.jsonl"

q() { PGOPTIONS="$PGOPTIONS -c search_path=$SCHEMA" psql "$PG" -Atc "$1"; }

# Waits until every payment since $1 (ms) has its email, for up to 120 s.
drained() {
  for _ in $(seq 1 1200); do
    left=$(q "SELECT count(*) FROM shop_payments p WHERE p.created_at >= $1
              AND NOT EXISTS (SELECT 1 FROM shop_emails e WHERE e.payment_id = p.id)")
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  echo "events did not drain: $left payments without their email" >&2
  exit 1
}

measure() { # broker, load, since (ms)
  drained "$3"
  q "SELECT json_build_object('broker', '$1', 'load', '$2',
       'events', count(*),
       'seconds', (max(e.created_at) - min(p.created_at)) / 1000.0,
       'per_s', count(*) / greatest((max(e.created_at) - min(p.created_at)) / 1000.0, 0.001),
       'lag_p50_ms', percentile_cont(0.5) WITHIN GROUP (ORDER BY e.created_at - p.created_at),
       'lag_p99_ms', percentile_cont(0.99) WITHIN GROUP (ORDER BY e.created_at - p.created_at),
       'lag_max_ms', max(e.created_at - p.created_at),
       'emails_per_payment', count(*)::float / greatest(count(DISTINCT p.id), 1))
     FROM shop_payments p JOIN shop_emails e ON e.payment_id = p.id
     WHERE p.created_at >= $3" >> "$out/results.jsonl"
  tail -n 1 "$out/results.jsonl" >&2
}

# Deletes the queues (RabbitMQ) and streams (NATS) this run's shop declared.
forget_broker() {
  { rabbitmqctl -q list_queues name 2>/dev/null || true; } | { grep "^$SCHEMA\." || true; } | while read -r qn; do
    rabbitmqctl -q delete_queue "$qn" >/dev/null 2>&1 || true
  done
  python3 - "$NATS" "$SCHEMA" <<'PY' || true
import socket, sys, urllib.parse
u = urllib.parse.urlparse(sys.argv[1])
prefix = "".join(c.upper() if c.isalnum() else "_" for c in sys.argv[2])
s = socket.create_connection((u.hostname, u.port or 4222), timeout=5)
s.recv(4096)
s.sendall(b'CONNECT {"verbose":false}\r\n')
for stream in ("ORDERS", "PAYMENTS", "ORDERS_PAID"):
    s.sendall(f"PUB $JS.API.STREAM.DELETE.{prefix}_{stream} 0\r\n\r\n".encode())
s.sendall(b"PING\r\n")
s.recv(4096)
s.close()
PY
}

run() { # broker name, then shop arguments
  local name=$1; shift
  SCHEMA="bench_events_$(date +%s%N)"
  psql "$PG" -qc "CREATE SCHEMA $SCHEMA"
  SHOP_LOG=error "$SHOP" --listen 127.0.0.1:0 \
    --database-url "$PG?options=-c%20search_path%3D$SCHEMA" --broker-prefix "$SCHEMA" "$@" \
    > "$out/shop.out" 2>"$out/shop.err" &
  PID=$!
  for _ in $(seq 1 300); do grep -q "listening on" "$out/shop.out" && break; sleep 0.1; done
  URL=$(sed -n 's/^shop listening on //p' "$out/shop.out")
  [ -n "$URL" ] || { cat "$out/shop.err"; exit 1; }
  "$BIN/idem-load" --url "$URL/payments" --requests 200 --concurrency 8 --label warmup >/dev/null 2>&1
  drained 0

  local since
  since=$(( $(date +%s%3N) ))
  "$BIN/idem-load" --url "$URL/payments" --requests 100000000 --rate "$RATE" --duration-secs "$STEADY_SECONDS" \
    --concurrency 64 --mix new=100 --replay-keys 0 --label "$name / steady" >&2 2>/dev/null
  measure "$name" "steady $RATE/s" "$since"

  since=$(( $(date +%s%3N) ))
  "$BIN/idem-load" --url "$URL/payments" --requests "$REQUESTS" --concurrency 32 --mix new=100 --replay-keys 0 \
    --label "$name / as fast as shop takes them" >&2 2>/dev/null
  measure "$name" "as fast as shop takes payments" "$since"

  kill "$PID"; wait "$PID" 2>/dev/null || true
  PID=""
  forget_broker
  psql "$PG" -qc "DROP SCHEMA $SCHEMA CASCADE"
  SCHEMA=""
}

for c in $CONSUMER_CONCURRENCY; do
  for b in $BROKERS; do
    case $b in
      inprocess) run "in process, $c at once$LABEL" --consumer-concurrency "$c" ;;
      rabbitmq) run "RabbitMQ, $c at once$LABEL" --broker-url "$AMQP" --consumer-concurrency "$c" ;;
      nats) run "NATS JetStream, $c at once$LABEL" --broker-url "$NATS" --consumer-concurrency "$c" ;;
      *) echo "unknown broker $b (inprocess, rabbitmq, nats)" >&2; exit 2 ;;
    esac
  done
done

cp "$out/results.jsonl" bench/events.json
python3 - bench/events.json <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| broker | load | events | events/s | lag p50 ms | lag p99 ms | lag max ms |")
print("|---|---|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['broker']} | {r['load']} | {r['events']} | {r['per_s']:.0f} | {r['lag_p50_ms']:.0f} "
          f"| {r['lag_p99_ms']:.0f} | {r['lag_max_ms']} |")
PY
