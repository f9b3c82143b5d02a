"""The built-in model zoo: ``zoo:<name>`` model paths.

A model path in a config may be an ordinary file path or ``zoo:<name>``, where
``<name>`` is one of :data:`ZOO_NAMES`:

``ppocr_det``, ``ppocr_cls``, ``ppocr_rec``
    Real pretrained PP-OCR models (text detection, text-direction
    classification, text recognition) shipped as ONNX files inside the PyPI
    package ``rapidocr-onnxruntime==1.4.4``. They are located on disk with
    :func:`importlib.util.find_spec`, without importing that package (which
    would pull in OpenCV).

``tiny_cnn``, ``mid_cnn``, ``resnet18``
    Synthetic "seed" image classifiers generated on first use with
    :mod:`onnx.helper` and numpy only (no torch), with fixed random seeds so
    that every build produces the same bytes. All three take ``input``
    (float32, ``[batch, 3, 224, 224]``, ``batch`` symbolic) and return
    ``logits`` (float32, ``[batch, 1000]``), opset 17. Their parameter counts
    match the seed article's three model sizes (0.09 M, 4.57 M, 11.69 M).
    Weights are He-normal, so that a N(0, 1) input gives logits of order 1-10
    and batched vs. single-row runs agree to well within 1e-4.

Generated models are cached in :func:`cache_dir` as
``<name>-v<GENERATOR_VERSION>.onnx``; files are written to a temporary file in
the same directory and moved into place with :func:`os.replace`, so concurrent
processes resolving the same name are safe (each build is byte-identical, the
last rename wins, and no reader ever sees a partial file).

Only :mod:`onnx` and :mod:`numpy` are needed, and only when a seed model is
actually generated; :func:`resolve` of a cached file or a plain path imports
neither.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
from typing import TYPE_CHECKING, Callable

from .files import atomic_write

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np
    import onnx

__all__ = [
    "ZOO_NAMES",
    "SEED_NAMES",
    "PPOCR_FILES",
    "GENERATOR_VERSION",
    "ZOO_PREFIX",
    "ZooError",
    "is_zoo_path",
    "resolve",
    "cache_dir",
    "build_seed_model",
    "count_parameters",
]

ZOO_PREFIX = "zoo:"

ZOO_NAMES: tuple[str, ...] = ("ppocr_det", "ppocr_cls", "ppocr_rec", "tiny_cnn", "mid_cnn", "resnet18")
"""Every name accepted after ``zoo:``."""

SEED_NAMES: tuple[str, ...] = ("tiny_cnn", "mid_cnn", "resnet18")
"""The generated (synthetic-weight) models; :func:`build_seed_model` accepts these."""

PPOCR_PACKAGE = "rapidocr_onnxruntime"
PPOCR_PIP_SPEC = "rapidocr-onnxruntime==1.4.4"

PPOCR_FILES: dict[str, str] = {
    "ppocr_det": "models/ch_PP-OCRv4_det_infer.onnx",
    "ppocr_cls": "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "ppocr_rec": "models/ch_PP-OCRv4_rec_infer.onnx",
}
"""Zoo name -> path of the ONNX file relative to the ``rapidocr_onnxruntime`` package directory."""

GENERATOR_VERSION = 1
"""Bumped whenever a seed model's bytes change; part of the cache file name."""

OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17; loadable by any onnxruntime >= 1.14
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
NUM_CLASSES = 1000
IMAGE_SIZE = 224


class ZooError(ValueError):
    """A ``zoo:`` path cannot be resolved: unknown name, or the package shipping it is missing."""


def _unknown(name: str) -> ZooError:
    return ZooError(f"unknown zoo model {name!r}; known names: {', '.join(ZOO_NAMES)}")


def is_zoo_path(path: str) -> bool:
    """True if ``path`` is a zoo reference, i.e. a string starting with ``"zoo:"``."""
    return isinstance(path, str) and path.startswith(ZOO_PREFIX)


def cache_dir() -> pathlib.Path:
    """Directory holding generated seed models.

    ``$BATCHER_CACHE_DIR`` if set and non-empty (``~`` expanded), else
    ``~/.cache/trt-batcher/zoo``. The directory is not created here;
    :func:`resolve` creates it when it writes a model.
    """
    env = os.environ.get("BATCHER_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "trt-batcher" / "zoo"


def resolve(path: str | os.PathLike[str]) -> pathlib.Path:
    """Turn a model path into a filesystem path.

    ``"zoo:<name>"`` returns the path of an existing ``.onnx`` file: the file
    inside the ``rapidocr_onnxruntime`` package for the PP-OCR models, or the
    cached generated file for the seed models (generated and written
    atomically on first use). Any other value is returned as
    ``pathlib.Path(path)``, unchanged and unchecked.

    Raises:
        ZooError: unknown zoo name (the message lists the known names), or
            ``rapidocr_onnxruntime`` is not installed / lacks the model file.
        OSError: the cache directory cannot be created or written.
    """
    if not is_zoo_path(path):  # type: ignore[arg-type]
        return pathlib.Path(path)
    name = str(path)[len(ZOO_PREFIX):]
    if name in PPOCR_FILES:
        return _ppocr_path(name)
    if name in SEED_NAMES:
        return _cached_seed_path(name)
    raise _unknown(name)


# --------------------------------------------------------------------------- PP-OCR


def _ppocr_path(name: str) -> pathlib.Path:
    try:
        spec = importlib.util.find_spec(PPOCR_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ZooError(
            f"zoo model {name!r} is shipped by the {PPOCR_PACKAGE!r} package, which is not installed; "
            f"run: pip install {PPOCR_PIP_SPEC}"
        )
    for loc in locations:
        candidate = pathlib.Path(loc) / PPOCR_FILES[name]
        if candidate.is_file():
            return candidate
    raise ZooError(
        f"zoo model {name!r}: {PPOCR_FILES[name]} not found under {locations}; "
        f"reinstall the expected version: pip install {PPOCR_PIP_SPEC}"
    )


# --------------------------------------------------------------------------- cache


def _cached_seed_path(name: str) -> pathlib.Path:
    directory = cache_dir()
    target = directory / f"{name}-v{GENERATOR_VERSION}.onnx"
    if target.is_file():
        return target
    atomic_write(target, build_seed_model(name).SerializeToString())
    return target


# --------------------------------------------------------------------------- parameter count


def count_parameters(model: "onnx.ModelProto") -> int:
    """Number of trainable parameters of ``model``.

    Sums the element counts of the floating-point graph initializers, except
    BatchNormalization running statistics (inputs 3 and 4, mean and var),
    which are buffers, not parameters. BatchNormalization scale and bias are
    counted, as in torch. Integer initializers (shapes, axes) are skipped.
    Float tensors held by Constant nodes (where exporters such as paddle2onnx
    put the weights) count too; subgraphs are not inspected.
    """
    import onnx

    buffers: set[str] = set()
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            buffers.update(n for n in node.input[3:5] if n)
    float_types = {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
    tensors = [(init.name, init) for init in model.graph.initializer]
    # Exporters such as paddle2onnx store weights as Constant nodes instead of initializers.
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    tensors.append((node.output[0], attr.t))
    total = 0
    for name, tensor in tensors:
        if name in buffers or tensor.data_type not in float_types:
            continue
        n = 1
        for d in tensor.dims:
            n *= int(d)
        if n > 1 or tensor.dims:  # skip float scalars (epsilons, scales), count weight tensors
            total += n
    return total


# --------------------------------------------------------------------------- seed-model builder


class _Builder:
    """Accumulates nodes and initializers for one seed graph.

    Every tensor is float32. Weights are He-normal (std ``sqrt(2 / fan_in)``)
    from a fixed-seed ``numpy.random.default_rng``; biases are zero.
    """

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self._count: dict[str, int] = {}

    def _name(self, kind: str) -> str:
        i = self._count.get(kind, 0)
        self._count[kind] = i + 1
        return f"{kind}{i}"

    def _init(self, name: str, array: "np.ndarray") -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(self.np.ascontiguousarray(array, dtype=self.np.float32), name))
        return name

    def _he(self, shape: tuple[int, ...], fan_in: int, gain: float = 1.0) -> "np.ndarray":
        std = gain * (2.0 / fan_in) ** 0.5
        return (self.rng.standard_normal(shape, dtype=self.np.float32) * self.np.float32(std)).astype(self.np.float32)

    def node(self, op: str, inputs: list[str], prefix: str | None = None, **attrs) -> str:
        from onnx import helper

        name = self._name(prefix or op.lower())
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, bias: bool = True, gain: float = 1.0) -> str:
        name = self._name("conv")
        w = self._init(f"{name}.weight", self._he((cout, cin, k, k), cin * k * k, gain))
        inputs = [x, w]
        if bias:
            inputs.append(self._init(f"{name}.bias", self.np.zeros(cout, self.np.float32)))
        from onnx import helper

        out = f"{name}_out"
        p = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv", inputs, [out], name=name, kernel_shape=[k, k], strides=[stride, stride], pads=[p, p, p, p]
            )
        )
        return out

    def bn(self, x: str, c: int, gamma: float = 1.0) -> str:
        """Inference BatchNormalization with scale=gamma, bias=0, mean=0, var=1 (an exact per-channel scale)."""
        np = self.np
        name = self._name("bn")
        ins = [
            x,
            self._init(f"{name}.weight", np.full(c, gamma, np.float32)),
            self._init(f"{name}.bias", np.zeros(c, np.float32)),
            self._init(f"{name}.running_mean", np.zeros(c, np.float32)),
            self._init(f"{name}.running_var", np.ones(c, np.float32)),
        ]
        from onnx import helper

        out = f"{name}_out"
        self.nodes.append(helper.make_node("BatchNormalization", ins, [out], name=name, epsilon=1e-5, momentum=0.9))
        return out

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def head(self, x: str, c: int) -> str:
        """GlobalAveragePool -> Flatten -> Gemm(c -> 1000) named ``logits``."""
        from onnx import helper

        x = self.node("GlobalAveragePool", [x], prefix="gap")
        x = self.node("Flatten", [x], axis=1)
        w = self._init("fc.weight", self._he((NUM_CLASSES, c), c))
        b = self._init("fc.bias", self.np.zeros(NUM_CLASSES, self.np.float32))
        self.nodes.append(helper.make_node("Gemm", [x, w, b], [OUTPUT_NAME], name="fc", transB=1))
        return OUTPUT_NAME

    def model(self, graph_name: str, doc: str) -> "onnx.ModelProto":
        import onnx
        from onnx import helper

        inp = helper.make_tensor_value_info(INPUT_NAME, onnx.TensorProto.FLOAT, ["batch", 3, IMAGE_SIZE, IMAGE_SIZE])
        out = helper.make_tensor_value_info(OUTPUT_NAME, onnx.TensorProto.FLOAT, ["batch", NUM_CLASSES])
        graph = helper.make_graph(self.nodes, graph_name, [inp], [out], initializer=self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="trt-batcher.zoo",
            producer_version=str(GENERATOR_VERSION),
            ir_version=IR_VERSION,
            doc_string=doc,
        )
        return model


def _tiny_cnn() -> "onnx.ModelProto":
    """tiny_cnn: 91,368 parameters (target 0.09 M, +1.5 %).

    Stands in for the seed article's 0.09 M-parameter "tiny CNN": almost no
    weights, but a large first activation (128 x 112 x 112 float32 = 6.4 MB
    per image), so it is bound by memory traffic, not arithmetic.

    Layers (input float32 [batch, 3, 224, 224]; biases on every conv):

    ====  ==========================================  ================  ======
    #     layer                                       output            params
    ====  ==========================================  ================  ======
    1     Conv 3x3/2 pad 1, 3 -> 128, ReLU            128 x 112 x 112    3,584
    2     Conv 1x1/1, 128 -> 32, ReLU                  32 x 112 x 112    4,128
    3     Conv 3x3/2 pad 1, 32 -> 48, ReLU             48 x 56 x 56     13,872
    4     Conv 3x3/2 pad 1, 48 -> 48, ReLU             48 x 28 x 28     20,784
    5     GlobalAveragePool, Flatten                   48                    0
    6     Gemm (FC) 48 -> 1000                         1000             49,000
    ====  ==========================================  ================  ======

    Output ``logits`` float32 [batch, 1000]. Total 91,368.
    """
    b = _Builder(seed=1001)
    x = b.relu(b.conv(INPUT_NAME, 3, 128, 3, stride=2))
    x = b.relu(b.conv(x, 128, 32, 1))
    x = b.relu(b.conv(x, 32, 48, 3, stride=2))
    x = b.relu(b.conv(x, 48, 48, 3, stride=2))
    b.head(x, 48)
    return b.model("tiny_cnn", inspect.cleandoc(_tiny_cnn.__doc__ or ""))


def _mid_cnn() -> "onnx.ModelProto":
    """mid_cnn: 4,565,960 parameters (target 4.57 M, -0.09 %).

    Stands in for the seed article's 4.57 M-parameter "mid-size CNN": the
    same 128 x 112 x 112 first activation as tiny_cnn, followed by strided
    3x3 convs that widen the channels (about 2.4 GMAC per image, so it is
    compute-bound at larger batches).

    Layers (input float32 [batch, 3, 224, 224]; biases on every conv):

    ====  ==========================================  ================  =========
    #     layer                                       output            params
    ====  ==========================================  ================  =========
    1     Conv 3x3/2 pad 1, 3 -> 128, ReLU            128 x 112 x 112       3,584
    2     Conv 3x3/2 pad 1, 128 -> 256, ReLU          256 x 56 x 56       295,168
    3     Conv 3x3/2 pad 1, 256 -> 512, ReLU          512 x 28 x 28     1,180,160
    4     Conv 3x3/2 pad 1, 512 -> 512, ReLU          512 x 14 x 14     2,359,808
    5     Conv 1x1/1, 512 -> 480, ReLU                480 x 14 x 14       246,240
    6     GlobalAveragePool, Flatten                  480                       0
    7     Gemm (FC) 480 -> 1000                       1000                481,000
    ====  ==========================================  ================  =========

    Output ``logits`` float32 [batch, 1000]. Total 4,565,960.
    """
    b = _Builder(seed=1002)
    x = b.relu(b.conv(INPUT_NAME, 3, 128, 3, stride=2))
    x = b.relu(b.conv(x, 128, 256, 3, stride=2))
    x = b.relu(b.conv(x, 256, 512, 3, stride=2))
    x = b.relu(b.conv(x, 512, 512, 3, stride=2))
    x = b.relu(b.conv(x, 512, 480, 1))
    b.head(x, 480)
    return b.model("mid_cnn", inspect.cleandoc(_mid_cnn.__doc__ or ""))


def _resnet18() -> "onnx.ModelProto":
    """resnet18: 11,689,512 parameters, exactly torchvision's ``resnet18()``.

    Stands in for the seed article's ResNet-18 (11.69 M parameters, about
    1.8 GMAC per image), with random weights instead of ImageNet ones.
    Convs have no bias; every conv is followed by an inference-mode
    BatchNormalization (scale and bias counted as parameters, running mean
    and var not). BN statistics are mean 0 / var 1; the last BN of each
    residual branch has scale 0.5 (the rest 1) so activations do not grow
    through the eight residual additions.

    Layers (input float32 [batch, 3, 224, 224]):

    - stem: Conv 7x7/2 pad 3, 3 -> 64, BN, ReLU (64 x 112 x 112);
      MaxPool 3x3/2 pad 1 (64 x 56 x 56)                              9,536
    - layer1: 2 x BasicBlock(64 -> 64)       64 x 56 x 56            147,968
    - layer2: BasicBlock(64 -> 128, stride 2, 1x1/2 conv+BN downsample),
      BasicBlock(128 -> 128)                 128 x 28 x 28           525,568
    - layer3: same pattern, 128 -> 256       256 x 14 x 14         2,099,712
    - layer4: same pattern, 256 -> 512       512 x 7 x 7           8,393,728
    - GlobalAveragePool, Flatten, Gemm (FC) 512 -> 1000                513,000

    BasicBlock(x) = ReLU(BN(Conv3x3(ReLU(BN(Conv3x3/s(x))))) + shortcut(x)).
    Output ``logits`` float32 [batch, 1000]. Total 11,689,512.
    """
    b = _Builder(seed=1018)
    x = b.relu(b.bn(b.conv(INPUT_NAME, 3, 64, 7, stride=2, bias=False), 64))
    x = b.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if (stage > 0 and block == 0) else 1
            y = b.relu(b.bn(b.conv(x, cin, cout, 3, stride=stride, bias=False), cout))
            y = b.bn(b.conv(y, cout, cout, 3, bias=False), cout, gamma=0.5)
            if stride != 1 or cin != cout:
                shortcut = b.bn(b.conv(x, cin, cout, 1, stride=stride, bias=False), cout)
            else:
                shortcut = x
            x = b.relu(b.node("Add", [y, shortcut]))
            cin = cout
    b.head(x, 512)
    return b.model("resnet18", inspect.cleandoc(_resnet18.__doc__ or ""))


_SEED_BUILDERS: dict[str, Callable[[], "onnx.ModelProto"]] = {
    "tiny_cnn": _tiny_cnn,
    "mid_cnn": _mid_cnn,
    "resnet18": _resnet18,
}


def build_seed_model(name: str) -> "onnx.ModelProto":
    """Build one of the synthetic seed models in memory (no caching, no disk I/O).

    ``name`` is ``"tiny_cnn"``, ``"mid_cnn"`` or ``"resnet18"`` (without the
    ``zoo:`` prefix). The result has input ``input`` float32
    ``["batch", 3, 224, 224]`` and output ``logits`` float32
    ``["batch", 1000]``, opset 17, and is deterministic: the same
    ``SerializeToString()`` bytes on every call. See the private builders'
    docstrings (also stored as the model's ``doc_string``) for the layers.

    Raises:
        ZooError: ``name`` is not a seed model (the PP-OCR names are
            pretrained files, not generated; use :func:`resolve`).
    """
    try:
        builder = _SEED_BUILDERS[name]
    except KeyError:
        if name in PPOCR_FILES:
            raise ZooError(
                f"{name!r} is a pretrained model file, not a generated one; use resolve('zoo:{name}'); "
                f"seed models: {', '.join(SEED_NAMES)}"
            ) from None
        raise _unknown(name) from None
    return builder()
