"""On the GPU machine: resnet18 in multi-process mode (8 front ends, INSTANCES contexts), closed-loop load from
client processes, then per-thread CPU of every server process and a py-spy profile of all of them."""
import os, subprocess, sys, tempfile, threading, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, os.getcwd())
from bench.gpubench import scale
from bench.server import ServerProcess
from bench.peers import descendants, CLK_TCK

out = Path(os.environ.get("OUT", "/tmp/out"))
inst = int(sys.argv[1]) if len(sys.argv) > 1 else 1
shm = len(sys.argv) > 2 and sys.argv[2] == "shm"
args = SimpleNamespace(instances=inst, kind=os.environ.get("KIND", "KIND_GPU"), model="resnet18", delay_us=2000, precision="tf32",
                       event_loop=os.environ.get("LOOP", "uvloop"), buffer_mb=256, duration=14.0, warmup=2.0, client_processes=int(os.environ.get("CP", 12)),
                       clients=int(os.environ.get("CLIENTS", 512)))

def threads_cpu(pid):
    r = {}
    for p in descendants(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                f = open(f"/proc/{p}/task/{t}/stat").read().rsplit(")", 1)[1].split()
                comm = open(f"/proc/{p}/task/{t}/comm").read().strip()
                r[(p, int(t), comm)] = (int(f[11]) + int(f[12])) / CLK_TCK
        except OSError:
            pass
    return r

def main():
    body, headers = scale.binary_request()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = scale.server_config([scale.model_entry("resnet18", args)], 8, args)
        with ServerProcess(cfg, Path(tmp), name="prof", timeout_s=600) as server:
            res = {}
            th = threading.Thread(target=lambda: res.update(row=scale.load(server, "resnet18", body, headers, args.clients, args)))
            th.start()
            time.sleep(5)
            c0, t0 = threads_cpu(server.proc.pid), time.time()
            time.sleep(4)
            c1, t1 = threads_cpu(server.proc.pid), time.time()
            tag = f"i{inst}{'_shm' if shm else ''}"
            spy = subprocess.run([".gpu/bin/py-spy", "record", "--subprocesses", "--pid", str(server.proc.pid),
                                  "--duration", "4", "--rate", "200", "--format", "raw", "--nonblocking",
                                  "--output", str(out / f"spy_{tag}.txt")], capture_output=True, text=True)
            print("py-spy rc", spy.returncode, spy.stderr[-800:])
            th.join()
            row = res["row"]
            print(tag, "qps", round(row["achieved_qps"]), "batch", row.get("avg_batch_size"), "errors", row["errors"])
            busy = sorted(((c1[k] - c0.get(k, c1[k])) / (t1 - t0), k) for k in c1)[::-1][:14]
            for cores, (p, t, comm) in busy:
                print(f"  pid {p} tid {t} {comm:16s} {cores:.2f} cores")


if __name__ == '__main__':
    main()
