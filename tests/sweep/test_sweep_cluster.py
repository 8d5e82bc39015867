"""tokenunlearn sweep on a Ray cluster: a head and a second node started here on loopback, a DVC pipeline with a
failing stage, run through the cluster's address."""

import json
import os
import socket
import subprocess
import time

import pytest

from tests.conftest import cli_env

pytestmark = pytest.mark.slow  # a two-node Ray cluster

pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _another_ray_runs(wait: float = 20.0) -> bool:
    """A raylet (a Ray node) runs on this machine, still after `wait` seconds: an earlier test's Ray, shut down just
    before, has ended by then."""
    deadline = time.monotonic() + wait
    while True:
        try:
            found = subprocess.run(["pgrep", "-f", "ray/raylet/raylet"], capture_output=True).returncode == 0
        except FileNotFoundError:  # no pgrep: assume none
            return False
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture
def two_node_cluster(tmp_path):
    """`ray start` twice, as on two machines: each node 1 CPU, token authentication as Ray sets it up. Its end,
    `ray stop --force`, ends every Ray of the machine's user: beside another Ray (a sweep running here) the test is
    skipped rather than end it."""
    if _another_ray_runs():
        pytest.skip("another Ray runs on this machine (a sweep?): this test's `ray stop --force` would end it")
    env = {**cli_env(), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    address = f"127.0.0.1:{_free_port()}"
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats"]
    try:
        subprocess.run(["ray", "start", "--head", "--port", address.split(":")[1], "--include-dashboard", "false",
                        *common], env=env, check=True, capture_output=True, timeout=120)
        subprocess.run(["ray", "start", "--address", address, *common], env=env, check=True, capture_output=True,
                       timeout=120)
        yield address, env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.mark.skipif(os.name != "posix", reason="ray start on one machine")
def test_a_sweep_on_a_two_node_cluster_records_what_ran_and_stops_only_what_failed(two_node_cluster, tmp_path):
    address, env = two_node_cluster
    env = {**env, "DVC_NO_ANALYTICS": "1"}
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  make:\n"
        "    foreach: [a, b, c]\n"
        "    do:\n"
        "      cmd: mkdir -p parts && sleep 2 && echo ${item} > parts/${item}.txt\n"
        "      outs:\n"
        "        - parts/${item}.txt\n"
        "  combine:\n"
        "    cmd: cat parts/a.txt parts/b.txt parts/c.txt > all.txt\n"
        "    deps: [parts/a.txt, parts/b.txt, parts/c.txt]\n"
        "    outs: [all.txt]\n"
        "  broken:\n"
        "    cmd: exit 3\n"
        "    outs: [broken.txt]\n"
        "  after_broken:\n"
        "    cmd: cp broken.txt after.txt\n"
        "    deps: [broken.txt]\n"
        "    outs: [after.txt]\n")
    (tmp_path / "params.yaml").write_text("sweep: {resources: {default: {cpus: 1}}}\n")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)

    proc = subprocess.run(["tokenunlearn", "sweep", "dvc.yaml", "*", "--address", address], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "stages failed: broken; not run: after_broken" in proc.stderr, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "artifacts/logs/sweep/sweep.json").read_text())["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {"make@a": "done", "make@b": "done", "make@c": "done",
                                                          "combine": "done", "broken": "failed",
                                                          "after_broken": "blocked"}
    assert len({s["node"] for s in stages.values() if "node" in s}) == 2  # both nodes ran stages
    assert (tmp_path / "all.txt").read_text() == "a\nb\nc\n"
    status = subprocess.run(["dvc", "status"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=True).stdout
    assert "broken" in status and "after_broken" in status and "make@" not in status and "combine" not in status
