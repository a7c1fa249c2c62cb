#!/usr/bin/env bash
# A newcomer's walk: builds a service in a fresh Cargo project, outside this
# workspace, from the documentation's snippets alone, against the facade,
# and runs it:
#
# 1. the README's quick start (its [dependencies] block and its rust block):
#    on SQLite, a request and its retry under one key (one order, the retry
#    replayed), and a request without a client id refused;
# 2. the messages guide's whole service (crates/idem/guide/messages.md):
#    PostgreSQL records with Redis in front, an outbox event relayed through
#    NATS JetStream to an inbox consumer, called by the retrying client.
#
# The services it needs (PostgreSQL, Redis, NATS) must answer; scripts/test
# starts them first. Everything it creates (a temporary project, a schema,
# Redis keys, a JetStream stream) is removed on the way out.
#
# Usage: bash scripts/newcomer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

fail() { echo "newcomer walk: $*" >&2; exit 1; }

tmp=$(mktemp -d)
run_id="nw$$$(date +%s)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  psql -h 127.0.0.1 -U postgres -d test -qc "DROP SCHEMA IF EXISTS \"walk_${run_id}\" CASCADE" \
    >/dev/null 2>&1 || true
  redis-cli -h 127.0.0.1 -p 6379 --scan --pattern "walk-${run_id}:*" 2>/dev/null \
    | xargs -r redis-cli -h 127.0.0.1 -p 6379 del >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# The block of `lang` that follows the heading `heading` in `file`.
block() {
  local file=$1 heading=$2 lang=$3
  awk -v h="$heading" -v l="$lang" '
    index($0, h) == 1 { q = 1; next }
    q && $0 == "```" l { f = 1; next }
    f && $0 == "```" { exit }
    f { print }' "$file"
}

mkdir -p "$tmp/walk/src/bin"
deps=$(block README.md "## Quick start" toml)
[ -n "$deps" ] || fail "no [dependencies] block in the README's quick start"
grep -q '^idem = ' <<<"$deps" || fail "the quick start's dependencies do not name idem"
# The one change a newcomer outside crates.io makes: idem from this checkout.
# Its features are the ones the messages guide asks for.
idem_line=$(block crates/idem/guide/messages.md "## A whole service" toml | grep '^idem = ')
features=$(sed -n 's/.*features = \(\[[^]]*\]\).*/\1/p' <<<"$idem_line")
[ -n "$features" ] || fail "the messages guide does not say which features its service needs"
{
  echo '[package]'
  echo 'name = "walk"'
  echo 'version = "0.0.0"'
  echo 'edition = "2021"'
  echo 'publish = false'
  echo '[workspace]'
  echo
  sed "s|^idem = .*|idem = { path = \"$repo/crates/idem\", features = $features }|" <<<"$deps"
} >"$tmp/walk/Cargo.toml"
block README.md "## Quick start" rust >"$tmp/walk/src/bin/quickstart.rs"
block crates/idem/guide/messages.md "## A whole service" rust,no_run >"$tmp/walk/src/bin/full_stack.rs"
[ -s "$tmp/walk/src/bin/quickstart.rs" ] || fail "no rust block in the README's quick start"
[ -s "$tmp/walk/src/bin/full_stack.rs" ] || fail "no rust,no_run block under 'A whole service'"
# Same versions as this workspace: cargo keeps what the new project uses.
cp Cargo.lock "$tmp/walk/Cargo.lock"
cat "$tmp/walk/Cargo.toml"

target="${CARGO_TARGET_DIR:-$tmp/walk/target}"
case "$target" in /*) ;; *) target="$repo/$target" ;; esac
bin="$target/debug"
echo "building the walk's two programs (a project of its own)"
(cd "$tmp/walk" && if [ -n "${CARGO_TARGET_DIR:-}" ]; then export CARGO_TARGET_DIR="$target"; fi
  timeout 1200 cargo build --bins --quiet) || fail "the documented snippets do not build"

echo "1. the quick start, on SQLite"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
(cd "$tmp" && LISTEN="127.0.0.1:$port" exec "$bin/quickstart") &
pids+=($!)
up=
for _ in $(seq 1 150); do
  kill -0 "${pids[-1]}" 2>/dev/null || fail "the quick start exited (port $port taken?)"
  if curl -s -o /dev/null --max-time 5 "http://127.0.0.1:$port/"; then up=1; break; fi
  sleep 0.2
done
[ -n "$up" ] || fail "the quick start did not answer on port $port"
order() {
  curl -s --max-time 30 -D "$tmp/headers" -o "$tmp/body" -w '%{http_code}' "http://127.0.0.1:$port/orders" "$@"
}
[ "$(order -H 'x-client-id: acme' -H 'Idempotency-Key: k1' -d 'two teas')" = 201 ] \
  || fail "the first order was not 201: $(cat "$tmp/body")"
[ "$(order -H 'x-client-id: acme' -H 'Idempotency-Key: k1' -d 'two teas')" = 201 ] \
  || fail "the retry was not 201"
grep -qi '^idempotent-replayed: true' "$tmp/headers" || fail "the retry was not a replay"
[ "$(order -H 'Idempotency-Key: k2' -d 'x')" = 401 ] || fail "no client id was not 401"
[ "$(order -H 'x-client-id: acme' -H 'Idempotency-Key: k1' -d 'three teas')" = 422 ] \
  || fail "another body under k1 was not 422"
orders=$(sqlite3 "$tmp/app.db" 'SELECT count(*) FROM orders' 2>/dev/null \
  || python3 -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM orders').fetchone()[0])" "$tmp/app.db")
[ "$orders" = 1 ] || fail "expected one order, found $orders"
echo "   one order, the retry replayed, 401 without a client id, 422 for another body"

echo "2. the whole service: PostgreSQL + Redis + NATS outbox/inbox + the client"
out=$(cd "$tmp" && RUN_ID="$run_id" timeout 120 "$bin/full_stack") \
  || fail "the whole service failed: $out"
echo "$out" | sed 's/^/   /'
grep -q '^201 Created replayed=false$' <<<"$out" || fail "no fresh 201"
grep -q '^201 Created replayed=true$' <<<"$out" || fail "the retry was not replayed"
grep -q '^orders: 1, events consumed: 1$' <<<"$out" || fail "not one order and one consumed event"
echo "newcomer walk: passed"
