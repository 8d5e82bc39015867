"""Loading what users have: hub names through the same code as local directories (from the local cache when the
hub cannot be reached, else a one-line error at once), and pickle-only checkpoints refused with how to convert."""

import shutil
import subprocess
import sys

import pytest

from pipeline.common.errors import DataError
from pipeline.common.modeling import load_model

from tests.conftest import cli_env

UNREACHABLE = "http://127.0.0.1:9"  # a closed port: the hub's probe fails at once, as on a machine offline

LOAD = """
import sys, time
from pipeline.common.modeling import load_model, load_tokenizer
start = time.perf_counter()
try:
    model, tok = load_model(sys.argv[1]), load_tokenizer(sys.argv[1])
    print("loaded", type(model).__name__, len(tok))
except Exception as e:
    print(type(e).__name__, e)
print(f"seconds {time.perf_counter() - start:.1f}")
"""


def _load_in_subprocess(name, hf_home):
    env = {**cli_env(), "HF_HOME": str(hf_home), "HF_ENDPOINT": UNREACHABLE}
    env.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run([sys.executable, "-c", LOAD, name], env=env, capture_output=True, text=True, timeout=300)
    return out.stdout


def _put_in_hub_cache(model_dir, hf_home, repo):
    """The layout `huggingface_hub` downloads into: models--OWNER--NAME/snapshots/COMMIT, refs/main -> COMMIT."""
    commit = "0" * 40
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


@pytest.mark.slow
def test_a_hub_name_loads_from_the_cache_offline_and_fails_in_one_line_when_not_cached(micro_model_dir, tmp_path):
    _put_in_hub_cache(micro_model_dir, tmp_path / "hf", "locuslab/tofu_ft_tiny")
    out = _load_in_subprocess("locuslab/tofu_ft_tiny", tmp_path / "hf")
    assert "loaded LlamaForCausalLM" in out, out
    out = _load_in_subprocess("microsoft/phi-1_5", tmp_path / "hf")
    assert "DataError model 'microsoft/phi-1_5': not in the local Hugging Face cache" in out, out
    assert "the hub cannot be reached (127.0.0.1: " in out and "huggingface-cli download microsoft/phi-1_5" in out
    assert float(out.split("seconds ")[1]) < 30  # not a minute of retries


def test_a_pickle_only_checkpoint_is_refused_with_how_to_convert(micro_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    bin_dir = tmp_path / "bin_only"
    shutil.copytree(micro_model_dir, bin_dir)
    weights = load_file(str(bin_dir / "model.safetensors"))
    (bin_dir / "model.safetensors").unlink()
    torch.save(weights, bin_dir / "pytorch_model.bin")
    with pytest.raises(DataError, match=r"has only PyTorch pickle weights \(\*\.bin\), which TokenUnlearn never loads"
                                        r".*save_pretrained\('converted'\)"):
        load_model(bin_dir)
