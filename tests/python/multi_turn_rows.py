"""Multi-turn agent rows for the trainer tests: tasks behind one system prompt, each with a
trajectory of assistant turns and tool outputs, as training rows of two kinds:

* veRL's agent loop (``ToolAgentLoop``): prompt = system + question, response = every later turn,
  tool outputs included and masked out of the loss (``response_mask`` 0);
* per-turn samples: one row per assistant turn, its prompt the whole conversation before it (so
  each turn's row is a prefix of the next turn's), its response the turn; a branch at turn 2
  gives two rows with the same prompt.

Rows of a task share its question and first turn (and more); every row shares the system prompt.
"""

from __future__ import annotations

import random
from typing import NamedTuple


class AgentRow(NamedTuple):
    prompt: list[int]
    response: list[int]
    scored: list[int]  # per response token: 1 assistant (in the loss), 0 tool output
    task: int


def agent_rows(
    rng: random.Random,
    vocab: int,
    tasks: int = 3,
    system: int = 70,
    rollouts: int = 1,
    turn: tuple[int, int] = (66, 80),
    tool: tuple[int, int] = (4, 14),
) -> list[AgentRow]:
    """The rows of ``tasks`` tasks (see the module docstring), in task order."""

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    def turns(*parts: list[int]) -> tuple[list[int], list[int]]:
        """Alternating assistant turns and tool outputs: tokens and their loss mask."""
        out, scored = [], []
        for i, p in enumerate(parts):
            out += p
            scored += [1 - i % 2] * len(p)
        return out, scored

    sys_prompt = tokens(system, system)
    rows = []
    for t in range(tasks):
        head = sys_prompt + tokens(3, 9)
        a1, t1, a2a, t2a, a3a, a2b = (tokens(*turn), tokens(*tool), tokens(*turn),
                                      tokens(*tool), tokens(*turn), tokens(*turn))  # fmt: skip
        # per-turn samples: each turn's prompt is the conversation before it
        rows.append(AgentRow(head, a1, [1] * len(a1), t))
        rows.append(AgentRow(head + a1 + t1, a2a, [1] * len(a2a), t))
        rows.append(AgentRow(head + a1 + t1, a2b, [1] * len(a2b), t))
        rows.append(AgentRow(head + a1 + t1 + a2a + t2a, a3a, [1] * len(a3a), t))
        # the agent loop's rows: the same trajectory, and independent rollouts of the task
        rows.append(AgentRow(head, *turns(a1, t1, a2a, t2a, a3a), t))
        for _ in range(rollouts):
            rows.append(AgentRow(head, *turns(tokens(*turn), tokens(*tool), tokens(*turn)), t))
    return rows


def grpo_groups_and_one_branching(
    rng: random.Random,
    vocab: int,
    groups: int = 20,
    shared: int = 40,
    prompt: tuple[int, int] = (64, 80),
) -> tuple[list[list[int]], list[list[list[int]]], int]:
    """An ordinary GRPO batch (``groups`` prompts of 64-80 tokens, 2-4 responses of 1-12 tokens,
    nothing shared beyond a prompt: a group's responses begin with distinct tokens) plus one
    group of branching rollouts: 4 responses that share their first ``shared`` tokens. As
    ``rows_from_lists`` takes them: ``(prompts, responses, index of the branching group)``, the
    branching group at a random index."""

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]

    prompts = [tokens(*prompt) for _ in range(groups)]
    responses = [
        [[first, *tokens(0, 11)] for first in rng.sample(range(vocab), rng.randint(2, 4))]
        for _ in range(groups)
    ]
    at = rng.randint(0, groups)
    stem = tokens(shared, shared)
    prompts.insert(at, tokens(70, 70))
    responses.insert(at, [stem + tokens(3, 10) for _ in range(4)])
    return prompts, responses, at
