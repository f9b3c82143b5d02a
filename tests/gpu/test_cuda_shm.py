"""Triton's CUDA shared-memory extension on a real GPU, through tritonclient's own ``cuda_shared_memory`` utilities,
unmodified (skipped without an NVIDIA GPU; CI covers the logic on the stand-in runtime in tests/unit/test_shm.py).

Run on a GPU machine: ``python -m pytest tests/gpu``. The client process exports device memory with
``cudaIpcGetMemHandle``; the server (another process, as CUDA IPC requires) opens it with ``cudaIpcOpenMemHandle``.
"""

from __future__ import annotations

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _gpus() -> int:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return 0
    err, count = runtime.cudaGetDeviceCount()
    return int(count) if err == runtime.cudaError_t.cudaSuccess else 0


pytestmark = pytest.mark.skipif(_gpus() == 0, reason="needs an NVIDIA GPU and cuda-python")


@pytest.fixture
def server(start_server):
    return start_server({"server": {"shared_memory": {"system": True, "cuda": True}},
                         "models": [{"name": "tiny_cnn", "path": "zoo:tiny_cnn", "max_batch_size": 8}]})


def binary_answer(client, x: np.ndarray) -> np.ndarray:
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return client.infer("tiny_cnn", [inp]).as_numpy("logits")


def test_cuda_shared_memory_round_trip_equals_binary_tensors(server):
    import tritonclient.utils.cuda_shared_memory as cudashm

    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
    x = np.random.default_rng(11).random((2, 3, 224, 224), dtype=np.float32)
    want = binary_answer(client, x)
    in_handle = cudashm.create_shared_memory_region("in", x.nbytes, 0)
    out_handle = cudashm.create_shared_memory_region("out", want.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(in_handle, [x])
        client.register_cuda_shared_memory("in", cudashm.get_raw_handle(in_handle), 0, x.nbytes)
        client.register_cuda_shared_memory("out", cudashm.get_raw_handle(out_handle), 0, want.nbytes)
        assert client.get_cuda_shared_memory_status() == [
            {"name": "in", "device_id": 0, "byte_size": x.nbytes},
            {"name": "out", "device_id": 0, "byte_size": want.nbytes}]
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = httpclient.InferRequestedOutput("logits", binary_data=True)
        out.set_shared_memory("out", want.nbytes)
        entry = client.infer("tiny_cnn", [inp], outputs=[out]).get_output("logits")
        assert entry["shape"] == [2, 1000] and "data" not in entry
        got = cudashm.get_contents_as_numpy(out_handle, np.float32, entry["shape"])
        assert np.array_equal(got, want)

        small = httpclient.InferRequestedOutput("logits", binary_data=True)
        small.set_shared_memory("out", want.nbytes - 4)
        with pytest.raises(InferenceServerException, match="needs 8000 bytes") as err:
            client.infer("tiny_cnn", [inp], outputs=[small])
        assert err.value.status() == "400"
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_cuda_shared_memory("in", cudashm.get_raw_handle(in_handle), 0, x.nbytes)

        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []
    finally:
        cudashm.destroy_shared_memory_region(in_handle)
        cudashm.destroy_shared_memory_region(out_handle)
        client.close()
