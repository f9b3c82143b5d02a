"""Bounded soak: mixed load with bad requests and disconnects; memory, threads and lost responses over time.

    python -m bench.soak --duration 600 --out bench/results/soak

One ``batcher serve`` (tiny_cnn and ppocr_cls on CPU, and two string models: identity and a STRING->FLOAT ``Cast``;
bodies up to 4 MiB). ``--clients`` closed-loop clients each pick, per request: a good request (65%: binary
tiny_cnn, JSON ppocr_cls, gzip-coded tiny_cnn, text to the string models), a bad one (20%, each with the status it
must get: bad JSON, bad shape, unknown input, bad binary size - 400; an unsupported content coding - 415; gzip that
is not gzip - 400; BYTES that are not UTF-8, text the Cast cannot parse - 400; a 60 KB gzip body that inflates
past the body limit - 413), malformed HTTP on a raw socket (5%: over-long request line or header, too many headers,
broken chunked framing - aiohttp's 400), or a client that sends its headers and half its body and hangs up (10%).
Every second the server's resident memory and thread count are sampled. At the end it checks:

* no lost responses: every request that was sent whole got exactly one HTTP response, with the status expected
  for its kind (200/503/504 for good ones, its own 4xx for each bad one); none raised a transport error;
* resident memory (judged only when the samples after the first fifth span at least ``--memory-window-s``,
  120 s by default: over a few seconds the allocator is still filling its arenas, and one 4 MiB body moves resident
  memory by more than a leak would in minutes, so a short run reports the numbers and leaves them unjudged): the
  highest sample of the last fifth of the run is within ``--rss-tolerance-mb`` of the highest of the first fifth
  (after a warm-up), i.e. no growth; and no upward trend: the Theil-Sen slope of the samples after the first
  fifth, times that window, is at most a third of ``--rss-tolerance-mb``;
* no 5xx: no response of the run has a 5xx status;
* threads: at most 2 more in the last fifth than in the first (pools start threads lazily; a leak keeps
  growing with the requests); the server is live and its log has no traceback and no ERROR line.
Exit 0 when all hold. Writes ``soak.csv`` (samples) and ``soak.json`` (summary).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.scripts import script_parser
from bench.server import ServerProcess
from bench.string_models import string_models
from bench.sweep.drivers import drive_closed
from bench.sweep.report import write_csv, write_json
from bench.sweep.requests import HEADER_LENGTH, build_request

CONFIG = {"server": {"max_body_bytes": 4 << 20}, "models": [
    {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "max_batch_size": 16,
     "dynamic_batching": {"max_queue_delay_microseconds": 1000, "default_queue_policy": {"default_timeout_microseconds": 2_000_000}}},
    {"name": "ppocr_cls", "path": "zoo:ppocr_cls", "inputs": [{"name": "x", "dims": [3, 48, 192]}],
     "max_batch_size": 16,
     "dynamic_batching": {"max_queue_delay_microseconds": 1000, "default_queue_policy": {"default_timeout_microseconds": 2_000_000}}},
]}
#: the string models added to CONFIG (bench.string_models): name in the config -> file
STRING_MODELS = {"str_id": "str_id1", "str2f": "str2f"}

Request = tuple[str, bytes, dict, tuple[int, ...]]  #: (model, body, headers, the statuses it may get)
GOOD = (200, 503, 504)


def _config(folder: Path) -> dict:
    paths = string_models(folder)
    extra = [{"name": n, "path": paths[f], "max_batch_size": 8,
              "dynamic_batching": {"max_queue_delay_microseconds": 1000}} for n, f in STRING_MODELS.items()]
    return {**CONFIG, "models": CONFIG["models"] + extra}


def _requests() -> tuple[list[Request], list[Request]]:
    """The good requests (binary tiny_cnn first: the hang-ups send half of it) and the bad ones, each with the
    statuses it may get."""
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), np.float32)
    good_bin = ("tiny_cnn", *build_request([("input", "FP32", x)]), GOOD)
    c = np.random.default_rng(1).random((1, 3, 48, 192), np.float32)
    good_json = ("ppocr_cls", *build_request([("x", "FP32", c)], binary=False), GOOD)
    gzipped = ("tiny_cnn", gzip.compress(good_bin[1], 1), {**good_bin[2], "Content-Encoding": "gzip"}, GOOD)
    text = np.array(["é", "日本", "", "a\x00b"], dtype=object)
    good_text = ("str_id", *build_request([("s", "BYTES", text)]), GOOD)
    good_cast = ("str2f", *build_request([("s", "BYTES", np.array([["1.5", "-2"]], dtype=object))], binary=False),
                 GOOD)
    head = good_bin[1][:int(good_bin[2][HEADER_LENGTH])]
    bomb = gzip.compress(b"\0" * (64 << 20), 9)  # ~60 KB inflating to 64 MiB, past the 4 MiB limit
    bad = [
        ("ppocr_cls", b"{not json", {}, (400,)),
        ("ppocr_cls", *build_request([("x", "FP32", np.zeros((1, 3, 32, 192), np.float32))], binary=False), (400,)),
        ("tiny_cnn", *build_request([("nope", "FP32", np.ones(1, np.float32))], binary=False), (400,)),
        ("tiny_cnn", head + b"\0" * 16, good_bin[2], (400,)),
        ("tiny_cnn", good_bin[1], {**good_bin[2], "Content-Encoding": "zstd"}, (415,)),
        ("ppocr_cls", good_json[1], {"Content-Encoding": "gzip"}, (400,)),
        ("str_id", *build_request([("s", "BYTES", np.array([b"ok", b"\xff\xfe"], dtype=object))]), (400,)),
        ("str2f", *build_request([("s", "BYTES", np.array([["1", "abc"]], dtype=object))], binary=False), (400,)),
        ("tiny_cnn", bomb, {"Content-Encoding": "gzip"}, (413,)),
    ]
    return [good_bin, good_json, gzipped, good_text, good_cast], bad


#: malformed HTTP (aiohttp answers each with 400 before any of the server's code runs)
MALFORMED = [
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 10000 + b"\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
    b"POST /v2/models/tiny_cnn/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


async def _malformed(port: int, data: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await reader.read()
    writer.close()
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0


async def _hang_up(port: int, model: str, body: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(random.uniform(0.0, 0.05))
    writer.close()


async def _load(server: ServerProcess, duration: float, clients: int, stats: dict) -> None:
    """``clients`` closed-loop clients for ``duration`` s, each request drawn from the mix; counts into ``stats``."""
    good, bad = _requests()
    rnd = random.Random(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def post(model: str, body: bytes, headers: dict) -> int:
            async with s.post(f"{server.base}/v2/models/{model}/infer", data=body, headers=headers) as resp:
                await resp.read()
                return resp.status

        async def send() -> int:
            r = rnd.random()
            if r < 0.10:
                try:
                    await _hang_up(server.port, *good[0][:2])
                except OSError as exc:  # the server refused a connection
                    stats["lost"] += 1
                    stats["errors"].append(repr(exc)[:200])
                stats["hang_ups"] += 1
                return 0
            if r < 0.15:
                what, expected = "malformed HTTP", (400,)
                call = _malformed(server.port, rnd.choice(MALFORMED))
            else:
                model, body, headers, expected = (
                    (bad[-1] if rnd.random() < 0.02 else rnd.choice(bad[:-1])) if r < 0.35
                    else good[0] if r < 0.70 else rnd.choice(good[1:]))
                what, call = f"{model} {headers}", post(model, body, headers)
            stats["sent"] += 1
            try:
                status = await call
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                stats["lost"] += 1
                stats["errors"].append(repr(exc)[:200])
                return 0
            stats["answered"] += 1
            stats["status"][str(status)] = stats["status"].get(str(status), 0) + 1
            if status not in expected:
                stats["unexpected"] += 1
                stats["errors"].append(f"{what} -> {status}, expected {expected}")
            return status

        await drive_closed(clients, send, until=duration)


async def _sample(server: ServerProcess, duration: float, samples: list) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration:
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(server.rss_mb(), 1),
                        "threads": server.threads()})
        await asyncio.sleep(1.0)


async def soak(server: ServerProcess, duration: float, clients: int, warmup: float) -> tuple[dict, list]:
    stats = {"sent": 0, "answered": 0, "lost": 0, "unexpected": 0, "hang_ups": 0, "status": {}, "errors": []}
    await _load(server, warmup, clients, {**stats, "status": {}, "errors": []})  # warm-up, not counted
    samples: list = []
    await asyncio.gather(_load(server, duration, clients, stats), _sample(server, duration, samples))
    await asyncio.sleep(1.0)
    samples.append({"t_s": round(duration + 1, 1), "rss_mb": round(server.rss_mb(), 1), "threads": server.threads()})
    return stats, samples


def theil_sen_slope(xs: list[float], ys: list[float]) -> float:
    """Theil-Sen estimate of the trend of ``ys`` against ``xs``: the median slope over every pair of points (robust
    to samples pushed up or down by whatever else runs on the machine; Sen 1968)."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    i, j = np.triu_indices(len(x), k=1)
    keep = x[j] != x[i]
    return float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep])) if keep.any() else 0.0


def memory_checks(samples: list[dict], tolerance_mb: float, min_window_s: float) -> tuple[dict | None, float, float]:
    """Judge resident memory over a run: ``(checks, slope, window_s)``.

    ``samples`` are ``{"t_s", "rss_mb"}`` once a second, in order. The first fifth is the settling period (pools and
    allocator arenas fill there). ``slope`` is the Theil-Sen trend after it in MB per second; ``window_s`` the
    seconds it spans. ``checks`` is None (not judged) when ``window_s < min_window_s``; otherwise two named booleans:
    the trend times the window is at most ``tolerance_mb / 3``, and the highest sample of the last fifth is at most
    ``tolerance_mb`` above the highest of the first fifth.
    """
    fifth = max(1, len(samples) // 5)
    steady = samples[fifth:]
    slope = theil_sen_slope([s["t_s"] for s in steady], [s["rss_mb"] for s in steady]) if len(steady) > 1 else 0.0
    window_s = steady[-1]["t_s"] - steady[0]["t_s"] if len(steady) > 1 else 0.0
    if window_s < min_window_s:
        return None, slope, window_s
    first, last = max(s["rss_mb"] for s in samples[:fifth]), max(s["rss_mb"] for s in samples[-fifth:])
    return {
        # a trend, not a level: the Theil-Sen slope of resident memory after the first fifth, times that window
        f"resident memory trend over the run <= {tolerance_mb / 3:g} MB": slope * window_s <= tolerance_mb / 3,
        f"resident memory growth <= {tolerance_mb:g} MB": last - first <= tolerance_mb,
    }, slope, window_s


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.soak", __doc__)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of mixed load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rss-tolerance-mb", type=float, default=30.0)
    p.add_argument("--memory-window-s", type=float, default=120.0,
                   help="judge resident memory only when the samples after the first fifth span this many seconds")
    p.add_argument("--out", type=Path, default=None, help="folder for soak.csv and soak.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(_config(Path(tmp)), Path(tmp), name="soak") as server:
        stats, samples = asyncio.run(soak(server, args.duration, args.clients, args.warmup))
        live = server.metric("batcher_request_success_total", model="tiny_cnn", version="1") > 0
        log = server.log()
    fifth = max(1, len(samples) // 5)
    memory, slope, window_s = memory_checks(samples, args.rss_tolerance_mb, args.memory_window_s)
    first, last = max(s["rss_mb"] for s in samples[:fifth]), max(s["rss_mb"] for s in samples[-fifth:])
    summary = {
        "duration_s": args.duration, "clients": args.clients, **{k: v for k, v in stats.items() if k != "errors"},
        "errors_sample": stats["errors"][:5], "rss_first_fifth_max_mb": first, "rss_last_fifth_max_mb": last,
        "rss_growth_mb": round(last - first, 1), "rss_trend_mb_per_min": round(slope * 60, 3),
        "rss_trend_over_run_mb": round(slope * window_s, 1),
        "responses_5xx": sum(n for code, n in stats["status"].items() if code.startswith("5")), "threads_start": samples[0]["threads"],
        "threads_end": samples[-1]["threads"], "tracebacks_in_log": log.count("Traceback"),
        "error_lines_in_log": sum(" ERROR " in line for line in log.splitlines()),
    }
    checks = {
        "no lost responses": stats["lost"] == 0 and stats["answered"] == stats["sent"],
        "only expected statuses": stats["unexpected"] == 0,
        "no 5xx": summary["responses_5xx"] == 0,
        # thread pools start a few threads lazily (at most 2 here); a leak grows with the requests instead (one per
        # request or hang-up would add thousands)
        "no leaked threads": max(s["threads"] for s in samples[-fifth:]) <= max(s["threads"] for s in samples[:fifth]) + 2,
        "server live, no traceback, no ERROR line": live and summary["tracebacks_in_log"] == 0
        and summary["error_lines_in_log"] == 0,
    }
    if memory is None:
        summary["not_judged"] = {"resident memory": f"the samples after the first fifth span {window_s:.0f} s, "
                                                    f"less than --memory-window-s {args.memory_window_s:g}"}
    else:
        checks.update(memory)
    summary["checks"] = checks
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "soak.json", summary)
        write_csv(args.out / "soak.csv", samples, ["t_s", "rss_mb", "threads"])
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
