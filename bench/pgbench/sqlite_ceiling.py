#!/usr/bin/env python3
"""SQLite's own limit for new keys: bench/run.sh's ceilings on SQLite.

The same statements as a `POST /bare/payments` and a new key's
`POST /payments` on SQLite, with no HTTP, no shop and no sqlx in between:
Python's sqlite3 module (SQLite's C library, called directly) on a file
whose tables shop made. SQLite writes one transaction at a time, so one
client running requests back to back is the writer's own limit; shop's
concurrent requests queue for that same writer.

  bare  the bank's charge (committed by itself) and its read-back, then,
        under the write lock (BEGIN IMMEDIATE), the payment, its read-back
        (shop's create-once) and its outbox event, committed together
  new   idem's first look (crates/idem-sql/sql/sqlite/get.sql, finding no
        record), the claim's insert committed by itself (insert.sql), then
        bare's statements with the completion (complete.sql) in their
        transaction
  intx  a counterfactual, not a mode idem has: new's statements with the
        claim's insert inside the payment's transaction, so that it has no
        commit of its own (a crash during the handler would then lose the
        claim and its operation id); what that commit costs

The record statements come from crates/idem-sql/sql, so the ceiling follows
the code. Neither has the outbox relay's or the inbox's work, which shop
also runs on the same writer (as the PostgreSQL and MySQL ceilings leave
them out too).

bare, new and intx alternate in ROUNDS rounds of SECONDS each; prints one JSON
line with the medians in requests per second.

Usage: python3 bench/pgbench/sqlite_ceiling.py FILE full|normal [SECONDS] [ROUNDS]
"""

import json
import os
import statistics
import sqlite3
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claims import template  # noqa: E402

# what idem's SQLite dialect writes for {now} (idem_sql::Sqlite::NOW_MILLIS)
NOW = "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"
TABLE = '"idem_records"'
OUTBOX = '"idem_outbox"'
SCOPE = "sqlite-ceiling"
LEASE_MS = 30000
RETENTION_MS = 86400000
BODY = b"x" * 220


def sqlite(name):
    """A record statement with SQLite's numbered placeholders (?1, ?2…)."""
    text = template("sqlite", name).replace("{table}", TABLE).replace("{now}", NOW)
    for n in range(9, 0, -1):
        text = text.replace("$%d" % n, "?%d" % n)
    return text


GET = sqlite("get")
INSERT = sqlite("insert")
COMPLETE = sqlite("complete")
BANK = (
    "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id)"
    " VALUES (?1, ?2, 'acc_bench', 100, 'EUR', 0, 'bench') ON CONFLICT (operation_id) DO NOTHING"
)
BANK_READ = "SELECT id FROM bank_charges WHERE operation_id = ?1"
PAYMENT = (
    "INSERT INTO shop_payments (id, client_id, account_id, amount, currency, status, bank_charge_id,"
    " operation_id, created_at) VALUES (?1, 'bench', 'acc_bench', 100, 'EUR', 'authorized', ?2, ?3, 0)"
    " ON CONFLICT (operation_id) DO NOTHING"
)
PAYMENT_READ = (
    "SELECT id, account_id, amount, currency, status, bank_charge_id FROM shop_payments"
    " WHERE operation_id = ?1"
)
EVENT = (
    "INSERT INTO " + OUTBOX + " (message_id, destination, ordering_key, payload, headers, created_at,"
    " next_attempt_at) VALUES (?1, 'payments.authorized', NULL, X'7b7d', X'', " + NOW + ", " + NOW + ")"
)


def bare_body(db, n, complete=None):
    db.execute(BANK, ("ch-" + n, "op-" + n))
    db.execute(BANK_READ, ("op-" + n,)).fetchall()
    db.execute("BEGIN IMMEDIATE")
    db.execute(PAYMENT, ("pay-" + n, "ch-" + n, "op-" + n))
    db.execute(PAYMENT_READ, ("op-" + n,)).fetchall()
    db.execute(EVENT, ("msg-" + n,))
    if complete:
        complete()
    db.execute("COMMIT")


def bare(db, n):
    bare_body(db, n)


def new(db, n):
    key = "k-" + n
    if db.execute(GET, (SCOPE, key)).fetchall():
        raise SystemExit("the first look found a record under a fresh key")
    token = int.from_bytes(os.urandom(7), "big")
    db.execute(
        INSERT,
        (SCOPE, key, os.urandom(32), str(uuid.uuid4()), token, LEASE_MS, RETENTION_MS),
    ).fetchall()

    def complete():
        if db.execute(COMPLETE, (SCOPE, key, token, 201, b"", BODY)).rowcount != 1:
            raise SystemExit("the completion found no claim")

    bare_body(db, n, complete)


def intx(db, n):
    key = "k-" + n
    if db.execute(GET, (SCOPE, key)).fetchall():
        raise SystemExit("the first look found a record under a fresh key")
    token = int.from_bytes(os.urandom(7), "big")

    def claim_and_complete():
        db.execute(
            INSERT,
            (SCOPE, key, os.urandom(32), str(uuid.uuid4()), token, LEASE_MS, RETENTION_MS),
        ).fetchall()
        if db.execute(COMPLETE, (SCOPE, key, token, 201, b"", BODY)).rowcount != 1:
            raise SystemExit("the completion found no claim")

    bare_body(db, n, claim_and_complete)


def run(db, request, seconds, prefix):
    done = 0
    end = time.monotonic() + seconds
    start = time.monotonic()
    while time.monotonic() < end:
        request(db, "%s-%d" % (prefix, done))
        done += 1
    return done / (time.monotonic() - start)


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ("full", "normal"):
        sys.exit(__doc__.rsplit("Usage: ", 1)[1].strip())
    path, synchronous = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    # autocommit: every statement outside BEGIN commits by itself, as on
    # idem's writers' connection
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL").fetchall()
    db.execute("PRAGMA synchronous = " + synchronous.upper())
    db.execute("PRAGMA foreign_keys = ON")
    db.execute("PRAGMA busy_timeout = 10000")
    run_id = uuid.uuid4().hex[:12]
    results = {"bare": [], "new": [], "intx": []}
    for r in range(rounds):
        for name, request in (("bare", bare), ("new", new), ("intx", intx)):
            results[name].append(run(db, request, seconds, "%s-%s-%d" % (run_id, name, r)))
    db.close()
    print(json.dumps({
        "synchronous": synchronous,
        "sqlite_version": sqlite3.sqlite_version,
        "bare_tps": round(statistics.median(results["bare"]), 1),
        "new_tps": round(statistics.median(results["new"]), 1),
        "intx_tps": round(statistics.median(results["intx"]), 1),
        "rounds": rounds,
    }))


if __name__ == "__main__":
    main()
