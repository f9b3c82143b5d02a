"""Part p of ``bench.gpu_scale``: where the CPU goes at saturation in multi-process mode.

One server (the largest ``--frontends``, ``--instances`` contexts) under the part's closed-loop load; while it runs,
the CPU of every thread of every server process is sampled over ``--profile-seconds`` (from ``/proc``), and, when
py-spy is there (``--py-spy PATH``, or on PATH), all server processes are sampled for the same time. Writes
``scale_p_threads.csv/.md`` (role, pid, thread, cores: CPU seconds per wall second) and, with py-spy,
``scale_p_spy.txt`` (its raw collapsed stacks, a thread frame under each process) and ``scale_p_functions.csv/.md`` (per role, the functions on most
samples, inclusive). A thread near 1.0 core, or an engine process whose threads add up to more than one core of
Python, is the bound; a machine with idle cores and no such thread is bound elsewhere (latency, the GIL).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.peers import thread_cpu
from bench.server import ServerProcess

from .common import finish, images, say
from .scale import binary_request, load, model_entry, server_config, shm_input

_READY = re.compile(r"((?:engine|frontend)-\S+) ready \(pid (\d+)\)")
_FRAME = re.compile(r" \((.*?):\d+\)")


def roles(log: str, supervisor: int) -> dict[int, str]:
    """pid -> role (``engine-gpu0``, ``frontend-3``) from the supervisor's ``<name> ready (pid N)`` lines (INFO)."""
    found = {int(pid): role for role, pid in _READY.findall(log)}
    found[supervisor] = "supervisor"
    return found


def top_functions(raw: str, role_of: dict[int, str], n: int = 12) -> list[dict]:
    """Per role, the ``n`` functions of this project (``batcher/``, ``engines/``) on most py-spy samples
    (inclusive), as a share of that role's samples."""
    per_role: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        pid = int(procs[-1].split(":")[0].split()[1]) if procs else -1
        role = role_of.get(pid, f"pid {pid}")
        totals[role] += int(count)
        ours = {_FRAME.sub(r" (\1)", f) for f in frames if "batcher/" in f or "engines/" in f}
        for fn in ours:
            per_role[role][fn] += int(count)
    rows = []
    for role, counter in sorted(per_role.items()):
        for fn, c in counter.most_common(n):
            rows.append({"role": role, "function": fn, "samples": c, "share": round(c / totals[role], 3)})
    return rows


def part_profile(raw: list[dict], args, out: Path) -> list[dict]:
    """(p) per-thread CPU (and py-spy, when there) of a multi-process server at saturation."""
    frontends = max(max(args.frontends), 1)
    spy = getattr(args, "py_spy", None) or shutil.which("py-spy")
    if spy and not os.access(spy, os.X_OK):
        say(f"  (p) {spy}: not an executable; no py-spy profile")
        spy = None
    shm = getattr(args, "profile_transport", "binary") == "shm"
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        if shm:
            register, body, headers = stack.enter_context(shm_input(images(1, seed=2)))
        else:
            body, headers = binary_request()
        cfg = server_config([model_entry(args.model, args)], frontends, args, shm=shm)
        cfg["server"]["log_level"] = "info"  # the supervisor's "<name> ready (pid N)" lines name the processes
        with ServerProcess(cfg, Path(tmp), name="profile", timeout_s=600) as server:
            if shm:
                register(server)
            result: dict = {}
            loader = threading.Thread(target=lambda: result.update(
                row=load(server, args.model, body, headers, args.clients, args)))
            loader.start()
            time.sleep(args.warmup + min(2.0, args.duration / 3))
            before, t0 = thread_cpu(server.proc.pid), time.monotonic()
            time.sleep(args.profile_seconds)
            after, wall = thread_cpu(server.proc.pid), time.monotonic() - t0
            spy_out, gil_out = out / "scale_p_spy.txt", out / "scale_p_spy_gil.txt"
            if spy:
                out.mkdir(parents=True, exist_ok=True)
                # both records at once, inside the load (one after the other, the second sampled an idle server
                # once the load had ended: an empty --gil profile on the H200); --gil: only the thread holding it
                records = [subprocess.Popen([spy, "record", "--subprocesses", "--pid", str(server.proc.pid),
                                             "--duration", str(max(1, round(args.profile_seconds))), "--rate",
                                             str(SPY_RATE), "--format", "raw", "--threads", "--nonblocking", *extra, "--output",
                                             str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                           for extra, path in (([], spy_out), (["--gil"], gil_out))]
                for record in records:
                    try:
                        record.wait(timeout=args.profile_seconds + 60)
                    except subprocess.TimeoutExpired:
                        record.kill()
                        record.wait()
            loader.join()
            role_of = roles(server.log(), server.proc.pid)
    rows = []
    for key in sorted(after, key=lambda k: after[k] - before.get(k, after[k]), reverse=True):
        pid, tid, name = key
        cores = (after[key] - before.get(key, after[key])) / wall
        if cores >= 0.01:
            rows.append({"role": role_of.get(pid, f"pid {pid}"), "pid": pid, "thread": "main" if tid == pid else
                         f"{name} {tid}", "cores": round(cores, 2)})
    row = result.get("row", {})
    how = "system shared memory" if shm else "binary HTTP"
    say(f"  (p) {frontends} front ends, {args.instances} context(s), {how}: "
        f"{float(row.get('achieved_qps', 0)):.0f} req/s, {len(rows)} busy threads")
    finish(out, "scale_p_threads", f"(p) {args.model}: CPU per thread at saturation ({frontends} front ends, "
           f"{args.instances} context(s), {how}, {float(row.get('achieved_qps', 0)):.0f} req/s)", rows)
    if spy and spy_out.is_file():
        finish(out, "scale_p_functions", "(p) py-spy: this project's functions on most samples per process role (inclusive)",
               top_functions(spy_out.read_text(errors="replace"), role_of))
    if spy and gil_out.is_file() and not gil_out.read_text(errors="replace").strip():
        say("  (p) py-spy --gil recorded no sample: no GIL table")
    elif spy and gil_out.is_file():
        finish(out, "scale_p_gil", "(p) py-spy --gil: share of the time each process's GIL is held (samples holding "
               f"it over {SPY_RATE}/s x {max(1, round(args.profile_seconds))} s), and its functions on most of them",
               gil_held(gil_out.read_text(errors="replace"), role_of, SPY_RATE * max(1, round(args.profile_seconds))))
    return rows


#: py-spy's samples per second
SPY_RATE = 200


def gil_held(raw: str, role_of: dict[int, str], expected: int) -> list[dict]:
    """Per role, from a ``py-spy record --gil`` raw profile: the share of ``expected`` samples in which one of its
    threads held the GIL (1.0: the process is bound by its GIL), then its functions on most of them."""
    rows = top_functions(raw, role_of, n=8)
    totals: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        procs = [f for f in stack.split(";") if f.startswith("process ")]
        if procs and count.isdigit():
            totals[role_of.get(int(procs[-1].split(":")[0].split()[1]), "?")] += int(count)
    head = [{"role": role, "function": "(GIL held)", "samples": c, "share": round(c / expected, 3)}
            for role, c in sorted(totals.items())]
    return head + rows
