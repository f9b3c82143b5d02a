"""Build options and what the installed TensorRT can honour: :class:`BuildOptions`, :func:`capabilities`,
:func:`unsupported_options`, and the builder's errors (see the package docstring for TensorRT 10 vs >= 11)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base import EngineError

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
