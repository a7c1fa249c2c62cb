#!/usr/bin/env python3
"""The database's own limit for new keys: bench/run.sh's ceilings.

Prints a script of the statements one request runs, with no HTTP and no
shop in between, made from the SQL idem itself runs (crates/idem-sql/sql),
so that the ceilings follow the code:

  pg-bare    the bare handler's statements (bench/pgbench/bare.sql)
  pg-new     the first look that inserts the claim and commits it, then the
             bare handler's statements with the completion in its
             transaction (the default mode)
  pg-held    the claim committed with its lease at zero, then the bare
             handler's transaction locking the claim's row first and
             completing it last (--claim-in-transaction)
  pg-intx    a counterfactual, not a mode idem has: the first look run
             inside the bare handler's transaction, so that the claim has no
             commit of its own (a crash would then lose the claim and its
             operation id with it); what removing that commit could gain
  pg-look    a replay's one statement: the first look run on one of the
             completed records bench/pgbench/records.sql writes (it finds
             the record and inserts nothing)
  my-bare    the bare handler's statements on MySQL / MariaDB (mysqlslap)
  my-new     the first look, the claim's insert (committed by itself), then
             the bare handler's statements with the completion in its
             transaction

PostgreSQL's scripts are for `pgbench -M prepared` (each :variable a bound
parameter); MySQL's for `mysqlslap --delimiter=';'` (user variables per
request, the statements sent as text, where sqlx prepares them). Neither
has the outbox's `pg_notify`, which shop sends on PostgreSQL (BENCHMARKS.md
measures it apart), and the binds are expressions where idem binds values.

Usage: python3 bench/pgbench/claims.py pg-new > new.sql
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SQL = os.path.join(ROOT, "crates", "idem-sql", "sql")


def template(dialect, name):
    with open(os.path.join(SQL, dialect, name + ".sql"), encoding="utf-8") as f:
        lines = [l for l in f.read().splitlines() if not l.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";")


def fill(sql, binds):
    # $10 and up never occur in these templates; replace the longest first
    for n in sorted(binds, reverse=True):
        sql = re.sub(r"\$%d(?!\d)" % n, lambda _m, v=binds[n]: v, sql)
    return sql


# PostgreSQL: one request's key, fingerprint and token from pgbench's :n
PG_KEY = "('k-' || :client_id || '-' || :n)"
PG_SCOPE = "'pgbench-new'"
PG_BODY = "convert_to(repeat('x', 220), 'UTF8')"


def pg(name):
    columns = template("postgres", "columns")
    expired = template("postgres", "expired")
    text = template("postgres", name)
    return text.replace("{columns}", columns).replace("{expired}", expired).replace(
        "{table}", "idem_records"
    )


def pg_claim(lease_ms):
    return fill(
        pg("claim_first"),
        {
            1: PG_SCOPE,
            2: PG_KEY,
            3: "sha256((:n)::text::bytea)",
            4: "gen_random_uuid()::text",
            5: ":n",
            6: str(lease_ms),
            7: "86400000",
        },
    )


def pg_look():
    # the records of bench/pgbench/records.sql: scope 'pgbench', keys k1..k10000.
    # The fingerprint and the proposed operation id are values, as idem binds
    # them (it computes both in the process): spelled as expressions here,
    # sha256() and gen_random_uuid() would add their own CPU to every look.
    # A completed record answers whatever the fingerprint, as a replay does.
    return fill(
        pg("claim_first"),
        {
            1: "'pgbench'",
            2: "('k' || :k)",
            3: "'\\x" + "ab" * 32 + "'::bytea",
            4: "'01890a5d-ac96-774b-bcce-b302099a8057'",
            5: ":k",
            6: "30000",
            7: "86400000",
        },
    )


def pg_complete():
    return fill(
        pg("complete"),
        {1: PG_SCOPE, 2: PG_KEY, 3: ":n", 4: "201", 5: "'\\x'::bytea", 6: PG_BODY},
    )


def pg_hold():
    return fill(pg("hold"), {1: PG_SCOPE, 2: PG_KEY, 3: ":n", 4: "'30000'"})


def bare_pg():
    with open(os.path.join(ROOT, "bench", "pgbench", "bare.sql"), encoding="utf-8") as f:
        lines = [l for l in f.read().splitlines() if not l.lstrip().startswith("--")]
    text = "\n".join(lines)
    head, rest = text.split("\\set n random(1, 1000000000000)\n", 1)
    bank, tx = rest.split("BEGIN;\n", 1)
    body = tx.rsplit("COMMIT;", 1)[0]
    return bank.strip(), body.strip()


def pg_script(kind):
    if kind == "pg-look":
        return "\\set k random(1, 10000)\n" + pg_look() + ";\n"
    bank, body = bare_pg()
    out = ["\\set n random(1, 1000000000000)"]
    if kind == "pg-bare":
        out += [bank, "BEGIN;", body, "COMMIT;"]
    elif kind == "pg-new":
        out += [pg_claim(30000) + ";", bank, "BEGIN;", body, pg_complete() + ";", "COMMIT;"]
    elif kind == "pg-intx":
        out += [bank, "BEGIN;", pg_claim(30000) + ";", body, pg_complete() + ";", "COMMIT;"]
    elif kind == "pg-held":
        out += [pg_claim(0) + ";", bank, "BEGIN;", pg_hold() + ";", body, pg_complete() + ";", "COMMIT;"]
    return "\n".join(out) + "\n"


# MySQL: one request's key from a user variable set per request
MY_KEY = "CONCAT('k-', @n)"
MY_SCOPE = "'mysqlslap-new'"
MY_NOW = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"


def my(name):
    return template("mysql", name).replace("{table}", "idem_records").replace("{now}", MY_NOW)


def one_line(sql):
    return " ".join(sql.split())


def my_script(kind):
    bank = [
        "INSERT INTO bank_charges (id, operation_id, account_id, amount, currency, created_at, client_id, reference) "
        "VALUES (CONCAT('ch-', @n), CONCAT('op-', @n), 'acc_bench', 100, 'EUR', 0, 'bench', '')",
        "SELECT id FROM bank_charges WHERE operation_id = CONCAT('op-', @n)",
    ]
    body = [
        "START TRANSACTION",
        "INSERT INTO shop_payments (id, client_id, account_id, amount, currency, status, bank_charge_id, operation_id, created_at) "
        "VALUES (CONCAT('pay-', @n), 'bench', 'acc_bench', 100, 'EUR', 'authorized', CONCAT('ch-', @n), CONCAT('op-', @n), 0)",
        "INSERT INTO idem_outbox (message_id, destination, ordering_key, payload, headers, created_at, next_attempt_at) "
        "VALUES (CONCAT('msg-', @n), 'payments.authorized', NULL, x'7b7d', x'', %s, %s)" % (MY_NOW, MY_NOW),
    ]
    # one request's key and token, set in the same statement
    out = ["SET @n = UUID(), @t = UUID_SHORT() DIV 2"]
    if kind == "my-bare":
        out += bank + body + ["COMMIT"]
    elif kind == "my-new":
        key = {1: MY_SCOPE, 2: MY_KEY}
        claim = dict(key)
        claim.update({3: "UNHEX(SHA2(@n, 256))", 4: "UUID()", 5: "@t"})
        claim.update({6: MY_NOW + " + 30000", 7: MY_NOW, 8: MY_NOW + " + 86400000"})
        # the first look, then (finding no record) the claim's one insert
        out += [fill(my("first"), key), fill(my("insert"), claim)]
        out += bank + body
        done = dict(key)
        done.update({3: "@t", 4: "201", 5: "x''", 6: "REPEAT('x', 220)"})
        out += [fill(my("complete"), done), "COMMIT"]
    return ";\n".join(one_line(s) for s in out) + ";\n"


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else ""
    if kind in ("pg-bare", "pg-new", "pg-held", "pg-intx", "pg-look"):
        sys.stdout.write(pg_script(kind))
    elif kind in ("my-bare", "my-new"):
        sys.stdout.write(my_script(kind))
    else:
        sys.exit("usage: claims.py pg-bare|pg-new|pg-held|pg-intx|pg-look|my-bare|my-new")


if __name__ == "__main__":
    main()
