"""lm-eval 0.4.13 for the tests that compare with it, installed once from the package index into
`.cache/lm-eval-0.4.13` (git-ignored) without touching the venv: a dry run lists the packages the venv lacks, which
are installed there with --no-deps, so the venv's torch and transformers stay the ones used. Where that cannot be
done (offline, no index) the calling test is skipped and says why. The harness then runs in a subprocess with that
folder on its PYTHONPATH."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

LM_EVAL = "lm-eval[hf]==0.4.13"
SITE = REPO / ".cache" / "lm-eval-0.4.13"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _install(target: Path) -> None:
    """The packages of lm-eval[hf] that the venv lacks (a dry run against it), into `target`, without deps."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        report = Path(tmp) / "report.json"
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--dry-run", "--report", str(report), LM_EVAL], check=True, capture_output=True,
                       text=True, timeout=600)
        missing = [f"{i['metadata']['name']}=={i['metadata']['version']}"
                   for i in json.loads(report.read_text())["install"]]
        site = Path(tmp) / "site"
        subprocess.run([*pip, "--no-deps", "--target", str(site), *missing], check=True, capture_output=True,
                       text=True, timeout=600)
        os.replace(site, target)  # whole or not at all: a half install is never reused


def lm_eval_site() -> Path:
    """The folder holding lm_eval, installed on first use; the test is skipped where it cannot be."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    return SITE


@functools.cache  # one try per test session, whichever test asks first
def _unavailable() -> str | None:
    """None once lm_eval is in SITE, else why it cannot be installed there."""
    if (SITE / "lm_eval" / "__init__.py").is_file():
        return None
    SITE.parent.mkdir(parents=True, exist_ok=True)
    try:
        _install(SITE)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or e.stdout or "").strip().splitlines()[-1:] or ["no output"]
        why = f"cannot install {LM_EVAL} into {SITE} (offline, or no package index?): {last[0]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"cannot install {LM_EVAL} into {SITE}: {e}"
    else:
        return None
    return None if (SITE / "lm_eval" / "__init__.py").is_file() else why  # else another session just installed it
