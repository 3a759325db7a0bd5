"""Radix prefix cache: a radix tree over token ids whose nodes own KV slots.

Each edge of the tree carries a run of token ids together with the KV slot
indices (int64) that hold those tokens' keys/values. Cached prefixes and running
requests share one KV pool: slots handed to the tree by ``insert`` belong to the
tree from then on, and the tree gives them back to the allocator only when it
evicts a leaf or is reset.

Ownership contract with the caller (the scheduler):

* ``match_prefix`` never changes slot ownership; it only reports which slots
  hold a prefix. The caller must ``inc_lock_ref(result.last_node)`` before using
  those slots and ``dec_lock_ref`` the same node when it is done, so eviction
  cannot free KV that a running request reads.
* ``insert(key, slots)`` takes ownership of the slots for the part of ``key``
  that was not in the tree yet. For the leading part that *was* already there,
  the tree keeps its own copy and the caller's slots are duplicates: the caller
  frees them (the tree never frees slots it was not given).

* Weight versions: KV computed under one version of the model's weights is
  never reused under another. ``set_version(v)`` *retires* the current tree and
  starts an empty one for ``v``; ``match_prefix`` and ``insert`` only ever see
  the current tree. A retired tree keeps only the nodes some request still has
  locked (a request paused in place across a weight update goes on reading its
  old KV): its unlocked nodes are freed at once, and each locked one is freed
  as soon as its last lock goes (``dec_lock_ref``). So a retired tree is never
  matched, holds no evictable tokens, and is dropped when empty. A request
  admitted under an older version must not ``insert`` its KV (the caller frees
  it instead). The size counters and ``all_slots`` cover retired trees too, so
  free + request-held + cache-held == pool size holds across updates.

A node with ``lock_ref > 0`` is protected; locking a node locks its whole path
to its tree's root. A root holds no tokens and is never counted or evicted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixray.engine.mem_cache.pool import TokenSlotAllocator

_EVICTION_POLICIES = ("lru", "lfu")


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two int sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)  # identity semantics: nodes are used as distinct objects
class TreeNode:
    """One node; ``key`` and ``slots`` describe the edge from the parent to this node."""

    key: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=_empty_slots)
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)


@dataclass
class MatchResult:
    slots: torch.Tensor  # int64 slots of the matched prefix, len == matched tokens
    last_node: TreeNode  # deepest matched node (root if none); lock it while the prefix is in use


class RadixCache:
    """Prefix cache over token ids; see the module docstring for the ownership contract.

    ``allocator`` receives evicted slots; ``None`` makes a simulated cache whose
    slots are arbitrary ints that eviction simply drops (unit tests, planning).
    ``disable=True`` builds a cache that matches nothing and stores nothing, so
    the scheduler can use the same code path with the cache off.
    ``eviction_policy``: ``"lru"`` evicts the least recently matched leaf first;
    ``"lfu"`` the least often matched one (ties broken by recency).
    ``version`` is the weights the current tree's KV belongs to (see ``set_version``;
    the engine passes its weight generation, an int that every weight change advances,
    not the user-facing version label).
    """

    def __init__(self, allocator: TokenSlotAllocator | None, *, disable: bool = False,
                 eviction_policy: str = "lru"):
        if eviction_policy not in _EVICTION_POLICIES:
            raise ValueError(
                f"radix_eviction_policy must be one of {_EVICTION_POLICIES}, got {eviction_policy!r}"
            )
        self.allocator = allocator
        self._disabled = disable
        self.eviction_policy = eviction_policy
        self.version = 0
        # Called with each leaf ``evict`` is about to free, while its slots still hold its
        # KV (the hierarchical cache's write_back copies it to the host tier here).
        self.on_evict: Callable[[TreeNode], None] | None = None
        self._reset_tree()

    @classmethod
    def create_simulated(cls, **kw) -> RadixCache:
        """A cache with no allocator: slots are caller-chosen ints and eviction just drops them."""
        return cls(None, **kw)

    @property
    def disabled(self) -> bool:
        return self._disabled

    # ------------------------------------------------------------------ state

    def _reset_tree(self) -> None:
        """Drop every node without freeing slots (used at construction and by ``reset``)."""
        self.root_node = TreeNode()
        # Roots of trees of older weight versions that still hold locked KV, oldest first.
        self._retired: list[TreeNode] = []
        self._evictable = 0
        self._protected = 0
        # A logical clock instead of wall time: strictly increasing, so LRU order
        # is deterministic even for accesses within the same clock tick.
        self._clock = 0

    def reset(self) -> None:
        """Give every slot the tree holds back to the allocator and empty the tree.

        Only valid when no request holds a lock (their KV would be freed under them).
        """
        assert self._protected == 0, "reset() while radix cache nodes are locked"
        if self.allocator is not None:
            slots = self.all_slots()
            if slots.numel():
                self.allocator.free(slots)
        self._reset_tree()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def set_version(self, version: int) -> None:
        """New weights went live: from now on only KV computed under ``version`` is shared.

        The current tree is retired: its unlocked nodes are freed now, its locked
        ones (KV that running requests still read) stay until their last lock goes,
        and none of it is ever matched again; an empty tree starts for ``version``.
        The same version again is a no-op; a disabled cache only records it.
        """
        if version == self.version:
            return
        self.version = version
        if self._disabled:
            return
        old, self.root_node = self.root_node, TreeNode()
        self._evict_tree(old, self.total_size())
        if old.children:
            self._retired.append(old)

    # ----------------------------------------------------------------- lookup

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key``: its slots and the deepest node on the path.

        If the match ends inside an edge, that node is split so ``last_node``
        covers exactly the matched tokens. Every node on the path gets a fresh
        access time and ``hit_count += 1``. Slot ownership does not change.

        The caller applies the "at most prompt_len - 1 tokens" rule by passing
        ``prompt[:prompt_len - 1]``: the last prompt token must always be
        prefilled, because its logits sample the first output token.
        """
        if self._disabled or len(key) == 0:
            return MatchResult(_empty_slots(), self.root_node)
        key = list(key)
        now = self._tick()
        node = self.root_node
        pieces: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            child.hit_count += 1
            pieces.append(child.slots)
            pos += n
            node = child
            # A mismatch inside the edge now sits at a node boundary, so the next
            # children lookup fails (or the key is used up) and the loop ends.
        slots = torch.cat(pieces) if pieces else _empty_slots()
        return MatchResult(slots, node)

    def walk(self, key: list[int]) -> list[tuple[TreeNode, int]]:
        """The nodes along ``key``'s cached path with how many of each one's tokens match
        (the last may match part of its edge). Changes nothing: no split, no access time,
        no hit count (a lookup that is not a use)."""
        if self._disabled:
            return []
        node, pos, path = self.root_node, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:pos + len(child.key)])
            path.append((child, n))
            pos += n
            if n < len(child.key):
                break
            node = child
        return path

    @staticmethod
    def path_of(node: TreeNode) -> tuple[list[int], torch.Tensor]:
        """Key and slots of the whole path from the root to ``node``."""
        keys, slots = [], []
        while node.parent is not None:
            keys.append(node.key)
            slots.append(node.slots)
            node = node.parent
        key = [t for k in reversed(keys) for t in k]
        return key, torch.cat(slots[::-1]) if slots else _empty_slots()

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Cache ``key`` with KV ``slots`` (``len(slots) == len(key)``).

        Returns how many leading tokens of ``key`` were already in the tree
        before this call. The tree keeps its own slots for those; the caller's
        slots in that range are duplicates, and the caller frees the ones it
        owns (``[its locked prefix length, returned value)``). The remaining
        slots are copied into a new leaf and owned by the tree from now on.
        Disabled cache: stores nothing and returns 0.
        """
        if len(slots) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        if self._disabled or len(key) == 0:
            return 0
        key = list(key)
        now = self._tick()
        node = self.root_node
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                # Clone: the caller's tensor is often a view of the request table
                # row, which is reused by the next request.
                new_slots = torch.as_tensor(slots[pos:], dtype=torch.int64).clone()
                leaf = TreeNode(key=key[pos:], slots=new_slots, parent=node, last_access=now)
                node.children[key[pos]] = leaf
                self._evictable += len(leaf)
                return pos
            n = _common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split ``node``'s edge after ``n`` tokens (0 < n < len); return the new upper node.

        The upper node inherits lock_ref, access time and hit count, because every
        request that locked or matched the whole edge also covers its first part;
        so the evictable/protected counters stay correct without adjustment.
        """
        assert 0 < n < len(node.key)
        parent = node.parent
        assert parent is not None
        upper = TreeNode(
            key=node.key[:n], slots=node.slots[:n], parent=parent,
            lock_ref=node.lock_ref, last_access=node.last_access, hit_count=node.hit_count,
        )
        upper.children[node.key[n]] = node
        parent.children[upper.key[0]] = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:]
        node.parent = upper
        return upper

    # ---------------------------------------------------------------- locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and every ancestor from eviction (one more user)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; raises AssertionError on an unlocked node.

        In a retired tree (an older weight version) the nodes this leaves unlocked
        are freed right away: nothing can match them any more.
        """
        start = node
        while node.parent is not None:
            assert node.lock_ref > 0, "dec_lock_ref on a radix node that is not locked"
            if node.lock_ref == 1:
                self._evictable += len(node)
                self._protected -= len(node)
            node.lock_ref -= 1
            node = node.parent
        assert not node.key, "dec_lock_ref on a radix node that was freed"
        if node is not self.root_node and self._retired:
            self._free_retired_path(start, node)

    def _free_retired_path(self, node: TreeNode, root: TreeNode) -> None:
        """Free the unlocked part of a retired tree's path from ``node`` up to ``root``.

        A retired tree holds only locked nodes, and an ancestor is locked at least as
        often as any descendant; so a node whose last lock just went has no children
        left, and freeing bottom-up stops at the first node still locked.
        """
        while node.parent is not None and node.lock_ref == 0 and node.is_leaf:
            parent = node.parent
            self._drop_leaf(node)
            node = parent
        if not root.children and root in self._retired:
            self._retired.remove(root)

    # --------------------------------------------------------------- eviction

    def _score(self, node: TreeNode):
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access)
        return node.last_access

    @staticmethod
    def _evictable_leaf(node: TreeNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and node.is_leaf

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, lowest score first, until ``num_tokens`` are freed.

        Stops early when nothing evictable is left. A parent whose last child
        is evicted becomes a leaf and competes in the same heap, so whole
        unlocked branches can go. Returns the number of tokens freed (may
        exceed ``num_tokens`` because leaves are freed whole). Only the current
        tree has evictable nodes: retired trees free theirs as soon as they unlock.
        """
        if self._disabled or num_tokens <= 0:
            return 0
        return self._evict_tree(self.root_node, num_tokens, self.on_evict)

    def _evict_tree(self, root: TreeNode, num_tokens: int,
                    on_evict: Callable[[TreeNode], None] | None = None) -> int:
        heap = []
        seq = 0  # tie-breaker so the heap never compares TreeNode objects
        for leaf in self._iter_nodes(root):
            if self._evictable_leaf(leaf):
                heap.append((self._score(leaf), seq, leaf))
                seq += 1
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not self._evictable_leaf(node):
                continue
            parent = node.parent
            freed += len(node)
            if on_evict is not None:
                on_evict(node)
            self._drop_leaf(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (self._score(parent), seq, parent))
                seq += 1
        return freed

    def _drop_leaf(self, node: TreeNode) -> None:
        """Free an unlocked leaf's slots and detach it from its parent."""
        if self.allocator is not None and node.slots.numel():
            self.allocator.free(node.slots)
        self._evictable -= len(node)
        del node.parent.children[node.key[0]]
        node.parent = None

    # ------------------------------------------------------------ inspection

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (freeable by ``evict`` once their subtrees go)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes locked by at least one request."""
        return self._protected

    def total_size(self) -> int:
        """Tokens the cache holds, retired trees included."""
        return self._evictable + self._protected

    def retired_size(self) -> int:
        """Tokens held by retired trees (all locked by requests admitted before an update)."""
        return sum(len(n) for root in self._retired for n in self._iter_nodes(root))

    def _iter_nodes(self, root: TreeNode | None = None):
        """Every non-root node of ``root``'s tree (default: the current one), depth first
        (iterative: deep trees must not hit recursion limits)."""
        stack = list((self.root_node if root is None else root).children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        """Concatenation of every slot the cache holds, retired trees included (for debug /
        conservation checks)."""
        pieces = [n.slots for root in [self.root_node, *self._retired] for n in self._iter_nodes(root)]
        return torch.cat(pieces) if pieces else _empty_slots()

    def pretty_print(self) -> str:
        """Indented dump of the tree: token preview, length, lock_ref, hits, access time;
        then each retired tree."""
        lines = [f"root v{self.version} (evictable={self._evictable}, protected={self._protected})"]
        self._pretty_tree(self.root_node, lines)
        for root in self._retired:
            lines.append("retired root")
            self._pretty_tree(root, lines)
        return "\n".join(lines)

    @staticmethod
    def _pretty_tree(root: TreeNode, lines: list[str]) -> None:
        stack = [(c, 1) for c in reversed(list(root.children.values()))]
        while stack:
            node, depth = stack.pop()
            preview = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(
                f"{'  ' * depth}{preview}{more} len={len(node)} lock={node.lock_ref} "
                f"hits={node.hit_count} t={node.last_access}"
            )
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
