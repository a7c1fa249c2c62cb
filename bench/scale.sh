#!/usr/bin/env bash
# How the cost grows with the records table: for PostgreSQL and MySQL at
# 10 million records, SQLite at 1 million, side by side with an empty table
# in the same run, and Redis's memory per record.
#
# For each SQL database two shops run at once, one on an empty records
# table and one on a table filled with completed records (copies of a real
# record shop wrote, under random keys, as a service's keys are); new keys
# and replays alternate between them, ROUNDS times. Then the table's and
# its indexes' size per record, and a sweep of EXPIRED records past their
# retention (`idem sweep`, batches of BATCH) while new keys arrive at RATE
# per second: the sweep's rate, and the claims' p99 beside the same load
# without a sweep.
#
# Usage: bash bench/scale.sh
#   ROWS=10000000 SQLITE_ROWS=1000000 EXPIRED=1000000 ROUNDS=3 RATE=300 BATCH=500
#   REDIS_RECORDS=1000000   ONLY='postgres|mysql|sqlite|redis'
# Prints a Markdown section and keeps every figure in bench/scale.json.
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-10000000}
SQLITE_ROWS=${SQLITE_ROWS:-1000000}
EXPIRED=${EXPIRED:-1000000}  # at most a million on MySQL
SQLITE_EXPIRED=${SQLITE_EXPIRED:-100000}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-5000}
CONCURRENCY=${CONCURRENCY:-32}
RATE=${RATE:-300}
BATCH=${BATCH:-500}
REDIS_RECORDS=${REDIS_RECORDS:-1000000}
ONLY=${ONLY:-postgres|mysql|sqlite|redis}
PG=${IDEM_BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
MY=${IDEM_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306}
REDIS=${IDEM_BENCH_REDIS_URL:-redis://127.0.0.1:6379}
export PGOPTIONS="-c client_min_messages=warning"

# idem-trivial on its own, with only its own features (as bench/run.sh does)
cargo build --release -q -p idem-trivial
cargo build --release -q -p shop -p idem-cli -p idem-load
BIN=${CARGO_TARGET_DIR:-target}/release
out=$(mktemp -d)
results=bench/scale.json
: > "$out/results.jsonl"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for s in empty full; do
    psql "$PG" -qc "DROP SCHEMA IF EXISTS scale_${s}_$$ CASCADE" 2>/dev/null || true
    mysql -h127.0.0.1 -uroot -e "DROP DATABASE IF EXISTS scale_${s}_$$" 2>/dev/null || true
  done
  redis-cli -u "$REDIS" --scan --pattern "scale-$$:*" | xargs -r -n 1000 redis-cli -u "$REDIS" DEL >/dev/null || true
  rm -rf "$out"
}
trap cleanup EXIT
wanted() { [[ "$1" =~ ^($ONLY)$ ]]; }
note() { echo "$*" >&2; }
record() { echo "$1" >> "$out/results.jsonl"; }

start_shop() { # name, then shop arguments; sets URL_<name>
  local name=$1; shift
  SHOP_LOG=error "$BIN/shop" --listen 127.0.0.1:0 "$@" > "$out/$name.out" 2>"$out/$name.err" &
  pids+=($!)
  eval "PID_$name=$!"
  for _ in $(seq 1 300); do grep -q "listening on" "$out/$name.out" && break; sleep 0.1; done
  local url
  url=$(sed -n 's/^shop listening on //p' "$out/$name.out")
  [ -n "$url" ] || { cat "$out/$name.err"; exit 1; }
  eval "URL_$name=$url"
}
stop_shop() { local p; p=$(eval echo "\$PID_$1"); kill "$p"; wait "$p" 2>/dev/null || true; }

load() { # db, table, scenario, url, mix, [more idem-load args]
  local db=$1 table=$2 scenario=$3 url=$4 mix=$5; shift 5
  "$BIN/idem-load" --url "$url/payments" --requests "$REQUESTS" --concurrency "$CONCURRENCY" \
    --mix "$mix" --label "$db $table / $scenario" "$@" >&2 2>"$out/last.json"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
d.update(db=sys.argv[2], table=sys.argv[3], scenario=sys.argv[4])
print(json.dumps(d))" "$out/last.json" "$db" "$table" "$scenario" >> "$out/results.jsonl"
}

# Alternates new keys and replays between the empty and the full table.
compare() { # db
  for _ in $(seq 1 "$ROUNDS"); do
    for t in empty full; do
      load "$1" "$t" new "$(eval echo "\$URL_$t")" new=100
      load "$1" "$t" replay "$(eval echo "\$URL_$t")" replay=100 --replay-keys 2000
    done
  done
}

# Claims at RATE/s alone for 10 s, then in 10-s windows for as long as the
# sweep runs: the sweep's rate, and the claims' latency beside it.
sweep_under_load() { # db, url, records past retention, sweep command…
  local db=$1 url=$2 expired=$3; shift 3
  window() { # label, output
    "$BIN/idem-load" --url "$url/payments" --requests 100000000 --rate "$RATE" --duration-secs 10 \
      --concurrency 64 --mix new=100 --label "$db / $1" >&2 2>"$2"
  }
  window "claims alone" "$out/alone.json"
  local t0 t1 sp i=0
  t0=$(date +%s.%N)
  ( "$@" > "$out/sweep.out" 2>&1; date +%s.%N > "$out/sweep.end" ) &
  sp=$!
  rm -f "$out"/during-*.json
  while kill -0 "$sp" 2>/dev/null; do
    i=$((i + 1))
    window "claims during the sweep ($i)" "$out/during-$i.json"
  done
  wait "$sp"
  t1=$(cat "$out/sweep.end")
  cat "$out/sweep.out" >&2
  # shop's own sweeper may take some of the rows (both skip what the other
  # holds): the rate counts every row past retention when the sweep began
  python3 - "$out" "$db" "$(echo "$t1 - $t0" | bc)" "$BATCH" "$RATE" "$expired" <<'PY' >> "$out/results.jsonl"
import glob, json, re, sys
out, db, seconds, batch, rate = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
swept = int(sys.argv[6])
alone = json.load(open(f"{out}/alone.json"))
during = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/during-*.json"))]
print(json.dumps(dict(db=db, scenario="sweep", swept=swept, seconds=seconds, rows_per_s=swept / seconds,
      batch=batch, rate=rate, alone_p50_ms=alone["p50_ms"], alone_p99_ms=alone["p99_ms"],
      during_windows=len(during),
      during_p50_ms=max((d["p50_ms"] for d in during), default=None),
      during_p99_ms=max((d["p99_ms"] for d in during), default=None),
      during_errors=sum(d["errors"] for d in during))))
PY
}

if wanted postgres; then
  note "== PostgreSQL: an empty table and $ROWS records"
  for t in empty full; do
    psql "$PG" -qc "CREATE SCHEMA scale_${t}_$$"
    start_shop "$t" --database-url "$PG?options=-c%20search_path%3Dscale_${t}_$$"
  done
  # one real record to copy: shop's own response and headers
  "$BIN/idem-load" --url "$URL_full/payments" --requests 10 --concurrency 1 --label seed 2>/dev/null >/dev/null
  fill_start=$(date +%s)
  PGOPTIONS="$PGOPTIONS -c search_path=scale_full_$$" psql "$PG" -q -v ON_ERROR_STOP=1 <<SQL
INSERT INTO idem_records (scope, key, fingerprint, operation_id, token, state, locked_until,
                          created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms)
SELECT r.scope, gen_random_uuid()::text, r.fingerprint, gen_random_uuid(), g, 'completed', NULL,
       now(), now() + interval '1 day', now(), r.status, r.headers, r.body, r.shortest_retention_ms
FROM generate_series(1, $ROWS) g, (SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1) r;
VACUUM ANALYZE idem_records;
SQL
  note "filled in $(( $(date +%s) - fill_start )) s"
  compare postgres
  size=$(PGOPTIONS="$PGOPTIONS -c search_path=scale_full_$$" psql "$PG" -Atc \
    "SELECT count(*), pg_table_size('idem_records'), pg_indexes_size('idem_records') FROM idem_records")
  IFS='|' read -r n table_bytes index_bytes <<< "$size"
  record "{\"db\": \"postgres\", \"scenario\": \"size\", \"records\": $n, \"table_bytes\": $table_bytes, \"index_bytes\": $index_bytes}"
  # records past their retention, swept while claims arrive
  PGOPTIONS="$PGOPTIONS -c search_path=scale_full_$$" psql "$PG" -q -v ON_ERROR_STOP=1 <<SQL
INSERT INTO idem_records (scope, key, fingerprint, operation_id, token, state, locked_until,
                          created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms)
SELECT r.scope, gen_random_uuid()::text, r.fingerprint, gen_random_uuid(), g, 'completed', NULL,
       now() - interval '2 days', now() - interval '1 day', now() - interval '2 days', r.status, r.headers, r.body, r.shortest_retention_ms
FROM generate_series(1, $EXPIRED) g, (SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1) r;
ANALYZE idem_records;
SQL
  expired=$(PGOPTIONS="$PGOPTIONS -c search_path=scale_full_$$" psql "$PG" -Atc \
    "SELECT count(*) FROM idem_records WHERE expires_at <= now()")
  sweep_under_load postgres "$URL_full" "$expired" "$BIN/idem" sweep --database-url "$PG" --schema "scale_full_$$" --batch "$BATCH"
  stop_shop empty; stop_shop full
  for t in empty full; do psql "$PG" -qc "DROP SCHEMA scale_${t}_$$ CASCADE"; done
fi

# SELECT n FROM 1..$1 (at most a million) in plain SQL, MySQL and MariaDB
# alike: a cross join of digit tables, cut to $1.
numbers() {
  local digits="SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
    UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9"
  echo "SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * h.d AS n
    FROM ($digits) a, ($digits) b, ($digits) c, ($digits) e, ($digits) f, ($digits) h
    WHERE a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d + 100000 * h.d < $1"
}

if wanted mysql; then
  note "== MySQL: an empty table and $ROWS records"
  for t in empty full; do
    mysql -h127.0.0.1 -uroot -e "CREATE DATABASE scale_${t}_$$"
    start_shop "$t" --database-url "$MY/scale_${t}_$$"
  done
  "$BIN/idem-load" --url "$URL_full/payments" --requests 10 --concurrency 1 --label seed 2>/dev/null >/dev/null
  fill_start=$(date +%s)
  # rows in chunks of a million (one statement each: a transaction of its own)
  done_rows=0
  while [ "$done_rows" -lt "$ROWS" ]; do
    chunk=$(( ROWS - done_rows < 1000000 ? ROWS - done_rows : 1000000 ))
    mysql -h127.0.0.1 -uroot "scale_full_$$" -e "
INSERT INTO idem_records (scope, \`key\`, fingerprint, operation_id, token, state, locked_until,
                          created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms)
SELECT r.scope, UUID(), r.fingerprint, UUID(), $done_rows + g.n, 'completed', NULL,
       r.created_at, r.created_at + 86400000, r.completed_at, r.status, r.headers, r.body, r.shortest_retention_ms
FROM ($(numbers "$chunk")) g, (SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1) r;"
    done_rows=$(( done_rows + chunk ))
  done
  mysql -h127.0.0.1 -uroot "scale_full_$$" -e "ANALYZE TABLE idem_records" >/dev/null
  note "filled in $(( $(date +%s) - fill_start )) s"
  compare mysql
  size=$(mysql -h127.0.0.1 -uroot -N -e "SELECT (SELECT count(*) FROM scale_full_$$.idem_records),
    data_length, index_length FROM information_schema.tables
    WHERE table_schema = 'scale_full_$$' AND table_name = 'idem_records'" | tr '\t' '|')
  IFS='|' read -r n table_bytes index_bytes <<< "$size"
  record "{\"db\": \"mysql\", \"scenario\": \"size\", \"records\": $n, \"table_bytes\": $table_bytes, \"index_bytes\": $index_bytes}"
  mysql -h127.0.0.1 -uroot "scale_full_$$" -e "
INSERT INTO idem_records (scope, \`key\`, fingerprint, operation_id, token, state, locked_until,
                          created_at, expires_at, completed_at, status, headers, body, shortest_retention_ms)
SELECT r.scope, UUID(), r.fingerprint, UUID(), g.n, 'completed', NULL,
       r.created_at - 172800000, r.created_at - 86400000, r.completed_at - 172800000,
       r.status, r.headers, r.body, r.shortest_retention_ms
FROM ($(numbers "$EXPIRED")) g, (SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1) r;
ANALYZE TABLE idem_records;" >/dev/null
  expired=$(mysql -h127.0.0.1 -uroot -N "scale_full_$$" -e \
    "SELECT count(*) FROM idem_records WHERE expires_at <= CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
  sweep_under_load mysql "$URL_full" "$expired" "$BIN/idem" sweep --database-url "$MY" --schema "scale_full_$$" --batch "$BATCH"
  stop_shop empty; stop_shop full
  for t in empty full; do mysql -h127.0.0.1 -uroot -e "DROP DATABASE scale_${t}_$$"; done
fi

if wanted sqlite; then
  note "== SQLite: an empty table and $SQLITE_ROWS records"
  for t in empty full; do start_shop "$t" --database-url "sqlite:$out/$t.db"; done
  "$BIN/idem-load" --url "$URL_full/payments" --requests 10 --concurrency 1 --label seed 2>/dev/null >/dev/null
  fill_start=$(date +%s)
  python3 - "$out/full.db" "$SQLITE_ROWS" "$SQLITE_EXPIRED" <<'PY'
import sqlite3, sys, uuid
db = sqlite3.connect(sys.argv[1], timeout=60)
n, expired = int(sys.argv[2]), int(sys.argv[3])
cols = [r[1] for r in db.execute("PRAGMA table_info(idem_records)")]
row = dict(zip(cols, db.execute(
    "SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1").fetchone()))
def rows(count, shift_ms):
    for i in range(count):
        r = dict(row)
        r["key"] = str(uuid.uuid4())
        r["operation_id"] = str(uuid.uuid4()) if isinstance(row["operation_id"], str) else uuid.uuid4().bytes
        r["token"] = i + 1
        for c in ("created_at", "expires_at", "completed_at"):
            r[c] = r[c] + shift_ms
        yield tuple(r[c] for c in cols)
marks = ",".join("?" * len(cols))
with db:
    db.executemany(f"INSERT INTO idem_records VALUES ({marks})", rows(n, 0))
db.execute("ANALYZE")
db.commit()
print(f"{n} rows", file=sys.stderr)
PY
  note "filled in $(( $(date +%s) - fill_start )) s"
  compare sqlite
  size=$(python3 - "$out/full.db" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
n = db.execute("SELECT count(*) FROM idem_records").fetchone()[0]
try:
    sizes = dict(db.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"))
    table = sizes.get("idem_records", 0)
    index = sum(v for k, v in sizes.items() if k.startswith("sqlite_autoindex_idem_records") or k.startswith("idem_records_"))
except sqlite3.OperationalError:
    page = db.execute("PRAGMA page_size").fetchone()[0]
    table = db.execute("PRAGMA page_count").fetchone()[0] * page
    index = 0
print(f"{n}|{table}|{index}")
PY
)
  IFS='|' read -r n table_bytes index_bytes <<< "$size"
  record "{\"db\": \"sqlite\", \"scenario\": \"size\", \"records\": $n, \"table_bytes\": $table_bytes, \"index_bytes\": $index_bytes}"
  python3 - "$out/full.db" "$SQLITE_EXPIRED" <<'PY'
import sqlite3, sys, uuid
db = sqlite3.connect(sys.argv[1], timeout=60)
n = int(sys.argv[2])
cols = [r[1] for r in db.execute("PRAGMA table_info(idem_records)")]
row = dict(zip(cols, db.execute(
    "SELECT * FROM idem_records WHERE state = 'completed' LIMIT 1").fetchone()))
day = 86_400_000
def rows():
    for i in range(n):
        r = dict(row)
        r["key"] = str(uuid.uuid4())
        r["token"] = i + 1
        for c in ("created_at", "expires_at", "completed_at"):
            r[c] = r[c] - 2 * day
        yield tuple(r[c] for c in cols)
with db:
    db.executemany(f"INSERT INTO idem_records VALUES ({','.join('?' * len(cols))})", rows())
PY
  expired=$(python3 -c "
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1])
print(db.execute('SELECT count(*) FROM idem_records WHERE expires_at <= ?', (int(time.time() * 1000),)).fetchone()[0])" "$out/full.db")
  sweep_under_load sqlite "$URL_full" "$expired" "$BIN/idem" sweep --database-url "sqlite:$out/full.db" --batch "$BATCH"
  stop_shop empty; stop_shop full
fi

if wanted redis; then
  note "== Redis: memory per record, up to $REDIS_RECORDS records"
  "$BIN/idem-trivial" --listen 127.0.0.1:0 --store redis --redis-url "$REDIS" --redis-prefix "scale-$$" \
    > "$out/trivial.out" 2>"$out/trivial.err" &
  pids+=($!)
  for _ in $(seq 1 100); do grep -q "listening on" "$out/trivial.out" && break; sleep 0.1; done
  turl=$(sed -n 's/^.* listening on //p' "$out/trivial.out")
  used() { redis-cli -u "$REDIS" INFO memory | awk -F: '/^used_memory:/ {print $2+0}'; }
  before=$(used)
  "$BIN/idem-load" --url "$turl/payments" --requests "$REDIS_RECORDS" --concurrency 64 --mix new=100 \
    --label "redis / $REDIS_RECORDS records" >&2 2>"$out/redis.json"
  after=$(used)
  records=$(redis-cli -u "$REDIS" --scan --pattern "scale-$$:*" | wc -l)
  sample=$(redis-cli -u "$REDIS" --scan --pattern "scale-$$:*" | head -1 || true)
  usage=$(redis-cli -u "$REDIS" MEMORY USAGE "$sample")
  record "{\"db\": \"redis\", \"scenario\": \"memory\", \"records\": $records, \"used_before\": $before, \"used_after\": $after, \"memory_usage_one\": $usage}"
fi

cp "$out/results.jsonl" "$results"
python3 bench/render_scale.py "$results"
