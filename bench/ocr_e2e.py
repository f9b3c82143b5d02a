"""End-to-end OCR check: RapidOCR's own pipeline with its model calls served remotely.

What it measures
----------------
RapidOCR (``rapidocr_onnxruntime`` 1.4.4) is run twice on the same deterministic,
PIL-rendered text images:

* **in-process** -- plain ``RapidOCR()``, the three ONNX models run by onnxruntime
  inside this process;
* **remote** -- the very same RapidOCR pre- and post-processing (resizing,
  normalisation, DB box post-processing, crop/rotate, angle classification, CTC
  decoding with the character list from the rec model's ONNX metadata), but every
  det/cls/rec model call is sent to a KServe v2 / Triton HTTP server under the model
  names ``ppocr_det``, ``ppocr_cls`` and ``ppocr_rec`` (input ``x``, output name taken
  from the model metadata).

Only the *call path* of RapidOCR's three ``OrtInferSession`` objects is replaced
(:class:`RemoteSession`); everything else, notably the metadata the recogniser reads
through ``have_key()`` / ``get_character_list()``, is delegated to the original
session.  Any difference between the two columns is therefore caused by the server
(wrong tensors, batching/padding bugs, numeric drift of the backend), not by OCR
logic.

Acceptance: the remote text equals the in-process text for every image, and, with
surrounding whitespace stripped, equals the rendered phrase for at least 80 % of the
images (8 of 10).

How to run
----------
Start the server so that it serves the three PP-OCR models shipped in
``rapidocr_onnxruntime`` as ``ppocr_det`` / ``ppocr_cls`` / ``ppocr_rec``, e.g.
``batcher serve --port 8000`` (``python -m batcher serve --port 8000 [--config FILE]``),
then::

    python -m bench.ocr_e2e --url 127.0.0.1:8000          # binary tensor extension
    python -m bench.ocr_e2e --url 127.0.0.1:8000 --json   # plain JSON tensors
    python -m bench.ocr_e2e --local                       # no server: plumbing check

It prints a table (rendered | in-process | remote | equal?) and the summary line
``remote==in-process: X/N, remote==rendered (stripped): Y/N``; the exit status is 1
when X < N or Y < ceil(0.8 * N), 0 otherwise (2 if the server cannot be used).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from rapidocr_onnxruntime import RapidOCR

Transport = Callable[[str, np.ndarray], np.ndarray]
"""(model_name, float32 input batch) -> first output of the model."""

DET_MODEL = "ppocr_det"
CLS_MODEL = "ppocr_cls"
REC_MODEL = "ppocr_rec"
INPUT_NAME = "x"

# model name -> section of rapidocr_onnxruntime/config.yaml that holds its model_path
_CONFIG_SECTIONS = {DET_MODEL: "Det", CLS_MODEL: "Cls", REC_MODEL: "Rec"}

# Short ASCII phrases that RapidOCR 1.4.4 reads back exactly when rendered by
# render_text() (PIL default font, size 32, margins below); checked in-process.
PHRASES: Tuple[str, ...] = (
    "Hello World 2024",
    "dynamic batching",
    "Triton HTTP v2",
    "inference server",
    "batch size 32",
    "OCR pipeline test",
    "throughput 1200",
    "latency p99 42",
    "quick brown fox",
    "request 12345",
    "max batch 64",
    "jumps over 7 dogs",
)

FONT_SIZE = 32
# White border around the text. Too little and the detector splits a line into
# words (spurious boxes); too much and the recogniser drops the spaces.
MARGIN_X = 32
MARGIN_Y = 40


# --------------------------------------------------------------------------- wrapping


class RemoteSession:
    """Stand-in for a RapidOCR ``OrtInferSession`` whose model call goes to a transport.

    ``session(x)`` returns ``[transport(model_name, x)]`` -- a one-element list, like
    ``OrtInferSession.__call__`` (callers take ``[0]``).  Every other attribute
    (``have_key``, ``get_character_list``, ``get_input_names``, ``session``, ...) is
    looked up on the original session.
    """

    def __init__(self, model_name: str, transport: Transport, original: Any) -> None:
        self.model_name = model_name
        self.transport = transport
        self.original = original

    def __call__(self, input_content: np.ndarray) -> List[np.ndarray]:
        x = np.ascontiguousarray(input_content, dtype=np.float32)
        return [np.asarray(self.transport(self.model_name, x))]

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set in __init__. Guard our own names so that
        # copy/pickle of a half-built instance does not recurse.
        if name in ("model_name", "transport", "original"):
            raise AttributeError(name)
        return getattr(self.original, name)

    def __repr__(self) -> str:
        return f"RemoteSession({self.model_name!r}, transport={self.transport!r})"


def wrap_sessions(ocr: Any, transport: Transport) -> Any:
    """Route the det/cls/rec model calls of a RapidOCR engine to ``transport`` (in place)."""
    stages = (
        (ocr.text_det, "infer", DET_MODEL),
        (ocr.text_cls, "infer", CLS_MODEL),
        (ocr.text_rec, "session", REC_MODEL),
    )
    for stage, attr, model in stages:
        original = getattr(stage, attr, None)
        if original is None:
            raise TypeError(
                f"{type(stage).__name__} has no {attr!r} session; "
                "unsupported rapidocr_onnxruntime version (expected 1.4.x)"
            )
        if isinstance(original, RemoteSession):
            original = original.original
        setattr(stage, attr, RemoteSession(model, transport, original))
    return ocr


class RemoteRapidOCR(RapidOCR):
    """``RapidOCR`` whose det/cls/rec model calls go to ``transport``.

    Pre- and post-processing are RapidOCR's own; the original ONNX sessions are still
    loaded (RapidOCR's constructor builds them) and serve metadata only.
    """

    def __init__(
        self, transport: Transport, config_path: Optional[str] = None, **rapidocr_kwargs: Any
    ) -> None:
        super().__init__(config_path, **rapidocr_kwargs)
        self.transport = transport
        wrap_sessions(self, transport)


def make_remote_ocr(transport: Transport, **rapidocr_kwargs: Any) -> RemoteRapidOCR:
    """A RapidOCR engine whose three model sessions call ``transport``."""
    return RemoteRapidOCR(transport, **rapidocr_kwargs)


# --------------------------------------------------------------------------- transports


def _model_paths() -> Dict[str, str]:
    from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
    from rapidocr_onnxruntime.utils import read_yaml, update_model_path

    config = update_model_path(read_yaml(str(DEFAULT_CFG_PATH)))
    return {name: config[sec]["model_path"] for name, sec in _CONFIG_SECTIONS.items()}


class LocalTransport:
    """Runs the ONNX files shipped with rapidocr_onnxruntime in-process (CPU).

    Session options mirror RapidOCR's ``OrtInferSession`` so results are identical to
    plain in-process RapidOCR. Sessions are created lazily, once per model.
    """

    def __init__(self) -> None:
        self._paths = _model_paths()
        self._sessions: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def _session(self, model_name: str) -> Any:
        sess = self._sessions.get(model_name)
        if sess is None:
            with self._lock:
                sess = self._sessions.get(model_name)
                if sess is None:
                    import onnxruntime as ort

                    if model_name not in self._paths:
                        raise KeyError(f"unknown model {model_name!r}")
                    opts = ort.SessionOptions()
                    opts.log_severity_level = 4
                    opts.enable_cpu_mem_arena = False
                    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                    sess = ort.InferenceSession(
                        self._paths[model_name],
                        sess_options=opts,
                        providers=["CPUExecutionProvider"],
                    )
                    self._sessions[model_name] = sess
        return sess

    def __call__(self, model_name: str, x: np.ndarray) -> np.ndarray:
        sess = self._session(model_name)
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]

    def __repr__(self) -> str:
        return "LocalTransport()"


def local_transport() -> Transport:
    """Transport that runs the same ONNX files in-process with onnxruntime."""
    return LocalTransport()


class HttpTransport:
    """KServe v2 / Triton HTTP transport built on ``tritonclient.http``.

    Input ``x`` (FP32); the output name is read once per model from
    ``GET /v2/models/{name}`` and cached. ``binary=True`` uses the binary tensor
    extension for inputs and outputs, ``False`` plain JSON.  Like the underlying
    client, an instance is not meant to be shared between threads.
    """

    def __init__(self, url: str, binary: bool = True) -> None:
        import tritonclient.http as httpclient

        for prefix in ("http://", "https://"):
            if url.startswith(prefix):
                url = url[len(prefix):]
        self.url = url.rstrip("/")
        self.binary = binary
        self._http = httpclient
        self.client = httpclient.InferenceServerClient(self.url)
        self._output_names: Dict[str, str] = {}

    def output_name(self, model_name: str) -> str:
        name = self._output_names.get(model_name)
        if name is None:
            meta = self.client.get_model_metadata(model_name)
            outputs = meta.get("outputs") or []
            if not outputs:
                raise RuntimeError(f"model {model_name!r} metadata lists no outputs: {meta}")
            name = outputs[0]["name"]
            self._output_names[model_name] = name
        return name

    def __call__(self, model_name: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out_name = self.output_name(model_name)
        inp = self._http.InferInput(INPUT_NAME, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=self.binary)
        out = self._http.InferRequestedOutput(out_name, binary_data=self.binary)
        result = self.client.infer(model_name, [inp], outputs=[out])
        arr = result.as_numpy(out_name)
        if arr is None:
            raise RuntimeError(f"{model_name}: response has no output {out_name!r}")
        return arr

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"HttpTransport({self.url!r}, binary={self.binary})"


def http_transport(url: str, binary: bool = True) -> Transport:
    """Transport sending each model call to a KServe v2 HTTP server at ``url`` (host:port)."""
    return HttpTransport(url, binary=binary)


# --------------------------------------------------------------------------- samples


def render_text(
    text: str, font_size: int = FONT_SIZE, margin_x: int = MARGIN_X, margin_y: int = MARGIN_Y
) -> np.ndarray:
    """Black ``text`` on white, PIL default font; returns BGR uint8 HxWx3."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = font.getbbox(text)
    size = (right - left + 2 * margin_x, bottom - top + 2 * margin_y)
    img = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(img).text((margin_x - left, margin_y - top), text, font=font, fill=(0, 0, 0))
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8)[:, :, ::-1])


def render_samples(n: int = 10, seed: int = 0) -> List[Tuple[str, np.ndarray]]:
    """``n`` deterministic (phrase, BGR image) pairs.

    ``seed=0`` takes :data:`PHRASES` in order; another seed shuffles the order
    (deterministically). For ``n > len(PHRASES)`` the phrases repeat.
    """
    order = list(range(len(PHRASES)))
    if seed:
        random.Random(seed).shuffle(order)
    cache: Dict[str, np.ndarray] = {}
    samples = []
    for i in range(n):
        phrase = PHRASES[order[i % len(order)]]
        if phrase not in cache:
            cache[phrase] = render_text(phrase)
        samples.append((phrase, cache[phrase].copy()))
    return samples


def ocr_text(ocr: Any, image: np.ndarray) -> str:
    """Detected lines of one image joined with a single space, in RapidOCR's order."""
    result, _elapse = ocr(image)
    if not result:
        return ""
    return " ".join(str(line[1]) for line in result)


def run(ocr: Any, images: Sequence[np.ndarray]) -> List[str]:
    """The recognized text per image (see :func:`ocr_text`)."""
    return [ocr_text(ocr, img) for img in images]


# --------------------------------------------------------------------------- CLI


def _print_table(rows: List[Tuple[str, ...]], header: Tuple[str, ...]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
        print(line)
        print("-+-".join("-" * w for w in widths))
        for r in rows:
            print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(*header)
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ocr_e2e",
        description="RapidOCR in-process vs. det/cls/rec served by a KServe v2 HTTP server.",
    )
    parser.add_argument("--url", default="127.0.0.1:8000", help="server host:port")
    parser.add_argument(
        "--json", action="store_true", help="send/receive tensors as JSON instead of binary"
    )
    parser.add_argument("-n", type=int, default=10, help="number of rendered images")
    parser.add_argument("--seed", type=int, default=0, help="phrase order (0 = fixed order)")
    parser.add_argument(
        "--local",
        action="store_true",
        help="use the in-process onnxruntime transport instead of a server (plumbing check)",
    )
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("-n must be >= 1")

    samples = render_samples(args.n, args.seed)
    phrases = [p for p, _ in samples]
    images = [img for _, img in samples]

    t0 = time.perf_counter()
    local_texts = run(RapidOCR(), images)
    t_local = time.perf_counter() - t0

    if args.local:
        transport: Transport = local_transport()
        target = "local onnxruntime transport"
    else:
        transport = http_transport(args.url, binary=not args.json)
        target = f"http://{args.url} ({'json' if args.json else 'binary'} tensors)"
    try:
        remote_ocr = make_remote_ocr(transport)
        t0 = time.perf_counter()
        remote_texts = run(remote_ocr, images)
        t_remote = time.perf_counter() - t0
    except Exception as exc:  # connection refused, unknown model, server error ...
        print(f"error: remote OCR via {target} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        close = getattr(transport, "close", None)
        if close is not None:
            close()

    n = len(images)
    same = [r == l for r, l in zip(remote_texts, local_texts)]
    remote_ok = [r.strip() == p for r, p in zip(remote_texts, phrases)]
    local_ok = [l.strip() == p for l, p in zip(local_texts, phrases)]

    rows = [
        (str(i), repr(p), repr(l), repr(r), "yes" if s else "NO")
        for i, (p, l, r, s) in enumerate(zip(phrases, local_texts, remote_texts, same))
    ]
    _print_table(rows, ("#", "rendered text", "in-process", "remote", "equal?"))

    x, y = sum(same), sum(remote_ok)
    need_y = math.ceil(0.8 * n)
    print(f"remote: {target}; in-process {t_local:.2f}s, remote {t_remote:.2f}s")
    print(f"in-process==rendered (stripped): {sum(local_ok)}/{n}")
    print(f"remote==in-process: {x}/{n}, remote==rendered (stripped): {y}/{n}")
    return 1 if x < n or y < need_y else 0


if __name__ == "__main__":
    sys.exit(main())
