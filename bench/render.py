"""Renders BENCHMARKS.md from bench/run.sh's results (JSON lines)."""
import json
import platform
import re
import subprocess
import sys

results_path, memory_path, criterion_path, command = sys.argv[1:5]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
raw = [json.loads(line) for line in open(results_path) if line.strip()]
memory = json.load(open(memory_path))
criterion = open(criterion_path).read().strip().splitlines()
ceilings = json.load(open(sys.argv[6])) if len(sys.argv) > 6 else {}
instructions = {}
if len(sys.argv) > 7:
    for line in open(sys.argv[7]):
        if line.strip():
            d = json.loads(line)
            instructions[d["scenario"]] = d["instructions_per_request"]


def criterion_time(name):
    """A criterion line's middle estimate, in nanoseconds."""
    units = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}
    for line in criterion:
        if line.split()[0] == name:
            inner = line.split("[", 1)[1].split("]", 1)[0].split()
            return float(inner[2]) * units[inner[3]]
    return float("nan")


def fingerprint_rounds(size):
    """The fingerprint's ratios from `--bench fingerprint_rounds` (each
    variant's fastest round over the raw hash's, and the medians of the
    rounds' own ratios), or None if that bench did not run."""
    for line in criterion:
        words = line.split()
        if words[:2] == ["fingerprint-rounds", size]:
            fastest, median = {}, {}
            into = fastest
            for w in words[2:]:
                if w == "median":
                    into = median
                elif "=" in w:
                    k, v = w.split("=", 1)
                    into[k] = float(v)
            return fastest, median
    return None


def cpu():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nproc():
    return subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# A scenario run several times (every scenario runs in rounds) shows the
# median of each figure; errors are summed.
grouped = {}
for r in raw:
    grouped.setdefault((r["config"], r["scenario"]), []).append(r)
rows = []
for (c, s_), runs in grouped.items():
    row = dict(runs[0])
    for k in ["rps", "p50_ms", "p99_ms", "p999_ms", "cpu_db_us", "cpu_app_us", "switches_app"]:
        if all(k in x for x in runs):
            row[k] = median([x[k] for x in runs])
    row["errors"] = sum(x["errors"] for x in runs)
    row["runs"] = len(runs)
    rows.append(row)
by = {(r["config"], r["scenario"]): r for r in rows}
configs = []
for r in rows:
    if r["config"] not in configs and not r["config"].startswith("trivial: "):
        configs.append(r["config"])
peers = [c for c in dict.fromkeys(r["config"] for r in rows) if c.startswith("trivial: ")]

out = []
out.append("# Benchmarks\n")
out.append("What idem costs on each path, side by side with the same `POST /payments` "
           "work without idem (`bare`: bank charge, payment insert, outbox event, one "
           "transaction), measured in one run on one machine by `bench/run.sh`.\n")
out.append(f"- machine: {cpu()}, {nproc()} cores, {platform.system()} {platform.release()}")
out.append(f"- load: `idem-load`, {rows[0]['requests']} requests per scenario, "
           f"concurrency {rows[0]['concurrency']}, client on the same machine")
out.append(f"- every scenario runs in each of {rounds} rounds per configuration (bare, new, "
           "then, once the new keys' backlog has settled, replays and in-flight duplicates), so "
           "that a slow spell of this shared machine lands on all of them, and the peers run in "
           "as many rounds, in an order reversed every other round; the rows show the median "
           "of the rounds")
out.append(f"- reproduce: `{command}` (after `bash scripts/test` has the services up)\n")
out.append("Scenarios: **bare** — no idem layer; **new** — a fresh `Idempotency-Key` each "
           "request; **replay** — completed keys sent again; **inflight** — duplicates of a "
           "key whose original is still running (answered `409`).\n")
out.append("Where the time goes: **db µs** is the CPU time the database servers (PostgreSQL, MariaDB) spent per "
           "request (both the shop's and the outbox's work), **shop µs** the CPU time of the "
           "shop process per request (in the kernel too: every round trip to the database "
           "is a write, a wake-up and a read). On a 2-core machine shared with the load "
           "generator, throughput follows their sum. **shop switches** counts the context "
           "switches of the shop process's threads per request: on SQLite, whose work runs "
           "inside shop, each statement is a round trip to the thread of its connection "
           "(sqlx's design), which wakes that thread and then the request's, and these "
           "switches, more than SQLite's own work, are what a request costs there.\n")
out.append("| config | scenario | req/s | p50 ms | p99 ms | p99.9 ms | errors | vs bare (req/s) | vs bare (p50) | db µs | shop µs | shop switches |")
out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in configs:
    bare = by.get((c, "bare"))
    for s in ["bare", "new", "replay", "inflight"]:
        r = by.get((c, s))
        if not r:
            continue
        ratio = f"{r['rps'] / bare['rps']:.2f}" if bare else "-"
        p50 = f"{r['p50_ms'] / bare['p50_ms']:.2f}" if bare and bare["p50_ms"] else "-"
        db = f"{r['cpu_db_us']:.0f}" if "cpu_db_us" in r else "-"
        app = f"{r['cpu_app_us']:.0f}" if "cpu_app_us" in r else "-"
        sw = f"{r['switches_app']:.0f}" if "switches_app" in r else "-"
        out.append(f"| {c} | {s} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                   f"{r['p999_ms']:.2f} | {r['errors']} | {ratio} | {p50} | {db} | {app} | {sw} |")
out.append("")

out.append("## Against the machine's limit\n")
out.append("The same work without the HTTP stack in between, in the same run: `pgbench` "
           "(prepared statements, the same concurrency, without TLS as shop connects) running bare's statements "
           "(`bench/pgbench/bare.sql`: the bank's charge and its read-back, the payment and "
           "its outbox event in one transaction) and a primary-key read of a completed "
           "record (`bench/pgbench/replay.sql`), and the HTTP stack without a database "
           "(idem's layer with the memory store in front of a trivial handler, below). "
           "Each figure is the fraction of its ceiling it reaches.\n")
bare_c = ceilings.get("bare_statements_tps")
read_c = ceilings.get("primary_key_read_tps")
http_c = by.get(("trivial: idem (memory)", "replay"))
# A replay on PostgreSQL: idem's first look (pgbench) and shop answering
# from its in-process cache, on the same two cores.
replay_bound = None
if (ceilings.get("first_look_tps") and by.get(("postgres+cache", "replay"))
        and by.get(("postgres", "bare")) and by.get(("postgres", "replay"))):
    look_c = ceilings["first_look_tps"]
    shop_r = by[("postgres+cache", "replay")]["rps"]
    replay_bound = (look_c, shop_r, 1 / (1 / look_c + 1 / shop_r))
if bare_c and read_c:
    out.append(f"- ceilings: bare's statements {bare_c:.0f}/s, a primary-key read {read_c:.0f}/s"
               + (f", the HTTP stack with the memory store {http_c['rps']:.0f} req/s." if http_c else "."))
    out.append("")
    out.append("| config | scenario | req/s | ceiling | fraction of it |")
    out.append("|---|---|---:|---|---:|")
    for c in ["postgres", "postgres (claim in tx)"]:
        for s_, ceiling, name in [("bare", bare_c, "bare's statements"),
                                  ("new", bare_c, "bare's statements"),
                                  ("replay", read_c, "primary-key read"),
                                  ("inflight", read_c, "primary-key read")]:
            r = by.get((c, s_))
            if r:
                out.append(f"| {c} | {s_} | {r['rps']:.0f} | {name} ({ceiling:.0f}/s) | {r['rps'] / ceiling:.2f} |")
    out.append("")
    out.append("A replay cannot beat the lower of its two ceilings: the read, and the HTTP "
               "stack around it, which share the same two cores.")
    if http_c:
        both = 1 / (1 / read_c + 1 / http_c["rps"])
        out.append(f"Each ceiling is measured with the whole machine to itself; a replay needs "
                   f"both on the same two cores, so it can reach at most about "
                   f"1 / (1/{read_c:.0f} + 1/{http_c['rps']:.0f}) = {both:.0f}/s, "
                   f"{both / min(read_c, http_c['rps']):.2f} of the lower one, before shop's own "
                   "work (its routes, authentication, tenant scope, the outbox relay) is counted.")
    if replay_bound:
        look_c, shop_r, bound = replay_bound
        bare_r = by[("postgres", "bare")]["rps"]
        out.append("")
        out.append(f"A replay's two parts, each measured alone in this run: the database's is "
                   f"idem's first look finding a completed record (`claims.py pg-look`), "
                   f"{look_c:.0f}/s with pgbench, {look_c / read_c:.2f} of the primary-key read "
                   "(the insert a new key would make is planned and opened even when it "
                   f"inserts nothing); shop's is a replay answered from its in-process cache "
                   f"(`postgres+cache`), {shop_r:.0f}/s. On the same two cores they allow about "
                   f"1 / (1/{look_c:.0f} + 1/{shop_r:.0f}) = {bound:.0f}/s: {bound / bare_r:.1f}× "
                   f"bare, {bound / read_c:.2f} of the primary-key read. An estimate, not a bound: "
                   "each part's figure also pays its own load client's CPU (pgbench's, "
                   "idem-load's), which a replay pays once. The measured replays "
                   f"reach {by[('postgres', 'replay')]['rps'] / bound:.2f} of it.")
    out.append("")

# The database's own price of a new key: the same statements with no HTTP
# and no shop in between, bare's and a new key's, alternated in one run.
new_c = ceilings.get("new_key_statements_tps")
held_c = ceilings.get("held_claim_statements_tps")
my_bare_c = ceilings.get("mysql_bare_statements_tps")
my_new_c = ceilings.get("mysql_new_key_statements_tps")
intx_c = ceilings.get("claim_without_commit_statements_tps")
bare_nf_c = ceilings.get("bare_statements_no_flush_tps")
new_nf_c = ceilings.get("new_key_statements_no_flush_tps")
db_limit = {}
# What is left of a new key's price with its claim's commit taken away, and
# with no commit waiting for the disk: counterfactuals, PostgreSQL's only.
counterfactual = {}
if bare_c and new_c:
    db_limit["postgres"] = (new_c / bare_c, f"{new_c:.0f} against {bare_c:.0f}/s")
    counterfactual["postgres"] = (
        f"{intx_c / bare_c:.2f} ({intx_c:.0f}/s)" if intx_c else "-",
        f"{new_nf_c / bare_nf_c:.2f} ({new_nf_c:.0f} against {bare_nf_c:.0f}/s)"
        if new_nf_c and bare_nf_c else "-",
    )
if bare_c and held_c:
    db_limit["postgres (claim in tx)"] = (held_c / bare_c, f"{held_c:.0f} against {bare_c:.0f}/s")
if my_bare_c and my_new_c:
    db_limit["mysql"] = (my_new_c / my_bare_c, f"{my_new_c:.0f} against {my_bare_c:.0f}/s")
for mode, prefix in [("sqlite", "sqlite"), ("sqlite (synchronous normal)", "sqlite_normal")]:
    sq_bare_c = ceilings.get(f"{prefix}_bare_statements_tps")
    sq_new_c = ceilings.get(f"{prefix}_new_key_statements_tps")
    sq_intx_c = ceilings.get(f"{prefix}_claim_without_commit_statements_tps")
    if sq_bare_c and sq_new_c:
        db_limit[mode] = (sq_new_c / sq_bare_c, f"{sq_new_c:.0f} against {sq_bare_c:.0f}/s")
        counterfactual[mode] = (
            f"{sq_intx_c / sq_bare_c:.2f} ({sq_intx_c:.0f}/s)" if sq_intx_c else "-",
            "-",
        )
if db_limit:
    out.append("### A new key's price in the database alone\n")
    out.append("What a new key adds can be measured without HTTP or shop: the same clients "
               "(pgbench on PostgreSQL, prepared; mysqlslap on MariaDB, as text; on SQLite "
               "Python's `sqlite3`, SQLite's C library called directly, one request after "
               "another, since SQLite writes one transaction at a time: "
               "`bench/pgbench/sqlite_ceiling.py`) run bare's "
               "statements, then a new key's: idem's own claim statements "
               "(`bench/pgbench/claims.py` makes the scripts from `crates/idem-sql/sql`), "
               "committed on their own, then bare's statements with the completion in their "
               "transaction (none with the outbox's `pg_notify`, nor the relay's and the "
               "inbox's work, which shop also runs). Alternated in "
               f"{ceilings.get('rounds', 1)} rounds, medians. The ratio is what the database "
               "alone allows a new key against bare on this machine; over HTTP shop's own "
               "work is added to both.\n")
    out.append("Two counterfactuals, alternated in the same rounds, say what that price is "
               "made of on PostgreSQL. *Without the claim's commit*: the first look run inside "
               "the business transaction, so the claim has no commit of its own (the same "
               "statements, one durable commit fewer; not a mode idem ships, since a crash before the "
               "commit would lose the claim's operation id, and the retry would run the bank's "
               "charge under a new one). *No flush*: bare's and a new key's statements with "
               "`synchronous_commit = off`, no commit waiting for the disk. Where both stay "
               "near the first figure, the price is the two statements' CPU, not the commit "
               "or the disk. On SQLite the first is the claim's insert run inside the "
               "payment's transaction, and the second is the row with `synchronous = NORMAL` "
               "(commits written to the log, synced at checkpoints).\n")
    out.append("| config | new keys / bare over HTTP | the database's statements alone: new / bare "
               "| without the claim's commit / bare | no flush: new / bare |")
    out.append("|---|---:|---:|---:|---:|")
    for c, (lim, detail) in db_limit.items():
        n, b = by.get((c, "new")), by.get((c, "bare"))
        http = f"{n['rps'] / b['rps']:.2f}" if n and b else "-"
        without, no_flush = counterfactual.get(c, ("-", "-"))
        out.append(f"| {c} | {http} | {lim:.2f} ({detail}) | {without} | {no_flush} |")
    out.append("")

out.append("## Making new keys fast\n")
out.append("A new key on the default path costs, beyond the bare handler, one statement "
           "that commits on its own (the first look: a read of the key and, finding none, "
           "the claim's insert; durable before the handler runs) and the completion "
           "inside the business transaction (one statement). A repeat costs the first "
           "look alone: a read that writes and locks nothing. With "
           "`--claim-in-transaction` the claim also commits first, then the business "
           "transaction locks the claim's row and holds it: one statement more, and a "
           "crash frees the key at once instead of after the lease.\n")
for mode in ["postgres", "postgres (claim in tx)"]:
    n, b = by.get((mode, "new")), by.get((mode, "bare"))
    if n and b and "cpu_db_us" in n and "cpu_db_us" in b:
        out.append(f"- {mode}: a new key adds {n['cpu_db_us'] - b['cpu_db_us']:.0f} µs of "
                   f"database CPU and {n['cpu_app_us'] - b['cpu_app_us']:.0f} µs of shop CPU "
                   f"to the bare request's {b['cpu_db_us']:.0f} + {b['cpu_app_us']:.0f} µs.")
out.append("")
out.append("The trade-off of a claim held by the transaction: the transaction, and its "
           "connection, stay open for the whole handler (here across the bank call), so it "
           "suits short handlers; a duplicate is told `409` at once while the row is locked "
           "(it never waits on it); a holder idle in its transaction past the lease has its "
           "session ended by PostgreSQL (`idle_in_transaction_session_timeout`, set for that "
           "transaction alone), and a crash ends the transaction with the connection, so "
           "the retry takes the claim over at once under the same operation id.\n")

# The cost model is counted from the code, not measured: kept beside this
# script and copied in as written.
with open(f"{sys.path[0]}/cost-model.md", encoding="utf-8") as model:
    out.append(model.read())

if instructions:
    out.append("## Instructions per request (callgrind)\n")
    out.append("Counted by valgrind's callgrind in `idem-trivial` (`bash bench/callgrind.sh`): "
               "the whole server process, per request, the difference between two runs of "
               "different lengths so that start-up and warm-up cancel out. The machine's speed "
               "cannot move these; the scheduler's wake-ups move them by about 1 % between "
               "runs of one binary, so a change to the code shows beyond that. Under valgrind SHA-256 runs without the "
               "CPU's SHA extensions, so the fingerprint's share is larger here than natively.\n")
    out.append("| scenario | instructions / request | vs bare |")
    out.append("|---|---:|---:|")
    base = instructions.get("bare")
    for s_ in ["bare", "new", "replay"]:
        if s_ in instructions:
            v = instructions[s_]
            out.append(f"| {s_} | {v:,.0f} | {v / base:.2f} |" if base else f"| {s_} | {v:,.0f} | - |")
    out.append("")

out.append("## Peers, in front of the same trivial endpoint\n")
out.append("Each library guards the same `POST /payments` (sleep if asked, answer 201 "
           "with a fresh id), driven by the same load; idem with the same kind of store "
           "next to each.\n")
out.append("| config | scenario | req/s | p50 ms | p99 ms | p99.9 ms | errors |")
out.append("|---|---|---:|---:|---:|---:|---:|")
for c in peers:
    for s_ in ["new", "replay", "inflight"]:
        r = by.get((c, s_))
        if r:
            out.append(f"| {c[9:]} | {s_} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                       f"{r['p999_ms']:.2f} | {r['errors']} |")
out.append("")
pairs = [("trivial: idem (memory)", "trivial: idempotent (memory)"),
         ("trivial: idem (memory)", "trivial: axum-idempotent (memory)"),
         ("trivial: idem (memory)", "trivial: express-idempotency"),
         ("trivial: idem (redis)", "trivial: idempotent (redis)"),
         ("trivial: idem (redis)", "trivial: @node-idempotency (redis)")]
for ours, theirs in pairs:
    for s_ in ["new", "replay", "inflight"]:
        a, b = by.get((ours, s_)), by.get((theirs, s_))
        if a and b:
            out.append(f"- {ours[9:]} / {theirs[9:]}, {s_}: {a['rps'] / b['rps']:.2f}× the throughput, "
                       f"p50 {a['p50_ms'] / b['p50_ms']:.2f}× the latency.")
out.append("")
out.append("What the peers, as configured here, do not give that idem does (a faster "
           "peer that double-charges is not ahead):\n")
out.append("- `idempotent` 2.0 (aklanti; its tower layer, memory and Valkey/Redis stores): an "
           "atomic claim (one of eight simultaneous requests runs, seven get `409`), a "
           "fingerprint of method, path, query and body (but `400`, not `422`, for a reused "
           "key), a renewed lease with takeover after a crash; but keys are global unless a "
           "scope is set, every status is stored (a `5xx` is replayed, so a retry never "
           "runs again), no fencing of a completion, no operation id, no SQL store (a record "
           "cannot commit with the business write), Redis single node only.")
out.append("- `axum-idempotent` 0.6 (records in a `ruts` session, here in memory): keyed by "
           "session, and it never creates a session, so a client without a session cookie "
           "gets no deduplication at all (the load sends one fixed cookie); no claim: a "
           "duplicate of a request still running runs the handler again (its `inflight` row "
           "measures second executions, not `409`s; eight simultaneous requests ran eight "
           "times); no fingerprint (another body with the same key gets the first response); "
           "no lease; records shared between instances only through a shared session store "
           "and the same cookie.")
out.append("- `express-idempotency`: records live in the process's memory (its default "
           "adapter), so two instances, or a restart, forget each other's keys; no lease, "
           "so a crashed request's key is never taken over; the handler must check "
           "`isHit()` itself; no record committed with the business write.")
out.append("- `@node-idempotency/core` + Redis: an atomic claim (`SET NX`) and a body "
           "fingerprint, but no fencing token: a holder that outlives its record can still "
           "complete it; no operation id kept across retries; the record cannot commit with "
           "a SQL business write.\n")

out.append("## Targets\n")
def ratio(c1, s1, c2, s2):
    a, b = by.get((c1, s1)), by.get((c2, s2))
    return a["rps"] / b["rps"] if a and b else float("nan")
def verdict(ok):
    return "met" if ok else "NOT met"
for s_ in ["replay", "inflight"]:
    t = ratio("postgres", s_, "postgres", "bare")
    line = (f"- {s_.capitalize()}s from PostgreSQL alone: {t:.2f}× the bare handler's "
            f"throughput (target ≥ 10) — {verdict(t >= 10)}")
    r = by.get(("postgres", s_))
    if r and read_c and http_c:
        low = min(read_c, http_c["rps"])
        f = r["rps"] / low
        line += (f"; {f:.2f} of the lower of its two ceilings, {low:.0f}/s (target ≥ 0.5) — "
                 f"{verdict(f >= 0.5)}")
    if s_ == "replay" and replay_bound:
        b = by[("postgres", "bare")]["rps"]
        line += (f"; what the first look and shop's own replay allow on the same two cores, "
                 f"estimated in this run (above): about {replay_bound[2]:.0f}/s, "
                 f"{replay_bound[2] / b:.1f}× bare")
        if read_c and http_c:
            line += f" and {replay_bound[2] / min(read_c, http_c['rps']):.2f} of the lower ceiling"
    out.append(line + ".")
for mode, floor in [("postgres", 0.85), ("postgres (claim in tx)", 0.85), ("mysql", 0.85),
                    ("sqlite", 0.80), ("sqlite (synchronous normal)", 0.80)]:
    n, b = by.get((mode, "new")), by.get((mode, "bare"))
    if n and b:
        t = n["rps"] / b["rps"]
        l = n["p50_ms"] / b["p50_ms"]
        line = (f"- New keys on {mode}: throughput {t:.3f} of bare (target ≥ {floor:.2f}) — "
                f"{verdict(t >= floor)}")
        if not mode.startswith("sqlite"):
            line += f"; p50 {l:.3f} of bare (target ≤ 1.20) — {verdict(l <= 1.20)}"
        if mode in db_limit:
            line += f"; the database's statements alone reach {db_limit[mode][0]:.2f} of bare's"
        if mode == "postgres" and intx_c and bare_c:
            line += f" ({intx_c / bare_c:.2f} with no commit of the claim's own"
            if new_nf_c and bare_nf_c:
                line += f", {new_nf_c / bare_nf_c:.2f} with no commit waiting for the disk"
            line += ")"
        out.append(line + ".")
for size in ["1KiB", "64KiB"]:
    alternated = fingerprint_rounds(size)
    if alternated:
        # Alternated rounds: the fastest round of each variant (the code's
        # cost), with the medians of the rounds' ratios beside it.
        fastest, median = alternated
        j = fastest["json/raw"]
        line = (f"- Canonical-JSON fingerprint of {size}: {j:.2f}× the cost of hashing "
                f"the raw bytes (target ≤ 2.5) — {verdict(j <= 2.5)}; fastest of "
                f"{fastest['rounds']:.0f} alternated rounds each (median of the rounds' ratios "
                f"{median['json/raw']:.2f}×); the same body already canonical "
                f"{fastest['canon/raw']:.2f}×, and serde_json validating it plus the hash "
                f"{fastest['serde/raw']:.2f}×")
        out.append(line + ".")
        continue
    j, r = criterion_time(f"fingerprint/json/{size}"), criterion_time(f"fingerprint/raw/{size}")
    if j == j and r == r:
        line = (f"- Canonical-JSON fingerprint of {size}: {j / r:.2f}× the cost of hashing "
                f"the raw bytes (target ≤ 2.5) — {verdict(j / r <= 2.5)}")
        c = criterion_time(f"fingerprint/canon/{size}")
        v = criterion_time(f"fingerprint/serde/{size}")
        if c == c and v == v:
            # The ceilings, in the same run: a body already canonical (the
            # parse without reordering), and serde_json validating the bytes
            # into nothing, to which the hash must still be added.
            line += (f"; the same body already canonical {c / r:.2f}×, and serde_json "
                     f"validating it alone plus the hash {(v + r) / r:.2f}×")
        out.append(line + ".")
c = ratio("postgres+cache", "replay", "postgres", "new")
out.append(f"- Replays from the in-process cache: {c:.2f}× the throughput of new keys (target ≥ 3) — "
           f"{verdict(c >= 3)}.")
r = ratio("postgres+redis", "replay", "postgres", "new")
out.append(f"- Replays from Redis: {r:.2f}× the throughput of new keys (target ≥ 1.5) — "
           f"{verdict(r >= 1.5)}.")
grow = memory["rss_end_kb"] - memory["rss_start_kb"]
samples = memory.get("samples_kb", [])
series = ", ".join(f"{kb / 1024:.1f}" for kb in samples)
out.append(f"- Memory: resident {memory['rss_start_kb'] / 1024:.1f} MiB after warm-up, "
           f"{memory['rss_end_kb'] / 1024:.1f} MiB after {memory['seconds']} s of steady load "
           f"(new keys and replays at 300 req/s): {grow / 1024:+.1f} MiB"
           + (f"; every tenth of the run: {series} MiB." if series else "."))
for ours, theirs in pairs:
    common = [s_ for s_ in ["new", "replay", "inflight"] if (ours, s_) in by and (theirs, s_) in by]
    if not common:
        continue
    ahead = all(by[(ours, s_)]["rps"] > by[(theirs, s_)]["rps"] for s_ in common)
    out.append(f"- {ours[9:]} ahead of {theirs[9:]} on every scenario it supports "
               f"({', '.join(common)}): {verdict(ahead)}.")
out.append("")

out.append("## The pure core (criterion)\n")
out.append("```")
out.extend(criterion)
out.append("```\n")

# Sections measured by other scripts (scale, events, gRPC, the proxy, …)
# carry a date in their heading: they are kept as they are, after the
# generated ones, when this run rewrites the file.
if len(sys.argv) > 8:
    try:
        previous = open(sys.argv[8], encoding="utf-8").read().splitlines()
    except OSError:
        previous = []
    keep, kept = False, []
    for line in previous:
        if line.startswith("## "):
            keep = bool(re.search(r"\(\d{4}-\d{2}-\d{2}", line))
        if keep:
            kept.append(line)
    if kept:
        out.extend(kept)
        out.append("")
print("\n".join(out).rstrip("\n"))
