"""Building a plan with the full TensorRT: :func:`build_plan`, and :func:`cached_build` on top of the plan cache.

Hardware seam: the full ``tensorrt`` module is reached only through :func:`load_full_tensorrt`, which returns the
module attribute :data:`_trt` when it is set (tests inject a stand-in).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..files import atomic_write
from .cache import cache_key, calibration_digest, load_calibration_batches
from .options import HARDWARE_COMPATIBILITY, BuildError, BuildOptions, TensorRTMissing
from .options import capabilities, unsupported_options

#: Injected full TensorRT module (tests); ``None``: ``import tensorrt``.
_trt: ModuleType | None = None


def load_full_tensorrt() -> ModuleType:
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
    from ..cuda import DeviceBuffer, Stream

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
    trt = load_full_tensorrt()
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
    from ..cuda import compute_capability

    trt = load_full_tensorrt()
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
