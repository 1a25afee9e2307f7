"""Radix prefix cache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Ownership: every slot referenced by a node's `value` is owned by the tree, and by no one else.
A running request that matched a prefix holds a lock on the deepest matched node; a lock pins the
whole path node..root, and locked nodes are never evicted. Slots leave the tree only through
`evict` (or `reset`), which returns them to the allocator.

Sizes: `evictable_size() + protected_size() == total_size()` is the number of slots the tree owns.
At an idle moment (no running requests) `allocator.available_size() + total_size() == size`.

Page size is 1: a node may be split at any token.

Eviction priority: every node remembers the `tag` of the request that last inserted it (a
session id for a session's turn, else None). `evict(n, keep_tags)` takes unlocked leaves whose
tag is not in `keep_tags` first (LRU among them), and only then the others (LRU), so the open
sessions' conversations outlive other cached prefixes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Container
from dataclasses import dataclass, field

import torch

from sluice.scheduler.memory_pool import TokenToKVPoolAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)
_node_ids = itertools.count()


@dataclass(eq=False)
class TreeNode:
    # key[i] is the token id whose KV lives in slot value[i]; len(key) == len(value)
    key: list[int] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=lambda: _EMPTY)  # int64 [len(key)]
    parent: TreeNode | None = None
    # children keyed by the first token id of their key
    children: dict[int, TreeNode] = field(default_factory=dict)
    # number of locks held on this node or on any descendant (a lock pins the path to the root)
    lock_ref: int = 0
    last_access: int = 0
    tag: str | None = None  # who last inserted this node (see module docstring)
    id: int = field(default_factory=lambda: next(_node_ids))

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 slots of the matched prefix, [matched_len]
    last_node: TreeNode  # deepest node on the matched path (root if nothing matched)


@dataclass
class UnfinishedResult:
    indices: torch.Tensor  # int64 canonical slots for the request's tokens, [len(kv_indices)]
    last_node: TreeNode  # the node the request now holds its lock on
    cache_protected_len: int  # how many leading tokens of the request the tree now owns


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two lists, by slice comparisons (no per-token loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator, disable: bool = False):
        self.allocator = allocator
        self.disable = disable
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode()
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0
        # every non-root node without children; eviction candidates once unlocked
        self._leaves: set[TreeNode] = set()

    # ---- sizes -------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- match and insert --------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. Splits a node so that the match ends at a node boundary."""
        if self.disable or not key:
            return MatchResult(self._empty, self.root_node)
        key = key if isinstance(key, list) else list(key)
        node, _, values = self._walk(key)
        indices = torch.cat(values) if values else self._empty
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, tag: str | None = None) -> int:
        """Insert key -> value; return how many leading tokens were already in the tree.

        Slots value[:returned] stay with the caller (the tree has its own for those tokens);
        slots value[returned:] become owned by the tree. Every node of the key's path gets `tag`.
        """
        if self.disable or not key:
            return 0
        key = key if isinstance(key, list) else list(key)
        assert len(value) >= len(key), "insert needs a slot for every token"
        node, matched_len, _ = self._walk(key)
        self._tag_path(node, tag)
        if matched_len < len(key):
            # cloned: the caller's tensor may be a view of a req_to_token row that gets reused
            self._add_leaf(node, key[matched_len:], value[matched_len : len(key)].clone(), tag)
        return matched_len

    def _tag_path(self, node: TreeNode, tag: str | None) -> None:
        while node is not self.root_node:
            node.tag = tag
            node = node.parent

    def _walk(self, key: list[int]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow key from the root, refreshing access times; split where the match ends mid-node.

        Returns the deepest matched node, the matched length and the matched nodes' values.
        """
        now = next(self._clock)
        node, pos, values = self.root_node, 0, []
        node.last_access = now
        # after a split the walk stops by itself: the split-off child starts with a different token
        while pos < len(key) and (child := node.children.get(key[pos])) is not None:
            child.last_access = now
            n = common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Split node into a new parent holding key[:split_len] and node holding the rest.

        The node keeps its identity (locks held on it stay valid); the new parent inherits its
        lock count, so the evictable/protected sizes do not change.
        """
        parent = node.parent
        assert parent is not None and 0 < split_len < len(node.key)
        new = TreeNode(
            key=node.key[:split_len],
            value=node.value[:split_len],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            tag=node.tag,
        )
        node.key = node.key[split_len:]
        node.value = node.value[split_len:]
        node.parent = new
        new.children[node.key[0]] = node
        parent.children[new.key[0]] = new
        return new

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, tag: str | None = None
    ) -> None:
        leaf = TreeNode(
            key=key, value=value, parent=parent, last_access=parent.last_access, tag=tag
        )
        parent.children[key[0]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable_size += len(key)

    # ---- locks -------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin node and its ancestors against eviction."""
        if self.disable:
            return
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        if self.disable:
            return
        while node is not self.root_node:
            assert node.lock_ref > 0, f"unbalanced dec_lock_ref on {node}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int, keep_tags: Container[str | None] = ()) -> int:
        """Free at least num_tokens slots if possible: unlocked leaves whose tag is not in
        `keep_tags` first, then the others, least recently used first within each group.

        A parent that becomes an unlocked leaf joins the candidates. Returns the number freed.
        """
        if self.disable or num_tokens <= 0:
            return 0

        def entry(n: TreeNode) -> tuple[bool, int, int, TreeNode]:
            return (n.tag in keep_tags, n.last_access, n.id, n)

        heap = [entry(n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            node = heapq.heappop(heap)[-1]
            freed.append(node.value)
            num_freed += len(node.key)
            parent = self._remove_leaf(node)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, entry(parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return num_freed

    def _remove_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[0]]
        self._leaves.discard(node)
        if parent is not self.root_node and not parent.children:
            self._leaves.add(parent)
        self._evictable_size -= len(node.key)
        node.parent = None
        return parent

    def reset(self) -> None:
        """Free every slot the tree owns to the allocator and empty the tree.

        Only valid when no request holds a lock (e.g. flushing the cache at idle).
        """
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} locked tokens in the cache")
        slots = self.all_slots()
        if slots.numel():
            self.allocator.free(slots)
        self._init_tree()

    # ---- request-level -----------------------------------------------------------------------

    def cache_finished(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        cache_protected_len: int,
        last_node: TreeNode,
        tag: str | None = None,
    ) -> None:
        """Hand a finished request's KV to the tree and release its lock.

        After this call the request owns no slots: duplicates are freed, the rest is tree-owned.
        """
        if self.disable:
            self.allocator.free(kv_indices[cache_protected_len:])
            return
        self._insert_request(token_ids, kv_indices, cache_protected_len, tag)
        self.dec_lock_ref(last_node)

    def cache_unfinished(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        cache_protected_len: int,
        last_node: TreeNode,
        tag: str | None = None,
    ) -> UnfinishedResult:
        """Hand a running request's KV so far to the tree; the request keeps using it under a lock.

        The returned indices are the tree's canonical slots for token_ids[:len(kv_indices)]; the
        caller writes them into its req_to_token row. The lock moves from last_node to the new one.
        """
        if self.disable:
            return UnfinishedResult(kv_indices, self.root_node, 0)
        key = self._insert_request(token_ids, kv_indices, cache_protected_len, tag)
        match = self.match_prefix(key)
        assert len(match.indices) == len(key)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return UnfinishedResult(match.indices, match.last_node, len(key))

    def _insert_request(
        self,
        token_ids: list[int],
        kv_indices: torch.Tensor,
        cache_protected_len: int,
        tag: str | None = None,
    ) -> list[int]:
        """Insert the request's tokens that have KV; free its slots that duplicate tree slots."""
        num_kv = len(kv_indices)
        assert len(token_ids) >= num_kv, "more KV slots than tokens"
        key = token_ids[:num_kv]
        key = key if isinstance(key, list) else list(key)
        already_len = self.insert(key, kv_indices, tag)
        assert already_len >= cache_protected_len, "a locked prefix went missing from the tree"
        self.allocator.free(kv_indices[cache_protected_len:already_len])
        return key

    # ---- inspection --------------------------------------------------------------------------

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns (for leak checks)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else self._empty

    def check_invariants(self) -> None:
        """Assert sizes add up, locks are consistent, children are keyed right, no slot twice."""
        evictable = protected = 0
        leaves = set()
        for node in self._nodes():
            self._check_node(node)
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
            if not node.children:
                leaves.add(node)
        assert evictable == self._evictable_size, (evictable, self._evictable_size)
        assert protected == self._protected_size, (protected, self._protected_size)
        assert leaves == self._leaves, "leaf set out of date"
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "a slot is owned twice by the tree"
        if slots.numel():
            assert int(slots.min()) >= 1 and int(slots.max()) <= self.allocator.size

    def _check_node(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and len(node.key) > 0
        assert len(node.key) == len(node.value), f"key/value length mismatch in {node}"
        assert parent.children.get(node.key[0]) is node, f"{node} not keyed by its first token"
        assert node.lock_ref >= 0, f"negative lock_ref in {node}"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, f"{node} has fewer locks than its children"
