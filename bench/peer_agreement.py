"""Greedy agreement with llama.cpp, near ties allowed: the peer suite's fidelity row.

Both sides decode the same chat prompts greedily and record, at every step, the gap between their
two most likely tokens (log-probability of the first minus the second: the raw logits' gap).  A
prompt agrees when its tokens are equal, or when they first differ at a *near tie*: a step where
both sides' top-two gaps are below `near_tie_nats`.  There two engines that quantize activations
to 8 bits in different orders (and llama.cpp keeps K and V in f16) may honestly pick either token,
and after the first difference the continuations are different texts, so nothing later is
compared.

Boundary: the prompts and the verdict; the workers (bench/peer_worker.py) only decode and record.
"""

from __future__ import annotations

from typing import Any, Sequence

# Short, answerable questions: greedy continuations of ordinary chat turns.
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give one tip for sleeping better.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
)


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` questions as token ids, in the model's chat template where it has one."""
    if count > len(QUESTIONS):
        raise ValueError(f"bench.agreement.prompts={count}: at most {len(QUESTIONS)} questions are built in")
    out = []
    for question in QUESTIONS[:count]:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        except ValueError:  # no chat template: the plain question
            text = question
        out.append(tokenizer.encode(text))
    return out


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def verdict(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], near_tie_nats: float) -> dict[str, Any]:
    """Per prompt ({"token_ids", "gaps"} from each side): where the tokens first differ and both
    sides' top-two gaps there; the counts of equal prompts and of those that differ first at a
    near tie; `agree` is their share."""
    rows = []
    for a, b in zip(ours, theirs):
        at = first_difference(a["token_ids"], b["token_ids"])
        gaps = None if at is None else (a["gaps"][at], b["gaps"][at])
        near = gaps is not None and max(gaps) < near_tie_nats
        rows.append({"first_difference": at, "gaps": gaps, "near_tie": near})
    equal = sum(r["first_difference"] is None for r in rows)
    near = sum(r["near_tie"] for r in rows)
    return {"prompts": len(rows), "new_tokens": len(ours[0]["token_ids"]) if ours else 0, "equal": equal,
            "after_near_tie": near, "agree": (equal + near) / len(rows) if rows else None,
            "near_tie_nats": near_tie_nats, "per_prompt": rows}


def note(label: str, v: dict[str, Any]) -> str:
    """One Markdown line of the verdict for a side."""
    differ = [f"{r['first_difference']} (gaps {r['gaps'][0]:.2f}/{r['gaps'][1]:.2f})" for r in v["per_prompt"]
              if r["first_difference"] is not None]
    return (f"{label}: {v['equal'] + v['after_near_tie']}/{v['prompts']} agree ({v['equal']} equal, "
            f"{v['after_near_tie']} first differ at a near tie, both top-two gaps < {v['near_tie_nats']} nats)"
            + (f"; first differences at token {', '.join(differ)} (ours/llama.cpp)" if differ else ""))
