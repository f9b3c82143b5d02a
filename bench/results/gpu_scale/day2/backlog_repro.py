"""Reproduce part n's transport errors at 1 front end: 512 closed-loop clients, log each failure's exception."""
import argparse, asyncio, collections, sys, tempfile, time
from pathlib import Path
import aiohttp
from bench.server import ServerProcess
from bench.gpubench.scale import server_config, model_entry, binary_request

ns = argparse.Namespace(model="resnet18", instances=1, kind="KIND_GPU", precision="tf32", delay_us=2000,
                        event_loop="uvloop", buffer_mb=256, gil_switch_us=None)
fe = int(sys.argv[1]); clients = int(sys.argv[2]); secs = float(sys.argv[3])
body, headers = binary_request()
errs = collections.Counter(); examples = {}
ok = 0
async def main(url):
    global ok
    conn = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        end = time.monotonic() + secs
        async def client():
            global ok
            while time.monotonic() < end:
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        await r.read()
                        if r.status == 200: ok += 1
                        else: errs[f"status {r.status}"] += 1
                except Exception as e:
                    k = f"{type(e).__name__}: {str(e)[:120]}"
                    errs[k] += 1; examples.setdefault(k, time.monotonic() - (end - secs))
        await asyncio.gather(*(client() for _ in range(clients)))
def child(url):
    asyncio.run(main(url))
    return ok, dict(errs), examples
if __name__ == "__main__":
    procs = int(sys.argv[4])
    clients //= procs
    from concurrent.futures import ProcessPoolExecutor
    with tempfile.TemporaryDirectory() as tmp:
        cfg = server_config([model_entry("resnet18", ns)], fe, ns)
        with ServerProcess(cfg, Path(tmp), name=f"fe{fe}", timeout_s=600) as server:
            with ProcessPoolExecutor(procs) as pool:
                res = list(pool.map(child, [server.base + "/v2/models/resnet18/infer"] * procs))
            log = server.log()
    for r in res: print("ok", r[0], "errors", r[1], "first at", r[2])
print("server log tail:\n", "\n".join(l for l in log.splitlines() if "W:onnx" not in l)[-3000:])
