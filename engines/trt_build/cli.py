"""The ``build`` command: argument parsing (shapes, profiles) and running a build from the command line
(``python -m engines.trt_build build ...``, or ``batcher build`` through :func:`add_arguments`/:func:`run`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..base import EngineError
from ..files import atomic_write
from . import build as builder
from .options import EXIT_NO_TENSORRT, HARDWARE_COMPATIBILITY, PRECISIONS, BuildError, BuildOptions, Profile
from .options import Shape, TensorRTMissing

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
        builder.load_full_tensorrt()
    except TensorRTMissing as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_NO_TENSORRT
    try:
        from ..zoo import ZooError, resolve

        try:
            model = resolve(args.model)
        except ZooError as exc:
            raise BuildError(str(exc)) from exc
        if args.cache_dir is not None:
            plan_path = builder.cached_build(model, options, args.cache_dir)
            if args.output is not None:
                atomic_write(args.output, plan_path.read_bytes())
                plan_path = args.output
        else:
            try:
                onnx_bytes = model.read_bytes()
            except OSError as exc:
                raise BuildError(f"cannot read ONNX model {model}: {exc.strerror}") from exc
            atomic_write(args.output, builder.build_plan(onnx_bytes, options, onnx_path=model))
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
