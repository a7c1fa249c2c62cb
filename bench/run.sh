#!/usr/bin/env bash
# Builds everything, starts shop in each configuration, runs every scenario
# with the same load, and writes BENCHMARKS.md: the table, the ratios, the
# machine, and this command.
#
# Usage: bash bench/run.sh [requests-per-scenario] [concurrency]
#   MEMORY_SECONDS=60 bash bench/run.sh   # a shorter memory run (default 300 s)
#   ROUNDS=3 bash bench/run.sh            # bare/new rounds per configuration, and peer rounds (default 7)
#   ONLY='^postgres$' bash bench/run.sh   # only the configurations matching (a quick look:
#                                         # prints the table, leaves BENCHMARKS.md alone)
#   CEILINGS=1 ONLY=… bash bench/run.sh   # a quick look with the ceilings, rendered to stdout
#   CEILING_ROUNDS=3 CEILING_SECONDS=10   # rounds and length of each pgbench ceiling;
#   MY_PER_CLIENT=600                     # requests per mysqlslap client (MariaDB's ceilings)
#   SETTLE_SECONDS=120                    # the longest wait for idle before replays
#
# Needs the services `bash scripts/test` starts (PostgreSQL, MariaDB, Redis), Node.js
# and npm for the Node peers, pgbench, mysqlslap and the mysql client for the
# ceilings, valgrind for the
# instruction counts (bench/callgrind.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-5000}
CONCURRENCY=${2:-32}
MEMORY_SECONDS=${MEMORY_SECONDS:-300}
ROUNDS=${ROUNDS:-7}
ONLY=${ONLY:-}
PG=${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
# MySQL / MariaDB: the server (each run makes a database of its own on it).
MY=${IDEM_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306}
REDIS=${IDEM_BENCH_REDIS_URL:-redis://127.0.0.1:6379}
export PGOPTIONS="-c client_min_messages=warning"

# idem-trivial on its own: built with the others, it would get the features
# shop turns on in the crates they share (idem-axum's sqlx), which a service
# on the memory store or Redis does not build.
cargo build --release -q -p idem-trivial
cargo build --release -q -p shop -p idem-load
BIN=${CARGO_TARGET_DIR:-target}/release
out=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null || true
  # schemas a failed run left behind
  if [ -f "$out/schemas" ]; then
    while read -r s; do psql "$PG" -qc "DROP SCHEMA IF EXISTS $s CASCADE" || true; done < "$out/schemas"
  fi
  if [ -f "$out/databases" ]; then
    while read -r d; do mysql -h127.0.0.1 -uroot -e "DROP DATABASE IF EXISTS $d" || true; done < "$out/databases"
  fi
  # The records the run left in Redis (kept a day otherwise): shop's under
  # this run's prefixes, and the peers' under theirs (idem-trivial's
  # `trivial-<uuid>`, the Rust peers' `peer-<uuid>`, the Node peer's
  # `node-idempotency`), walked with SCAN, deleted a batch at a time.
  for pattern in "bench-$$:*" "bench2-$$:*" 'trivial-*' 'peer-*' 'node-idempotency*'; do
    redis-cli -u "$REDIS" --scan --pattern "$pattern" 2>/dev/null \
      | xargs -r -n 500 redis-cli -u "$REDIS" del > /dev/null 2>&1 || true
  done
  rm -rf "$out"
}
trap cleanup EXIT
results="$out/results.jsonl"
: > "$results"

start_shop() { # config name, then shop arguments; sets URL, PID, SCHEMA, MYDB
  local args=("$@")
  SCHEMA=""
  MYDB=""
  if [[ " ${args[*]} " == *" MYDATABASE "* ]]; then
    MYDB="bench_$(date +%s%N)"
    mysql -h127.0.0.1 -uroot -e "CREATE DATABASE $MYDB"
    echo "$MYDB" >> "$out/databases"
    args=("${args[@]/MYDATABASE/$MY/$MYDB}")
  fi
  if [[ " ${args[*]} " == *" PGSCHEMA "* ]]; then
    SCHEMA="bench_$(date +%s%N)"
    psql "$PG" -qc "CREATE SCHEMA $SCHEMA"
    echo "$SCHEMA" >> "$out/schemas"
    args=("${args[@]/PGSCHEMA/$PG?options=-c%20search_path%3D$SCHEMA}")
  fi
  SHOP_LOG=error "$BIN/shop" --listen 127.0.0.1:0 "${args[@]}" > "$out/shop.out" 2>"$out/shop.err" &
  PID=$!
  for _ in $(seq 1 100); do grep -q "listening on" "$out/shop.out" && break; sleep 0.1; done
  URL=$(sed -n 's/^shop listening on //p' "$out/shop.out")
  [ -n "$URL" ] || { cat "$out/shop.err"; exit 1; }
}

stop_shop() {
  kill "$PID"; wait "$PID" 2>/dev/null || true
  if [ -n "$SCHEMA" ]; then psql "$PG" -qc "DROP SCHEMA $SCHEMA CASCADE"; fi
  if [ -n "$MYDB" ]; then mysql -h127.0.0.1 -uroot -e "DROP DATABASE $MYDB"; fi
}

load() { # config, scenario, path, mix (LOAD_ARGS: more idem-load arguments)
  local before after
  before=$(python3 bench/cpu.py "$PID")
  # shellcheck disable=SC2086
  "$BIN/idem-load" --url "$URL$3" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --mix "$4" --label "$1 / $2" ${LOAD_ARGS:-} 2>>"$out/raw.jsonl" | tee -a "$out/table.txt"
  after=$(python3 bench/cpu.py "$PID")
  # CPU per request, in µs: the database servers, and the server under test;
  # the server's context switches per request
  tail -n 1 "$out/raw.jsonl" | python3 -c "
import json, sys
d = json.load(sys.stdin)
b, a = [list(map(float, x.split())) for x in sys.argv[1:3]]
d.update(config='$1', scenario='$2',
         cpu_db_us=(a[0] - b[0]) * 1000 / d['requests'], cpu_app_us=(a[1] - b[1]) * 1000 / d['requests'],
         switches_app=(a[2] - b[2]) / d['requests'])
print(json.dumps(d))" "$before" "$after" >> "$results"
}

wanted() { [ -z "$ONLY" ] || [[ "$1" =~ $ONLY ]]; }

# Waits until shop and the database servers are idle (under a tenth of a
# core for three seconds in a row): every payment sends an event that shop's consumers
# commit once through the inbox, and the backlog the new-key rounds leave
# would otherwise run beside the next scenario (it once cut replays to a
# quarter). At most SETTLE_SECONDS (default 120).
settle() {
  local before after waited=0 quiet=0
  before=$(python3 bench/cpu.py "$PID")
  while [ "$waited" -lt "${SETTLE_SECONDS:-120}" ]; do
    sleep 1; waited=$((waited + 1))
    after=$(python3 bench/cpu.py "$PID")
    if python3 -c "
import sys
b, a = [list(map(float, x.split())) for x in sys.argv[1:3]]
sys.exit(0 if (a[0] - b[0]) + (a[1] - b[1]) < 100 else 1)" "$before" "$after"; then
      quiet=$((quiet + 1))
    else
      quiet=0
    fi
    before=$after
    if [ "$quiet" -ge 3 ]; then
      if [ "$waited" -gt 3 ]; then echo "   (settled after ${waited}s)"; fi
      return 0
    fi
  done
  echo "   (still busy after ${waited}s)"
}

run_config() { # name, then shop arguments
  local name=$1; shift
  wanted "$name" || return 0
  start_shop "$@"
  # Every scenario in each of ROUNDS rounds, so that a slow spell of the
  # machine lands on all of them (and so does the events' backlog each
  # round leaves); the table shows the median of the rounds. Replays and
  # in-flight duplicates wait for the new keys' backlog to settle first (it
  # once cut replays to a quarter); measured once each, after all the
  # rounds, the replays of one configuration ran at 5x bare and those of
  # the next at 10x with the same first look.
  for _ in $(seq 1 "$ROUNDS"); do
    load "$name" bare /bare/payments nokey=100
    load "$name" new /payments new=100
    settle
    load "$name" replay /payments replay=100
    load "$name" inflight /payments inflight=100
  done
  stop_shop
}

echo "== scenarios: $REQUESTS requests each, concurrency $CONCURRENCY"
run_config "sqlite"            --database-url "sqlite:$out/bench.db"
run_config "sqlite (synchronous normal)" --database-url "sqlite:$out/bench3.db" --sqlite-synchronous normal
run_config "postgres"          --database-url PGSCHEMA
run_config "mysql"             --database-url MYDATABASE
run_config "postgres (claim in tx)" --database-url PGSCHEMA --claim-in-transaction
run_config "postgres+redis"    --database-url PGSCHEMA --redis-url "$REDIS" --redis-prefix "bench-$$"
run_config "postgres+cache"    --database-url PGSCHEMA --replay-cache 10000
run_config "redis-only"        --database-url "sqlite:$out/bench2.db" --idem-store redis --redis-url "$REDIS" --redis-prefix "bench2-$$"

echo "== peers: each library in front of the same trivial endpoint"
wanted "trivial: " && (cd bench/peers && npm install --silent --no-audit --no-fund >/dev/null)
start_peer() { # config name, then the command; sets URL, PID
  "$@" > "$out/peer.out" 2>"$out/peer.err" &
  PID=$!
  for _ in $(seq 1 100); do grep -q "listening on" "$out/peer.out" && break; sleep 0.1; done
  URL=$(sed -n 's/^.* listening on //p' "$out/peer.out")
  [ -n "$URL" ] || { cat "$out/peer.err"; exit 1; }
}
run_peer() { # config name, then the command
  local name=$1; shift
  wanted "$name" || return 0
  start_peer "$@"
  load "$name" new /payments new=100
  load "$name" replay /payments replay=100
  load "$name" inflight /payments inflight=100
  kill "$PID"; wait "$PID" 2>/dev/null || true
}
# The Rust peers build in a workspace of their own (bench/rust-peers): their
# axum, redis and session crates stay out of idem's lock file. aklanti's
# `idempotent` 2 declares rustc 1.98 but builds on this toolchain.
PEERS_BIN=${IDEM_PEERS_TARGET_DIR:-$HOME/.cache/idem-peers-target}/release
wanted "trivial: " && (cd bench/rust-peers && CARGO_TARGET_DIR=${PEERS_BIN%/release} \
  cargo build --release -q --ignore-rust-version)
# One peer by its number; the peers run in ROUNDS rounds, the order reversed
# every other round (a slow spell, or a Redis grown by the runs before,
# lands on all), and the table shows the median of the rounds.
PEERS=7
peer() { # number
  case $1 in
    1) run_peer "trivial: idem (memory)"              "$BIN/idem-trivial" --listen 127.0.0.1:0 --store memory ;;
    2) run_peer "trivial: idempotent (memory)"        "$PEERS_BIN/idempotent-peer" --listen 127.0.0.1:0 --store memory ;;
    # axum-idempotent keys records by session and never creates one: every
    # request carries one fixed session cookie, or nothing is deduplicated.
    3) LOAD_ARGS="--header cookie:session=aWRlbS1iZW5jaC1zZXNzMQ" \
       run_peer "trivial: axum-idempotent (memory)"   "$PEERS_BIN/axum-idempotent-peer" --listen 127.0.0.1:0 --store memory ;;
    4) run_peer "trivial: express-idempotency"        node bench/peers/express-idempotency.js ;;
    5) run_peer "trivial: idem (redis)"               "$BIN/idem-trivial" --listen 127.0.0.1:0 --store redis --redis-url "$REDIS" ;;
    6) run_peer "trivial: idempotent (redis)"         "$PEERS_BIN/idempotent-peer" --listen 127.0.0.1:0 --store redis --redis-url "$REDIS" ;;
    7) run_peer "trivial: @node-idempotency (redis)"  env REDIS_URL="$REDIS" node bench/peers/node-idempotency.js ;;
  esac
}
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order=$(seq 1 "$PEERS"); else order=$(seq "$PEERS" -1 1); fi
  for i in $order; do peer "$i"; done
done

# A quick look (ONLY) stops here, unless CEILINGS=1 asks for the ceilings
# too; it then prints the rendered tables instead of writing BENCHMARKS.md.
if [ -n "$ONLY" ] && [ -z "${CEILINGS:-}" ]; then exit 0; fi

echo "== ceilings: the same statements with pgbench, mysqlslap and sqlite3, no HTTP in between"
# The shop creates its tables in a schema of its own; pgbench then runs, at
# the same concurrency, prepared once per connection: bare's statements;
# those of a new key (the claim committed first, the completion in bare's
# transaction) in both modes, made from idem's own SQL by claims.py; and a
# primary-key read of a completed record. bare, new and held alternate in
# CEILING_ROUNDS rounds (medians), as the HTTP rounds do, with three
# counterfactuals that say what limits a new key here: the claim inside the
# business transaction (no commit of its own: a mode idem refuses to ship,
# since a crash would lose the claim's operation id), and bare and new with
# no commit waiting for the disk (synchronous_commit off for that client).
CEILING_ROUNDS=${CEILING_ROUNDS:-3}
start_shop --database-url PGSCHEMA
kill "$PID"; wait "$PID" 2>/dev/null || true
ceiling_opts="-c client_min_messages=warning -c search_path=$SCHEMA"
PGOPTIONS="$ceiling_opts" psql "$PG" -q -f bench/pgbench/records.sql
for k in pg-new pg-held pg-intx pg-look my-bare my-new; do python3 bench/pgbench/claims.py "$k" > "$out/$k.sql"; done
# A ceiling that fails prints nothing (render.py leaves it out) and says
# why in ceilings.err, rather than ending the run and its results.
# Without TLS, as shop connects (sqlx is built without it); libpq would
# otherwise encrypt every statement on this loopback (PostgreSQL here has
# ssl on), a cost the HTTP rows never pay.
pgbench_tps() { # script [server options]
  { PGSSLMODE=disable PGOPTIONS="$ceiling_opts ${2:-}" pgbench -n -M prepared -c "$CONCURRENCY" -j 2 -T "${CEILING_SECONDS:-10}" \
    -f "$1" "$PG" 2>>"$out/ceilings.err" || echo "pgbench failed on $1" >&2; } | awk '/^tps = / {print $3; exit}'
}
# The reads first, before the write rounds leave work for autovacuum: a
# primary-key read, and idem's first look finding a completed record (what
# a replay costs the database).
read_tps=$(pgbench_tps bench/pgbench/replay.sql)
look_tps=$(pgbench_tps "$out/pg-look.sql")
median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2)}'; }
no_flush="-c synchronous_commit=off"
for f in pg-bare pg-new pg-held pg-intx pg-bare-noflush pg-new-noflush; do : > "$out/$f.tps"; done
for _ in $(seq 1 "$CEILING_ROUNDS"); do
  pgbench_tps bench/pgbench/bare.sql >> "$out/pg-bare.tps"
  pgbench_tps "$out/pg-new.sql" >> "$out/pg-new.tps"
  pgbench_tps "$out/pg-held.sql" >> "$out/pg-held.tps"
  pgbench_tps "$out/pg-intx.sql" >> "$out/pg-intx.tps"
  pgbench_tps bench/pgbench/bare.sql "$no_flush" >> "$out/pg-bare-noflush.tps"
  pgbench_tps "$out/pg-new.sql" "$no_flush" >> "$out/pg-new-noflush.tps"
done
bare_tps=$(median < "$out/pg-bare.tps")
new_tps=$(median < "$out/pg-new.tps")
held_tps=$(median < "$out/pg-held.tps")
intx_tps=$(median < "$out/pg-intx.tps")
bare_noflush_tps=$(median < "$out/pg-bare-noflush.tps")
new_noflush_tps=$(median < "$out/pg-new-noflush.tps")
psql "$PG" -qc "DROP SCHEMA $SCHEMA CASCADE"
echo "pgbench: bare statements $bare_tps tps, a new key's $new_tps, claim in tx $held_tps, primary-key read $read_tps tps, first look on a completed record $look_tps tps"
echo "pgbench counterfactuals: the claim without a commit of its own $intx_tps tps; no commit waiting for the disk: bare $bare_noflush_tps, a new key $new_noflush_tps"
# MySQL / MariaDB: the same with mysqlslap (statements sent as text, no
# pgbench there), each client running a request's statements in turn.
start_shop --database-url MYDATABASE
kill "$PID"; wait "$PID" 2>/dev/null || true
MY_PER_CLIENT=${MY_PER_CLIENT:-600}
mysqlslap_tps() { # script: requests per second
  local statements seconds
  statements=$(grep -c ';$' "$1")
  seconds=$( { mysqlslap -h127.0.0.1 -uroot --create-schema="$MYDB" --concurrency="$CONCURRENCY" --iterations=1 \
    --number-of-queries=$((CONCURRENCY * MY_PER_CLIENT * statements)) --query="$1" --delimiter=";" \
    2>>"$out/ceilings.err" || echo "mysqlslap failed on $1" >&2; } \
    | awk '/Average number of seconds/ {print $(NF - 1); exit}')
  [ -n "$seconds" ] && python3 -c "print(round($CONCURRENCY * $MY_PER_CLIENT / $seconds, 1))"
  return 0
}
: > "$out/my-bare.tps"; : > "$out/my-new.tps"
for _ in $(seq 1 "$CEILING_ROUNDS"); do
  mysqlslap_tps "$out/my-bare.sql" >> "$out/my-bare.tps"
  mysqlslap_tps "$out/my-new.sql" >> "$out/my-new.tps"
done
my_bare_tps=$(median < "$out/my-bare.tps")
my_new_tps=$(median < "$out/my-new.tps")
mysql -h127.0.0.1 -uroot -e "DROP DATABASE $MYDB"
# SQLite: Python's sqlite3 (SQLite's C library, called directly: no HTTP,
# no sqlx) runs the same statements, one request after another, as SQLite
# writes one transaction at a time; on a file shop made, with idem's
# default durability (synchronous full) and with normal. bare, new and the
# claim without a commit of its own (a counterfactual) alternate in
# CEILING_ROUNDS rounds inside each.
start_shop --database-url "sqlite:$out/ceiling.db"
kill "$PID"; wait "$PID" 2>/dev/null || true
sqlite_ceiling() { # synchronous: one JSON line
  python3 bench/pgbench/sqlite_ceiling.py "$out/ceiling.db" "$1" "${CEILING_SECONDS:-10}" "$CEILING_ROUNDS" \
    2>>"$out/ceilings.err" || echo "sqlite_ceiling.py failed ($1)" >&2
}
json_field() { python3 -c "import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2" 2>/dev/null || true; }
sq_full=$(sqlite_ceiling full)
sq_normal=$(sqlite_ceiling normal)
sq_bare_tps=$(json_field "$sq_full" bare_tps)
sq_new_tps=$(json_field "$sq_full" new_tps)
sq_normal_bare_tps=$(json_field "$sq_normal" bare_tps)
sq_normal_new_tps=$(json_field "$sq_normal" new_tps)
sq_intx_tps=$(json_field "$sq_full" intx_tps)
sq_normal_intx_tps=$(json_field "$sq_normal" intx_tps)
[ -s "$out/ceilings.err" ] && { echo "ceilings that failed:"; cat "$out/ceilings.err"; }
echo "mysqlslap: bare statements $my_bare_tps/s, a new key's $my_new_tps/s"
echo "sqlite3: bare statements $sq_bare_tps/s, a new key's $sq_new_tps/s (without the claim's commit $sq_intx_tps/s); with synchronous normal $sq_normal_bare_tps/s, $sq_normal_new_tps/s ($sq_normal_intx_tps/s)"
cat > "$out/ceilings.json" <<JSON
{"bare_statements_tps": ${bare_tps:-null}, "new_key_statements_tps": ${new_tps:-null}, "held_claim_statements_tps": ${held_tps:-null},
 "claim_without_commit_statements_tps": ${intx_tps:-null}, "bare_statements_no_flush_tps": ${bare_noflush_tps:-null}, "new_key_statements_no_flush_tps": ${new_noflush_tps:-null},
 "primary_key_read_tps": ${read_tps:-null}, "first_look_tps": ${look_tps:-null}, "mysql_bare_statements_tps": ${my_bare_tps:-null}, "mysql_new_key_statements_tps": ${my_new_tps:-null},
 "sqlite_bare_statements_tps": ${sq_bare_tps:-null}, "sqlite_new_key_statements_tps": ${sq_new_tps:-null},
 "sqlite_normal_bare_statements_tps": ${sq_normal_bare_tps:-null}, "sqlite_normal_new_key_statements_tps": ${sq_normal_new_tps:-null},
 "sqlite_claim_without_commit_statements_tps": ${sq_intx_tps:-null}, "sqlite_normal_claim_without_commit_statements_tps": ${sq_normal_intx_tps:-null},
 "rounds": $CEILING_ROUNDS}
JSON

if [ -n "$ONLY" ]; then
  echo '{"rss_start_kb": 0, "rss_end_kb": 0, "seconds": 0}' > "$out/memory.json"
  : > "$out/criterion.txt"
  python3 bench/render.py "$results" "$out/memory.json" "$out/criterion.txt" \
    "ONLY='$ONLY' CEILINGS=1 ROUNDS=$ROUNDS CEILING_ROUNDS=$CEILING_ROUNDS bash bench/run.sh $REQUESTS $CONCURRENCY" \
    "$ROUNDS" "$out/ceilings.json"
  exit 0
fi

echo "== instructions per request (callgrind): the layer with the memory store vs the bare handler"
bash bench/callgrind.sh "$out/callgrind.jsonl"
cat "$out/callgrind.jsonl"

echo "== memory: new keys at a fixed rate for ${MEMORY_SECONDS}s on postgres"
start_shop --database-url PGSCHEMA
"$BIN/idem-load" --url "$URL/payments" --requests 1000 --concurrency 8 --mix new=50,replay=50 --label warmup 2>/dev/null >/dev/null
rss() { awk '/VmRSS/ {print $2}' "/proc/$PID/status"; }
rss_start=$(rss)
"$BIN/idem-load" --url "$URL/payments" --requests 100000000 --rate 300 --duration-secs "$MEMORY_SECONDS" \
  --concurrency 16 --mix new=50,replay=50 --label "memory run" 2>/dev/null &
LOADPID=$!
# resident memory every tenth of the run: a leak shows as a slope
samples="$rss_start"
step=$(( MEMORY_SECONDS / 10 > 0 ? MEMORY_SECONDS / 10 : 1 ))
while kill -0 "$LOADPID" 2>/dev/null; do
  sleep "$step"
  kill -0 "$LOADPID" 2>/dev/null && samples="$samples, $(rss)"
done
wait "$LOADPID" || true
rss_end=$(rss)
stop_shop
echo "{\"rss_start_kb\": $rss_start, \"rss_end_kb\": $rss_end, \"seconds\": $MEMORY_SECONDS, \"samples_kb\": [$samples, $rss_end]}" > "$out/memory.json"

echo "== criterion micro-benchmarks"
cargo bench -q -p idem-core --bench core -- --warm-up-time 1 --measurement-time 3 2>/dev/null \
  | grep -E "^[a-z].*time:" > "$out/criterion.txt" || true
# The fingerprint against the raw hash in alternated rounds (criterion times
# one variant after the other): the figure render.py reports for it.
cargo bench -q -p idem-core --bench fingerprint_rounds 2>/dev/null \
  | grep -E "^fingerprint-rounds " >> "$out/criterion.txt" || true

python3 bench/render.py "$results" "$out/memory.json" "$out/criterion.txt" \
  "bash bench/run.sh $REQUESTS $CONCURRENCY" "$ROUNDS" "$out/ceilings.json" "$out/callgrind.jsonl" \
  BENCHMARKS.md > "$out/BENCHMARKS.md"
mv "$out/BENCHMARKS.md" BENCHMARKS.md
echo "wrote BENCHMARKS.md"
