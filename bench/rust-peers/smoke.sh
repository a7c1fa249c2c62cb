#!/usr/bin/env bash
# Smoke test of one peer server by hand: replay, in-flight duplicate, same
# key with another body, and two simultaneous requests with one key.
# Usage: bash bench/rust-peers/smoke.sh URL [extra curl arguments, e.g. -H 'cookie: session=...']
set -u
url=$1/payments; shift
run=$(date +%s%N)
body='{"account_id":"acc_bench","amount":100,"currency":"EUR"}'
post() { # key, then extra curl arguments; prints status, headers and body
  local key=$1; shift
  curl -sS -i -X POST "$url" -H 'content-type: application/json' -H 'authorization: Bearer bench' \
    -H "idempotency-key: $key" "$@" | tr -d '\r' | grep -iv '^date:'
  echo
}

echo "== 1. the same key twice"
post "$run-a" -d "$body" "$@"
post "$run-a" -d "$body" "$@"

echo "== 2. a duplicate while the first (bank-delay=2000) runs"
post "$run-b" -d "$body" -H 'x-simulate: bank-delay=2000' "$@" > /tmp/smoke-first.$$ &
sleep 0.5
post "$run-b" -d "$body" "$@"
wait
echo "-- the first, when it finished:"; cat /tmp/smoke-first.$$
echo "-- and a retry after it finished:"; post "$run-b" -d "$body" "$@"

echo "== 3. the key of 1 with another body"
post "$run-a" -d '{"account_id":"acc_bench","amount":999,"currency":"EUR"}' "$@"

echo "== 4. eight simultaneous requests with one key (bank-delay=1000): statuses, then ids"
for i in 1 2 3 4 5 6 7 8; do
  post "$run-c" -d "$body" -H 'x-simulate: bank-delay=1000' "$@" > /tmp/smoke-c$i.$$ &
done
wait
grep -h '^HTTP' /tmp/smoke-c?.$$ | sort | uniq -c
grep -ho '"id":"[^"]*"' /tmp/smoke-c?.$$ | sort | uniq -c
rm -f /tmp/smoke-*.$$
