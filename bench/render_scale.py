"""Renders bench/scale.sh's results (one JSON object per line) as the
Markdown section BENCHMARKS.md keeps: latency against an empty table, size
per record, the sweep beside claims, Redis's memory per record.

Usage: python3 bench/render_scale.py bench/scale.json
"""

import json
import statistics
import sys


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    dbs = [d for d in ("postgres", "mysql", "sqlite") if any(r["db"] == d for r in rows)]
    out = []
    out.append("| database | table | records | scenario | req/s | p50 ms | p99 ms | p50 vs empty | p99 vs empty |")
    out.append("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for db in dbs:
        size = next((r for r in rows if r["db"] == db and r["scenario"] == "size"), None)
        records = size["records"] if size else None
        for scenario in ("new", "replay"):
            med = {}
            for table in ("empty", "full"):
                runs = [r for r in rows if r["db"] == db and r.get("table") == table and r["scenario"] == scenario]
                if not runs:
                    continue
                med[table] = {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")}
                med[table]["rounds"] = len(runs)
            for table in ("empty", "full"):
                if table not in med:
                    continue
                m = med[table]
                vs50 = vs99 = ""
                if table == "full" and "empty" in med:
                    vs50 = f"{m['p50_ms'] / med['empty']['p50_ms']:.2f}"
                    vs99 = f"{m['p99_ms'] / med['empty']['p99_ms']:.2f}"
                n = "0" if table == "empty" else (f"{records:,}" if records else "?")
                out.append(
                    f"| {db} | {table} | {n} | {scenario} | {m['rps']:.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {vs50} | {vs99} |"
                )
    out.append("")
    sizes = [r for r in rows if r["scenario"] == "size"]
    if sizes:
        out.append("| database | records | table bytes/record | index bytes/record | total MiB |")
        out.append("|---|---:|---:|---:|---:|")
        for r in sizes:
            n = max(r["records"], 1)
            total = (r["table_bytes"] + r["index_bytes"]) / 2**20
            out.append(
                f"| {r['db']} | {r['records']:,} | {r['table_bytes'] / n:.0f} | {r['index_bytes'] / n:.0f} | {total:,.0f} |"
            )
        out.append("")
    sweeps = [r for r in rows if r["scenario"] == "sweep"]
    if sweeps:
        out.append(
            "| database | swept | batch | rows/s | ms per batch | claims at | p50 alone | p99 alone | worst p50 during | worst p99 during | errors |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sweeps:
            dp50 = "" if r["during_p50_ms"] is None else f"{r['during_p50_ms']:.2f}"
            dp99 = "" if r["during_p99_ms"] is None else f"{r['during_p99_ms']:.2f}"
            out.append(
                f"| {r['db']} | {r['swept']:,} | {r['batch']} | {r['rows_per_s']:,.0f} "
                f"| {r['seconds'] * 1000 / max(-(-r['swept'] // r['batch']), 1):.1f} | {r['rate']:.0f}/s "
                f"| {r['alone_p50_ms']:.2f} | {r['alone_p99_ms']:.2f} | {dp50} | {dp99} | {r['during_errors']} |"
            )
        out.append("")
    for r in rows:
        if r["db"] == "redis" and r["scenario"] == "memory":
            per = (r["used_after"] - r["used_before"]) / max(r["records"], 1)
            out.append(
                f"- Redis: {r['records']:,} records take {(r['used_after'] - r['used_before']) / 2**20:,.0f} MiB "
                f"(`used_memory` before and after): {per:.0f} bytes per record; `MEMORY USAGE` of one record: "
                f"{r['memory_usage_one']} bytes."
            )
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/scale.json")
