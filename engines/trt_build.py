"""ONNX -> TensorRT plan builder, with an on-disk plan cache and a CLI.

Needs the FULL TensorRT package (``import tensorrt``: builder + ONNX parser; ``pip install
"trt-batcher[tensorrt]"``) and a GPU: TensorRT times kernels on the GPU it builds for. The lean and dispatch
runtimes cannot build. Nothing of the build path has run on this project's CI machine (no GPU, no full
TensorRT); the pure helpers (:func:`parse_shape`, :func:`parse_profile_args`, :func:`unsupported_options`,
:func:`cache_key`, ...) are tested directly.

What the installed TensorRT can do is detected from the module itself (:func:`capabilities`), not from its
version number:

* TensorRT 10 has the weak-typing builder flags (``BuilderFlag.FP16``/``BF16``/``INT8``): fp16/bf16 set the flag,
  int8 sets ``INT8`` and feeds an ``IInt8EntropyCalibrator2`` from ``calibration_dir``.
* TensorRT >= 11 removed them (strongly typed networks only; see NVIDIA's "Migrating from TensorRT 10.x to
  11.x"): fp16 is honoured by converting the ONNX model's float tensors to float16 BEFORE parsing
  (``onnxconverter_common.float16.convert_float_to_float16(model, keep_io_types=True)``, so the engine's I/O stay
  FP32); bf16 and int8 cannot be honoured by this builder there - :class:`BuildError` says so (convert/quantize
  the ONNX model yourself, e.g. with NVIDIA ModelOpt, and build it as fp32).

``version_compatible`` sets ``BuilderFlag.VERSION_COMPATIBLE`` and clears ``EXCLUDE_LEAN_RUNTIME`` so the plan
embeds the lean runtime and runs on the lean/dispatch runtimes (and later TensorRT versions of the same major);
loading such a plan needs ``Runtime.engine_host_code_allowed`` (``engines.tensorrt`` sets it).

CLI (also ``batcher build`` once attached through :func:`add_arguments`/:func:`run`)::

    python -m engines.trt_build build MODEL.onnx -o MODEL.plan \\
        --min input:1x3x224x224 --opt input:8x3x224x224 --max input:32x3x224x224 --precision fp16

Exit status: 0 built (or found in the cache), 1 the build failed, 2 bad arguments, 3 TensorRT (full) is not
importable.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .files import atomic_write
from .base import EngineError

__all__ = [
    "BuildError",
    "TensorRTMissing",
    "BuildOptions",
    "PRECISIONS",
    "HARDWARE_COMPATIBILITY",
    "EXIT_NO_TENSORRT",
    "capabilities",
    "unsupported_options",
    "cache_key",
    "calibration_digest",
    "load_calibration_batches",
    "build_plan",
    "cached_build",
    "parse_shape",
    "parse_profile_args",
    "profiles_from_args",
    "add_arguments",
    "run",
    "main",
]

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
#: ``hardware_compatibility`` option -> ``trt.HardwareCompatibilityLevel`` member.
HARDWARE_COMPATIBILITY: dict[str, str] = {
    "none": "NONE",
    "ampere_plus": "AMPERE_PLUS",
    "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
}
#: Exit status of the CLI when the full ``tensorrt`` package cannot be imported.
EXIT_NO_TENSORRT = 3
#: Bumped when the meaning of a cached plan's key changes.
CACHE_FORMAT = 1

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]

#: Injected full TensorRT module (tests); ``None``: ``import tensorrt``.
_trt: ModuleType | None = None


class BuildError(EngineError):
    """A plan cannot be built: bad options, an option the installed TensorRT cannot honour, an ONNX parse error,
    or the TensorRT build itself failed. The message says which."""


class TensorRTMissing(BuildError):
    """The full ``tensorrt`` package (builder + ONNX parser) is not importable."""


# --------------------------------------------------------------------------- options


def _check_profiles(profiles: Sequence[Mapping[str, Sequence[Sequence[int]]]]) -> list[Profile]:
    out: list[Profile] = []
    for i, profile in enumerate(profiles):
        clean: Profile = {}
        for name, triple in profile.items():
            if len(triple) != 3:
                raise BuildError(f"profile {i} input {name!r}: need (min, opt, max) shapes, got {triple!r}")
            mn, op, mx = (tuple(int(d) for d in s) for s in triple)
            if not (len(mn) == len(op) == len(mx)):
                raise BuildError(f"profile {i} input {name!r}: min {mn}, opt {op}, max {mx} differ in rank")
            if any(d < 0 for d in mn):
                raise BuildError(f"profile {i} input {name!r}: min {mn} has a negative dimension")
            if any(not (a <= b <= c) for a, b, c in zip(mn, op, mx)):
                raise BuildError(f"profile {i} input {name!r}: need min <= opt <= max per dim; got {mn}, {op}, {mx}")
            clean[name] = (mn, op, mx)
        out.append(clean)
    return out


@dataclass
class BuildOptions:
    """How to build a plan.

    Attributes:
        profiles: one dict per optimization profile: input name -> ``(min_shape, opt_shape, max_shape)``, batch
            dimension first. Every input with a dynamic dim must appear in every profile. Empty: a fully static
            model (TensorRT then needs no profile). Several profiles let several contexts run side by side
            (``engines.tensorrt`` gives context k profile k % n).
        precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"int8"`` (see the module docstring for how each is
            honoured on TensorRT 10 and >= 11).
        workspace_mb: builder workspace limit in MiB (``set_memory_pool_limit(WORKSPACE, workspace_mb << 20)``);
            ``None``: TensorRT's default (the device's memory).
        timing_cache: file of TensorRT's timing cache: loaded if it exists (a cache from another TensorRT/GPU is
            ignored), written back after the build; speeds up rebuilds. Does not change the plan's cache key.
        version_compatible: build a version-compatible plan with the lean runtime embedded (runs on the
            lean/dispatch runtimes).
        hardware_compatibility: ``"none"``, ``"ampere_plus"`` (runs on any Ampere or later GPU) or
            ``"same_compute_capability"``.
        calibration_dir: folder of ``.npy`` input samples for INT8 entropy calibration (TensorRT 10 only; see
            :func:`load_calibration_batches`).

    Raises:
        BuildError: an unknown precision or hardware level, a non-positive workspace, or inconsistent profile
            shapes (min <= opt <= max per dim, same rank).
    """

    profiles: list[Profile] = field(default_factory=list)
    precision: str = "fp32"
    workspace_mb: int | None = None
    timing_cache: Path | None = None
    version_compatible: bool = False
    hardware_compatibility: str = "none"
    calibration_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise BuildError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise BuildError(
                f"hardware_compatibility must be one of {', '.join(HARDWARE_COMPATIBILITY)}; "
                f"got {self.hardware_compatibility!r}"
            )
        if self.workspace_mb is not None and self.workspace_mb <= 0:
            raise BuildError(f"workspace_mb must be positive; got {self.workspace_mb}")
        self.profiles = _check_profiles(self.profiles)
        if self.timing_cache is not None:
            self.timing_cache = Path(self.timing_cache)
        if self.calibration_dir is not None:
            self.calibration_dir = Path(self.calibration_dir)


# --------------------------------------------------------------------------- capabilities


def capabilities(trt: ModuleType, *, fp16_converter: bool | None = None) -> dict[str, Any]:
    """What the installed TensorRT module can build, read off the module itself.

    Args:
        trt: the imported ``tensorrt`` (or any TensorRT runtime module: lean/dispatch report ``builder: False``).
        fp16_converter: whether ``onnxconverter_common`` is importable; ``None``: look it up.

    Returns:
        ``version`` (str), ``builder`` (has ``Builder`` and ``OnnxParser``), ``fp16_flag``/``bf16_flag``/
        ``int8_flag`` (``BuilderFlag`` members exist), ``int8_calibrator`` (``IInt8EntropyCalibrator2`` exists),
        ``strongly_typed_only`` (``BuilderFlag`` exists but has none of FP16/BF16/INT8: TensorRT >= 11),
        ``version_compatible``, ``exclude_lean_runtime`` (those ``BuilderFlag`` members exist),
        ``hardware_compatibility`` (sorted option names whose ``HardwareCompatibilityLevel`` member exists;
        always includes ``"none"``), ``timing_cache`` (``ITimingCache`` exists), ``fp16_converter``.
    """
    flags = getattr(trt, "BuilderFlag", None)
    levels = getattr(trt, "HardwareCompatibilityLevel", None)

    def has_flag(name: str) -> bool:
        return flags is not None and hasattr(flags, name)

    if fp16_converter is None:
        fp16_converter = importlib.util.find_spec("onnxconverter_common") is not None
    return {
        "version": str(getattr(trt, "__version__", "unknown")),
        "builder": hasattr(trt, "Builder") and hasattr(trt, "OnnxParser"),
        "fp16_flag": has_flag("FP16"),
        "bf16_flag": has_flag("BF16"),
        "int8_flag": has_flag("INT8"),
        "int8_calibrator": hasattr(trt, "IInt8EntropyCalibrator2"),
        "strongly_typed_only": flags is not None and not (has_flag("FP16") or has_flag("BF16") or has_flag("INT8")),
        "version_compatible": has_flag("VERSION_COMPATIBLE"),
        "exclude_lean_runtime": has_flag("EXCLUDE_LEAN_RUNTIME"),
        "hardware_compatibility": sorted(
            opt for opt, member in HARDWARE_COMPATIBILITY.items()
            if opt == "none" or (levels is not None and hasattr(levels, member))
        ),
        "timing_cache": hasattr(trt, "ITimingCache"),
        "fp16_converter": bool(fp16_converter),
    }


def unsupported_options(options: BuildOptions, caps: Mapping[str, Any]) -> list[str]:
    """Why ``options`` cannot be built with a TensorRT of capabilities ``caps`` (see :func:`capabilities`).

    Returns:
        one human-readable reason per problem; empty when the build can proceed.
    """
    v = caps.get("version", "?")
    reasons = []
    if not caps.get("builder"):
        reasons.append(
            f"TensorRT {v} here has no Builder/OnnxParser (a lean or dispatch runtime); building needs the full "
            'package: pip install "trt-batcher[tensorrt]"'
        )
    p = options.precision
    if p == "fp16" and not caps.get("fp16_flag"):
        if not caps.get("strongly_typed_only"):
            reasons.append(f"fp16: TensorRT {v} has no BuilderFlag.FP16")
        elif not caps.get("fp16_converter"):
            reasons.append(
                f"fp16: TensorRT {v} builds only strongly typed networks, so the ONNX model must be converted to "
                "float16 before parsing, and onnxconverter-common is not installed: pip install onnxconverter-common"
            )
    if p == "bf16" and not caps.get("bf16_flag"):
        reasons.append(
            f"bf16: TensorRT {v} has no BuilderFlag.BF16 (strongly typed networks only) and this builder has no "
            "bf16 ONNX converter; convert the model to bf16 yourself (e.g. NVIDIA ModelOpt AutoCast) and build it "
            "with precision fp32"
        )
    if p == "int8":
        if not (caps.get("int8_flag") and caps.get("int8_calibrator")):
            reasons.append(
                f"int8: TensorRT {v} has no implicit INT8 calibration (BuilderFlag.INT8 and "
                "IInt8EntropyCalibrator2 were removed in TensorRT 11); quantize the ONNX model explicitly with Q/DQ "
                "nodes (e.g. NVIDIA ModelOpt) and build it with precision fp32"
            )
        elif options.calibration_dir is None:
            reasons.append("int8 needs calibration_dir (--calibration-dir): a folder of .npy input samples")
    if options.calibration_dir is not None and p != "int8":
        reasons.append(f"calibration_dir applies only to precision int8, not {p}")
    if options.version_compatible and not caps.get("version_compatible"):
        reasons.append(f"version_compatible: TensorRT {v} has no BuilderFlag.VERSION_COMPATIBLE")
    if options.hardware_compatibility not in caps.get("hardware_compatibility", ["none"]):
        reasons.append(
            f"hardware_compatibility {options.hardware_compatibility}: TensorRT {v} has no "
            f"HardwareCompatibilityLevel.{HARDWARE_COMPATIBILITY[options.hardware_compatibility]}"
        )
    if options.timing_cache is not None and not caps.get("timing_cache"):
        reasons.append(f"timing_cache: TensorRT {v} has no ITimingCache")
    return reasons


# --------------------------------------------------------------------------- cache key


def _cc_text(compute_capability: str | Sequence[int]) -> str:
    if isinstance(compute_capability, str):
        return compute_capability
    return ".".join(str(int(x)) for x in compute_capability)


def cache_key(
    onnx_bytes: bytes,
    trt_version: str,
    compute_capability: str | Sequence[int],
    options: BuildOptions,
    *,
    calibration: str = "",
) -> str:
    """Hex sha256 naming the plan built from these inputs (``<cache_dir>/<key>.plan``).

    Covers: the sha256 of the ONNX bytes, the TensorRT version string, the compute capability (``"9.0"`` or
    ``(9, 0)``), precision, every profile's shapes (order of profiles matters: context k gets profile k % n; order
    of inputs within a profile does not), workspace, version/hardware compatibility, and ``calibration`` (a digest
    of the INT8 calibration data, :func:`calibration_digest`; ignored unless precision is int8). Not covered: the
    timing cache (it changes build time, not correctness).
    """
    payload = {
        "format": CACHE_FORMAT,
        "onnx_sha256": hashlib.sha256(onnx_bytes).hexdigest(),
        "tensorrt": str(trt_version),
        "compute_capability": _cc_text(compute_capability),
        "precision": options.precision,
        "profiles": [
            {name: [list(s) for s in triple] for name, triple in sorted(profile.items())}
            for profile in options.profiles
        ],
        "workspace_mb": options.workspace_mb,
        "version_compatible": bool(options.version_compatible),
        "hardware_compatibility": options.hardware_compatibility,
        "calibration": calibration if options.precision == "int8" else "",
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def calibration_digest(directory: Path) -> str:
    """sha256 over the names and contents of the ``.npy`` files in ``directory`` (sorted by name).

    Raises:
        BuildError: the directory cannot be read.
    """
    h = hashlib.sha256()
    try:
        for path in sorted(Path(directory).glob("*.npy")):
            h.update(path.name.encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    except OSError as exc:
        raise BuildError(f"cannot read calibration data in {directory}: {exc}") from exc
    return h.hexdigest()


def load_calibration_batches(directory: Path, shape_min: Shape, shape_max: Shape, batch_size: int) -> list[np.ndarray]:
    """Calibration batches for a single-input model, from the ``.npy`` files of ``directory`` (sorted by name).

    Each file holds one sample (``ndim == len(shape_max) - 1``) or a batch of samples (``ndim ==
    len(shape_max)``); all samples are stacked and split into float32 batches of ``batch_size`` rows (a trailing
    partial batch is dropped). Every batch shape must lie within ``[shape_min, shape_max]`` (the calibration
    profile).

    Raises:
        BuildError: no ``.npy`` files, fewer samples than ``batch_size``, a sample of the wrong rank, or a batch
            shape outside the profile.
    """
    files = sorted(Path(directory).glob("*.npy"))
    if not files:
        raise BuildError(f"no .npy files in calibration_dir {directory}")
    rank = len(shape_max)
    samples = []
    for path in files:
        arr = np.load(path, allow_pickle=False)
        if arr.ndim == rank - 1:
            samples.append(arr[None])
        elif arr.ndim == rank:
            samples.append(arr)
        else:
            raise BuildError(f"{path}: shape {arr.shape} is neither one sample nor a batch for rank-{rank} input")
    try:
        data = np.concatenate(samples).astype(np.float32, copy=False)
    except ValueError as exc:
        raise BuildError(f"calibration samples in {directory} differ in shape: {exc}") from exc
    n = data.shape[0] // batch_size
    if n == 0:
        raise BuildError(f"{data.shape[0]} calibration samples in {directory}; need at least {batch_size}")
    batches = [np.ascontiguousarray(data[i * batch_size : (i + 1) * batch_size]) for i in range(n)]
    shape = batches[0].shape
    if len(shape) != rank or any(not (a <= s <= b) for s, a, b in zip(shape, shape_min, shape_max)):
        raise BuildError(f"calibration batch shape {list(shape)} is outside profile 0: {list(shape_min)}..{list(shape_max)}")
    return batches


# --------------------------------------------------------------------------- build


def _load_full_tensorrt() -> ModuleType:
    """The full ``tensorrt`` module.

    Raises:
        TensorRTMissing: not importable (the message names the pip package).
    """
    if _trt is not None:
        return _trt
    try:
        return importlib.import_module("tensorrt")
    except (ImportError, OSError) as exc:
        raise TensorRTMissing(
            f"building a TensorRT plan needs the full TensorRT package (import tensorrt failed: {exc}); on a machine "
            'with an NVIDIA GPU: pip install "trt-batcher[tensorrt]"'
        ) from exc


def _convert_fp16(onnx_bytes: bytes) -> bytes:
    try:
        from onnxconverter_common import float16
    except ImportError as exc:
        raise BuildError(f"fp16 on a strongly typed TensorRT needs onnxconverter-common: {exc}") from exc
    import onnx

    model = onnx.load_from_string(onnx_bytes)
    return float16.convert_float_to_float16(model, keep_io_types=True).SerializeToString()


def _make_calibrator(trt: ModuleType, batches: list[np.ndarray]) -> Any:
    """An ``IInt8EntropyCalibrator2`` feeding ``batches`` through one device buffer (TensorRT 10 only)."""
    from .cuda import DeviceBuffer, Stream

    class _Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._i = 0
            self._stream = Stream()
            self._device = DeviceBuffer(max(b.nbytes for b in batches))

        def get_batch_size(self) -> int:
            return int(batches[0].shape[0])

        def get_batch(self, names: list[str]) -> list[int] | None:
            if self._i >= len(batches):
                return None
            batch = batches[self._i]
            self._i += 1
            self._device.copy_from_host_async(batch.ctypes.data, batch.nbytes, self._stream, repr(names[0]))
            self._stream.synchronize()  # the batch is pageable host memory: wait until it is on the device
            return [self._device.ptr]

        def read_calibration_cache(self) -> bytes | None:
            return None

        def write_calibration_cache(self, cache: Any) -> None:
            return None

        def close(self) -> None:
            self._device.free()
            self._stream.destroy()

    return _Calibrator()


def build_plan(onnx_bytes: bytes, options: BuildOptions, *, onnx_path: Path | None = None) -> bytes:
    """Build a serialized TensorRT plan from ONNX bytes.

    Args:
        onnx_bytes: the ONNX model.
        options: see :class:`BuildOptions`.
        onnx_path: the model's file, passed to the parser so external-data weights next to it are found.

    Returns:
        the plan bytes (load with ``engines.tensorrt.TensorRTEngine``).

    Raises:
        TensorRTMissing: full TensorRT not importable. BuildError: an option the installed TensorRT cannot
            honour (all reasons listed), an ONNX parse error (TensorRT's messages), a profile naming an unknown
            input or missing a dynamic one, or the build returned nothing (TensorRT's log has the reason).
    """
    trt = _load_full_tensorrt()
    caps = capabilities(trt)
    problems = unsupported_options(options, caps)
    if problems:
        raise BuildError(f"cannot build with the installed TensorRT {caps['version']}: " + "; ".join(problems))
    if options.precision == "fp16" and not caps["fp16_flag"]:
        onnx_bytes = _convert_fp16(onnx_bytes)  # strongly typed TensorRT: precision lives in the graph
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    parsed = parser.parse(onnx_bytes, str(onnx_path)) if onnx_path is not None else parser.parse(onnx_bytes)
    if not parsed:
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError("TensorRT cannot parse the ONNX model: " + "; ".join(errors))
    config = builder.create_builder_config()
    if options.workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb << 20)
    if options.precision == "fp16" and caps["fp16_flag"]:
        config.set_flag(trt.BuilderFlag.FP16)
    if options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        if caps["exclude_lean_runtime"]:
            config.clear_flag(trt.BuilderFlag.EXCLUDE_LEAN_RUNTIME)  # embed the lean runtime in the plan
    if options.hardware_compatibility != "none":
        level = HARDWARE_COMPATIBILITY[options.hardware_compatibility]
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, level)
    inputs = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs[tensor.name] = tuple(int(d) for d in tensor.shape)
    trt_profiles = []
    for k, profile in enumerate(options.profiles):
        unknown = sorted(set(profile) - set(inputs))
        if unknown:
            raise BuildError(f"profile {k} names unknown inputs {unknown}; the model's inputs: {sorted(inputs)}")
        uncovered = sorted(n for n, s in inputs.items() if -1 in s and n not in profile)
        if uncovered:
            raise BuildError(f"profile {k} gives no shapes for dynamic inputs {uncovered}")
        trt_profile = builder.create_optimization_profile()
        for name, (mn, op, mx) in profile.items():
            trt_profile.set_shape(name, mn, op, mx)
        if config.add_optimization_profile(trt_profile) < 0:
            raise BuildError(f"TensorRT rejected optimization profile {k}: {profile}")
        trt_profiles.append(trt_profile)
    if not options.profiles and any(-1 in s for s in inputs.values()):
        dynamic = {n: list(s) for n, s in inputs.items() if -1 in s}
        raise BuildError(f"the model has dynamic inputs {dynamic}; give profile shapes (--min/--opt/--max)")
    calibrator = None
    if options.precision == "int8":
        if len(inputs) != 1 or not options.profiles:
            raise BuildError("INT8 calibration from a folder supports single-input models with a profile")
        (name, (mn, op, mx)), = options.profiles[0].items()
        if options.calibration_dir is None:  # unsupported_options() reports this too; kept for type narrowing
            raise BuildError("int8 needs calibration_dir")
        batches = load_calibration_batches(options.calibration_dir, mn, mx, batch_size=op[0])
        config.set_flag(trt.BuilderFlag.INT8)
        calibrator = _make_calibrator(trt, batches)
        config.int8_calibrator = calibrator
        config.set_calibration_profile(trt_profiles[0])
    if options.timing_cache is not None:
        blob = options.timing_cache.read_bytes() if options.timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        if not config.set_timing_cache(cache, False):  # from another TensorRT/GPU: start a fresh one
            config.set_timing_cache(config.create_timing_cache(b""), False)
    try:
        serialized = builder.build_serialized_network(network, config)
    finally:
        if calibrator is not None:
            calibrator.close()
    if serialized is None:
        raise BuildError("TensorRT build_serialized_network failed; its log above gives the reason")
    if options.timing_cache is not None:
        atomic_write(options.timing_cache, bytes(config.get_timing_cache().serialize()))
    return bytes(serialized)


def cached_build(onnx_path: Path, options: BuildOptions, cache_dir: Path, *, device_id: int = 0) -> Path:
    """Return ``<cache_dir>/<cache_key>.plan``, building and writing it (atomically) when it is not there.

    The key (:func:`cache_key`) covers the ONNX content, the TensorRT version, the compute capability of
    ``device_id`` and every option that changes the plan, so a stale plan is never reused.

    Raises:
        TensorRTMissing / BuildError: as :func:`build_plan`; BuildError also when the ONNX file cannot be read.
        engines.cuda.CudaError: no usable CUDA device.
    """
    from .cuda import compute_capability

    trt = _load_full_tensorrt()
    try:
        onnx_bytes = Path(onnx_path).read_bytes()
    except OSError as exc:
        raise BuildError(f"cannot read ONNX model {onnx_path}: {exc.strerror}") from exc
    calibration = ""
    if options.precision == "int8" and options.calibration_dir is not None:
        calibration = calibration_digest(options.calibration_dir)
    key = cache_key(onnx_bytes, trt.__version__, compute_capability(device_id), options, calibration=calibration)
    target = Path(cache_dir) / f"{key}.plan"
    if target.is_file():
        return target
    plan = build_plan(onnx_bytes, options, onnx_path=Path(onnx_path))
    atomic_write(target, plan)
    return target


# --------------------------------------------------------------------------- CLI helpers


def parse_shape(text: str) -> Shape:
    """``"1x3x224x224"`` -> ``(1, 3, 224, 224)``.

    Raises:
        ValueError: empty, a non-integer or a negative dimension (the message quotes ``text``).
    """
    parts = text.strip().lower().split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape {text!r} must be integers joined by 'x', e.g. 1x3x224x224") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {text!r} has a negative dimension")
    return dims


def parse_profile_args(items: Sequence[str] | None) -> dict[str, Shape]:
    """``["input:1x3x224x224", ...]`` -> ``{"input": (1, 3, 224, 224), ...}`` (the last ``:`` splits name/shape).

    Raises:
        ValueError: an item without ``NAME:SHAPE``, a bad shape, or a name given twice.
    """
    out: dict[str, Shape] = {}
    for item in items or []:
        name, sep, shape = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"{item!r} must be NAME:SHAPE, e.g. input:1x3x224x224")
        if name in out:
            raise ValueError(f"input {name!r} given twice")
        out[name] = parse_shape(shape)
    return out


def profiles_from_args(
    mins: Sequence[str] | None, opts: Sequence[str] | None, maxs: Sequence[str] | None
) -> list[Profile]:
    """One profile from ``--min/--opt/--max NAME:SHAPE`` lists; ``[]`` when none is given. ``--opt`` defaults to
    ``--max`` per input.

    Raises:
        ValueError: a bad item, or an input with ``--opt``/``--max`` but no ``--min`` (or the reverse).
    """
    lo, mid, hi = parse_profile_args(mins), parse_profile_args(opts), parse_profile_args(maxs)
    names = list(dict.fromkeys([*lo, *mid, *hi]))
    if not names:
        return []
    missing = [n for n in names if n not in lo or n not in hi]
    if missing:
        raise ValueError(f"inputs {missing} need both --min and --max (--opt defaults to --max)")
    return [{n: (lo[n], mid.get(n, hi[n]), hi[n]) for n in names}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``build`` arguments to ``parser`` (for ``batcher build`` or this module's CLI)."""
    parser.add_argument("model", help="ONNX model file, or zoo:<name> for a built-in model")
    parser.add_argument("-o", "--output", type=Path, help="where to write the plan (needed unless --cache-dir)")
    shape_help = "NAME:SHAPE, e.g. input:{}x3x224x224; repeat for each input"
    parser.add_argument("--min", action="append", metavar="NAME:SHAPE", help="profile minimum shape; " + shape_help.format(1))
    parser.add_argument("--opt", action="append", metavar="NAME:SHAPE", help="shape TensorRT tunes for (default: --max); " + shape_help.format(8))
    parser.add_argument("--max", action="append", metavar="NAME:SHAPE", help="profile maximum shape (its batch dim is the engine's max batch); " + shape_help.format(32))
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32",
        help="fp32 (default); fp16 (TensorRT 10: builder flag; >= 11: ONNX converted to float16 first, I/O stay "
        "FP32, needs onnxconverter-common); bf16 and int8 only on TensorRT 10 (int8 needs --calibration-dir)",
    )
    parser.add_argument("--workspace-mb", type=int, metavar="N", help="builder workspace limit in MiB (default: TensorRT's)")
    parser.add_argument("--timing-cache", type=Path, metavar="FILE", help="TensorRT timing cache: read if present, written back; speeds up rebuilds")
    parser.add_argument("--version-compatible", action="store_true", help="embed the lean runtime so tensorrt-lean / dispatch (and later TensorRT versions) can run the plan")
    parser.add_argument("--hardware-compatibility", choices=tuple(HARDWARE_COMPATIBILITY), default="none", help="none (default: this GPU's architecture), ampere_plus (any Ampere or newer GPU), same_compute_capability")
    parser.add_argument("--calibration-dir", type=Path, metavar="DIR", help="folder of .npy input samples for int8 entropy calibration (TensorRT 10)")
    parser.add_argument("--cache-dir", type=Path, metavar="DIR", help="reuse DIR/<key>.plan when the same model+TensorRT+GPU+options were built before; else build and store it there")


def _options_from_args(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(
        profiles=profiles_from_args(args.min, args.opt, args.max),
        precision=args.precision,
        workspace_mb=args.workspace_mb,
        timing_cache=args.timing_cache,
        version_compatible=args.version_compatible,
        hardware_compatibility=args.hardware_compatibility,
        calibration_dir=args.calibration_dir,
    )


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``build`` command; returns the exit status (0 ok, 1 build failed, 2 bad arguments,
    3 TensorRT missing). Errors are printed as one line on stderr."""
    prog = "build"
    try:
        options = _options_from_args(args)
    except (ValueError, BuildError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.output is None and args.cache_dir is None:
        print(f"{prog}: error: give -o/--output or --cache-dir", file=sys.stderr)
        return 2
    try:
        _load_full_tensorrt()
    except TensorRTMissing as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_NO_TENSORRT
    try:
        from .zoo import ZooError, resolve

        try:
            model = resolve(args.model)
        except ZooError as exc:
            raise BuildError(str(exc)) from exc
        if args.cache_dir is not None:
            plan_path = cached_build(model, options, args.cache_dir)
            if args.output is not None:
                atomic_write(args.output, plan_path.read_bytes())
                plan_path = args.output
        else:
            try:
                onnx_bytes = model.read_bytes()
            except OSError as exc:
                raise BuildError(f"cannot read ONNX model {model}: {exc.strerror}") from exc
            atomic_write(args.output, build_plan(onnx_bytes, options, onnx_path=model))
            plan_path = args.output
    except EngineError as exc:  # BuildError, or CudaError (no usable GPU)
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"{plan_path} ({plan_path.stat().st_size} bytes)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``build MODEL.onnx -o MODEL.plan [options]``; ``--help`` lists every option."""
    parser = argparse.ArgumentParser(
        prog="python -m engines.trt_build", description="Build TensorRT plans from ONNX models (needs full TensorRT and a GPU)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build",
        help="build a plan from an ONNX model",
        description="Build a TensorRT plan from an ONNX model. Exit status: 0 ok, 1 build failed, 2 bad "
        "arguments, 3 TensorRT not installed.",
    )
    add_arguments(build)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
