"""What every engine run compares with the reference the same way: greedy continuations of the reference
(transformers), and the engine's agreement with them (teacher-forced, and the free-running matching prefix)."""

from __future__ import annotations

import torch

from .common import Check

MAX_PROMPTS = 4


def greedy_continuations(model, samples: list[torch.Tensor], gen_tokens: int, dev: torch.device
                         ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, continuations): the first half of up to MAX_PROMPTS samples (<= 32 tokens each) and the reference's
    `gen_tokens` greedy tokens after each."""
    prompts, conts = [], []
    if gen_tokens <= 0:
        return prompts, conts
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=gen_tokens, min_new_tokens=gen_tokens,
                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        for s in samples[:MAX_PROMPTS]:
            p = s[: max(1, min(32, s.numel() // 2))].reshape(1, -1).to(dev)
            full = model.generate(p, attention_mask=torch.ones_like(p), generation_config=cfg)
            prompts.append(p[0].tolist())
            conts.append(full[0, p.shape[1]:].tolist())
    return prompts, conts


def generation_check(engine: str, forced: list[list[int]], generated: list[list[int]],
                     continuations: list[list[int]], gen_tokens: int, threshold: float) -> tuple[dict, Check]:
    """The engine's teacher-forced top-1 on the reference's continuations (the check) and its free-running greedy
    tokens' matching prefix (reported)."""
    from .numerics import limit_check

    tf = [sum(a == b for a, b in zip(f, c)) / max(1, len(c)) for f, c in zip(forced, continuations)]
    prefix = []
    for g, c in zip(generated, continuations):
        k = 0
        while k < min(len(g), len(c)) and g[k] == c[k]:
            k += 1
        prefix.append(k / max(1, len(c)))
    doc = {"tokens": gen_tokens, "prompts": len(tf), "agreement": sum(tf) / len(tf) if tf else float("nan"),
           "matching_prefix": (sum(prefix) / len(prefix)) if prefix else None}
    check = limit_check("engine_generation_agreement", doc["agreement"], threshold, upper=False,
                   what=f"{len(tf)} prompts x {gen_tokens} greedy tokens, {engine} teacher-forced on the reference's "
                        f"continuation; free-running matching prefix "
                        f"{doc['matching_prefix'] if prefix else float('nan'):.2f}")
    return doc, check
