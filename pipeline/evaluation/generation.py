"""Greedy answers, batched with left padding and the KV cache."""

from __future__ import annotations

import torch

from pipeline.common.progress import progress
from pipeline.data.templates import PromptTemplate, encode_prompt


@torch.no_grad()
def greedy_answers(model, tokenizer, template: PromptTemplate, questions: list[str], max_new_tokens: int = 200,
                   batch_size: int = 32) -> list[str]:
    model.eval()
    device = next(model.parameters()).device
    answers: list[str] = []
    starts = range(0, len(questions), batch_size)
    for start in progress(starts, total=len(starts), desc="generation"):
        prompts = [encode_prompt(tokenizer, template, q)[2] for q in questions[start : start + batch_size]]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        answers.extend(tokenizer.batch_decode(out[:, width:], skip_special_tokens=True))
    return [a.strip() for a in answers]


def exact_match(prediction: str, gold: str) -> bool:
    """Equal up to whitespace."""
    return prediction.split() == gold.split()
