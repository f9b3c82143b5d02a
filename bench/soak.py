"""Bounded soak: mixed load with bad requests and disconnects; memory, threads and lost responses over time.

    python -m bench.soak --duration 600 --out bench/results/soak

One ``batcher serve`` (tiny_cnn and ppocr_cls on CPU). ``--clients`` closed-loop clients each pick, per request:
a good binary tiny_cnn request (60%), a good JSON ppocr_cls request (15%), a malformed request (15%: bad JSON, bad
shape, unknown input, bad binary size), or a client that sends its headers and half its body and hangs up (10%).
Every second the server's resident memory and thread count are sampled. At the end it checks:

* no lost responses: every request that was sent whole got exactly one HTTP response, with the status expected
  for its kind (200/503/504 for good ones, 400 for bad ones); none raised a transport error;
* resident memory: the highest sample of the last fifth of the run is within ``--rss-tolerance-mb`` of the highest
  of the first fifth (after a warm-up), i.e. no growth;
* threads: at most 2 more in the last fifth than in the first (pools start threads lazily; a leak keeps
  growing with the requests); the server is live and its log has no traceback.
Exit 0 when all hold. Writes ``soak.csv`` (samples) and ``soak.json`` (summary).
"""

from __future__ import annotations

import asyncio
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
from bench.sweep.drivers import drive_closed
from bench.sweep.report import write_csv, write_json
from bench.sweep.requests import HEADER_LENGTH, build_request

CONFIG = {"models": [
    {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "max_batch_size": 16,
     "dynamic_batching": {"max_queue_delay_microseconds": 1000, "default_queue_policy": {"default_timeout_microseconds": 2_000_000}}},
    {"name": "ppocr_cls", "path": "zoo:ppocr_cls", "inputs": [{"name": "x", "dims": [3, 48, 192]}],
     "max_batch_size": 16,
     "dynamic_batching": {"max_queue_delay_microseconds": 1000, "default_queue_policy": {"default_timeout_microseconds": 2_000_000}}},
]}


def _requests():
    """(model, body, headers) of a good binary tiny_cnn request, a good JSON ppocr_cls request, and the bad ones:
    malformed JSON, declared dims violated, an unknown input, binary data of the wrong size."""
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), np.float32)
    good_bin = ("tiny_cnn", *build_request([("input", "FP32", x)]))
    c = np.random.default_rng(1).random((1, 3, 48, 192), np.float32)
    good_json = ("ppocr_cls", *build_request([("x", "FP32", c)], binary=False))
    head = good_bin[1][:int(good_bin[2][HEADER_LENGTH])]
    bad = [
        ("ppocr_cls", b"{not json", {}),
        ("ppocr_cls", *build_request([("x", "FP32", np.zeros((1, 3, 32, 192), np.float32))], binary=False)),
        ("tiny_cnn", *build_request([("nope", "FP32", np.ones(1, np.float32))], binary=False)),
        ("tiny_cnn", head + b"\0" * 16, good_bin[2]),
    ]
    return good_bin, good_json, bad


async def _hang_up(port: int, model: str, body: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(random.uniform(0.0, 0.05))
    writer.close()


async def _load(server: ServerProcess, duration: float, clients: int, stats: dict) -> None:
    """``clients`` closed-loop clients for ``duration`` s, each request drawn from the mix; counts into ``stats``."""
    good_bin, good_json, bad = _requests()
    rnd = random.Random(0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def send() -> int:
            r = rnd.random()
            if r < 0.10:
                try:
                    await _hang_up(server.port, *good_bin[:2])
                except OSError as exc:  # the server refused a connection
                    stats["lost"] += 1
                    stats["errors"].append(repr(exc)[:200])
                stats["hang_ups"] += 1
                return 0
            kind, (model, body, headers) = (("good", good_bin) if r < 0.70 else ("good", good_json) if r < 0.85
                                            else ("bad", rnd.choice(bad)))
            stats["sent"] += 1
            try:
                async with s.post(f"{server.base}/v2/models/{model}/infer", data=body, headers=headers) as resp:
                    await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                stats["lost"] += 1
                stats["errors"].append(repr(exc)[:200])
                return 0
            stats["answered"] += 1
            stats["status"][str(resp.status)] = stats["status"].get(str(resp.status), 0) + 1
            if resp.status not in ((200, 503, 504) if kind == "good" else (400,)):
                stats["unexpected"] += 1
            return resp.status

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


def main(argv: list[str] | None = None) -> int:
    p = script_parser("bench.soak", __doc__)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of mixed load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--rss-tolerance-mb", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=None, help="folder for soak.csv and soak.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(CONFIG, Path(tmp), name="soak") as server:
        stats, samples = asyncio.run(soak(server, args.duration, args.clients, args.warmup))
        live = server.metric("batcher_request_success_total", model="tiny_cnn", version="1") > 0
        log = server.log()
    fifth = max(1, len(samples) // 5)
    first, last = max(s["rss_mb"] for s in samples[:fifth]), max(s["rss_mb"] for s in samples[-fifth:])
    summary = {
        "duration_s": args.duration, "clients": args.clients, **{k: v for k, v in stats.items() if k != "errors"},
        "errors_sample": stats["errors"][:5], "rss_first_fifth_max_mb": first, "rss_last_fifth_max_mb": last,
        "rss_growth_mb": round(last - first, 1), "threads_start": samples[0]["threads"],
        "threads_end": samples[-1]["threads"], "tracebacks_in_log": log.count("Traceback"),
    }
    checks = {
        "no lost responses": stats["lost"] == 0 and stats["answered"] == stats["sent"],
        "only expected statuses": stats["unexpected"] == 0,
        f"resident memory growth <= {args.rss_tolerance_mb:g} MB": last - first <= args.rss_tolerance_mb,
        # thread pools start a few threads lazily (at most 2 here); a leak grows with the requests instead (one per
        # request or hang-up would add thousands)
        "no leaked threads": max(s["threads"] for s in samples[-fifth:]) <= max(s["threads"] for s in samples[:fifth]) + 2,
        "server live, no traceback": live and summary["tracebacks_in_log"] == 0,
    }
    summary["checks"] = checks
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "soak.json", summary)
        write_csv(args.out / "soak.csv", samples, ["t_s", "rss_mb", "threads"])
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
