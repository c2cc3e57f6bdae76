#!/usr/bin/env python3
"""Turns the log of `cargo bench` into the ratio table of BENCHMARKS.md.

Usage: cargo bench -p idempotency-bench 2>&1 | tee bench.log
       python3 bench/ratios.py bench.log
Reads criterion's "thrpt: [low mid high]" lines (mid = the estimate), the
benches' own LATENCY / PEAK_RSS / SWEEP lines, and the PAIRED lines (the
interleaved measurements the target table is built from) with their
ROUNDS lines (the per-round ratios, printed by the postgres bench).
Targets are issue 12's. A target on a ratio is checked against the median
of the per-round ratios; a target on an absolute figure ("ours <= ...", the
bytes written per request) against the median of ours over the rounds.
"""
import re
import sys

UNITS = {"elem/s": 1, "Kelem/s": 1e3, "Melem/s": 1e6, "Gelem/s": 1e9,
         "B/s": 1, "KiB/s": 1024, "MiB/s": 1024**2, "GiB/s": 1024**3}


def parse(path):
    thrpt, lat, notes, name = {}, {}, [], None
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        m = re.match(r"^(\S.*?)\s+time:\s+\[", line)
        if m:
            name = m.group(1)
        elif line and not line[0].isspace() and not re.match(
                r"^(Benchmarking|Found|Warning|Gnuplot|LATENCY|RATIO|PRELOAD|"
                r"PEAK_RSS|SWEEP|LAYOUT|bench databases|preloaded|Running|"
                r"Compiling|Finished|Executable|PAIRED|ROUNDS|PG server|with-postgres|"
                r"postgres bench skipped|Redis server|with-redis|redis bench skipped|"
                r"IO_BYTES|BYTES)", line):
            name = line.strip()
        m = re.search(r"thrpt:\s+\[\S+\s+\S+\s+(\S+)\s+(\S+)\s+\S+\s+\S+\]", line)
        if m and name and "%" not in line:
            thrpt[name] = float(m.group(1)) * UNITS[m.group(2)]
        m = re.match(r"^LATENCY (.*): n=(\d+) p50=([\d.]+)us p99=([\d.]+)us", line)
        if m:
            lat[m.group(1)] = (float(m.group(3)), float(m.group(4)))
        if re.match(r"^(PEAK_RSS|SWEEP|PRELOAD|LAYOUT|PG server|IO_BYTES|BYTES)", line):
            notes.append(line)
    return thrpt, lat, notes


def find(d, *parts):
    hits = [k for k in d if all(p in k for p in parts)]
    return d[hits[0]] if len(hits) == 1 else None


def main():
    thrpt, lat, notes = parse(sys.argv[1])
    paired, rounds = {}, {}
    for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
        m = re.match(r"^ROUNDS (.*): ratios ([\d. ]+) \|", line)
        if m:
            rounds[m.group(1)] = m.group(2).split()
        m = re.match(r"^PAIRED (.*): ours ([\d.]+) (\S+), baseline ([\d.]+) \S+, "
                     r"ratio median ([\d.]+) \(min ([\d.]+), max ([\d.]+), (\d+) rounds\)", line)
        if m:
            paired[m.group(1)] = m.groups()[1:]
    print("## Criterion throughputs (elements/s or bytes/s)\n")
    for k, v in thrpt.items():
        print(f"- {k}: {v:,.1f}")
    print("\n## Latencies from the criterion benches (µs)\n")
    for k, (p50, p99) in lat.items():
        print(f"- {k}: p50 {p50:,.1f}, p99 {p99:,.1f}")
    print("\n## Notes\n")
    for n in notes:
        print(f"- {n}")
    print("\n## Targets (interleaved PAIRED measurements, median of per-round ratios)\n")
    print("| measure | ours (median) | baseline (median) | ratio median [min, max] | target | result |")
    print("|---|---|---|---|---|---|")
    # (name parts, op, goal): ">=" / "<=" on the ratio, "ours<=" on ours
    # (absolute), "info" for no target.
    targets = [
        (("durable req/s, 64 threads: engine vs redb 1 txn/op",), "info", 0),
        (("durable req/s, 64 threads: engine vs sqlite 1 txn/op",), "info", 0),
        (("durable req/s, 64 threads: engine vs sqlite batched",), ">=", 1.5),
        (("durable req/s, 8 threads: engine vs sqlite batched",), ">=", 1.0),
        (("begin p99 at 64 threads vs raw fsync p99",), "<=", 10),
        (("begin p50 at 64 threads vs raw fsync p50",), "info", 0),
        (("bytes written per request, 64 threads: engine vs sqlite batched",), "ours<=", 3072),
        (("device bytes written per request",), "ours<=", 3072),
        (("bytes written per request, 64 threads: engine vs redb 1 txn/op",), "info", 0),
        (("bytes written per request, 64 threads: engine vs sqlite 1 txn/op",), "info", 0),
        (("bytes written per request, 8 threads: engine vs sqlite batched",), "info", 0),
        (("bytes written per request (write calls), 64 threads: engine vs sqlite batched",), "info", 0),
        (("bytes written per request (write calls), 8 threads: engine vs sqlite batched",), "info", 0),
        (("replay", "engine vs raw redb"), ">=", 0.7),
        (("replay", "engine vs sqlite"), "info", 0),
        (("fingerprint 300B",), ">=", 0.8),
        (("fingerprint 10KiB",), ">=", 0.8),
        (("records vs 10000 records",), ">=", 0.8),
        (("while sweeping",), "<=", 2),
        (("postgres", "engine (pool 64) vs hand-written baseline"), ">=", 0.8),
        (("postgres", "redb engine vs hand-written postgres baseline"), "info", 0),
        (("redis durable req/s, 64 threads", "engine (pool 64) vs hand-written baseline"), ">=", 0.8),
        (("redis durable req/s, 8 threads", "engine (pool 64) vs hand-written baseline"), "info", 0),
        (("redis durable req/s, 64 threads", "redb engine vs hand-written redis"), "info", 0),
        (("redis durable req/s, 8 threads", "redb engine vs hand-written redis"), "info", 0),
    ]
    for parts, op, goal in targets:
        key = [k for k in paired if all(p in k for p in parts)]
        if len(key) != 1:
            print(f"| {' '.join(parts)} | | | | | not measured |")
            continue
        ours, unit, base, med, lo, hi, n = paired[key[0]]
        r = float(med)
        if op == "info":
            result, tgt = "", "(no target)"
        elif op == "ours<=":
            result = "met" if float(ours) <= goal else "MISSED"
            tgt = f"ours ≤ {goal:,} {unit}"
        else:
            ok = r >= goal if op == ">=" else r <= goal
            result, tgt = ("met" if ok else "MISSED"), f"{'≥' if op == '>=' else '≤'} {goal}×"
        print(f"| {key[0]} | {float(ours):,.1f} {unit} | {float(base):,.1f} {unit} | "
              f"{r:.2f}× [{float(lo):.2f}, {float(hi):.2f}] ({n} rounds) | {tgt} | {result} |")
    if rounds:
        print("\n## Per-round ratios (in measurement order)\n")
        for k, v in rounds.items():
            print(f"- {k}: {', '.join(x + '×' for x in v)}")


main()
