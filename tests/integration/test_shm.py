"""Triton's shared-memory extensions on a real server, through tritonclient's own shared-memory utilities,
unmodified: round trips on zoo models equal to the binary-tensor answers, bad offsets and sizes get 400, status
listing, unregistering a region a request still uses, the server's mappings (/proc/<pid>/maps) gone after
unregistering, nothing left in /dev/shm, and the extensions off by default."""

from __future__ import annotations

import base64
import itertools
import os
import time
import urllib.error
import urllib.request

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from helpers import reference
from tritonclient.utils import InferenceServerException

from bench.peers import descendants
from bench.server import ServerProcess

PREFIX = f"trtb-it-{os.getpid()}-"
_keys = itertools.count()
#: model: (input, output, one request's input shape)
MODELS = {"tiny_cnn": ("input", "logits", (2, 3, 224, 224)), "ppocr_cls": ("x", "save_infer_model/scale_0.tmp_1", (3, 3, 48, 192))}


@pytest.fixture(scope="module", params=[0, 2], ids=["single", "multi"])
def server(request, tmp_path_factory, cache_dir):
    """Single-process mode, and multi-process mode (two front ends: registrations reach the engine process, which
    maps the regions)."""
    config = {
        "server": {"shared_memory": {"system": True, "cuda": True}, "frontends": request.param},
        "models": [
            {"name": "tiny_cnn", "path": "zoo:tiny_cnn", "max_batch_size": 8},
            {"name": "ppocr_cls", "path": "zoo:ppocr_cls", "max_batch_size": 8, "inputs": [{"name": "x", "dims": [3, 48, 192]}]},
            # a lone request waits up to 10 s for a second row: it stays in flight until another request comes
            {"name": "held", "path": "zoo:tiny_cnn", "max_batch_size": 2,
             "dynamic_batching": {"max_queue_delay_microseconds": 10_000_000,
                                  "default_queue_policy": {"default_timeout_microseconds": 120_000_000}}},
        ],
    }
    with ServerProcess(config, tmp_path_factory.mktemp("shm")) as s:
        yield s
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]  # the tests destroyed theirs


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url, network_timeout=120)
    yield c
    c.close()


@pytest.fixture
def regions(client):
    """Factory: a system shared-memory segment made with tritonclient's utility; unregistered (all regions) and
    destroyed at the end."""
    made = []

    def make(byte_size: int):
        key = f"{PREFIX}{next(_keys)}"
        handle = shm.create_shared_memory_region(key, "/" + key, byte_size)
        made.append(handle)
        return handle, "/" + key

    yield make
    client.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def server_mappings(server, key: str) -> int:
    """How many mappings of /dev/shm/<key> the server's processes have."""
    count = 0
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                count += sum(1 for line in f if line.rstrip().endswith("/dev/shm" + key))
        except OSError:
            pass
    return count


def unmapped(server, *keys: str) -> bool:
    """Whether the server maps none of ``keys``, waiting up to 10 s: the answer can reach the client a moment before
    the executor thread drops its last reference to a batch (the mapping goes with the last view of it)."""
    end = time.monotonic() + 10
    while any(server_mappings(server, k) for k in keys):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def binary_answer(client, model: str, x: np.ndarray) -> np.ndarray:
    name, out, _ = MODELS.get(model, MODELS["tiny_cnn"])
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput(out)]).as_numpy(out)


def shm_request(model: str, x: np.ndarray, in_region: str, out_region: str, out_bytes: int, in_offset: int = 0):
    name, out, _ = MODELS.get(model, MODELS["tiny_cnn"])
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_shared_memory(in_region, x.nbytes, offset=in_offset)
    req_out = httpclient.InferRequestedOutput(out, binary_data=True)
    req_out.set_shared_memory(out_region, out_bytes)
    return {"inputs": [inp], "outputs": [req_out]}


def raw(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(server.base + path, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read())


@pytest.mark.parametrize("model", list(MODELS))
def test_round_trip_through_tritonclient_shm_utilities_equals_binary_tensors(server, client, regions, model):
    name, out, shape = MODELS[model]
    x = np.random.default_rng(3).random(shape, dtype=np.float32)
    want = binary_answer(client, model, x)
    out_bytes = want.nbytes
    # one segment: a header, the input at an unaligned offset, then the output; two regions registered over it
    handle, key = regions(100 + x.nbytes + out_bytes)
    shm.set_shared_memory_region(handle, [x], offset=100)
    client.register_system_shared_memory("in", key, x.nbytes + 100)
    client.register_system_shared_memory("out", key, out_bytes, offset=100 + x.nbytes)
    result = client.infer(model, **shm_request(model, x, "in", "out", out_bytes, in_offset=100))
    entry = result.get_output(out)
    assert entry == {"name": out, "datatype": "FP32", "shape": list(want.shape),
                     "parameters": {"shared_memory_region": "out", "shared_memory_offset": 0,
                                    "shared_memory_byte_size": out_bytes}}
    got = shm.get_contents_as_numpy(handle, np.float32, entry["shape"], offset=100 + x.nbytes)
    assert np.array_equal(got, want)  # bit-exact: the same model on the same rows
    assert np.max(np.abs(got - reference(model, x))) <= 1e-4
    assert server_mappings(server, key) == 2
    client.unregister_system_shared_memory("in")
    client.unregister_system_shared_memory("out")
    assert unmapped(server, key)


def test_status_lists_regions_as_triton_does(server, client, regions):
    assert client.get_server_metadata()["extensions"][-2:] == ["system_shared_memory", "cuda_shared_memory"]
    _, key_a = regions(4096)
    _, key_b = regions(8192)
    client.register_system_shared_memory("a", key_a, 4096)
    client.register_system_shared_memory("b", key_b, 1000, offset=5000)
    assert client.get_system_shared_memory_status() == [
        {"name": "a", "key": key_a, "offset": 0, "byte_size": 4096},
        {"name": "b", "key": key_b, "offset": 5000, "byte_size": 1000}]
    assert client.get_system_shared_memory_status("b") == [{"name": "b", "key": key_b, "offset": 5000, "byte_size": 1000}]
    status, body = raw(server, "GET", "/v2/systemsharedmemory/region/zz/status")
    assert status == 404 and body == {"error": "unable to find system shared memory region 'zz'"}
    assert client.get_cuda_shared_memory_status() == []  # CUDA on, nothing registered
    status, body = raw(server, "GET", "/v2/cudasharedmemory/region/a/status")
    assert status == 404 and "registered as system shared memory, not cuda" in body["error"]
    client.unregister_system_shared_memory()  # all of them
    assert client.get_system_shared_memory_status() == []
    assert server_mappings(server, key_a) == server_mappings(server, key_b) == 0  # no request ever held them


def test_bad_registrations_and_offsets_and_sizes_get_400(server, client, regions):
    x = np.ones((1, 3, 224, 224), np.float32)
    handle, key = regions(x.nbytes + 4000)
    shm.set_shared_memory_region(handle, [x])
    client.register_system_shared_memory("r", key, x.nbytes + 4000)

    def refused(call, message: str) -> None:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == "400" and message in err.value.message(), err.value.message()

    refused(lambda: client.register_system_shared_memory("r", key, 16), "region 'r' is already registered")
    refused(lambda: client.register_system_shared_memory("n", f"/{PREFIX}missing", 16),
            f"no shared memory segment has the key '/{PREFIX}missing'")
    refused(lambda: client.register_system_shared_memory("n", key, 4096, offset=x.nbytes + 1),
            f"offset {x.nbytes + 1} + byte_size 4096 runs past the end of segment '{key}' ({x.nbytes + 4000} bytes)")
    invalid0 = server.metric("batcher_request_failure_total", model="tiny_cnn", version="1", reason="invalid")
    region_bytes = x.nbytes + 4000
    refused(lambda: client.infer("tiny_cnn", **shm_request("tiny_cnn", x, "r", "r", 4000, in_offset=4001)),
            f"input 'input': shared_memory_offset 4001 + shared_memory_byte_size {x.nbytes} runs past the end of "
            f"shared memory region 'r' ({region_bytes} bytes)")
    wrong_size = shm_request("tiny_cnn", x, "r", "r", 4000)
    wrong_size["inputs"][0].set_shared_memory("r", x.nbytes - 4)
    refused(lambda: client.infer("tiny_cnn", **wrong_size),
            f"shared_memory_byte_size: shape [1, 3, 224, 224] of FP32 needs {x.nbytes} bytes, got {x.nbytes - 4}")
    refused(lambda: client.infer("tiny_cnn", **shm_request("tiny_cnn", x, "r", "r", 3999)),
            "output 'logits' needs 4000 bytes, shared_memory_byte_size of region 'r' is 3999")
    refused(lambda: client.infer("tiny_cnn", **shm_request("tiny_cnn", x, "r", "nope", 4000)),
            "output 'logits': shared memory region 'nope' is not registered")
    assert server.metric("batcher_request_failure_total", model="tiny_cnn", version="1",
                         reason="invalid") == invalid0 + 4
    status, body = raw(server, "POST", "/v2/systemsharedmemory/region/q/register", b'{"key": "/k"}')
    assert status == 400 and body == {"error": "system shared memory register request: byte_size is required"}


def test_cuda_registration_that_cuda_refuses_is_a_clear_400(server):
    handle = base64.b64encode(bytes(64)).decode()
    body = orjson.dumps({"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 64})
    status, answer = raw(server, "POST", "/v2/cudasharedmemory/region/g/register", body)
    # without a GPU: no usable driver; with one: the all-zero handle is refused
    assert status == 400 and answer["error"].startswith("CUDA shared memory region 'g' cannot be registered: cuda")
    assert raw(server, "GET", "/v2/cudasharedmemory/status") == (200, [])
    assert raw(server, "POST", "/v2/cudasharedmemory/unregister") == (200, {})


def test_unregister_while_a_request_uses_the_region_unmaps_it_when_the_request_is_done(server, client, regions):
    x = np.random.default_rng(5).random((1, 3, 224, 224), dtype=np.float32)
    want = binary_answer(client, "tiny_cnn", x)
    in_handle, in_key = regions(x.nbytes)
    out_handle, out_key = regions(want.nbytes)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory("held-in", in_key, x.nbytes)
    client.register_system_shared_memory("held-out", out_key, want.nbytes)
    other = httpclient.InferenceServerClient(server.url, network_timeout=120)  # its one connection stays busy
    pending = other.async_infer("held", **shm_request("held", x, "held-in", "held-out", want.nbytes))
    deadline = time.monotonic() + 60
    while server.metric("batcher_queue_depth", model="held", version="1") != 1:  # in flight: queued for company
        assert time.monotonic() < deadline, "the request never reached the queue"
        time.sleep(0.02)
    client.unregister_system_shared_memory("held-in")
    client.unregister_system_shared_memory("held-out")
    assert client.get_system_shared_memory_status() == []  # answered at once; gone from the namespace
    assert server_mappings(server, in_key) == server_mappings(server, out_key) == 1  # still mapped for the request
    with pytest.raises(InferenceServerException, match="shared memory region 'held-in' is not registered"):
        client.infer("held", **shm_request("held", x, "held-in", "held-out", want.nbytes))
    np.testing.assert_array_equal(binary_answer(client, "held", x), want)  # the second row: the batch goes
    entry = pending.get_result().get_output("logits")
    other.close()
    got = shm.get_contents_as_numpy(out_handle, np.float32, entry["shape"])
    assert np.array_equal(got, want)
    assert unmapped(server, in_key, out_key)


def test_extensions_are_off_by_default(default_server):
    assert raw(default_server, "GET", "/v2")[1]["extensions"] == ["binary_tensor_data", "model_configuration",
                                                                   "statistics"]
    for method, path in [("GET", "/v2/systemsharedmemory/status"), ("POST", "/v2/systemsharedmemory/unregister"),
                         ("POST", "/v2/systemsharedmemory/region/r/register"),
                         ("GET", "/v2/cudasharedmemory/region/r/status")]:
        status, body = raw(default_server, method, path, b"{}" if method == "POST" else None)
        kind = "cuda" if "cuda" in path else "system"
        assert (status, body) == (404, {"error": f"{kind} shared memory is disabled "
                                                 f"(server.shared_memory.{kind}: false)"})
    request = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 224, 224],
                           "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 602112}}]}
    status, body = raw(default_server, "POST", "/v2/models/tiny_cnn/infer", orjson.dumps(request))
    assert status == 400 and body["error"] == ("input 'input': shared memory region 'r' is not registered "
                                               "(shared memory is disabled: server.shared_memory)")
