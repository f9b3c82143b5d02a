"""The whole test suite, run several times in a row while CPU-bound processes run beside it (issue 11: the suite
must not depend on having the machine to itself).

    python -m bench.busy_suite --runs 5 --hogs 1 --out bench/results/busy_suite

Each run is ``python -m pytest -q -p no:cacheprovider`` (the README's test command, without the cache) in a fresh
subprocess; ``--hogs`` processes spin ``while True: pass`` for the whole time (each takes one core, so on the
2-core CI machine one hog leaves the suite one core). Prints a table and writes ``runs.csv`` (run, exit code,
passed, failed, errors, skipped, seconds) and each run's output tail to ``run_<k>.log``. Exit 0 when every run
passed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from bench.scripts import script_parser
from bench.server import ROOT
from bench.sweep.report import write_csv

HOG = "while True: pass"
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def summary_counts(output: str) -> dict[str, int]:
    """pytest's last summary line as counts: ``"3 failed, 700 passed, 2 skipped in 9.1s"`` ->
    ``{"passed": 700, "failed": 3, "errors": 0, "skipped": 2}``."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    lines = [line for line in output.splitlines() if re.search(r"\b(passed|failed|error)", line)]
    for n, what in COUNTS.findall(lines[-1] if lines else ""):
        key = "errors" if what.startswith("error") else what
        if key in counts:
            counts[key] = int(n)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.busy_suite", __doc__)
    p.add_argument("--runs", type=int, default=5, help="suite runs in a row")
    p.add_argument("--hogs", type=int, default=1, help="CPU-bound processes beside the suite")
    p.add_argument("--out", type=Path, default=Path("bench/results/busy_suite"), help="folder for runs.csv, logs")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. a test path)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    rows = []
    try:
        for k in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                                  cwd=ROOT, capture_output=True, text=True)
            seconds = time.monotonic() - t0
            (args.out / f"run_{k}.log").write_text("\n".join(proc.stdout.splitlines()[-60:]) + "\n" + proc.stderr[-4000:])
            rows.append({"run": k, "exit_code": proc.returncode, **summary_counts(proc.stdout),
                         "seconds": round(seconds, 1)})
            r = rows[-1]
            print(f"run {k}: exit {r['exit_code']}, {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, "
                  f"{r['skipped']} skipped, {r['seconds']} s (hogs: {args.hogs})", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    write_csv(args.out / "runs.csv", rows, ["run", "exit_code", "passed", "failed", "errors", "skipped", "seconds"])
    ok = all(r["exit_code"] == 0 for r in rows)
    print(f"{sum(r['exit_code'] == 0 for r in rows)}/{len(rows)} runs passed beside {args.hogs} CPU-bound "
          f"process(es)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
