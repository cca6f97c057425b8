"""Prefix-tree batches for the benchmarks (issue 33): the shapes, their rows, the FlexAttention
tree mask.

Three shapes from real use, their lengths drawn with a fixed seed (``scale`` shrinks every length
for CPU smoke runs):

* ``branching``  branching rollouts: a 4K prompt, 4 branches at each of 3 depths (64 leaves),
                 512-1024 tokens per segment; each leaf a row, its response everything after the
                 prompt.
* ``agentic``    agentic multi-turn batch: per task a 6K context, trajectories branching in two at
                 each of turns 1-3 (into 8), then a 4th turn each; turns of 300-900 tokens; every
                 turn is a training sample, so the rows are each turn's whole prefix (22 rows per
                 task, rho ~ 9), the response of a row its last turn.
* ``sysprompt``  a 4K system prompt shared by 8 groups of 16 responses: group prompts of
                 1.5-2.5K, responses log-normal around 1K (64 to 4K); a row is system prompt +
                 group prompt + response.
* ``long-horizon`` deep trees: per task a 4K context and two trajectories of 24 turns of
                 150-600 tokens each, parting at the first turn; every turn a sample (rho ~ 20).

The tree is listed depth-first (as ``dualkv.pack(..., tree=True)`` packs it). A row that ends
where the tree goes on (an agentic turn that later turns extend) gets an empty leaf in
:meth:`TreeBatch.layout_forest`, so that ``Layout.tree``'s unshared rows (one per leaf) are the
batch's rows and its ``token_reduction`` is theirs.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

Forest = tuple[list[int], list[int]]  # (parents, lengths)


@dataclass(frozen=True)
class TreeBatch:
    """A forest of segments (depth-first packed order) and the rows trained on it.

    Attributes:
        name: the shape's name.
        parents: parent segment of each segment (-1 for a root), ``parents[i] < i``.
        lengths: tokens of each segment (> 0).
        rows: per row ``(end, response)``: the row is the path from its root to segment ``end``;
            its response is the part of that path from segment ``response`` (an ancestor of
            ``end``, or ``end`` itself) on, its prompt the part before.
        task: per row, the tree (task) it belongs to: its GRPO group.
    """

    name: str
    parents: list[int]
    lengths: list[int]
    rows: list[tuple[int, int]]
    task: list[int]

    def path(self, seg: int) -> list[int]:
        """Segments from the root to ``seg`` (root first)."""
        out = [seg]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def row_lengths(self) -> list[tuple[int, int]]:
        """``(prompt tokens, response tokens)`` of each row."""
        out = []
        for end, resp in self.rows:
            path = self.path(end)
            cut = path.index(resp)
            out.append(
                (sum(self.lengths[s] for s in path[:cut]), sum(self.lengths[s] for s in path[cut:]))
            )
        return out

    @property
    def packed_tokens(self) -> int:
        return sum(self.lengths)

    def tree_tokens(self) -> list[int]:
        """Packed tokens of each tree (its root's subtree), roots in list order."""
        roots = [s for s, p in enumerate(self.parents) if p < 0]
        out = [0] * len(roots)
        for s, n in enumerate(self.lengths):
            out[roots.index(self.path(s)[0])] += n
        return out

    @property
    def row_tokens(self) -> int:
        """Tokens of the unshared rows."""
        return sum(p + r for p, r in self.row_lengths())

    def layout_forest(self) -> Forest:
        """``(parents, lengths)`` for ``dualkv.Layout.tree``: the segments, plus an empty leaf
        under every row end that has children (appended: no token moves)."""
        ends = {end for end, _ in self.rows}
        inner = set(self.parents)
        leaves = [s for s in range(len(self.parents)) if s not in inner]
        if any(s not in ends for s in leaves):
            raise ValueError(f"{self.name}: a leaf that no row ends at")
        extra = sorted(ends & inner)
        return self.parents + extra, self.lengths + [0] * len(extra)

    def packed_forest(self) -> Forest:
        """``(parents, lengths)`` as ``dualkv.pack(tree=True, min_shared=1)`` packs the rows:
        segments end only where the tree branches (a segment with one child goes on into it;
        the rows that end there read a prefix of it). No token moves: the tree is listed
        depth-first, so an only child follows its parent."""
        kids = [0] * len(self.parents)
        for q in self.parents:
            if q >= 0:
                kids[q] += 1
        parents: list[int] = []
        lengths: list[int] = []
        merged: list[int] = []  # the packed segment of each listed one
        for s, q in enumerate(self.parents):
            if q >= 0 and kids[q] == 1:
                if q != s - 1:
                    raise ValueError(f"{self.name}: segment {s}, an only child, does not follow "
                                     f"its parent {q}")  # fmt: skip
                merged.append(merged[q])
                lengths[merged[q]] += self.lengths[s]
            else:
                merged.append(len(parents))
                parents.append(merged[q] if q >= 0 else -1)
                lengths.append(self.lengths[s])
        return parents, lengths

    def twin(self) -> tuple[int, int, int]:
        """``(N, P, R)`` of the depth-two layout of comparable size: one prompt of the mean root
        length and N equal responses as long as the rows' mean part below their root, N such
        that the packed tokens are about the tree's (the "tree >= 90% of the depth-two kernel's
        TF/s" comparison)."""
        roots = [s for s, p in enumerate(self.parents) if p < 0]
        p = round(sum(self.lengths[s] for s in roots) / len(roots))
        below = [sum(self.lengths[s] for s in self.path(end)[1:]) for end, _ in self.rows]
        r = max(1, round(sum(below) / len(below)))
        n = max(1, round((self.packed_tokens - p) / r))
        return n, p, r

    def token_rows(
        self, vocab: int, seed: int = 0
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Random token ids for the segments (distinct first tokens among siblings, so that the
        rows share exactly the tree's segments): per row its prompt and response token lists,
        and its task."""
        g = torch.Generator().manual_seed(seed)
        tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in self.lengths]
        children: dict[int, list[int]] = {}
        for s, p in enumerate(self.parents):
            children.setdefault(p, []).append(s)
        for kids in children.values():  # siblings must differ at their first token
            for i, s in enumerate(kids):
                tokens[s][0] = (tokens[kids[0]][0] + i) % vocab
        if len(children.get(-1, [])) > vocab or any(len(k) > vocab for k in children.values()):
            raise ValueError(f"{self.name}: more siblings than the vocabulary has tokens")
        prompts, responses = [], []
        for end, resp in self.rows:
            path = self.path(end)
            cut = path.index(resp)
            prompts.append([t for s in path[:cut] for t in tokens[s]])
            responses.append([t for s in path[cut:] for t in tokens[s]])
        return prompts, responses, list(self.task)

    def describe(self) -> str:
        depth = max(len(self.path(s)) for s in range(len(self.parents)))
        return (
            f"{self.name}: {len(self.parents)} segments, depth {depth}, {len(self.rows)} rows, "
            f"{self.packed_tokens} packed tokens, {self.row_tokens} row tokens "
            f"(rho {self.row_tokens / self.packed_tokens:.2f})"
        )


def _length(rng: random.Random, lo: int, hi: int, scale: float) -> int:
    return max(1, round(rng.randint(lo, hi) * scale))


def branching(seed: int = 0, scale: float = 1.0, prompt: int = 4096, branches: int = 4,
              depths: int = 3) -> TreeBatch:  # fmt: skip
    """Branching rollouts (tree search): a prompt, ``branches`` children at each of ``depths``
    levels, 512-1024 tokens per segment; a row per leaf, its response all of it below the
    prompt."""
    rng = random.Random(seed)
    parents, lengths = [-1], [max(1, round(prompt * scale))]
    rows: list[tuple[int, int]] = []

    def grow(seg: int, level: int, first: int) -> None:
        for _ in range(branches):
            parents.append(seg)
            lengths.append(_length(rng, 512, 1024, scale))
            me = len(parents) - 1
            top = me if level == 1 else first
            if level == depths:
                rows.append((me, top))
            else:
                grow(me, level + 1, top)

    grow(0, 1, -1)
    return TreeBatch("branching", parents, lengths, rows, [0] * len(rows))


def agentic(tasks: int = 4, seed: int = 0, scale: float = 1.0, context: int = 6144) -> TreeBatch:
    """Agentic multi-turn batch: ``tasks`` trees, each a context of ``context`` tokens and
    trajectories that branch in two at each of turns 1-3 (8 trajectories), then a 4th turn each;
    turns of 300-900 tokens. Every turn is a training sample: a row per turn (its whole prefix),
    its response the turn."""
    rng = random.Random(seed)
    parents: list[int] = []
    lengths: list[int] = []
    rows: list[tuple[int, int]] = []
    task: list[int] = []

    def turn(seg: int, number: int, t: int) -> None:
        for _ in range(2 if number <= 3 else 1):
            parents.append(seg)
            lengths.append(_length(rng, 300, 900, scale))
            me = len(parents) - 1
            rows.append((me, me))
            task.append(t)
            if number < 4:
                turn(me, number + 1, t)

    for t in range(tasks):
        parents.append(-1)
        lengths.append(max(1, round(context * scale)))
        turn(len(parents) - 1, 1, t)
    return TreeBatch("agentic", parents, lengths, rows, task)


def sysprompt(seed: int = 0, scale: float = 1.0, system: int = 4096, groups: int = 8,
              responses: int = 16) -> TreeBatch:  # fmt: skip
    """A system prompt shared by ``groups`` GRPO groups: group prompts of 1.5-2.5K tokens,
    ``responses`` per group, log-normal lengths (median 1024, sigma 0.6, 64 to 4096)."""
    rng = random.Random(seed)
    parents, lengths = [-1], [max(1, round(system * scale))]
    rows: list[tuple[int, int]] = []
    task: list[int] = []
    for g in range(groups):
        parents.append(0)
        lengths.append(_length(rng, 1536, 2560, scale))
        prompt = len(parents) - 1
        for _ in range(responses):
            n = min(4096, max(64, round(math.exp(math.log(1024) + 0.6 * rng.gauss(0, 1)))))
            parents.append(prompt)
            lengths.append(max(1, round(n * scale)))
            rows.append((len(parents) - 1, len(parents) - 1))
            task.append(g)
    return TreeBatch("sysprompt", parents, lengths, rows, task)


def long_horizon(tasks: int = 3, seed: int = 0, scale: float = 1.0, context: int = 4096,
                 turns: int = 24) -> TreeBatch:  # fmt: skip
    """Long-horizon agent batch (deep trees): ``tasks`` trees, each a context of ``context``
    tokens and two trajectories that part at the first turn and then go on alone for ``turns``
    turns of 150-600 tokens. Every turn is a training sample: a row per turn (its whole prefix),
    its response the turn. A query of turn t walks t - 1 middle ancestors, so this is the shape
    where the walk's cost per ancestor shows (the others have at most 3)."""
    rng = random.Random(seed)
    parents: list[int] = []
    lengths: list[int] = []
    rows: list[tuple[int, int]] = []
    task: list[int] = []
    for t in range(tasks):
        parents.append(-1)
        lengths.append(max(1, round(context * scale)))
        root = len(parents) - 1
        for _ in range(2):
            at = root
            for _ in range(turns):
                parents.append(at)
                lengths.append(_length(rng, 150, 600, scale))
                at = len(parents) - 1
                rows.append((at, at))
                task.append(t)
    return TreeBatch("long-horizon", parents, lengths, rows, task)


TREES: dict[str, Callable[..., TreeBatch]] = {
    "branching": branching,
    "agentic": agentic,
    "sysprompt": sysprompt,
    "long-horizon": long_horizon,
}


def short_prefix_batch(
    groups: int = 4,
    responses: int = 16,
    seed: int = 0,
    scale: float = 1.0,
) -> TreeBatch:
    """GRPO groups whose responses begin with short shared prefixes (the min_shared sweep): each
    group a prompt of 1-3K tokens; its responses first split into clusters that share a
    beginning of 2-48 tokens (a formatting prefix, a restated question), within a cluster some
    share a further 16-256 tokens, then each goes on alone (300-1500 tokens)."""
    rng = random.Random(seed)
    parents: list[int] = []
    lengths: list[int] = []
    rows: list[tuple[int, int]] = []
    task: list[int] = []
    for g in range(groups):
        parents.append(-1)
        lengths.append(_length(rng, 1024, 3072, scale))
        prompt = len(parents) - 1
        left = responses
        while left:
            size = min(left, rng.randint(2, 6))
            left -= size
            parents.append(prompt)
            lengths.append(_length(rng, 2, 48, scale))
            cluster = len(parents) - 1
            sub = rng.randint(1, size)  # responses that share a second, longer part
            below = cluster
            if sub > 1:
                parents.append(cluster)
                lengths.append(_length(rng, 16, 256, scale))
                below = len(parents) - 1
            for i in range(size):
                parents.append(below if i < sub else cluster)
                lengths.append(_length(rng, 300, 1500, scale))
                rows.append((len(parents) - 1, cluster))
                task.append(g)
    return TreeBatch("short-prefix", *_depth_first(parents, lengths, rows), task)


def _depth_first(
    parents: list[int], lengths: list[int], rows: list[tuple[int, int]]
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The forest relisted depth-first (children in list order), rows renumbered."""
    children: dict[int, list[int]] = {}
    for s, p in enumerate(parents):
        children.setdefault(p, []).append(s)
    order: list[int] = []
    stack = children.get(-1, [])[::-1]
    while stack:
        s = stack.pop()
        order.append(s)
        stack.extend(children.get(s, [])[::-1])
    new = {s: i for i, s in enumerate(order)}
    return (
        [new[parents[s]] if parents[s] >= 0 else -1 for s in order],
        [lengths[s] for s in order],
        [(new[e], new[r]) for e, r in rows],
    )


def forest_rows(parents: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """The unshared rows of a forest: for each leaf (in list order; empty ones included), the
    packed token indices of its root-to-leaf path."""
    starts = [0, *itertools.accumulate(lengths)]
    inner = set(parents)
    rows = []
    for leaf in range(len(parents)):
        if leaf in inner:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        rows.append(torch.cat([torch.arange(starts[s], starts[s + 1]) for s in path[::-1]]))
    return rows


# --- FlexAttention's tree mask -------------------------------------------------------------------


def tree_mask_tensors(
    parents: list[int], lengths: list[int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed token: the pre-order rank of its segment, one past the last pre-order rank of
    that segment's subtree, and its logical position (the tokens of its ancestors before it).
    Segment a is an ancestor of segment s, or s itself, iff pre[a] <= pre[s] < end[a]."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for s, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(s)
    pre, end, pos0 = [0] * n, [0] * n, [0] * n
    rank = 0
    stack = [(s, False) for s in roots[::-1]]
    while stack:
        s, done = stack.pop()
        if done:
            end[s] = rank
            continue
        pre[s] = rank
        rank += 1
        p = parents[s]
        pos0[s] = pos0[p] + lengths[p] if p >= 0 else 0
        stack.append((s, True))
        stack.extend((c, False) for c in children[s][::-1])
    seg = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths, dtype=torch.int64))
    start = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0) - torch.tensor(lengths)
    pos = torch.tensor(pos0)[seg] + torch.arange(seg.numel()) - start[seg]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)[seg].to(device)  # noqa: E731
    return as_int(pre), as_int(end), pos.to(device=device, dtype=torch.int32)


def tree_mask_mod(
    parents: list[int], lengths: list[int], device: torch.device | str, window: int | None = None
) -> Callable[..., torch.Tensor]:
    """The FlexAttention ``mask_mod`` of a packed forest (the mask AReaL-style tree training
    builds): key k is visible to query q iff k's segment is an ancestor of q's or q's own
    (pre-order intervals) and pos(k) <= pos(q); with a window also pos(q) - pos(k) < window."""
    pre, end, pos = tree_mask_tensors(parents, lengths, device)

    def mask_mod(b, h, q, kv):  # noqa: ANN001, ANN202
        visible = (pre[kv] <= pre[q]) & (pre[q] < end[kv]) & (pos[kv] <= pos[q])
        return visible if window is None else visible & (pos[q] - pos[kv] < window)

    return mask_mod


_COMPILED: dict[str, Callable[..., object]] = {}


def tree_block_mask(
    parents: list[int], lengths: list[int], device: torch.device | str, window: int | None = None
) -> object:
    """The tree mask as a FlexAttention ``BlockMask``. On CUDA ``create_block_mask`` is compiled
    (FlexAttention's advice for long sequences: eager, it materialises [T, T] intermediates,
    ~8 bytes each, out of memory at the shapes above); eager on the CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    t = sum(lengths)
    fn: Callable[..., object] = create_block_mask
    if torch.device(device).type == "cuda":
        if "create" not in _COMPILED:
            _COMPILED["create"] = torch.compile(create_block_mask)
        fn = _COMPILED["create"]
    mod = tree_mask_mod(parents, lengths, device, window)
    return fn(mod, 1, None, t, t, device=device)
