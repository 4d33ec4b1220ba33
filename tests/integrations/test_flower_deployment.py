"""AuditStrategy on Flower's deployment engine, as the issue's user ran it: a SuperLink and two
SuperNodes over loopback, the app submitted with `flwr run`, the ServerApp in the SuperLink's
own subprocess and the inversion in a worker process spawned from it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

APP = Path(__file__).resolve().parents[1] / "fixtures" / "flower_deployment"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {seconds} s")


@pytest.mark.slow
def test_the_audit_runs_on_flowers_deployment_engine(tmp_path) -> None:
    app = tmp_path / "app"
    shutil.copytree(APP, app)
    home = tmp_path / "flwr-home"
    home.mkdir()
    link = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{link}"\n'
        "insecure = true\n")
    # the SuperLink starts `flower-superexec` by name: this interpreter's scripts come first on
    # PATH even when its environment is not activated (`.venv/bin/python -m pytest`)
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")])}
    started = []

    def start(*command: str, log: str) -> None:
        handle = (tmp_path / log).open("w")
        started.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True, cwd=tmp_path))

    try:
        start(str(BIN / "flower-superlink"), "--insecure", "--port", str(link),
              "--disable-runtime-dependency-installation", log="superlink.log")
        wait_for_port(link, 60)
        for pid in (0, 1):
            start(str(BIN / "flower-supernode"), "--insecure", "--superlink",
                  f"127.0.0.1:{link}", "--port", str(free_port()),
                  "--node-config", f"partition-id={pid}", log=f"supernode-{pid}.log")
        out = tmp_path / "audit"
        run = subprocess.run([str(BIN / "flwr"), "run", ".", "--stream", "--run-config",
                              f'audit-out="{out}"'], cwd=app, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        deadline = time.monotonic() + 60  # the stream can end before the ServerApp exits
        while time.monotonic() < deadline and not (
                (out / "audit.json").is_file()
                and json.loads((out / "audit.json").read_text())["status"] == "complete"):
            time.sleep(0.5)
        audit = json.loads((out / "audit.json").read_text())
        assert audit["status"] == "complete", (tmp_path / "superlink.log").read_text()[-3000:]
        assert len(list((out / "updates" / "round-001").glob("node-*.safetensors"))) == 2
        assert audit["summary"]["sme"]["updates"] == 2 and not audit["failures"]
        assert {r["num_examples"] for r in audit["rows"]} == {8}
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
