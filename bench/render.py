"""Renders BENCHMARKS.md from bench/run.sh's results (JSON lines)."""
import json
import platform
import subprocess
import sys

results_path, memory_path, criterion_path, command = sys.argv[1:5]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
raw = [json.loads(line) for line in open(results_path) if line.strip()]
memory = json.load(open(memory_path))
criterion = open(criterion_path).read().strip().splitlines()


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


# A scenario run several times (bare and new alternate in rounds) shows the
# median of each figure; errors are summed.
grouped = {}
for r in raw:
    grouped.setdefault((r["config"], r["scenario"]), []).append(r)
rows = []
for (c, s_), runs in grouped.items():
    row = dict(runs[0])
    for k in ["rps", "p50_ms", "p99_ms", "p999_ms", "cpu_db_us", "cpu_app_us"]:
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
out.append(f"- bare and new alternate in {rounds} rounds per configuration (a slow spell of "
           "this shared machine lands on both); their rows show the median of the rounds")
out.append(f"- reproduce: `{command}` (after `bash scripts/test` has the services up)\n")
out.append("Scenarios: **bare** — no idem layer; **new** — a fresh `Idempotency-Key` each "
           "request; **replay** — completed keys sent again; **inflight** — duplicates of a "
           "key whose original is still running (answered `409`).\n")
out.append("Where the time goes: **db µs** is the CPU time all of PostgreSQL spent per "
           "request (both the shop's and the outbox's work), **shop µs** the CPU time of the "
           "shop process per request (in the kernel too: every round trip to the database "
           "is a write, a wake-up and a read). On a 2-core machine shared with the load "
           "generator, throughput follows their sum.\n")
out.append("| config | scenario | req/s | p50 ms | p99 ms | p99.9 ms | errors | vs bare (req/s) | vs bare (p50) | db µs | shop µs |")
out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
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
        out.append(f"| {c} | {s} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                   f"{r['p999_ms']:.2f} | {r['errors']} | {ratio} | {p50} | {db} | {app} |")
out.append("")

out.append("## Making new keys fast\n")
out.append("A new key on the default path costs, beyond the bare handler, a claim that "
           "commits on its own (a pooled connection, its health check, the statement, a "
           "commit) and the completion inside the business transaction (one statement). "
           "With `--claim-in-transaction` (`IdempotencyLayer::claim_in_transaction` + "
           "`PendingClaim::begin`) the claim also commits first (it must bind the key to "
           "its request before the bank is called), then the business transaction locks "
           "the claim's row and holds it: one statement more than the default path, and "
           "a crash frees the key at once instead of after the lease. A key never seen is "
           "claimed by a plain `INSERT … ON CONFLICT DO NOTHING`; the statement that decides "
           "takeovers and duplicates only runs on a conflict.\n")
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
pairs = [("trivial: idem (memory)", "trivial: express-idempotency"),
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
for mode in ["postgres", "postgres (claim in tx)"]:
    pg_new, pg_bare = by.get((mode, "new")), by.get((mode, "bare"))
    if pg_new and pg_bare:
        t = pg_new["rps"] / pg_bare["rps"]
        l = pg_new["p50_ms"] / pg_bare["p50_ms"]
        out.append(f"- New keys on {mode}: throughput {t:.3f} of bare (target ≥ 0.75) — "
                   f"{'met' if t >= 0.75 else 'NOT met'}; p50 {l:.3f} of bare (target ≤ 1.35) — "
                   f"{'met' if l <= 1.35 else 'NOT met'}.")
c = ratio("postgres+cache", "replay", "postgres", "new")
out.append(f"- Replays from the in-process cache: {c:.2f}× the throughput of new keys (target ≥ 3) — "
           f"{'met' if c >= 3 else 'NOT met'}.")
r = ratio("postgres+redis", "replay", "postgres", "new")
out.append(f"- Replays from Redis: {r:.2f}× the throughput of new keys (target ≥ 1.5) — "
           f"{'met' if r >= 1.5 else 'NOT met'}.")
grow = memory["rss_end_kb"] - memory["rss_start_kb"]
samples = memory.get("samples_kb", [])
series = ", ".join(f"{kb / 1024:.1f}" for kb in samples)
out.append(f"- Memory: resident {memory['rss_start_kb'] / 1024:.1f} MiB after warm-up, "
           f"{memory['rss_end_kb'] / 1024:.1f} MiB after {memory['seconds']} s of steady load "
           f"(new keys and replays at 300 req/s): {grow / 1024:+.1f} MiB"
           + (f"; every tenth of the run: {series} MiB." if series else "."))
for ours, theirs in pairs:
    ahead = all(by[(ours, s_)]["rps"] > by[(theirs, s_)]["rps"]
                for s_ in ["new", "replay", "inflight"] if (ours, s_) in by and (theirs, s_) in by)
    out.append(f"- {ours[9:]} ahead of {theirs[9:]} on every scenario: {'met' if ahead else 'NOT met'}.")
out.append("- `axum-idempotent` was not run: it keys records by a session (cookie) store "
           "and needs a session layer in front; not wired yet.\n")

out.append("## The pure core (criterion)\n")
out.append("```")
out.extend(criterion)
out.append("```\n")
print("\n".join(out))
