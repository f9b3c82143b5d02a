"""Multi-process mode with real processes: the same answers as single-process mode on the zoo models, a front end
or an engine process killed with kill -9, the SIGTERM drain across processes, nothing left in /dev/shm.

Which front end holds a client's connection is the kernel's choice (SO_REUSEPORT); the tests find it from
/proc (the socket's inode in /proc/net/tcp, then the process holding that inode) instead of guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import orjson
import pytest
from helpers import require_program, until
from test_server import BAD_REQUESTS, MODELS

from bench.peers import descendants
from bench.server import ServerProcess, Subprocess, free_port

MID = {"name": "mid_cnn", "path": "zoo:mid_cnn", "intra_op_threads": 1, "max_batch_size": 8}


def _binary(x: np.ndarray, **parameters) -> dict:
    head = orjson.dumps({"id": "r1", "inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                                  "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True, **parameters}})
    return {"data": head + x.tobytes(), "headers": {"Inference-Header-Content-Length": str(len(head))}}


def _shared_memory(server) -> tuple[set[str], int]:
    """What the server's processes hold of /dev/shm (files mapped or open; nothing, so nothing can be left there
    however a process ends) and how many memfd areas they map (the shared memory they do use has no name)."""
    named, memfd = set(), 0
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        named |= {ln.split(None, 5)[-1] for ln in maps.splitlines() if "/dev/shm/" in ln}
        named |= {t for t in fds if t.startswith("/dev/shm/")}
        memfd += maps.count("/memfd:batcher-area")
    return named, memfd


def _wait_log(server, pattern: str, count: int = 1, timeout_s: float = 60.0) -> list[str]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = re.findall(pattern, server.log())
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not logged {count} time(s):\n{server.log()[-3000:]}")


class Connection:
    """A client session with exactly one keep-alive connection, and the local port it uses (to find its owner)."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

        def factory(addr_info):
            sock = socket.socket(addr_info[0], addr_info[1], addr_info[2])
            self.sockets.append(sock)
            return sock

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, socket_factory=factory))

    async def open(self, server) -> int:
        """Connect (a GET of /v2/health/live); the pid of the process holding the server side."""
        async with self.session.get(f"{server.base}/v2/health/live") as r:
            assert r.status == 200
        return _owner(server, self.sockets[-1].getsockname()[1])


async def _queued(server, n: int) -> bool:
    """Whether mid_cnn's queue reaches ``n`` requests within 5 s."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        if await asyncio.to_thread(server.metric, "batcher_queue_depth", model="mid_cnn", version="1") == n:
            return True
        await asyncio.sleep(0.01)
    return False


def _owner(server, client_port: int) -> int:
    """The pid of the process holding the server side of the connection from ``client_port`` (/proc)."""
    local = f"0100007F:{server.port:04X}"
    remote = f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as f:
        inode = next(line.split()[9] for line in f if line.split()[1:3] == [local, remote])
    for pid in descendants(server.proc.pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                pass
    raise AssertionError(f"no process holds the connection from port {client_port}")


@pytest.fixture(scope="module")
def multi_server(tmp_path_factory, cache_dir):
    """The embedded default config (the six zoo models) in multi-process mode: two front ends, one engine, on
    uvloop's event loop (``server.event_loop``)."""
    server_cfg = {**_default_config()["server"], "frontends": 2, "event_loop": "uvloop", "listen_backlog": 777}
    with ServerProcess({**_default_config(), "server": server_cfg},
                       tmp_path_factory.mktemp("multi"), name="multi") as server:
        _wait_log(server, r"serving KServe v2")
        yield server


def test_each_process_carries_its_role_as_its_name(multi_server):
    """ps, top and /proc/PID/comm name the processes of multi-process mode by role (what bench.peers splits the
    CPU by)."""
    from bench.peers import descendants, role_of

    names = set()
    for pid in descendants(multi_server.proc.pid)[1:]:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            pass
    assert {"engine-cpu", "frontend-0", "frontend-1"} <= names
    assert sorted(role_of(p) for p in descendants(multi_server.proc.pid)).count("frontend") == 2


def _listen_backlogs(port: int) -> list[int]:
    """The accept-queue length of every socket listening on ``port`` (``ss``'s Send-Q column of a LISTEN socket)."""
    ss = require_program(shutil.which("ss"), "ss (iproute2) is not installed", "BATCHER_REQUIRE_SS")
    out = subprocess.run([ss, "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return sorted(int(line.split()[2]) for line in out.splitlines() if line.startswith("LISTEN"))


def test_every_listening_socket_takes_server_listen_backlog(default_server, multi_server):
    """``server.listen_backlog`` (default 1024) is the accept queue of the one process that listens in
    single-process mode and of each front end (``SO_REUSEPORT``) in multi-process mode; aiohttp's 128 reset
    connections when 512 clients connected at once to one front end on the H200."""
    assert _listen_backlogs(default_server.port) == [1024]
    assert _listen_backlogs(multi_server.port) == [777, 777]


def _default_config() -> dict:
    import yaml

    from batcher.config import default_config_text

    return yaml.safe_load(default_config_text())


async def _exchange(base: str, method: str, path: str, **kwargs) -> tuple[int, str | None, str | None, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, base + path, **kwargs) as r:
            return r.status, r.headers.get("Content-Type"), r.headers.get("Inference-Header-Content-Length"), \
                await r.read()


async def test_multi_process_mode_answers_exactly_as_single_process_mode(default_server, multi_server):
    """Byte for byte: inference on every zoo model (JSON and binary tensors), every documented bad request,
    metadata, model config, readiness; and the counts of the multi-process server match what was sent."""
    rng = np.random.default_rng(3)
    cases = [("GET", "/v2", {}), ("GET", "/v2/health/ready", {}), ("GET", "/v2/models/nope/config", {}),
             ("POST", "/v2/models/tiny_cnn/versions/7/infer", {"json": {}})]
    sent = {m: 0 for m in MODELS}
    for model, (name, shape) in MODELS.items():
        x = rng.random(shape, dtype=np.float32)
        json_body = {"id": "j", "inputs": [{"name": name, "datatype": "FP32", "shape": list(shape),
                                            "data": x.ravel().tolist()}]}
        head = orjson.dumps({"id": "b", "inputs": [{"name": name, "datatype": "FP32", "shape": list(shape),
                                                      "parameters": {"binary_data_size": x.nbytes}}],
                             "parameters": {"binary_data_output": True}})
        binary = {"data": head + x.tobytes(), "headers": {"Inference-Header-Content-Length": str(len(head))}}
        cases += [("POST", f"/v2/models/{model}/infer", {"json": json_body}),
                  ("POST", f"/v2/models/{model}/infer", binary),
                  ("GET", f"/v2/models/{model}", {}), ("GET", f"/v2/models/{model}/config", {}),
                  ("GET", f"/v2/models/{model}/ready", {})]
        sent[model] += 2
    cases += [("POST", f"/v2/models/{model}/infer", kwargs) for _, model, kwargs, _, _ in BAD_REQUESTS]
    for method, path, kwargs in cases:  # one at a time: the same batches on both servers
        single = await _exchange(default_server.base, method, path, **kwargs)
        multi = await _exchange(multi_server.base, method, path, **kwargs)
        assert multi == single, (method, path)
    invalid = {m: sum(1 for _, model, _, status, _ in BAD_REQUESTS if model == m and status == 400) for m in MODELS}

    def counted() -> float:  # the engine counts an answer when its front end's acknowledgement arrives: it may
        # still be on its way when the client has the answer
        return sum(multi_server.metric("batcher_request_success_total", model=m, version="1")
                   + multi_server.metric("batcher_request_failure_total", reason="invalid", model=m, version="1")
                   for m in MODELS)

    await until(lambda: counted() >= sum(sent.values()) + sum(invalid.values()), timeout_s=30)
    for model in MODELS:
        labels = {"model": model, "version": "1"}
        assert multi_server.metric("batcher_request_success_total", **labels) == sent[model]
        assert multi_server.metric("batcher_request_failure_total", reason="invalid", **labels) == invalid[model]
        status, _, _, body = await _exchange(multi_server.base, "GET", f"/v2/models/{model}/stats")
        stats = orjson.loads(body)["model_stats"][0]["inference_stats"]
        assert (stats["success"]["count"], stats["fail"]["count"]) == (sent[model], invalid[model])


async def test_kill_9_of_a_front_end_loses_only_its_requests_and_of_the_engine_answers_503_until_it_is_back(
        start_server):
    server = start_server({"server": {"frontends": 2}, "models": [MID, {"name": "tiny_cnn", "path": "zoo:tiny_cnn"}]})
    _wait_log(server, r"serving KServe v2")
    url = f"{server.base}/v2/models/mid_cnn/infer"
    conns: list[Connection] = []
    owners: list[int] = []
    try:
        while len(set(owners)) < 2 and len(conns) < 30:  # connections until both front ends hold some
            conns.append(Connection())
            owners.append(await conns[-1].open(server))
        sessions = [c.session for c in conns]
        victim, survivor = owners[0], next(o for o in owners if o != owners[0])

        async def post(s, rows):
            async with s.post(url, **_binary(np.ones((rows, 3, 224, 224), np.float32))) as r:
                await r.read()
                return r.status

        blocker = asyncio.create_task(post(sessions[owners.index(survivor)], 8))  # ~0.5 s executing
        await asyncio.sleep(0.15)
        others = [i for i in range(len(sessions)) if i != owners.index(survivor)]
        queued = {i: asyncio.create_task(post(sessions[i], 1)) for i in others}
        assert await _queued(server, len(queued))  # every request is in the engine's queue
        named, areas = _shared_memory(server)
        assert named == set() and areas >= 4  # 2 front ends x 1 engine, each side mapping the area
        os.kill(victim, signal.SIGKILL)
        results = {i: r for i, r in zip(queued, await asyncio.gather(*queued.values(), return_exceptions=True))}
        assert await blocker == 200
        lost = [i for i, r in results.items() if isinstance(r, aiohttp.ClientError)]
        assert sorted(lost) == [i for i in others if owners[i] == victim]
        assert all(results[i] == 200 for i in others if owners[i] != victim)
        # the engine names the front end by the pid the supervisor's lines give it, not by its own count
        _wait_log(server, rf"front end \(pid {victim}\) is gone: dropping its {len(lost)} request")
        # its clients saw the connection close at the kill; the engine counts their requests once it has seen the
        # front end go (after that line: the drop settles each request in a later pass of its event loop)
        labels = {"model": "mid_cnn", "version": "1"}

        def dropped() -> float:
            return server.metric("batcher_request_failure_total", reason="dropped", **labels)

        await until(lambda: dropped() >= len(lost))
        assert dropped() == len(lost)
        _wait_log(server, r"frontend-\d ready", count=3)  # started again
        assert server.metric("batcher_process_restart_total", process="frontend") == 1
        assert all(st == 200 for st in await asyncio.gather(*(post(s, 1) for s in sessions[1:])))

        engine_pid = int(_wait_log(server, r"engine-cpu ready \(pid (\d+)\)")[0])
        rejected = {m: server.metric("batcher_request_failure_total", reason="rejected", model=m, version="1")
                    for m in ("mid_cnn", "tiny_cnn")}
        blocker = asyncio.create_task(post(sessions[0], 8))
        await asyncio.sleep(0.15)
        os.kill(engine_pid, signal.SIGKILL)
        assert await blocker == 503  # its request was lost with it
        async with sessions[1].post(f"{server.base}/v2/models/tiny_cnn/infer",
                                    **_binary(np.ones((1, 3, 224, 224), np.float32))) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"  # until it is back
        # both 503s are counted, by the front ends: the lost request's engine process died with its count
        assert [server.metric("batcher_request_failure_total", reason="rejected", model=m, version="1") - rejected[m]
                for m in ("mid_cnn", "tiny_cnn")] == [1, 1]
        _wait_log(server, r"engine-cpu ready", count=2)
        for _ in range(100):
            async with sessions[1].get(f"{server.base}/v2/health/ready") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert await post(sessions[1], 1) == 200
        assert server.metric("batcher_process_restart_total", process="engine") == 1
        assert server.metric("batcher_request_failure_total", reason="dropped", **labels) == len(lost)  # kept
    finally:
        for c in conns:
            await c.session.close()
    folder = _wait_log(server, r"runtime folder (\S+)")[0]
    assert _shared_memory(server)[0] == set()
    assert server.stop() == 0
    assert not os.path.exists(folder)
    assert "Traceback" not in server.log()


def test_a_supervisor_killed_with_kill_9_leaves_its_runtime_folder_to_the_next_one(start_server, tmp_path):
    """kill -9 of the supervisor: its children die with it (PR_SET_PDEATHSIG), its runtime folder (engine sockets,
    the metrics' files) stays; the next multi-process server removes it as it starts, and keeps its own."""
    env = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    config = {"server": {"frontends": 1, "log_level": "info"}, "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn"}]}
    first = start_server(config, env=env)
    folder = _wait_log(first, r"runtime folder (\S+)")[0]
    _wait_log(first, r"serving KServe v2")
    children = descendants(first.proc.pid)[1:]
    assert folder.startswith(str(tmp_path / "tmp")) and os.path.isdir(os.path.join(folder, "metrics")) and children
    first.proc.kill()
    first.proc.wait(timeout=30)
    end = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)
    assert os.path.isdir(folder)
    second = start_server(config, env=env)
    own = _wait_log(second, r"multi-process mode: runtime folder (\S+)")[0]
    assert _wait_log(second, r"removed (\S+): the runtime folder of a supervisor that is gone") == [folder]
    assert not os.path.exists(folder) and os.path.isdir(own)
    _wait_log(second, r"serving KServe v2")
    assert second.stop() == 0
    assert [n for n in os.listdir(tmp_path / "tmp") if n.startswith("batcher-")] == []  # its own removed at exit


def _unshare() -> list[str]:
    """``unshare`` into a new PID namespace (``batcher serve`` becomes its PID 1, as in a container), or a skip."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        if subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0:
            return cmd
    except (OSError, subprocess.TimeoutExpired):
        pass
    pytest.skip("unshare --pid (root, util-linux) is not available here")


def test_as_pid_1_of_its_namespace_and_beside_a_server_of_another_namespace(start_server, tmp_path):
    """``batcher serve`` as PID 1 of a PID namespace (a container's entrypoint): its children do not take their
    parent, PID 1, for the reaper that adopts orphans, and it serves. A server of the host's namespace sharing its
    TMPDIR (containers sharing /tmp) does not take that server's runtime folder for a dead supervisor's (pids mean
    nothing across namespaces; the owner file's lock does), and the first keeps serving."""
    unshare = _unshare()
    (tmp_path / "tmp").mkdir()
    env = {"TMPDIR": str(tmp_path / "tmp")}
    model = {"name": "tiny_cnn", "path": "zoo:tiny_cnn"}
    config = tmp_path / "pid1.yaml"
    config.write_text(orjson.dumps({"server": {"frontends": 1, "log_level": "info"}, "models": [model]}).decode())
    port = free_port()
    first = Subprocess([*unshare, sys.executable, "-m", "batcher", "serve", "--config", str(config), "--port",
                        str(port)], tmp_path, "pid1", port, env=env)
    try:
        folder = _wait_log(first, r"multi-process mode: runtime folder (\S+)")[0]
        assert _infer_status(first.base) == 200
        second = start_server({"server": {"frontends": 1, "log_level": "info"}, "models": [model]}, env=env)
        _wait_log(second, r"serving KServe v2")
        assert "removed" not in second.log() and os.path.isdir(folder)
        assert _infer_status(first.base) == 200 and _infer_status(second.base) == 200
        assert second.stop() == 0 and os.path.isdir(folder)
    finally:
        os.killpg(first.proc.pid, signal.SIGTERM)  # unshare and its PID 1, which drains and exits
        first.proc.wait(timeout=60)
        first.stop()
    assert "Traceback" not in first.log() and "exited (code 1) before it was ready" not in first.log()


def _infer_status(base: str) -> int:
    x = np.zeros((1, 3, 224, 224), np.float32)

    async def post() -> int:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/v2/models/tiny_cnn/infer", **_binary(x)) as r:
                return r.status

    return asyncio.run(post())


@pytest.mark.parametrize("to", ["supervisor", "process group"])
async def test_sigterm_drains_every_accepted_request_across_processes(start_server, to):
    """SIGTERM to the supervisor, or to the server's whole process group (``kill -TERM -- -PGID``, a terminal's
    job): readiness false, new requests 503, every accepted request answered,
    exit 0. Each child has a process group of its own, so a group's signal reaches the supervisor alone, which
    stops the engines only after the front ends drained."""
    # the slow request: 32 rows (about 0.4 s here), long enough that its front end is still draining when the probe
    # is sent 0.35 s after it (8 rows, ~0.1 s, were done by then once in a while: the probe found the port closed)
    server = start_server({"server": {"frontends": 2, "shutdown_grace_s": 20},
                           "models": [{**MID, "max_batch_size": 32}]})
    _wait_log(server, r"serving KServe v2")
    url = f"{server.base}/v2/models/mid_cnn/infer"
    conns = [Connection() for _ in range(6)]
    sessions = [c.session for c in conns]
    owners = []
    try:
        for c in conns:
            owners.append(await c.open(server))
        for _ in range(40):  # an idle connection to the front end of the slow request (it drains longest)
            conns.append(Connection())
            owners.append(await conns[-1].open(server))
            if owners[-1] == owners[0]:
                break
        probe = conns[-1].session

        async def post(s, rows):
            async with s.post(url, **_binary(np.ones((rows, 3, 224, 224), np.float32))) as r:
                return r.status, await r.read()

        tasks = [asyncio.create_task(post(sessions[0], 32))]  # ~0.4 s executing
        await asyncio.sleep(0.15)
        tasks += [asyncio.create_task(post(s, 1)) for s in sessions[1:]]
        assert await _queued(server, 5)
        assert _shared_memory(server)[0] == set()
        if to == "supervisor":
            server.proc.terminate()
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)
        await asyncio.sleep(0.2)
        status, body = await post(probe, 1)  # a new request while draining: refused; readiness false
        assert status == 503 and b"shutting down" in body
        async with probe.get(f"{server.base}/v2/health/ready") as r:
            assert r.status == 503
        assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 6
    finally:
        for c in conns:
            await c.session.close()
    assert await asyncio.to_thread(server.proc.wait, 40) == 0
    folder = _wait_log(server, r"runtime folder (\S+)")[0]
    assert not os.path.exists(folder)
    log = server.log()
    assert "stopped" in log and "Traceback" not in log


TINY = {"name": "tiny_cnn", "path": "zoo:tiny_cnn"}


async def _post_tiny(session: aiohttp.ClientSession, base: str, **parameters) -> tuple[int, dict]:
    async with session.post(f"{base}/v2/models/tiny_cnn/infer",
                            **_binary(np.zeros((1, 3, 224, 224), np.float32), **parameters)) as r:
        body = await r.read()
        return r.status, (orjson.loads(body) if r.content_type == "application/json" else {})


def _ready(base: str) -> bool:
    with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(f"{base}/v2/health/ready") as r:
        return r.status == 200
    return False


LABELS = {"model": "tiny_cnn", "version": "1"}


def _one_engine(start_server, stall_timeout_s: float | None, **queue_policy) -> tuple[ServerProcess, int]:
    """A server of one front end and one engine process serving tiny_cnn, and the engine process's pid."""
    model = {**TINY, "dynamic_batching": {"default_queue_policy": queue_policy}}
    server = start_server({"server": {"frontends": 1, "stall_timeout_s": stall_timeout_s}, "models": [model]})
    _wait_log(server, r"serving KServe v2")
    return server, int(_wait_log(server, r"engine-cpu ready \(pid (\d+)\)")[0])


async def test_a_stopped_engine_process_still_gets_its_requests_answered_504_at_their_deadline(start_server):
    """SIGSTOP of the engine process (``server.stall_timeout_s`` null: never killed): a request with a timeout is
    answered 504 by its front end soon after its deadline (its engine process would have; a user's requests waited
    for as long as the process was stopped), and the engine process, once SIGCONT, counts it ``timeout`` (the
    front end's ABORT says so) and serves on."""
    server, engine = _one_engine(start_server, None)
    async with aiohttp.ClientSession() as s:
        assert (await _post_tiny(s, server.base))[0] == 200
        os.kill(engine, signal.SIGSTOP)
        try:
            status, body = await _post_tiny(s, server.base, timeout=100_000)
        finally:
            os.kill(engine, signal.SIGCONT)
        assert status == 504
        assert body["error"] == "model 'tiny_cnn': no answer from the engine process by the request's deadline"
        await until(lambda: server.metric("batcher_request_failure_total", reason="timeout", **LABELS) == 1)
        assert (await _post_tiny(s, server.base))[0] == 200
    # counted by the engine process when the front end's acknowledgement arrives, a moment after the answer
    await until(lambda: server.metric("batcher_request_success_total", **LABELS) == 2)
    assert server.metric("batcher_request_failure_total", reason="canceled", **LABELS) == 0
    assert server.metric("batcher_process_restart_total", process="engine") == 0
    assert server.stop() == 0
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


async def test_a_stalled_engine_process_is_killed_and_restarted_after_server_stall_timeout_s(start_server):
    """SIGSTOP of the engine process: after ``server.stall_timeout_s`` without a heartbeat of its event loop the
    supervisor kills it (batcher.heartbeat) and starts it again. Meanwhile a request with a timeout gets 504 from
    its front end, one without (the model's default far off) gets 503 when the process is killed (as for any engine
    death); each counted once,
    by the front end (the engine process died without counting them)."""
    # the model's default deadline far off: the request without a timeout of its own waits for the kill
    server, engine = _one_engine(start_server, 3, default_timeout_microseconds=120_000_000)
    async with aiohttp.ClientSession() as s:
        assert (await _post_tiny(s, server.base))[0] == 200
        os.kill(engine, signal.SIGSTOP)
        waiting = asyncio.create_task(_post_tiny(s, server.base))  # answered when the process is killed
        status, body = await _post_tiny(s, server.base, timeout=100_000)
        assert status == 504, body
        status, body = await waiting
        assert status == 503 and "being restarted" in body["error"], body
        line = _wait_log(server, r"the engine-cpu process \(pid (\d+)\) has not run its event loop for")
        assert line == [str(engine)]
        _wait_log(server, r"engine-cpu ready", count=2)
        await until(lambda: _ready(server.base))
        assert (await _post_tiny(s, server.base))[0] == 200
    assert server.metric("batcher_process_restart_total", process="engine") == 1
    assert server.metric("batcher_process_restart_total", process="frontend") == 0
    assert server.metric("batcher_request_failure_total", reason="timeout", **LABELS) == 1
    assert server.metric("batcher_request_failure_total", reason="rejected", **LABELS) == 1
    assert server.stop() == 0


def test_a_model_on_several_gpus_needs_multi_process_mode(start_server, tmp_path):
    with pytest.raises(RuntimeError) as exc:
        start_server({"server": {"frontends": 0}, "models": [
            {"name": "r", "path": "zoo:tiny_cnn", "instance_group": [{"kind": "KIND_GPU", "gpus": [0, 1]}]}]})
    assert "needs multi-process mode (server.frontends >= 1" in str(exc.value)


async def test_engine_processes_per_model_isolate_models_and_answer_as_single_process_mode(default_server,
                                                                                          start_server):
    """``engine_processes: per_model``: an engine process per model, named by it; answers byte for byte those of
    single-process mode; one model's engine process killed with kill -9 leaves the other model answering 200
    while its own model answers 503 until its process is back; the counts match what was sent."""
    models = [m for m in _default_config()["models"] if m["name"] in ("tiny_cnn", "mid_cnn")]
    server = start_server({"server": {"frontends": 1, "engine_processes": "per_model"}, "models": models})
    _wait_log(server, r"serving KServe v2")
    pids = {m: int(_wait_log(server, rf"engine-cpu:{m} ready \(pid (\d+)\)")[0]) for m in ("tiny_cnn", "mid_cnn")}
    assert len(set(pids.values())) == 2
    x = np.random.default_rng(5).random((2, 3, 224, 224), dtype=np.float32)
    for model in ("tiny_cnn", "mid_cnn"):
        path = f"/v2/models/{model}/infer"
        assert await _exchange(server.base, "POST", path, **_binary(x)) == \
            await _exchange(default_server.base, "POST", path, **_binary(x))
    os.kill(pids["mid_cnn"], signal.SIGKILL)
    _wait_log(server, r"the engine-cpu:mid_cnn process \(pid \d+\) died")
    status, _, _, _ = await _exchange(server.base, "POST", "/v2/models/tiny_cnn/infer", **_binary(x))
    assert status == 200  # the other model's process is untouched
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.base}/v2/models/mid_cnn/infer", **_binary(x)) as r:
            assert (r.status, r.headers.get("Retry-After")) == (503, "1")
            assert "engine process" in orjson.loads(await r.read())["error"]
    _wait_log(server, r"engine-cpu:mid_cnn ready", count=2)
    for _ in range(200):  # the front end reconnects by itself
        status, _, _, _ = await _exchange(server.base, "POST", "/v2/models/mid_cnn/infer", **_binary(x))
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    assert server.metric("batcher_request_success_total", model="tiny_cnn", version="1") == 2
    assert server.metric("batcher_process_restart_total", process="engine") == 1
    assert server.stop() == 0
    assert "Traceback" not in server.log()


FAKE_MPS_CONTROL = """#!/bin/sh
# stand-in for nvidia-cuda-mps-control (no GPU here): records what the supervisor asks and with which folders
if [ "$1" = "-d" ]; then
  [ -n "$FAIL" ] && { echo "$FAIL"; exit 1; }
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$RECORD"
else
  echo "command $(cat) $CUDA_MPS_PIPE_DIRECTORY" >> "$RECORD"
fi
"""


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)


def test_cuda_mps_starts_a_private_daemon_for_the_engine_processes_and_quits_it_at_exit(start_server, tmp_path):
    """``server.cuda_mps``: the supervisor starts the MPS control daemon (``-d``) with its pipe and log folders in
    its runtime folder before any engine process, every engine process has them in its environment, and the
    daemon gets ``quit`` after the engine processes are gone (the control program is a stand-in: no GPU here)."""
    control, record = tmp_path / "mps-control", tmp_path / "record.txt"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    models = [m for m in _default_config()["models"] if m["name"] in ("tiny_cnn", "mid_cnn")]
    server = start_server({"server": {"frontends": 1, "engine_processes": "per_model", "cuda_mps": True},
                           "models": models}, env={"BATCHER_MPS_CONTROL": str(control), "RECORD": str(record)})
    _wait_log(server, r"serving KServe v2")
    [start] = record.read_text().splitlines()
    _, pipe, logs = start.split()
    runtime = re.search(r"runtime folder (\S+)", server.log())[1]
    assert (pipe, logs) == (f"{runtime}/mps-pipe", f"{runtime}/mps-log")
    pids = [int(p) for p in _wait_log(server, r"engine-cpu:\w+ ready \(pid (\d+)\)", count=2)]
    for pid in pids:
        env = _environ(pid)
        assert (env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]) == (pipe, logs)
    x = np.zeros((1, 3, 224, 224), np.float32)

    async def infer() -> int:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.base}/v2/models/tiny_cnn/infer", **_binary(x)) as r:
                return r.status

    assert asyncio.run(infer()) == 200
    assert server.stop() == 0
    assert record.read_text().splitlines() == [start, f"command quit {pipe}"]
    assert not os.path.exists(runtime)


def test_the_mps_daemon_of_a_supervisor_killed_with_kill_9_is_sent_quit_by_the_next_one(start_server, tmp_path):
    """A supervisor with ``server.cuda_mps`` killed with kill -9 leaves its MPS control daemon running, its pipes in
    its runtime folder; the next server to start (with or without MPS) sends that daemon ``quit`` through those
    pipes, then removes the folder (the control program is a stand-in: no GPU here)."""
    control, record = tmp_path / "mps-control", tmp_path / "record.txt"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = {"BATCHER_MPS_CONTROL": str(control), "RECORD": str(record), "TMPDIR": str(tmp_path / "tmp")}
    model = {"name": "tiny_cnn", "path": "zoo:tiny_cnn"}
    first = start_server({"server": {"frontends": 1, "cuda_mps": True}, "models": [model]}, env=env)
    _wait_log(first, r"serving KServe v2")
    [start] = record.read_text().splitlines()
    pipe = start.split()[1]
    first.proc.kill()
    first.proc.wait(timeout=30)
    second = start_server({"server": {"frontends": 1, "log_level": "info"}, "models": [model]}, env=env)
    _wait_log(second, r"serving KServe v2")
    assert record.read_text().splitlines() == [start, f"command quit {pipe}"]
    assert not os.path.exists(os.path.dirname(pipe))
    assert second.stop() == 0 and record.read_text().splitlines() == [start, f"command quit {pipe}"]


def test_cuda_mps_that_fails_to_start_stops_the_server_with_its_message(start_server, tmp_path):
    control = tmp_path / "mps-control"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    with pytest.raises(RuntimeError) as exc:
        start_server({"server": {"frontends": 1, "cuda_mps": True}, "models": [MID]}, timeout_s=60, env={
            "BATCHER_MPS_CONTROL": str(control), "RECORD": str(tmp_path / "r"), "FAIL": "An instance is running"})
    assert "exited with 2" in str(exc.value)
    assert "mps-control -d' failed (exit code 1): An instance is running" in str(exc.value)
    assert "Traceback" not in str(exc.value)


def test_cuda_mps_uses_the_daemon_the_environment_names(start_server, tmp_path):
    """With ``CUDA_MPS_PIPE_DIRECTORY`` already set (an MPS daemon run by the platform), none is started."""
    control, record = tmp_path / "mps-control", tmp_path / "record.txt"
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(0o755)
    server = start_server({"server": {"frontends": 1, "cuda_mps": True}, "models": [MID]}, env={
        "BATCHER_MPS_CONTROL": str(control), "RECORD": str(record), "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    [pid] = [int(p) for p in _wait_log(server, r"engine-cpu ready \(pid (\d+)\)")]
    assert _environ(pid)["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path)
    assert server.stop() == 0
    assert not record.exists()
    assert "using the MPS daemon of CUDA_MPS_PIPE_DIRECTORY" in server.log()


def test_engine_processes_and_cuda_mps_need_multi_process_mode(start_server):
    for key, value in (("engine_processes", "per_model"), ("cuda_mps", True)):
        with pytest.raises(RuntimeError) as exc:
            start_server({"server": {"frontends": 0, key: value}, "models": [MID]}, timeout_s=60)
        assert f"server.{key}: {str(value).lower()} applies to the engine processes of multi-process mode" \
            in str(exc.value)


async def test_an_engine_process_that_restarts_gets_the_shared_memory_regions_of_the_others(start_server):
    """``engine_processes: per_model``, system shared memory (a fresh user's find: after one model's engine
    process restarted, status listed no region while the other process still had it, and registering it again
    was refused): the restarted process gets the other's regions again, so status, inference, unregister and
    register agree across processes."""
    from multiprocessing.shared_memory import SharedMemory

    models = [m for m in _default_config()["models"] if m["name"] in ("tiny_cnn", "mid_cnn")]
    server = start_server({"server": {"frontends": 1, "engine_processes": "per_model",
                                      "shared_memory": {"system": True}}, "models": models})
    pids = {m: int(_wait_log(server, rf"engine-cpu:{m} ready \(pid (\d+)\)")[0]) for m in ("tiny_cnn", "mid_cnn")}
    x = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    seg = SharedMemory(create=True, size=x.nbytes)
    try:
        np.ndarray(x.shape, x.dtype, buffer=seg.buf)[...] = x
        reg = {"key": "/" + seg.name, "offset": 0, "byte_size": x.nbytes}
        body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "parameters": {
            "shared_memory_region": "r", "shared_memory_byte_size": x.nbytes}}]})
        async with aiohttp.ClientSession() as s:
            async def post(path: str, data: bytes = b"") -> int:
                async with s.post(server.base + path, data=data) as r:
                    await r.read()
                    return r.status

            async def status() -> list:
                async with s.get(f"{server.base}/v2/systemsharedmemory/status") as r:
                    return orjson.loads(await r.read())

            assert await post("/v2/systemsharedmemory/region/r/register", orjson.dumps(reg)) == 200
            os.kill(pids["tiny_cnn"], signal.SIGKILL)
            _wait_log(server, r"engine-cpu:tiny_cnn ready", count=2)
            _wait_log(server, r"reconnected to the engine process for cpu:tiny_cnn")
            assert [r["name"] for r in await status()] == ["r"]
            for model in ("tiny_cnn", "mid_cnn"):
                assert await post(f"/v2/models/{model}/infer", body) == 200
            assert await post("/v2/systemsharedmemory/region/r/unregister") == 200
            assert await status() == []
            assert await post("/v2/systemsharedmemory/region/r/register", orjson.dumps(reg)) == 200
            assert [r["name"] for r in await status()] == ["r"]
            assert await post("/v2/systemsharedmemory/region/r/unregister") == 200
    finally:
        seg.close()
        seg.unlink()
    assert server.stop() == 0
    assert "Traceback" not in server.log()


async def test_a_restarted_lone_engine_process_is_said_to_have_lost_the_regions_each_front_end_registered(
        start_server):
    """Shared memory on, two front ends, one engine process killed with kill -9 (a fresh user's find: every front
    end warned that the regions were lost, also when none had been registered): the front end a region was
    registered through names it, once; one registered and unregistered again is not named; the other front end
    says nothing."""
    from multiprocessing.shared_memory import SharedMemory

    models = [m for m in _default_config()["models"] if m["name"] == "tiny_cnn"]
    server = start_server({"server": {"frontends": 2, "shared_memory": {"system": True}}, "models": models})
    engine_pid = int(_wait_log(server, r"engine-cpu ready \(pid (\d+)\)")[0])
    seg = SharedMemory(create=True, size=4096)
    try:
        reg = orjson.dumps({"key": "/" + seg.name, "offset": 0, "byte_size": 4096})
        async with aiohttp.ClientSession() as s:
            async def post(path: str, data: bytes = b"") -> int:
                async with s.post(server.base + path, data=data) as r:
                    await r.read()
                    return r.status

            assert await post("/v2/systemsharedmemory/region/kept/register", reg) == 200
            assert await post("/v2/systemsharedmemory/region/gone/register", reg) == 200
            assert await post("/v2/systemsharedmemory/region/gone/unregister") == 200
            os.kill(engine_pid, signal.SIGKILL)
            _wait_log(server, r"engine-cpu ready", count=2)
            _wait_log(server, r"reconnected to the engine", count=2)  # both front ends are back on it
            async with s.get(f"{server.base}/v2/systemsharedmemory/status") as r:
                assert (r.status, orjson.loads(await r.read())) == (200, [])  # the regions died with it
    finally:
        seg.close()
        seg.unlink()
    lines = [line for line in server.log().splitlines() if "restarted without the shared memory regions" in line]
    assert len(lines) == 1 and "(kept, registered through this front end)" in lines[0], lines
    assert server.stop() == 0
    assert "Traceback" not in server.log()


async def test_sigterm_to_an_engine_process_drains_it_and_counts_each_request_once(start_server):
    """SIGTERM to the engine process alone (a fresh user's find: it closed at once, its front end answered its
    queued requests 503 and counted them ``rejected``, and the engine counted them ``dropped`` too): it drains as
    a server does (batcher.engine_main), so the requests queued in its 1.5 s batch window are answered 200;
    meanwhile readiness is false and a new request gets 503 (a second fresh user's find: readiness stayed 200 while
    the only engine process drained), each counted once; then the supervisor starts it again."""
    model = {**TINY, "dynamic_batching": {"max_queue_delay_microseconds": 1_500_000}}
    server = start_server({"server": {"frontends": 1}, "models": [model]})
    _wait_log(server, r"serving KServe v2")
    engine = int(_wait_log(server, r"engine-cpu ready \(pid (\d+)\)")[0])
    async with aiohttp.ClientSession() as s:
        queued = [asyncio.create_task(_post_tiny(s, server.base)) for _ in range(3)]
        await until(lambda: server.metric("batcher_queue_depth", **LABELS) == 3)
        os.kill(engine, signal.SIGTERM)
        await until(lambda: not _ready(server.base))  # told to drain, the front end routes nothing new to it
        late = await _post_tiny(s, server.base)
        answers = [await t for t in queued]
        assert [status for status, _ in answers] == [200, 200, 200], answers
        assert late[0] == 503 and "being restarted" in late[1]["error"], late
        _wait_log(server, r"engine-cpu ready", count=2)
        await until(lambda: _ready(server.base))
        assert (await _post_tiny(s, server.base))[0] == 200
    await until(lambda: server.metric("batcher_request_success_total", **LABELS) == 4)
    assert server.metric("batcher_request_failure_total", reason="rejected", **LABELS) == 1
    assert server.metric("batcher_request_failure_total", reason="dropped", **LABELS) == 0
    assert server.metric("batcher_process_restart_total", process="engine") == 1
    assert server.stop() == 0
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


def _tensor_bytes(response: aiohttp.ClientResponse, body: bytes) -> bytes:
    """The binary part of a binary-extension answer (its one output's bytes)."""
    return body[int(response.headers["Inference-Header-Content-Length"]):]


async def test_one_region_name_registered_through_two_front_ends_at_once_has_one_owner_everywhere(start_server):
    """Two front ends, an engine process per model, system shared memory (a fresh user's find: registering one
    name with two segments through two front ends at once reached the engine processes in different orders; both
    clients got 400 while the name stayed registered, the two models reading different segments): the changes
    take turns (batcher.shm.RegistryLock), so one registration wins, the other gets 400, and both models read the
    winner's segment."""
    from multiprocessing.shared_memory import SharedMemory

    models = [m for m in _default_config()["models"] if m["name"] in ("tiny_cnn", "mid_cnn")]
    server = start_server({"server": {"frontends": 2, "engine_processes": "per_model",
                                      "shared_memory": {"system": True}}, "models": models})
    _wait_log(server, r"serving KServe v2")
    shape = (1, 3, 224, 224)
    data = [np.zeros(shape, np.float32), np.ones(shape, np.float32)]
    segs = [SharedMemory(create=True, size=data[0].nbytes) for _ in data]
    conns = []
    try:
        for seg, x in zip(segs, data):
            np.ndarray(shape, np.float32, buffer=seg.buf)[...] = x
        owners: dict[int, Connection] = {}
        while len(owners) < 2:  # one connection on each front end
            conn = Connection()
            conns.append(conn)
            owners.setdefault(await conn.open(server), conn)
        a, b = owners.values()
        expected = {}
        async with aiohttp.ClientSession() as s:
            for model in ("tiny_cnn", "mid_cnn"):
                for i, x in enumerate(data):
                    async with s.post(f"{server.base}/v2/models/{model}/infer", **_binary(x)) as r:
                        assert r.status == 200
                        expected[model, i] = _tensor_bytes(r, await r.read())
            shm_body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(shape),
                                                 "parameters": {"shared_memory_region": "n",
                                                                "shared_memory_byte_size": data[0].nbytes}}],
                                     "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]})
            for _ in range(20):
                async def register(conn: Connection, seg: SharedMemory) -> int:
                    reg = orjson.dumps({"key": "/" + seg.name, "offset": 0, "byte_size": data[0].nbytes})
                    async with conn.session.post(f"{server.base}/v2/systemsharedmemory/region/n/register",
                                                 data=reg) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(register(a, segs[0]), register(b, segs[1]))
                assert sorted(statuses) == [200, 400], statuses
                winner = statuses.index(200)
                for model in ("tiny_cnn", "mid_cnn"):
                    async with s.post(f"{server.base}/v2/models/{model}/infer", data=shm_body) as r:
                        assert r.status == 200
                        assert _tensor_bytes(r, await r.read()) == expected[model, winner], (model, winner)
                async with s.post(f"{server.base}/v2/systemsharedmemory/region/n/unregister") as r:
                    assert r.status == 200
    finally:
        for conn in conns:
            await conn.session.close()
        for seg in segs:
            seg.close()
            seg.unlink()
    assert server.stop() == 0
    assert "Traceback" not in server.log() and " ERROR " not in server.log()
