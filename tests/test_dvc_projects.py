"""The demo's DVC project (dvc.yaml at the root) and the experiments' (experiments/, a project of its own) stay
apart: a DVC command on the demo never reads an experiment's pipeline or record, so the experiments' growth never
slows the user's flows again."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.slow  # DVC commands on the demo's and the experiments' projects

# `dvc status dvc.yaml` as a user runs it, with every file it opens or lists recorded (Python's audit hooks see
# each open, listdir and scandir, DVC's and its libraries' alike).
AUDITED_STATUS = """
import json, os, sys
experiments = os.path.abspath("experiments")
seen = set()

def hook(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path == experiments or path.startswith(experiments + os.sep):
            seen.add(os.path.relpath(path))

sys.addaudithook(hook)
from dvc.cli import main
from dvc.repo import Repo

code = main(["status", "dvc.yaml"])
with Repo(".") as repo:
    files = sorted({os.path.relpath(s.path) for s in repo.index.stages})
print(json.dumps({"code": code, "read": sorted(seen), "stage_files": files}))
"""


def test_a_dvc_command_on_the_demo_reads_no_file_of_the_experiments():
    proc = subprocess.run([sys.executable, "-c", AUDITED_STATUS], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**cli_env(), "DVC_NO_ANALYTICS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    assert result["read"] == [], f"the demo's DVC index read the experiments' files: {result['read'][:10]}"
    assert result["stage_files"] == ["dvc.yaml"]
