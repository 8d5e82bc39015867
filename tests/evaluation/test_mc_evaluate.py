"""Multiple-choice sets in an evaluation: their spec's keys, an MC-only evaluation (no TOFU sets), per-item rows that
join back to the source and per-subject accuracy in the summary."""

import json

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.errors import ParamError
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_path

from tests.conftest import REPO


def _cfg(sets: dict, **kw) -> EvalConfig:
    return EvalConfig.from_params({"tofu_sets": [], "multiple_choice": sets, **kw}, "evaluate")


@pytest.mark.parametrize("spec, message", [
    ({"format": "wmdp", "source": "x.json", "subjet": "biology"},
     r"evaluate\.multiple_choice\.wmdp_bio: unknown key\(s\) \['subjet'\] \(known: \['add_bos_token', 'config', "
     r"'format', 'max_length', 'scoring', 'source', 'subject'\]\)"),
    ({"format": "wmdp", "source": "x.json", "subject": ""}, r"wmdp_bio\.subject: '' is invalid: must be a non-empty"),
    ({"format": "wmdp", "source": "x.json", "config": "wmdp-physics"},
     r"wmdp_bio\.config: 'wmdp-physics' is invalid: must be one of \['wmdp-bio', 'wmdp-chem', 'wmdp-cyber'\]"),
    ({"format": "wmdp", "source": "x.json", "add_bos_token": "yes"},
     r"wmdp_bio\.add_bos_token: 'yes' is invalid: must be null \(the tokenizer's default\), true or false"),
    ({"format": "mmlu", "source": "d", "max_length": 0}, r"wmdp_bio\.max_length: 0 is invalid: must be null"),
    ({"format": "mmlu", "source": "d", "subjects": "anatomy"}, r"wmdp_bio\.subjects: 'anatomy' is invalid: must be "
                                                                r"a non-empty list of MMLU subjects"),
    ({"format": "mmlu", "source": "d", "subject": "anatomy"}, r"wmdp_bio: unknown key\(s\) \['subject'\]"),
    ({"format": "world", "source": "w", "scoring": "cloze", "add_bos_token": True},
     r"wmdp_bio\.add_bos_token: applies to letter scoring only"),
])
def test_mc_specs_are_checked_key_by_key(spec, message):
    with pytest.raises(ParamError, match=message):
        _cfg({"wmdp_bio": spec})


def test_the_new_keys_are_accepted():
    cfg = _cfg({"w": {"format": "wmdp", "source": "x.json", "subject": "biology", "add_bos_token": False,
                      "max_length": 512, "config": None},
                "m": {"format": "mmlu", "source": "d", "subjects": ["anatomy"], "add_bos_token": None}})
    assert cfg.multiple_choice["w"]["subject"] == "biology" and cfg.tofu_sets == []


def test_a_set_switched_off_by_an_overlay_is_left_out():
    cfg = _cfg({"world": None, "w": {"format": "wmdp", "source": "x.json", "subject": "biology"}})
    assert list(cfg.multiple_choice) == ["w"]
    with pytest.raises(ParamError, match=r"multiple_choice\.world: needs format"):
        _cfg({"world": {"source": "w"}})


def _sources(tmp_path):
    wmdp = tmp_path / "bio_questions.jsonl"  # not named like a WMDP set: the spec's subject names it
    wmdp.write_text("".join(json.dumps({"question": f"Which agent {k}?", "choices": ["a", "b", "c", "d"],
                                        "answer": k % 4}) + "\n" for k in range(5)))
    mmlu = tmp_path / "mmlu"
    mmlu.mkdir()
    (mmlu / "anatomy_test.csv").write_text("Which bone?,femur,tibia,ulna,rib,A\nWhich organ?,lung,liver,skin,eye,B\n")
    (mmlu / "virology_test.csv").write_text("Which virus?,flu,cold,HIV,none,C\n")
    return {"wmdp_bio": {"format": "wmdp", "source": str(wmdp), "subject": "biology"},
            "mmlu": {"format": "mmlu", "source": str(mmlu), "max_length": 64}}


def test_an_mc_only_evaluation_keeps_rows_that_join_back_and_per_subject_accuracy(micro_model_dir, tmp_path):
    sets = _sources(tmp_path)
    out = tmp_path / "eval"
    summary = evaluate_path(str(micro_model_dir), _cfg(sets, source=str(tmp_path / "no_world")), out, None,
                            tmp_path / "metrics.json")
    assert not {"forget", "retain", "forget_es", "model_utility"} & set(summary)  # no TOFU set was needed
    mmlu = pq.read_table(out / "mc" / "mmlu.parquet").to_pylist()
    assert [(r["index"], r["subject"], r["question"]) for r in mmlu] == [
        (0, "anatomy", "Which bone?"), (1, "anatomy", "Which organ?"), (2, "virology", "Which virus?")]
    wmdp = pq.read_table(out / "mc" / "wmdp_bio.parquet").to_pylist()
    assert [r["index"] for r in wmdp] == list(range(5)) and {r["subject"] for r in wmdp} == {"biology"}
    assert summary["mc_mmlu"] == pytest.approx(sum(r["correct"] for r in mmlu) / 3, abs=1e-6)  # overall, as before
    by_subject = summary["multiple_choice"]["mmlu"]["by_subject"]
    assert {s: g["n"] for s, g in by_subject.items()} == {"anatomy": 2, "virology": 1}
    assert by_subject["virology"]["accuracy"] == float(mmlu[2]["correct"])
    assert summary["multiple_choice"]["mmlu"]["max_length"] == 64  # the spec's
    assert summary["multiple_choice"]["wmdp_bio"]["max_length"] == 128  # the model's max_position_embeddings
    assert json.loads((tmp_path / "metrics.json").read_text()) == summary


def test_subjects_that_match_nothing_fail_before_the_model_loads(micro_model_dir, tmp_path):
    sets = _sources(tmp_path)
    sets["mmlu"]["subjects"] = ["anatomy", "astrology"]
    with pytest.raises(ParamError, match=r"evaluate\.multiple_choice\.mmlu\.subjects: \['astrology'\] match no "
                                         r"question of .*mmlu \(its subjects: anatomy, virology\)"):
        evaluate_path(str(tmp_path / "no_model"), _cfg(sets), tmp_path / "eval", None)


def test_the_cli_runs_an_mc_only_evaluation(micro_model_dir, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from stages.cli import cli

    params = tmp_path / "params.yaml"
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    # no TOFU set, so no membership inference (it scores the forget set); the probes score the sets there are
    base["evaluate"] = {**base["evaluate"], "tofu_sets": [], "multiple_choice": _sources(tmp_path), "mia": None,
                        "probe_sets": [], "quantize": {"bits": [8, 4], "group_size": 128, "method": "auto"}}
    params.write_text(yaml.safe_dump(base))
    monkeypatch.chdir(tmp_path)  # no artifacts/world here: nothing may need the TOFU splits
    result = CliRunner().invoke(cli, ["evaluate", "m", "--model", str(micro_model_dir), "--params", str(params)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "artifacts" / "metrics" / "eval" / "m.json").read_text())
    assert {"mc_wmdp_bio", "mc_mmlu"} <= set(summary) and "forget" not in summary
    assert {"q4_mc_wmdp_bio", "q8_mc_mmlu"} <= set(summary)  # the quantization attack on multiple choice alone
