"""``python -m bench SUBCOMMAND ...``: the load-testing command line.

Subcommands are registered in :data:`SUBCOMMANDS` as ``name -> (module, one-line help)``; each module provides
``DESCRIPTION``, ``EPILOG``, ``add_arguments(parser)`` and ``main(args) -> exit code``, and is imported only
when its subcommand runs (so ``--help`` stays fast). The other experiments in ``bench/`` run as
``python -m bench.<module>``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sweep": ("bench.sweep.cli", ("latency against throughput over offered rates (open loop) or client counts "
                              "(closed loop) against any KServe v2 server: CSV, PNG plot, table")),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand ``load`` (if any) gets its module imported and its options added."""
    parser = argparse.ArgumentParser(
        prog="python -m bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load-testing tools for KServe v2 (Triton-compatible) HTTP inference servers.",
        epilog="run 'python -m bench SUBCOMMAND --help' for a subcommand's options; other experiments: "
               "python -m bench.peers, bench.experiments, bench.overload, bench.soak, bench.loading_bench, "
               "bench.ocr_e2e, bench.gpu_bench, bench.trt_smoke",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name == load:
            module = importlib.import_module(module_name)
            p = sub.add_parser(name, help=help_text, description=module.DESCRIPTION, epilog=module.EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
            module.add_arguments(p)
            p.set_defaults(func=module.main)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
