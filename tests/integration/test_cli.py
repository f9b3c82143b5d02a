"""The command line: help, bad configs, check-config, serve failures (each a real `python -m batcher` process)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batcher", *args], capture_output=True, text=True, timeout=60)


def test_cli_help_describes_every_option():
    top = _cli("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "check-config" in top.stdout
    serve = _cli("serve", "--help")
    assert serve.returncode == 0
    for opt in ("--config", "--host", "--port", "--log-level", "--access-log", "configs/default.yaml"):
        assert opt in serve.stdout, opt


def test_cli_reports_a_bad_config_and_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - {name: m, path: zoo:tiny_cnn}\n  - {name: n, path: zoo:tiny_cnn, max_batch_size: -3}\n")
    r = _cli("check-config", str(bad))
    assert r.returncode == 2
    assert "models[1].max_batch_size" in r.stderr and "(got -3)" in r.stderr
    r = _cli("serve", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read config" in r.stderr
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes(b"\xff\xfe bad")
    for args in (["check-config", str(latin)], ["serve", "--config", str(latin)]):
        r = _cli(*args)
        assert r.returncode == 2 and "is not UTF-8 text: byte 0 is 0xff" in r.stderr and "Traceback" not in r.stderr


def test_serve_fails_clearly_on_an_unknown_zoo_model(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: m, path: 'zoo:nope'}\n")
    r = _cli("serve", "--config", str(cfg), "--port", "0")
    assert r.returncode == 2
    assert "models[0].path" in r.stderr and "ppocr_det" in r.stderr


def test_serve_says_once_why_a_model_failed_to_load_then_that_it_is_not_serving(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: a, path: 'zoo:tiny_cnn'}\n  - {name: b, path: /no/such.onnx}\n")
    r = _cli("serve", "--config", str(cfg), "--port", "0")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if "'/no/such.onnx' is not a file" in line]
    assert len(lines) == 2 and "ERROR batcher.repository: models[1].path" in lines[0], lines
    assert "ERROR batcher: not serving: models[1].path" in lines[1]


def test_a_repository_config_pbtxt_left_unread_is_logged_in_the_server_format(tmp_path):
    version = tmp_path / "repo" / "m" / "1"
    version.mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    from bench.mlp import write_trivial

    write_trivial(version / "model.onnx")
    r = _cli("check-config", "--model-repository", str(tmp_path / "repo"))
    assert r.returncode == 0, r.stderr
    line = r"^\S+ \S+ WARNING batcher.model_repository: \S+/m: config.pbtxt is not read"
    assert re.search(line, r.stderr, re.M), r.stderr


def test_check_config_resolves_paths_and_load_checks_dims(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: a, path: 'zoo:nope'}\n  - {name: b, path: /no/such.onnx}\n"
                   "  - {name: c, path: 'zoo:ppocr_cls', inputs: [{name: x, dims: [4, 48, 192]}]}\n")
    r = _cli("check-config", str(cfg))
    assert r.returncode == 2
    assert "models[0]" in r.stderr and "ppocr_det" in r.stderr  # names the known zoo models
    assert "models[1].path: '/no/such.onnx' is not a file" in r.stderr
    assert r.stdout.startswith("c v1:")  # the loadable one is listed
    r = _cli("check-config", "--load", str(cfg))
    assert "models[2].inputs[0].dims[0]: 4 contradicts the model's fixed size 3" in r.stderr


def test_tensorrt_backend_without_tensorrt_fails_clearly(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: m, path: 'zoo:tiny_cnn', backend: tensorrt, runtime: full,\n"
                   "     build: {profiles: [{input: {min: [1,3,224,224], opt: [8,3,224,224], max: [32,3,224,224]}}]}}\n")
    r = _cli("serve", "--config", str(cfg), "--port", "0")
    assert r.returncode == 2
    assert "models[0]" in r.stderr and "tensorrt" in r.stderr.lower()


def test_cli_rejects_a_port_out_of_range():
    r = _cli("serve", "--port", "70000")
    assert r.returncode == 2 and "expected 0-65535, got 70000" in r.stderr




def test_serve_on_port_0_logs_the_port_it_got(tmp_path, cache_dir):
    """``--port 0``: the log names the real port, and the server answers there."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: m, path: 'zoo:tiny_cnn'}\n")
    proc = subprocess.Popen([sys.executable, "-m", "batcher", "serve", "--config", str(cfg), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the line comes once the server listens (a blocking read: event ordering)
            match = re.search(r"serving KServe v2 on http://127\.0\.0\.1:(\d+)$", line.strip())
            if match:
                break
        else:
            raise AssertionError(f"no 'serving' line; exit code {proc.wait()}")
        port = int(match.group(1))
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0


@pytest.mark.parametrize("frontends", ["0", "1"])
def test_serve_raises_its_open_files_limit_to_the_hard_one_in_every_process(tmp_path, cache_dir, frontends):
    """Started under a soft limit of 1,024 (a hard one above it): the server and the processes it starts may open
    as many files as the hard limit allows (at most 2^20), as one system shared-memory region takes two and each
    connection one (a fresh user's 505 registrations used up 1,024, and then no connection was accepted)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = (1 << 20) if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if want <= 1024:
        pytest.skip(f"the hard limit of open files here is {hard}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: m, path: 'zoo:tiny_cnn'}\n")
    proc = subprocess.Popen([sys.executable, "-m", "batcher", "serve", "--config", str(cfg), "--port", "0",
                             "--frontends", frontends], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    try:
        for line in proc.stderr:  # once it serves, every process it starts has started
            if "serving KServe v2 on" in line:
                break
        else:
            raise AssertionError(f"no 'serving' line; exit code {proc.wait()}")
        pids = [proc.pid, *map(int, subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split())]
        assert len(pids) == (1 if frontends == "0" else 4)  # multi-process: an engine, a front end, the tracker
        for pid in pids:
            with open(f"/proc/{pid}/limits") as f:
                soft = next(line.split()[3] for line in f if line.startswith("Max open files"))
            assert int(soft) == want, (pid, soft)
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0


@pytest.mark.parametrize("frontends", ["0", "1"])
def test_a_port_in_use_is_reported_before_any_model_loads(tmp_path, cache_dir, frontends):
    """Also when the server listening there set SO_REUSEPORT (another server's front ends do): multi-process mode
    must not join its listeners (a fresh user's second server did, and the kernel split the traffic)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n  - {name: m, path: 'zoo:resnet18'}\n")
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _cli("serve", "--config", str(cfg), "--port", str(port), "--frontends", frontends)
    assert r.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "load model" not in r.stderr and "resnet18" not in r.stderr  # it never got to the models


def test_check_config_marks_versions_its_version_policy_does_not_serve(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models:\n"
                   "  - {name: t, version: 1, path: 'zoo:tiny_cnn'}\n"
                   "  - {name: t, version: 2, path: 'zoo:tiny_cnn', version_policy: {latest: 1}}\n")
    r = _cli("check-config", str(cfg))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("t v1:") and lines[0].endswith("; not served: outside its version_policy)")
    assert lines[1].startswith("t v2:") and "not served" not in lines[1]


def test_check_config_refuses_what_serve_refuses_in_single_process_mode(tmp_path):
    """A fresh user's find: check-config passed configs that serve then refused in single-process mode."""
    cfg = tmp_path / "c.yaml"
    for server, unset in (("{frontends: 0, engine_processes: per_model}", ""),
                          ("{frontends: 0, cuda_mps: true}", ""),
                          ("{engine_processes: per_model}", " (server.frontends null: 0 on this machine)")):
        cfg.write_text(f"server: {server}\nmodels:\n  - {{name: m, path: 'zoo:tiny_cnn'}}\n")
        r = _cli("check-config", str(cfg))
        if unset and "0 on this machine" not in r.stderr and r.returncode == 0:
            continue  # a machine with more than 2 usable cores defaults to multi-process mode: nothing to refuse
        assert r.returncode == 2, (server, r.stderr)
        assert "applies to the engine processes of multi-process mode" in r.stderr and r.stderr.endswith(
            unset + "\n")
    cfg.write_text("server: {frontends: 1, engine_processes: per_model}\nmodels:\n  - {name: m, path: 'zoo:tiny_cnn'}\n")
    assert _cli("check-config", str(cfg)).returncode == 0
