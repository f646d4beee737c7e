"""Which drafts a step verifies: the expected accepted tokens against the measured cost of rows.

Each candidate draft token i of a request is worth alpha^i expected tokens, alpha being the
request's running acceptance rate (a draft token is only accepted if every one before it was).
Taking candidates best first, a step of B requests with n extra rows yields about
B + sum(worth) tokens for cost(B + n) seconds (cost_model.py); the policy keeps the n that gives
the most tokens per second, and none unless that beats plain decode (B / cost(B)) by `margin`:
the worths are estimates, and a draft that only breaks even on paper loses to their error.
A batch where extra rows cost as much as they can return speculates no more: at large batch
sizes a CPU forward is compute-bound and speculation turns itself off.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphexec.speculative.cost_model import StepCosts


def choose_lengths(
    alphas: Sequence[float],
    proposals: Sequence[int],
    costs: StepCosts,
    spare_rows: int,
    margin: float = 0.1,
) -> list[int]:
    """Per request, how many of its proposed draft tokens to verify (request r proposed
    `proposals[r]`, accepts each with rate `alphas[r]`); at most `spare_rows` in all."""
    batch = len(proposals)
    base = costs.estimate(batch)
    lengths = [0] * batch
    if base is None or spare_rows <= 0:
        return lengths
    candidates = sorted(
        ((alpha**i, r) for r, (alpha, k) in enumerate(zip(alphas, proposals)) for i in range(1, k + 1)),
        key=lambda c: -c[0],
    )[:spare_rows]
    best_rate, best_n = batch / base * (1 + margin), 0
    tokens = float(batch)
    for n, (worth, _) in enumerate(candidates, start=1):
        tokens += worth
        seconds = costs.estimate(batch + n)
        if seconds and tokens / seconds > best_rate:
            best_rate, best_n = tokens / seconds, n
    for _, r in candidates[:best_n]:
        lengths[r] += 1
    return lengths
