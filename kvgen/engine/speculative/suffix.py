"""Suffix decoding: model-free proposals from a suffix tree over the request's own tokens and over
recent requests' outputs (as Arctic Inference's and vLLM's `suffix` method).

Two depth-bounded suffix trees (tries of every substring up to DEPTH tokens, each node counting how
often its substring occurred):

    per sequence   its prompt and its own output so far, extended as tokens are verified
    global         the outputs of the last requests, shared by all, bounded (LRU) in tokens

Appending token t at the end extends each of the last DEPTH suffixes by t: the nodes of the suffixes
ending at the previous token (`_Tail.nodes[d]` is the node of the last d tokens) each step to their
child t, counted once more. So an update costs O(DEPTH) dictionary operations, never a rebuild, and
the same list of nodes is the match of every suffix length of the context for free.

Proposing for a sequence:

    match       the deepest node of the context's suffixes that has a continuation (in the per-
                sequence tree: the tail's own nodes; in the global tree: walked from the root over
                the last DEPTH tokens, longest first)
    continue    from it, the child counted most often, again and again: each step's probability is
                child count / the node's continuations; the path's probability is their product (at
                the tree's depth the path goes on from the node of its last DEPTH / 2 tokens);
                stop where it falls below MIN_PROB, after max(1, min(K, FACTOR * match length)) tokens,
                or where the tree ends
    choose      of the two trees' candidates, the one with the larger score (sum of the path's
                probabilities: the expected number of accepted tokens)

Ties between equally frequent children go to the latest one seen (dicts keep insertion order; a
child's count is refreshed by moving it last), so a text that repeats its latest variant is followed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from kvgen.engine.speculative.proposer import Proposal, Proposer
from kvgen.scheduling.output import ScheduledChunk
from kvgen.scheduling.sequence import Sequence

DEPTH = 24  # the longest substring a tree holds (vLLM's suffix_decoding_max_tree_depth)
MIN_PROB = 0.1  # stop proposing where the path's estimated probability falls below this
FACTOR = 1.0  # at most FACTOR x the match length tokens are proposed (a 1-token match proposes 1)
GLOBAL_TOKENS = 1 << 14  # the global tree's bound: tokens of recent outputs it holds (~6 KB a token at most)
MIN_OUTPUT = 2  # outputs shorter than this are not cached globally


class SuffixTree:
    """A trie of every substring (up to `depth` tokens) of the sequences inserted, with counts.

    Nodes are ints: `children[n]` maps a token to its child, `counts[n]` is how many times the
    substring ending at n occurred. Freed nodes (after `remove`) are reused."""

    def __init__(self, depth: int = DEPTH) -> None:
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.counts: list[int] = [0]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self._free)

    def _new(self) -> int:
        if self._free:
            node = self._free.pop()
            self.counts[node] = 0
            return node
        self.children.append({})
        self.counts.append(0)
        return len(self.counts) - 1

    def extend(self, nodes: list[int], token: int) -> list[int]:
        """`nodes[d]`: the node of the last d tokens (nodes[0] the root). Appends `token`: each of
        those suffixes (the deepest dropped at `depth`) gains it; returns the new end's nodes."""
        children, counts = self.children, self.counts
        new = [0]
        for node in nodes[: self.depth]:
            kids = children[node]
            child = kids.pop(token, None)
            if child is None:
                child = self._new()
            kids[token] = child  # re-inserted last: the latest child wins ties
            counts[child] += 1
            new.append(child)
        counts[0] += 1
        return new

    def insert(self, tokens: list[int]) -> None:
        nodes = [0]
        for token in tokens:
            nodes = self.extend(nodes, token)

    def remove(self, tokens: list[int]) -> None:
        """Undoes `insert(tokens)`: every count it added is taken back, nodes left at 0 freed."""
        for start in range(len(tokens)):
            node = 0
            self.counts[0] -= 1
            for token in tokens[start : start + self.depth]:
                child = self.children[node][token]
                self.counts[child] -= 1
                if self.counts[child] == 0:
                    self._drop(node, token, child)
                    break
                node = child

    def _drop(self, parent: int, token: int, child: int) -> None:
        del self.children[parent][token]
        stack = [child]
        while stack:  # a node at 0 has only descendants at 0
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self.counts[node] = 0
            self._free.append(node)

    def match(self, context: list[int]) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context` (up to `depth` tokens) in the tree that
        has a continuation; (0, 0) if none."""
        tail = context[-self.depth :]
        for start in range(len(tail)):
            node = 0
            for token in tail[start:]:
                node = self.children[node].get(token, -1)
                if node < 0:
                    break
            if node > 0 and self.children[node]:
                return node, len(tail) - start
        return 0, 0

    def walk(self, tokens: list[int]) -> int:
        """The node of `tokens` (at most `depth` of them), or -1 where the tree has no such path."""
        node = 0
        for token in tokens:
            node = self.children[node].get(token, -1)
            if node < 0:
                return -1
        return node

    def continuation(self, node: int, length: int, context: list[int], limit: int,
                     min_prob: float = MIN_PROB) -> tuple[list[int], float]:
        """The most frequent path of up to `limit` tokens from `node` (the last `length` tokens of
        `context`) while its probability holds above `min_prob`, and its score (the sum of the
        probabilities along it). Where the path reaches the tree's depth it goes on from the node of
        its last depth / 2 tokens, so a long match still proposes up to `limit`."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            kids = self.children[node]
            if not kids and length >= self.depth:
                recent = (context[-self.depth:] + tokens)[-(self.depth // 2):]
                node, length = self.walk(recent), len(recent)
                if node < 0:
                    break
                kids = self.children[node]
            if not kids:
                break
            total = 0
            best_token, best_child, best_count = -1, -1, 0
            for token, child in kids.items():
                count = self.counts[child]
                total += count
                if count >= best_count:
                    best_token, best_child, best_count = token, child, count
            prob *= best_count / total
            if prob < min_prob:
                break
            tokens.append(best_token)
            score += prob
            node, length = best_child, length + 1
        return tokens, score


class _Tail:
    """One sequence's own tree and the nodes of its context's suffixes."""

    __slots__ = ("tree", "nodes", "length")

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.nodes = [0]
        self.length = 0  # tokens of the sequence inserted

    def catch_up(self, token_ids: list[int]) -> None:
        """Inserts the sequence's tokens past those already in (O(depth) each)."""
        for token in token_ids[self.length :]:
            self.nodes = self.tree.extend(self.nodes, token)
        self.length = len(token_ids)

    def match(self) -> tuple[int, int]:
        """The deepest of the context's suffix nodes that has a continuation (an earlier occurrence)."""
        children = self.tree.children
        for depth in range(len(self.nodes) - 1, 0, -1):
            if children[self.nodes[depth]]:
                return self.nodes[depth], depth
        return 0, 0


class Found(NamedTuple):
    """A lookup's proposal and the length of the context's suffix it continues (0: nothing found)."""

    tokens: list[int]
    match: int


class SuffixProposer(Proposer):
    """Found while scheduling (only what is proposed is reserved, as prompt lookup), handed out after.
    Finished sequences' outputs go into the global tree when the engine forgets them."""

    def __init__(self, depth: int = DEPTH, global_tokens: int = GLOBAL_TOKENS, min_prob: float = MIN_PROB,
                 factor: float = FACTOR) -> None:
        self.depth, self.global_tokens, self.min_prob, self.factor = depth, global_tokens, min_prob, factor
        self.global_tree = SuffixTree(depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # seq_id -> its output, oldest first
        self._cached_tokens = 0
        self._tails: dict[int, _Tail] = {}
        self._seqs: dict[int, Sequence] = {}
        self._found: dict[int, list[int]] = {}

    def reserve(self, seq: Sequence, k: int) -> int:
        found = self.find(seq, k).tokens
        self._found[seq.seq_id] = found
        return len(found)

    def find(self, seq: Sequence, k: int) -> Found:
        """The better of the two trees' proposals of up to `k` tokens for `seq` (its tree caught up)."""
        tail = self._tails.get(seq.seq_id)
        if tail is None:
            tail = self._tails[seq.seq_id] = _Tail(self.depth)
        self._seqs[seq.seq_id] = seq
        token_ids = seq.token_ids
        tail.catch_up(token_ids)
        best, best_score = Found([], 0), 0.0
        for tree, (node, length) in ((tail.tree, tail.match()), (self.global_tree, self.global_tree.match(token_ids))):
            if length == 0:
                continue
            limit = min(k, max(1, int(self.factor * length)))
            tokens, score = tree.continuation(node, length, token_ids, limit, self.min_prob)
            if score > best_score:
                best, best_score = Found(tokens, length), score
        return best

    def guess(self, seq: Sequence) -> int | None:
        found = self.find(seq, 1).tokens
        return found[0] if found else None

    def propose(self, chunks: list[ScheduledChunk]) -> list[Proposal]:
        found, self._found = self._found, {}  # a sequence preempted after reserving leaves nothing behind
        return [Proposal(found.get(c.seq.seq_id, [])[: c.num_lookahead]) for c in chunks]

    def forget(self, seq_id: int) -> None:
        """Finished or preempted: its own tree goes; its output so far enters the global tree (a
        preempted sequence's later, longer output replaces it)."""
        self._tails.pop(seq_id, None)
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.cache_output(seq_id, list(seq.output_token_ids))

    def cache_output(self, key: int, output: list[int]) -> None:
        """Adds `output` to the global tree under `key` (replacing what `key` held), then evicts the
        oldest outputs until at most `global_tokens` tokens remain."""
        old = self._cached.pop(key, None)
        if old is not None:
            self.global_tree.remove(old)
            self._cached_tokens -= len(old)
        if len(output) < MIN_OUTPUT or len(output) > self.global_tokens:
            return
        self.global_tree.insert(output)
        self._cached[key] = output
        self._cached_tokens += len(output)
        while self._cached_tokens > self.global_tokens:
            _, evicted = self._cached.popitem(last=False)
            self.global_tree.remove(evicted)
            self._cached_tokens -= len(evicted)

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens
