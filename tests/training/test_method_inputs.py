"""The inputs the loop hands a method's loss (pipeline.training.method_inputs): a method that declares an input
gets it, computed on a case small enough to check by hand; one that does not is not given it, and nothing is
computed for it (no LM head, no pass on an answer it does not read)."""

import math

import pytest
import torch

from pipeline.training.method_inputs import METHOD_INPUTS, method_inputs
from pipeline.training.methods import METHODS, ForwardOut, Method
from pipeline.training.methods.base import INPUTS

from tests.training.test_retain_terms import THETA, ToyLM

LN3 = math.log(3)


def forget_batch() -> dict:
    """Forget answer: tokens 0 1 0, the last two scored; alternative answer: tokens 1 0, the last one scored."""
    return {"input_ids": torch.tensor([[0, 1, 0]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
            "scored": torch.tensor([[0, 1, 1]]), "ref_logp": torch.tensor([[0.0, -1.0, -2.0]]),
            "teacher_ids": torch.zeros(1, 3, 1, dtype=torch.long), "teacher_logp": torch.zeros(1, 3, 1),
            "teacher_tail": torch.zeros(1, 3),
            "alternative": {"input_ids": torch.tensor([[1, 0]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
                            "scored": torch.tensor([[0, 1]])}}


def max_logit(logits, tokens, params):
    return logits.max(-1).values


def probe(inputs, **kw) -> Method:
    return Method("probe", lambda out, batch, params: None, inputs=inputs, **kw)


class Counted:
    """A toy model that counts its decoder passes and the positions its LM head runs on."""

    def __init__(self):
        self.net, self.passes, self.head_rows = ToyLM(THETA), 0, 0
        self.net.decoder.register_forward_hook(lambda *a: setattr(self, "passes", self.passes + 1))
        self.net.head.register_forward_hook(lambda m, args, out: setattr(self, "head_rows",
                                                                          self.head_rows + args[0].shape[0]))


def inputs_of(method: Method, model: Counted | None = None, hidden_layer: int = 1) -> ForwardOut:
    model = model or Counted()
    return method_inputs(method, method.params(), model.net, forget_batch(), chunk_size=1, hidden_layer=hidden_layer)


def test_the_table_provides_every_input_a_method_may_declare_and_every_method_declares_known_ones():
    assert tuple(METHOD_INPUTS) == INPUTS == ("logp", "hidden", "from_logits", "alternative_logp")
    assert all(set(m.inputs) <= set(METHOD_INPUTS) and m.inputs for m in METHODS.values())
    assert METHODS["rmu"].inputs == ("hidden",) and METHODS["npo"].inputs == ("logp",)
    assert METHODS["idknll"].inputs == ("alternative_logp",) and not METHODS["idknll"].reads_forget_answer


@pytest.mark.parametrize("name, expected", [
    # log p_θ of the scored tokens: p(1 | 0) = 1/2, p(0 | 1) = 3/4; 0 where not scored
    ("logp", [[0.0, math.log(1 / 2), math.log(3 / 4)]]),
    # the hidden states at layer 1 (the toy's doubles the embedding), at every position
    ("hidden", [[[0.0, 0.0], [2 * LN3, 0.0], [0.0, 0.0]]]),
    # the method's function of the logits that predict each scored token: here their largest, 0 then ln 3
    ("from_logits", [[0.0, 0.0, LN3]]),
    # log p_θ of the alternative answer's scored token: p(0 | 1) = 3/4
    ("alternative_logp", [[0.0, math.log(3 / 4)]]),
])
def test_a_method_gets_the_input_it_declares_and_no_other(name, expected):
    extra = {"from_logits": {"from_logits": max_logit}, "alternative_logp": {"alternative": "idk"}}.get(name, {})
    out = inputs_of(probe((name,), **extra))
    torch.testing.assert_close(getattr(out, name), torch.tensor(expected))
    assert all(getattr(out, other) is None for other in INPUTS if other != name)


def test_nothing_is_computed_for_an_input_not_declared():
    hidden_only = Counted()
    inputs_of(probe(("hidden",)), hidden_only)
    assert (hidden_only.passes, hidden_only.head_rows) == (1, 0)  # RMU's: no LM head on the forget set
    alternative_only = Counted()
    inputs_of(probe(("alternative_logp",), alternative="idk"), alternative_only)
    assert (alternative_only.passes, alternative_only.head_rows) == (1, 1)  # no pass on the forget answer
    both = Counted()
    inputs_of(probe(("logp", "from_logits"), from_logits=max_logit), both)
    assert (both.passes, both.head_rows) == (1, 4)  # one pass on the forget answer, read by both inputs


def test_a_teacher_method_gets_theta_os_values_at_each_scored_token_after_the_tokens():
    def teacher_ref_logp(logits, tokens, ids, logp, tail, ref_logp, params):
        assert ids.shape == (len(tokens), 1) and logp.shape == (len(tokens), 1) and tail.shape == (len(tokens),)
        return ref_logp

    out = inputs_of(probe(("from_logits",), from_logits=teacher_ref_logp, teacher=True))
    torch.testing.assert_close(out.from_logits, torch.tensor([[0.0, -1.0, -2.0]]))


def test_a_method_record_declares_its_inputs_with_what_they_are_computed_from():
    with pytest.raises(ValueError, match="inputs \\['logits'\\]: one or more of"):
        probe(("logits",))
    with pytest.raises(ValueError, match="one or more of"):
        probe(())
    with pytest.raises(ValueError, match="from_logits and a from_logits function go together"):
        probe(("from_logits",))
    with pytest.raises(ValueError, match="from_logits and a from_logits function go together"):
        probe(("logp",), from_logits=max_logit)
    with pytest.raises(ValueError, match="alternative_logp and an alternative answer go together"):
        probe(("logp",), alternative="idk")
    assert probe(("logp", "hidden")).needs_hidden and not probe(("logp",)).needs_hidden
