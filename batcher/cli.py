"""Command line: ``batcher serve`` runs the server; ``batcher check-config`` validates a config file."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from . import __version__
from .errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batcher",
        description="Dynamic-batching inference server speaking the KServe v2 (Triton-compatible) HTTP protocol.",
    )
    p.add_argument("--version", action="version", version=f"trt-batcher {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="serve the models of a config over HTTP",
        description="Load every model of the config, then serve KServe v2 HTTP on HOST:PORT until SIGINT/SIGTERM.",
    )
    s.add_argument("--config", metavar="PATH",
                   help="YAML config (default: the embedded configs/default.yaml: three PP-OCR models and the "
                        "seed models tiny_cnn, mid_cnn, resnet18 on CPU)")
    s.add_argument("--model-repository", metavar="DIR",
                   help="also serve every model in DIR, a Triton/KServe repository (<model>/<version>/model.onnx, "
                        "optional <model>/config.yaml); without --config only these")
    s.add_argument("--host", help="address to bind (default: the config's server.host, 127.0.0.1)")
    s.add_argument("--port", type=_int_in(0, 65535),
                   help="TCP port, 0-65535 (default: the config's server.port, 8000)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="logging level (default: the config's server.log_level, info)")
    s.add_argument("--access-log", action="store_true", help="log one line per HTTP request (costs CPU)")
    s.add_argument("--frontends", type=_int_in(0, 64), metavar="N",
                   help="front-end processes in front of one engine process per GPU; 0: single-process mode "
                        "(default: the config's server.frontends, else 0 on 2 cores or fewer, else the cores, "
                        "at most 8)")

    c = sub.add_parser("check-config", help="validate a config file and print the models it serves",
                       description="Validate a YAML config: types, ranges, references and model paths; with "
                                   "--load also load every model (dims, profile limits, a warm-up run).")
    c.add_argument("path", metavar="PATH", nargs="?", help="YAML config (default: the embedded default)")
    c.add_argument("--model-repository", metavar="DIR", help="also check the models of DIR, as serve would")
    c.add_argument("--load", action="store_true", help="load each model as serve would, then release it")

    b = sub.add_parser("build", help="build a TensorRT plan from an ONNX model (needs TensorRT and a GPU)",
                       description="Build a TensorRT engine plan from an ONNX model: optimization profiles, "
                                   "precision, workspace, timing cache, version/hardware compatibility.")
    from engines.trt_build import add_arguments

    add_arguments(b)

    sub.add_parser("zoo", help="list the built-in models (zoo:<name>) with their files and parameter counts",
                   description="Resolve every zoo model (generating the seed models on first use) and print a table.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "zoo":
        return _zoo()
    if args.command == "build":
        from engines.trt_build import run

        return run(args)
    from .config import load_config
    from .supervisor import setup_logging

    # what loading the config logs (a repository's config.pbtxt left unread) in the server's format; serve sets
    # the configured level once the config is read
    setup_logging(getattr(args, "log_level", None) or "warning")
    try:
        config = load_config(args.config if args.command == "serve" else args.path, args.model_repository)
    except ConfigError as exc:
        print(f"batcher: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        return _check(config, args.load)
    return _serve(config, args)


def _int_in(low: int, high: int):
    """An argparse type: an integer in ``low..high``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"expected {low}-{high}, got {n}")
        return n

    return parse


def _check(config, load: bool) -> int:
    from engines.zoo import ZooError, resolve

    from .loader import load_model

    from .topology import frontends, selected_versions, single_process_problem

    by_name: dict[str, list] = {}
    for m in config.models:
        by_name.setdefault(m.name, []).append(m)
    served = {name: selected_versions(cfgs) for name, cfgs in by_name.items()}
    problems = 0
    n = frontends(config)
    problem = single_process_problem(config) if n == 0 else None
    if problem is not None:  # what serve would refuse on this machine (frontends null: 0 on 2 cores or fewer)
        unset = " (server.frontends null: 0 on this machine)" if config.server.frontends is None else ""
        print(f"batcher: {problem}{unset}", file=sys.stderr)
        problems += 1
    for i, m in enumerate(config.models):
        where = f"models[{i}]"
        try:
            path = resolve(m.path)
            if not path.is_file():
                raise ConfigError(f"{where}.path: {str(path)!r} is not a file")
            if load:
                load_model(m, where).release()
        except (ZooError, ConfigError) as exc:
            print(f"batcher: {where}: {exc}" if isinstance(exc, ZooError) else f"batcher: {exc}", file=sys.stderr)
            problems += 1
            continue
        note = "" if m.version in served[m.name] else "; not served: outside its version_policy"
        print(f"{m.name} v{m.version}: {path} ({m.backend}, {m.device}, instances {m.instances}{note})")
    return 2 if problems else 0


def _zoo() -> int:
    import onnx

    from engines.zoo import ZOO_NAMES, count_parameters, resolve

    print(f"{'name':<10} {'parameters':>12} {'file MB':>8}  path")
    for name in ZOO_NAMES:
        path = resolve(f"zoo:{name}")
        params = count_parameters(onnx.load(str(path)))
        print(f"{name:<10} {params:>12,} {path.stat().st_size / 1e6:>8.1f}  {path}")
    return 0


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: an ephemeral one), not yet listening: the server binds before
    any model loads, so a port in use is reported at once; it listens once the models are loaded. ``reuse_port``
    (multi-process mode): ``SO_REUSEPORT``, so that the front ends can listen on the same port; the port is first
    bound without it, so a port another server listens on (with ``SO_REUSEPORT`` or not) is in use here too.

    Raises:
        OSError: the address cannot be resolved or bound (e.g. the port is in use).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    if reuse_port:
        # SO_REUSEPORT would let this server join another one's listeners on the port (any process of the same
        # user that set it too), and the kernel would split connections between two servers: first claim the
        # port without it, which fails while anything listens there (and picks the port for port 0).
        probe = _bind(family, kind, proto, address, reuse_port=False)
        address = probe.getsockname()
        probe.close()
    return _bind(family, kind, proto, address, reuse_port)


def _bind(family: int, kind: int, proto: int, address: tuple, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does on Unix
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _serve(config, args) -> int:
    from .supervisor import raise_fd_limit, setup_logging
    from .topology import frontends, single_process_problem

    server = config.server.model_copy(update={
        k: v for k, v in (("host", args.host), ("port", args.port), ("log_level", args.log_level),
                          ("frontends", args.frontends)) if v is not None
    })
    config = config.model_copy(update={"server": server})
    setup_logging(server.log_level)
    raise_fd_limit()  # before any child process starts: they inherit it
    log = logging.getLogger("batcher")
    n = frontends(config)
    if n:
        from .supervisor import serve_multiprocess

        return serve_multiprocess(config, n, args.access_log)
    problem = single_process_problem(config)
    if problem is not None:
        log.error("%s", problem)
        return 2
    from aiohttp import web

    from .app import create_app
    from .supervisor import freeze_on_startup, new_event_loop, set_device_options, set_switch_interval

    set_switch_interval(server.gil_switch_interval_us)
    set_device_options(server)
    try:
        sock = bind_socket(server.host, server.port)
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", server.host, server.port, exc.strerror or exc)
        return 1
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    app = create_app(config)
    app.on_startup.append(freeze_on_startup)
    try:
        web.run_app(
            app, loop=new_event_loop(server.event_loop),
            sock=sock, backlog=server.listen_backlog,
            # with --port 0 this line is the only way to learn the port: shown at any log level but error
            print=lambda _msg: log.log(logging.WARNING if server.port == 0 else logging.INFO,
                                       "serving KServe v2 on http://%s:%d", host, port),
            access_log=logging.getLogger("aiohttp.access") if args.access_log else None,
            handle_signals=True,
            handler_cancellation=True,  # a client that goes away cancels its handler: queued work is dropped
            shutdown_timeout=server.shutdown_grace_s,
        )
    except ConfigError as exc:  # a model that failed to load at startup (its own line came first) or the config
        log.error("not serving: %s", exc)
        return 2
    finally:
        sock.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
