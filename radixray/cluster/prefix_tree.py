"""An approximate radix tree over request text, shared by many workers ("tenants").

The router keeps one of these to guess which worker already holds a request's prefix in
its KV cache, the way SGLang's sgl-model-gateway ``cache_aware`` policy does. It works on
characters, not tokens: a token-id-only request is routed as ``"".join(map(chr, ids))``,
so any code point (lone surrogates included) is a valid character here.

Each node holds an edge of text, its children keyed by their first character, its parent,
and ``tenants``: worker -> last access time. Invariant kept by every method: a node's
tenants are a subset of its parent's (a worker recorded on a node is recorded on the whole
path from the root to it), so one walk from the root answers a match for every worker.

Walks are iterative, so texts of any length work without hitting the recursion limit.
"""

from __future__ import annotations

import heapq
from itertools import count


class _Node:
    __slots__ = ("text", "children", "tenants", "parent")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}
        self.parent = parent


def _common_prefix_len(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]``."""
    if text.startswith(edge, start):
        return len(edge)
    n = min(len(edge), len(text) - start)
    i = 0
    while i < n and edge[i] == text[start + i]:
        i += 1
    return i


def _step(node: _Node, text: str, i: int) -> tuple[_Node | None, int]:
    """The child of ``node`` that ``text[i:]`` enters, and how many of its chars match."""
    child = node.children.get(text[i])
    return (None, 0) if child is None else (child, _common_prefix_len(child.text, text, i))


class PrefixTree:
    """Radix tree of request texts, each path tagged with the workers it was sent to.

    Not thread-safe: the owner (the router) serializes all calls. ``now`` arguments are
    timestamps from the owner's clock; only their order matters (for LRU eviction).

    Per-worker size = the sum of the edge lengths of the nodes that list the worker; it is
    kept up to date incrementally and is what :meth:`evict` bounds.
    """

    def __init__(self) -> None:
        self._root = _Node("", None)
        self._sizes: dict[str, int] = {}
        self._num_nodes = 0
        self._total_chars = 0

    # ----------------------------------------------------------------- updates

    def insert(self, text: str, worker: str, now: float) -> None:
        """Record ``worker`` on every node along the path of ``text``, access time ``now``.

        Creates the missing tail node and splits an edge where ``text`` diverges inside it
        (the new upper node copies the lower one's tenants, so sizes do not change on a
        split). Empty text is a no-op.
        """
        node = self._root
        i = 0
        n = len(text)
        while i < n:
            child, k = _step(node, text, i)
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[worker] = now
                node.children[text[i]] = leaf
                self._num_nodes += 1
                self._total_chars += n - i
                self._sizes[worker] = self._sizes.get(worker, 0) + (n - i)
                return
            if k < len(child.text):
                child = self._split(child, k)
            if worker not in child.tenants:
                self._sizes[worker] = self._sizes.get(worker, 0) + len(child.text)
            child.tenants[worker] = now
            i += k
            node = child

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after ``k`` chars (0 < k < len); return the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.text)
        upper = _Node(child.text[:k], parent)
        upper.tenants = dict(child.tenants)
        parent.children[child.text[0]] = upper
        child.text = child.text[k:]
        child.parent = upper
        upper.children[child.text[0]] = child
        self._num_nodes += 1
        return upper

    def remove_worker(self, worker: str) -> None:
        """Drop ``worker`` from every node; nodes left with no tenant are pruned."""
        if worker not in self._sizes:
            return
        stack = [c for c in self._root.children.values() if worker in c.tenants]
        while stack:
            node = stack.pop()
            # By the invariant, only children of a node that lists the worker can list it.
            stack.extend(c for c in node.children.values() if worker in c.tenants)
            del node.tenants[worker]
            if not node.tenants:
                self._detach(node)
        del self._sizes[worker]

    def _detach(self, node: _Node) -> None:
        """Unlink a node that has no tenants left (its descendants have none either)."""
        parent = node.parent
        if parent is not None and parent.children.get(node.text[0]) is node:
            del parent.children[node.text[0]]
        node.parent = None
        self._num_nodes -= 1
        self._total_chars -= len(node.text)

    def evict(self, max_size: int) -> int:
        """Shrink every worker whose size exceeds ``max_size`` to at most ``max_size``.

        For each such worker, repeatedly drops it from its least recently used leaf (a node
        listing the worker that has no child listing it); a parent becomes a leaf for the
        worker once its last such child is gone. Other workers' entries are untouched,
        except that a node with no tenant left is pruned. Returns the total chars removed
        from worker sizes.
        """
        removed = 0
        for worker in [w for w, size in self._sizes.items() if size > max_size]:
            removed += self._evict_worker(worker, max_size)
        return removed

    def _evict_worker(self, worker: str, max_size: int) -> int:
        seq = count()
        heap: list[tuple[float, int, _Node]] = []
        stack = [c for c in self._root.children.values() if worker in c.tenants]
        while stack:
            node = stack.pop()
            listed = [c for c in node.children.values() if worker in c.tenants]
            if listed:
                stack.extend(listed)
            else:
                heap.append((node.tenants[worker], next(seq), node))
        heapq.heapify(heap)
        removed = 0
        while heap and self._sizes[worker] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[worker]
            self._sizes[worker] -= len(node.text)
            removed += len(node.text)
            parent = node.parent
            if not node.tenants:
                self._detach(node)
            if (
                parent is not None
                and parent is not self._root
                and worker in parent.tenants
                and not any(worker in c.tenants for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.tenants[worker], next(seq), parent))
        if self._sizes[worker] == 0:
            del self._sizes[worker]
        return removed

    # ----------------------------------------------------------------- queries

    def match(self, text: str, now: float | None = None) -> dict[str, int]:
        """For each worker, the length of the longest prefix of ``text`` inserted for it.

        A partial match inside an edge counts the matched chars for every tenant of that
        node. Workers with no matched char are omitted. With ``now``, the access time of
        every returned worker is bumped on the matched nodes (and only those).
        """
        result: dict[str, int] = {}
        path: list[_Node] = []
        node, i = self._root, 0
        while i < len(text):
            child, k = _step(node, text, i)
            if child is None:
                break
            i += k
            # Tenants shrink along the path, so the deepest write per worker is its match.
            for w in child.tenants:
                result[w] = i
            path.append(child)
            if k < len(child.text):
                break
            node = child
        if now is not None:
            for matched in path:
                for w in matched.tenants:
                    matched.tenants[w] = now
        return result

    def worker_size(self, worker: str) -> int:
        """Chars the tree holds for ``worker`` (0 if it holds none)."""
        return self._sizes.get(worker, 0)

    def worker_sizes(self) -> dict[str, int]:
        """A copy of worker -> chars for every worker with a non-zero size."""
        return {w: s for w, s in self._sizes.items() if s}

    def num_nodes(self) -> int:
        """Number of nodes, not counting the (empty) root."""
        return self._num_nodes

    def total_chars(self) -> int:
        """Sum of the edge lengths of all nodes (each shared edge counted once)."""
        return self._total_chars

    def __len__(self) -> int:
        return self._total_chars
