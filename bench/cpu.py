"""Prints the CPU time (ms) used so far by every database server process
(PostgreSQL's, MariaDB's or MySQL's) and by the process `pid`, then the
context switches of `pid`'s threads so far: `bench/run.sh` reads it before
and after each scenario to show where the time of a request goes."""
import os
import sys

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime, stime (and the children's, for forked workers)
        return sum(int(x) for x in fields[11:15])
    except (OSError, IndexError, ValueError):
        return 0


def postgres():
    total = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/comm") as f:
                if not f.read().startswith(("postgres", "mariadbd", "mysqld")):
                    continue
        except OSError:
            continue
        total += ticks(p)
    return total


def switches(pid):
    """Voluntary and involuntary context switches of every live thread of
    `pid`: on SQLite, every statement is a round trip to a thread of its
    connection, and each wakes one thread and then another."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:
                        total += int(line.split()[-1])
        except (OSError, ValueError):
            continue
    return total


print(f"{postgres() * TICK_MS:.0f} {ticks(sys.argv[1]) * TICK_MS:.0f} {switches(sys.argv[1])}")
