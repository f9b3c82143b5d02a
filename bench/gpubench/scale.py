"""The parts of ``bench.gpu_scale`` (issue 10 on a GPU machine): a real ``batcher serve`` per step, resnet18 at the
GPU issue's allowed batch sizes and precision, binary HTTP (or system shared memory) from the toolkit's
closed-loop driver in client processes on the same machine, each step's ratio to the raw engine's rows/s at the
batch size it formed (part r of the same run)."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batcher import batch_trace
from bench.peers import cpu_delta, descendants, machine_busy_seconds, role_of, tree_cpu_seconds
from bench.server import ServerProcess
from bench.sweep.requests import build_request
from bench.sweep.run import SweepConfig, run_sweep

from .common import SIZES, finish, images, line_plot, raw_at, say

MiB = 1 << 20


def model_entry(name: str, args, gpus: list[int] | None = None, model: str | None = None,
                instances: int | None = None) -> dict:
    """A zoo entry (``model``, default ``args.model``: resnet18) served as ``name``: ``instances`` contexts
    (default ``args.instances``) on each of ``gpus`` (default: GPU 0), the allowed batch sizes and precision of the
    GPU issue (``allowed_batch_sizes``, ``precision``), a deep queue."""
    group = {"count": instances or args.instances, "kind": args.kind}
    if args.kind == "KIND_GPU":
        group["gpus"] = gpus or [0]
    entry = {"name": name, "path": f"zoo:{model or args.model}", "instance_group": [group],
             "max_batch_size": max(SIZES), "allowed_batch_sizes": list(SIZES),
             "dynamic_batching": {"max_queue_delay_microseconds": args.delay_us,
                                  "default_queue_policy": {"max_queue_size": 16384}}}
    if args.kind == "KIND_GPU":
        entry["precision"] = args.precision
    return entry


def server_config(models: list[dict], frontends: int, args, shm: bool = False,
                  engine_processes: str = "per_device", cuda_mps: bool = False) -> dict:
    server = {"frontends": frontends, "event_loop": args.event_loop, "log_level": "warning",
              "frontend_buffer_mb": args.buffer_mb, "engine_processes": engine_processes, "cuda_mps": cuda_mps}
    if args.gil_switch_us is not None:
        server["gil_switch_interval_us"] = args.gil_switch_us
    if getattr(args, "cuda_blocking_sync", False):
        server["cuda_blocking_sync"] = True
    if shm:
        server["shared_memory"] = {"system": True}
    return {"server": server, "models": models}


def load(server: ServerProcess, model: str, body: bytes, headers: dict[str, str], clients: int, args,
         label: str = "") -> dict:
    """One closed-loop step of ``clients`` over ``args.client_processes`` processes; the toolkit's row plus the
    server's CPU (every process) per request. With the server's batches traced (``BATCHER_BATCH_TRACE``, inherited
    by the server), the step's ``label`` and its start and end on the trace's clock go to ``steps.csv`` there."""
    cfg = SweepConfig(url=server.url, model=model, mode="closed", concurrency=[clients], duration=args.duration,
                      warmup=args.warmup, processes=args.client_processes, client_timeout_s=60, progress=False,
                      metrics_url=server.base + "/metrics")
    before = server.metrics()
    with placed(server, args):
        cpu0, busy0, t0 = tree_cpu_seconds(server.proc.pid), machine_busy_seconds(), time.monotonic()
        started = time.perf_counter()
        row = run_sweep(cfg, body, headers)[0]
        trace_step(label, started, time.perf_counter(), args.duration)
    cpu = cpu_delta(cpu0, tree_cpu_seconds(server.proc.pid))
    row["server_cpu_ms_per_request"] = cpu / max(row["ok"], 1) * 1e3
    # the whole machine (server, load generator, kernel): is the box itself the bound?
    row["machine_busy_cores"] = (machine_busy_seconds() - busy0) / (time.monotonic() - t0)
    row.update(batch_times(before, server.metrics(), model))
    return row


def trace_step(label: str, start: float, end: float, duration: float) -> None:
    """One step's line in ``$BATCHER_BATCH_TRACE/steps.csv`` (label, start, end, measured seconds), when set."""
    folder = os.environ.get(batch_trace.ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "steps.csv"), "a") as f:
            f.write(f"{label},{start:.6f},{end:.6f},{duration}\n")


def cpu_list(text: str) -> set[int]:
    """``--engine-cpus``: CPU numbers and ranges, ``0-2,5`` -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _pin(pid: int, cpus: set[int], nice: int | None) -> list[str]:
    """Every thread of ``pid`` on ``cpus`` (``sched_setaffinity`` is per thread), at ``nice``; returns what was
    refused (a negative nice needs CAP_SYS_NICE, which a container may not grant), one line per kind of failure."""
    refused: dict[str, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            refused.setdefault("affinity", f"pid {pid}: sched_setaffinity {sorted(cpus)}: {exc}")
        if nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:
                continue
            except OSError as exc:
                refused.setdefault("nice", f"pid {pid}: nice {nice}: {exc}")
    return list(refused.values())


@contextlib.contextmanager
def placed(server: ServerProcess, args):
    """For one step with ``--engine-cpus``: the server's engine processes (every thread) on those CPUs, its front
    ends and this process (the client processes start inside the step and inherit it) on the others; with
    ``--engine-nice`` the engine threads at that nice value. Without either option nothing changes. This process's
    own affinity is given back after the step (the server's stays: the next step on it is placed the same). What
    the kernel refuses is printed, and the step runs as placed so far.

    Raises:
        ValueError: ``--engine-cpus`` names a CPU this process may not use, or leaves none for the others.
    """
    engine_cpus = getattr(args, "engine_cpus", None)
    nice = getattr(args, "engine_nice", None)
    if engine_cpus is None and nice is None:
        yield
        return
    every = os.sched_getaffinity(0)
    engine = set(engine_cpus) if engine_cpus else every
    rest = every - engine if engine_cpus else every
    if not engine <= every or not rest:
        raise ValueError(f"--engine-cpus {sorted(engine)}: must be a part of this process's CPUs {sorted(every)}, "
                         "leaving some for the front ends and the load generator")
    refused = []
    for pid in descendants(server.proc.pid):
        role = role_of(pid)
        if role == "engine":
            refused += _pin(pid, engine, nice)
        elif role == "frontend":
            refused += _pin(pid, rest, None)
    for line in refused:
        say(f"  placement refused: {line}")
    os.sched_setaffinity(0, rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, every)


def batch_times(before: dict, after: dict, model: str) -> dict:
    """The engine's own account of the step (warm-up included), from /metrics: ms per batch stacking inputs and
    executing (on the context's thread: copies, the engine, the wait for the GPU), ms per request queued, and from
    the contexts' CUDA timing events the device's ms per batch (empty without timed contexts; the share of the
    window the device was busy is the sweep's ``device_busy_share``)."""
    def delta(sample: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k[0] == sample and ("model", model) in k[1])

    batches = max(delta("batcher_execution_count_total"), 1.0)
    busy = delta("batcher_device_busy_seconds_total")
    return {"stack_ms_per_batch": round(delta("batcher_compute_input_seconds_total") / batches * 1e3, 3),
            "execute_ms_per_batch": round(delta("batcher_compute_infer_seconds_total") / batches * 1e3, 3),
            "queue_ms_per_request": round(delta("batcher_queue_duration_seconds_sum")
                                          / max(delta("batcher_queue_duration_seconds_count"), 1.0) * 1e3, 3),
            "device_ms_per_batch": round(busy / batches * 1e3, 3) if busy else None}


def summary(row: dict, raw: list[dict], args, **keys) -> dict:
    """The columns a part reports for one step."""
    batch = float(row.get("avg_batch_size") or 0.0)
    ref = raw_at(raw, args.model, args.precision, batch)
    return {**keys, "qps": round(float(row["achieved_qps"]), 1), "p50_ms": round(float(row["p50_ms"]), 2),
            "p99_ms": round(float(row["p99_ms"]), 2), "avg_batch": round(batch, 2), "errors": row["errors"],
            "errors_by_status": row.get("errors_by_status", ""),
            "server_cpu_ms_per_request": round(row["server_cpu_ms_per_request"], 3),
            **{k: row[k] for k in ("stack_ms_per_batch", "execute_ms_per_batch", "queue_ms_per_request",
                                   "device_ms_per_batch")},
            "device_busy_share": round(row["device_busy_share"], 3) if row.get("device_busy_share") else None,
            "machine_busy_cores": f"{row['machine_busy_cores']:.1f}/{os.cpu_count()}",
            "raw_rows_per_s_at_batch": round(ref, 1) if ref else None,
            "over_raw": round(float(row["achieved_qps"]) / ref, 3) if ref else None}


def binary_request() -> tuple[bytes, dict[str, str]]:
    return build_request([("input", "FP32", images(1, seed=2))])


def part_frontends(raw: list[dict], args, out: Path) -> list[dict]:
    """(n) throughput at saturation for each number of front ends (0: single-process mode)."""
    rows: list[dict] = []
    body, headers = binary_request()
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.frontends:
            cfg = server_config([model_entry(args.model, args)], n, args)
            with ServerProcess(cfg, Path(tmp), name=f"frontends-{n}", timeout_s=600) as server:
                rows.append(summary(load(server, args.model, body, headers, args.clients, args,
                                         label=f"frontends {n}"), raw, args, frontends=n, transport="binary"))
            say(f"  (n) {rows[-1]}")

    def plot(png: Path) -> None:
        line_plot(png, f"(n) {args.model}: requests/s at saturation by front ends", "front ends (0: one process)",
                  "requests/s (1 row each)", {"binary HTTP": ([r["frontends"] for r in rows], [r["qps"] for r in rows]),
                                               "raw engine at the formed batch": (
                                                   [r["frontends"] for r in rows],
                                                   [r["raw_rows_per_s_at_batch"] or 0 for r in rows])})

    finish(out, "scale_n_frontends", f"(n) {args.model} at saturation ({args.clients} clients) by front ends", rows,
           plot)
    return rows


def part_switch(raw: list[dict], args, out: Path) -> list[dict]:
    """(s) ``server.gil_switch_interval_us`` at saturation, the largest number of front ends of --frontends: how
    long the engine's executor thread may wait for the GIL against its event loop. With ``--gil-switch-us best``
    the later parts of the run use the value of the highest throughput here."""
    n = max(args.frontends)
    body, headers = binary_request()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for us in args.switch_sweep_us:
            args_us = argparse.Namespace(**{**vars(args), "gil_switch_us": us})
            cfg = server_config([model_entry(args.model, args)], n, args_us)
            with ServerProcess(cfg, Path(tmp), name=f"switch-{us}", timeout_s=600) as server:
                rows.append(summary(load(server, args.model, body, headers, args.clients, args), raw, args,
                                    gil_switch_interval_us=us, frontends=n))
            say(f"  (s) {rows[-1]}")
    if args.gil_switch_us == "best" and rows:
        args.gil_switch_us = max(rows, key=lambda r: r["qps"])["gil_switch_interval_us"]
        say(f"  (s) the later parts use gil_switch_interval_us {args.gil_switch_us}")
    finish(out, "scale_s_switch", f"(s) {args.model} at saturation by the engine's GIL switch interval "
           f"({n} front ends)", rows)
    return rows


@contextlib.contextmanager
def shm_input(x):
    """A POSIX segment (``/dev/shm``) holding ``x`` and the JSON body of a request whose input ``input`` names it
    (region ``scale-input``; outputs binary): yields ``(register, body, headers)``, ``register(server)`` registering
    the segment with a server. The segment is unlinked on exit."""
    from multiprocessing.shared_memory import SharedMemory

    import numpy as np
    import orjson

    region = "scale-input"
    segment = SharedMemory(name=f"trtb-scale-{os.getpid()}-{id(x)}", create=True, size=x.nbytes)
    try:
        np.ndarray(x.shape, x.dtype, buffer=segment.buf)[...] = x
        body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "parameters": {
            "shared_memory_region": region, "shared_memory_byte_size": x.nbytes}}],
            "parameters": {"binary_data_output": True}})

        def register(server: ServerProcess) -> None:
            import urllib.request

            reg = orjson.dumps({"key": "/" + segment.name, "offset": 0, "byte_size": x.nbytes})
            urllib.request.urlopen(urllib.request.Request(
                f"{server.base}/v2/systemsharedmemory/region/{region}/register", data=reg), timeout=60).read()

        yield register, body, {"Content-Type": "application/json"}
    finally:
        segment.close()
        segment.unlink()


def part_shm(raw: list[dict], args, out: Path) -> list[dict]:
    """(m) the input in system shared memory (one read-only segment every request names; outputs binary), against
    binary HTTP, at the largest number of front ends of --frontends."""
    n = max(args.frontends)
    rows: list[dict] = []
    with shm_input(images(1, seed=2)) as (register, body, headers), tempfile.TemporaryDirectory() as tmp:
        cfg = server_config([model_entry(args.model, args)], n, args, shm=True)
        with ServerProcess(cfg, Path(tmp), name="shm", timeout_s=600) as server:
            register(server)
            for transport, (b, h) in (("binary", binary_request()), ("system shm", (body, headers))):
                rows.append(summary(load(server, args.model, b, h, args.clients, args, label=transport), raw, args,
                                    frontends=n, transport=transport))
                say(f"  (m) {rows[-1]}")
    finish(out, "scale_m_shm", f"(m) {args.model}: binary HTTP against system shared memory ({n} front ends)", rows)
    return rows


def retention_pairs(args) -> list[tuple[str, str]]:
    """(served name, zoo model) of part t's two models: ``--retention-models`` (two zoo names, e.g. the seed's
    ``tiny_cnn,resnet18``), served under their own names, or by default two copies of ``--model`` served as ``a``
    and ``b``."""
    models = args.retention_models or [args.model, args.model]
    if len(models) != 2:
        raise ValueError(f"--retention-models takes two zoo models, got {models}")
    return list(zip(("a", "b"), models)) if models[0] == models[1] else [(m, m) for m in models]


def part_retention(raw: list[dict], args, out: Path) -> list[dict]:
    """(t) retention, seed 000's measure (two models served together keep 51.3 % of the sum of what each serves
    alone, in one process, with 4 contexts per model and 4 concurrent requests per model): the two models of
    :func:`retention_pairs`, ``--retention-instances`` contexts each, at each of ``--retention-clients``
    closed-loop clients per model, alone and then both at once; each keeps ``together / alone`` of its
    throughput, and the seed's ratio is the sum together over the sum alone.

    Layouts (``--retention-layouts``): ``shared``, one server, both models in its engine process; ``per_model``,
    one server with ``engine_processes: per_model`` (an engine process per model, the front ends shared);
    ``per_model_mps``, the same under NVIDIA MPS (``server.cuda_mps``); ``separate``, a server per model (its own
    engine process and half the front ends), both on the device. Each layout's server(s) start once and serve
    every client count. First the device alone (:func:`bench.gpubench.raw.part_pair`): two contexts in one
    process, the first model's."""
    from .raw import part_pair

    pairs = retention_pairs(args)
    instances = args.retention_instances or args.instances
    part_pair(pairs[0][1], args.precision, args.device, max(args.raw_seconds, 0.02) * 2, out,
              models=[m for _, m in pairs])
    n = max(args.frontends)
    body, headers = binary_request()
    names = [name for name, _ in pairs]
    entries = {name: model_entry(name, args, model=m, instances=instances) for name, m in pairs}
    rows = []
    for layout in args.retention_layouts:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            if layout != "separate":
                cfg = server_config(list(entries.values()), n, args,
                                    engine_processes="per_device" if layout == "shared" else "per_model",
                                    cuda_mps=layout == "per_model_mps")
                one = stack.enter_context(ServerProcess(cfg, Path(tmp), name="retention", timeout_s=600))
                servers = {m: one for m in names}
            else:
                servers = {m: stack.enter_context(ServerProcess(
                    server_config([entries[m]], max(1, n // 2), args), Path(tmp), name=f"retention-{m}",
                    timeout_s=600)) for m in names}
            for clients in args.retention_clients:
                rows += retention_rows(layout, servers, names, clients, instances,
                                       max(1, n // 2) if layout == "separate" else n, body, headers, args)
    finish(out, "scale_t_retention", "(t) retention: two models served together against alone", rows)
    return rows


def qps(row: dict) -> float:
    """A load step's achieved req/s."""
    return float(row["achieved_qps"])


def retention_rows(layout: str, servers: dict, names: list[str], clients: int, instances: int, frontends: int,
                   body: bytes, headers: dict[str, str], args) -> list[dict]:
    """One layout at one client count, ``--retention-rounds`` rounds of: each model alone, then both at once.
    What a model keeps is its together / alone of one round (the two steps next to each other in time, so that the
    machine's drift over a run cancels), and a row reports the median round of each model and of the sum, with
    the lowest and highest kept of the rounds."""
    rounds: list[tuple[dict, dict]] = []
    for k in range(args.retention_rounds):
        alone = {m: load(servers[m], m, body, headers, clients, args) for m in names}
        with ThreadPoolExecutor(len(names)) as pool:  # both loads at once
            together = dict(zip(names, pool.map(lambda m: load(servers[m], m, body, headers, clients, args),
                                                names)))
        rounds.append((alone, together))
        say(f"  (t) {layout}, {clients} clients, round {k + 1}: alone { {m: round(qps(alone[m]), 1) for m in names} }"
            f", together { {m: round(qps(together[m]), 1) for m in names} }")

    def median_round(kept: list[float]) -> tuple[int, dict]:
        """The median round (the lower middle one of an even count) and the kept columns of a row."""
        i = sorted(range(len(kept)), key=lambda j: kept[j])[(len(kept) - 1) // 2]
        return i, {"kept": round(kept[i], 3), "rounds": len(kept), "kept_min": round(min(kept), 3),
                   "kept_max": round(max(kept), 3)}

    part = []
    for m in names:
        i, kept_columns = median_round([qps(t[m]) / qps(a[m]) if qps(a[m]) else float("nan") for a, t in rounds])
        alone, together = (r[m] for r in rounds[i])
        part.append({"layout": layout, "model": m, "clients": clients, "instances": instances,
                     "frontends": frontends, "alone_qps": round(qps(alone), 1),
                     "together_qps": round(qps(together), 1), **kept_columns,
                     "alone_batch": round(float(alone.get("avg_batch_size") or 0.0), 2),
                     "together_batch": round(float(together.get("avg_batch_size") or 0.0), 2),
                     "alone_execute_ms_per_batch": alone["execute_ms_per_batch"],
                     "together_execute_ms_per_batch": together["execute_ms_per_batch"],
                     "alone_p50_ms": round(float(alone["p50_ms"]), 2),
                     "together_p50_ms": round(float(together["p50_ms"]), 2),
                     "together_machine_busy_cores": f"{together['machine_busy_cores']:.1f}/{os.cpu_count()}"})
    sums = [(sum(qps(a[m]) for m in names), sum(qps(t[m]) for m in names)) for a, t in rounds]
    i, kept_columns = median_round([t / a if a else float("nan") for a, t in sums])
    part.append({"layout": layout, "model": "sum (seed's ratio)", "clients": clients, "instances": instances,
                 "frontends": frontends, "alone_qps": round(sums[i][0], 1), "together_qps": round(sums[i][1], 1),
                 **kept_columns})
    say(f"  (t) {layout}, {clients} clients: kept (median of {len(rounds)} rounds) {[r['kept'] for r in part]}")
    return part


def part_gpus(raw: list[dict], args, out: Path) -> list[dict]:
    """(g) the same model on one GPU and on two (``gpus: [0, 1]``: one engine process and one queue per GPU)."""
    from engines.cuda import device_count

    if args.kind == "KIND_GPU" and device_count() < 2:
        say("  (g) skipped: this machine has one GPU")
        return []
    n = max(args.frontends)
    body, headers = binary_request()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in ([0], [0, 1]):
            cfg = server_config([model_entry(args.model, args, gpus)], n, args)
            with ServerProcess(cfg, Path(tmp), name=f"gpus-{len(gpus)}", timeout_s=600) as server:
                rows.append(summary(load(server, args.model, body, headers, args.clients * len(gpus), args), raw,
                                    args, gpus=len(gpus), frontends=n))
            say(f"  (g) {rows[-1]}")
    rows[-1]["over_one_gpu"] = round(rows[-1]["qps"] / rows[0]["qps"], 3) if rows[0]["qps"] else None
    finish(out, "scale_g_gpus", f"(g) {args.model} on one GPU and on two ({n} front ends)", rows)
    return rows
