"""Greedy answers, batched with left padding and the KV cache, as open-unlearning generates them for ROUGE.

open-unlearning (src/evals/metrics/utils.py::eval_text_similarity, configs/generation/default.yaml): greedy
decoding of at most `max_new_tokens`; an answer ends at the EOS of the model's generation_config (an id or a list);
rows are left-padded with the pad token (EOS where the tokenizer has none) and finished rows filled with EOS; the
new tokens are decoded without special tokens and with clean_up_tokenization_spaces=True, cut at the EOS text and
stripped.
"""

from __future__ import annotations

import torch

from pipeline.common.errors import ParamError
from pipeline.common.progress import progress
from pipeline.data.templates import PromptTemplate, encode_prompt


def decode(tokenizer, ids) -> str:
    """Token ids as text, as open-unlearning decodes prompts, ground truths and generations."""
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=True)


def stop_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the model's generation_config EOS (as `generate` uses it when none is passed),
    else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ParamError(f"tokenizer {tokenizer.name_or_path!r} and the model's generation_config have no EOS token")
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


def _cut_at(text: str, stop: str) -> str:
    return (text.split(stop)[0] if stop and stop in text else text).strip()


def _answers(model, tokenizer, template: PromptTemplate, questions: list[str], max_new_tokens: int, batch_size: int,
             desc: str, **how) -> list[str]:
    """Each question's answers (`how`: generate's decoding options; `num_return_sequences` answers per question, in
    order), left-padded batches of `batch_size` questions."""
    model.eval()
    device = next(model.parameters()).device
    eos = stop_ids(model, tokenizer)
    fill = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos[0]  # open-unlearning's pad_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fill
    stop = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
    answers: list[str] = []
    starts = range(0, len(questions), batch_size)
    for start in progress(starts, total=len(starts), desc=desc):
        prompts = [encode_prompt(tokenizer, template, q)[2] for q in questions[start : start + batch_size]]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            use_cache=True, eos_token_id=eos, pad_token_id=fill, **how,
        )
        answers.extend(_cut_at(decode(tokenizer, row), stop) for row in out[:, width:].tolist())
    return answers


@torch.no_grad()
def greedy_answers(model, tokenizer, template: PromptTemplate, questions: list[str], max_new_tokens: int = 64,
                   batch_size: int = 32) -> list[str]:
    return _answers(model, tokenizer, template, questions, max_new_tokens, batch_size, "generation", do_sample=False)


@torch.no_grad()
def sampled_answers(model, tokenizer, template: PromptTemplate, questions: list[str], n: int, temperature: float = 1.0,
                    top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 32, seed: int = 0) -> list[list[str]]:
    """`n` answers sampled per question at `temperature` and nucleus `top_p` (no top-k cut: transformers' default of
    50 is switched off), each batch from torch's generator seeded by (`seed`, the batch's first question), the
    caller's random state left as it was: the same answers on a rerun with the same batch size."""
    answers: list[str] = []
    per_batch = max(1, batch_size // n)
    for start in range(0, len(questions), per_batch):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + start)
            answers += _answers(model, tokenizer, template, questions[start : start + per_batch], max_new_tokens,
                                per_batch, "sampling", do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                num_return_sequences=n)
    return [answers[i * n : (i + 1) * n] for i in range(len(questions))]


def exact_match(prediction: str, gold: str) -> bool:
    """Equal up to whitespace."""
    return prediction.split() == gold.split()
