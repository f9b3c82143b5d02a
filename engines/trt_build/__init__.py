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

Modules: :mod:`.options` (options, capabilities, errors), :mod:`.cache` (cache key, calibration data),
:mod:`.build` (building, the ``_trt`` seam), :mod:`.cli` (the ``build`` command).
"""

from __future__ import annotations

from .build import build_plan, cached_build
from .cache import cache_key, calibration_digest, load_calibration_batches
from .cli import add_arguments, main, parse_profile_args, parse_shape, profiles_from_args, run
from .options import EXIT_NO_TENSORRT, HARDWARE_COMPATIBILITY, PRECISIONS, BuildError, BuildOptions
from .options import TensorRTMissing, capabilities, unsupported_options

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
