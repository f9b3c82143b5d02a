"""A/B of server CPU per request: servers from several source roots up at once, alternating fixed-count h2load
bursts (binary [1,4] trivial, -c C, -n N), R rounds; prints each burst and the median per root.
usage: python ab2.py R N C name=ROOT[:INLINE_US] [name=ROOT[:INLINE_US] ...]
ROOT: a source tree (e.g. `git archive` of a commit); INLINE_US sets that server's server.inline_execution_us.
env INLINE_US sets it for all; BARE=1 adds the bare aiohttp handler (bench/bare_server.py, asyncio loop).
Needs h2load on PATH. Our servers: single-process mode on uvloop, bench.peers' config for the trivial model."""
import argparse, os, subprocess, sys, tempfile, statistics, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import bench.server as bs
from bench.mlp import write_trivial
from bench.peers import ours_config
from bench.sweep.requests import build_request
import numpy as np
R, N, C = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
roots = dict(a.split("=", 1) for a in sys.argv[4:])
wd = Path(tempfile.mkdtemp())
mp = write_trivial(wd / "trivial.onnx")
args = argparse.Namespace(ours_frontends=0, ours_event_loop="uvloop", intra_op_threads=1, max_batch_size=32,
                          max_queue_delay_us=500)
servers = {}
def cpu(pid):
    t = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(t[11]) + int(t[12])) / os.sysconf("SC_CLK_TCK")
try:
    for name, root in roots.items():
        cfg = ours_config(mp, "trivial", args)
        if os.environ.get("INLINE_US"): cfg["server"]["inline_execution_us"] = int(os.environ["INLINE_US"])
        if ":" in root:
            root, inl = root.split(":"); cfg["server"]["inline_execution_us"] = int(inl)
        bs.ROOT = Path(root)
        servers[name] = bs.ServerProcess(cfg, wd / name, name=name)
    if os.environ.get("BARE"):
        port = bs.free_port(); bs.ROOT = Path(__file__).resolve().parents[4]
        servers["bare"] = bs.Subprocess([sys.executable, "-m", "bench.bare_server", "--port", str(port)], wd, "bare", port)
    body, headers = build_request([("x", "FP32", np.ones((1, 4), np.float32))], binary=True)
    (wd / "body").write_bytes(body)
    hdr = sum((["-H", f"{k}: {v}"] for k, v in headers.items()), [])
    res = {n: [] for n in servers}
    for r in range(R + 1):
        for n, s in servers.items():
            url = f"http://{s.url}/v2/models/trivial/infer"
            c0 = cpu(s.proc.pid); t0 = time.perf_counter()
            o = subprocess.run(["h2load", "--h1", "-c", str(C), "-n", str(N), "-d", str(wd / "body"), *hdr, url],
                               capture_output=True, text=True).stdout
            dt = time.perf_counter() - t0; c1 = cpu(s.proc.pid)
            ok = [l for l in o.splitlines() if "requests:" in l][0]
            if r == 0:
                continue  # warm-up round
            us = (c1 - c0) / N * 1e6
            res[n].append(us)
            print(f"round {r} {n:>6}: {us:6.1f} us/req  {N/dt:7.0f} req/s  {ok.split(',')[3].strip()}", flush=True)
    for n, v in res.items():
        print(f"{n:>6}: median {statistics.median(v):6.1f} us/req  min {min(v):6.1f}  max {max(v):6.1f}")
finally:
    for s in servers.values():
        s.stop()
