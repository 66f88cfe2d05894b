"""The prefix cache's index: one compressed token trie (a radix tree) per extra key.

A node stands for the prefix of its ``length`` tokens (any length: on a block
grid or off it); its ``key`` is the edge from its parent, and a parent's
children are keyed by their edge's first token, so two children never share
one. Walking a prompt is one dict lookup and one slice compare per edge, and a
checkpoint at any length is a node, split out of an edge where it falls inside
one. The cache (``_prefix``) owns what a node holds (pool slot, host slot,
payload); this module owns the shape.

Invariants:

* every node except a root holds a checkpoint or has at least two children
  (``prune`` unlinks and merges what no longer does), so the trie has fewer
  nodes than twice the checkpoints;
* ``below`` is the number of device checkpoints strictly below a node (the
  prefixes that extend it), so ``below == 0`` is a leaf for eviction;
* a node unlinked or merged away is marked dead (``live = False``) and is
  never linked again: a hit on it is stale.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

__all__ = ["Trie"]


class _Node:
    """A prefix of ``length`` tokens; ``key`` is the edge from ``parent``; holds a checkpoint of it, or not."""

    __slots__ = ("below", "children", "gen", "host", "key", "length", "live", "parent", "payload", "slot", "space")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], length: int, space: Hashable = None) -> None:
        self.parent, self.key, self.length, self.space = parent, key, length, space
        self.children: dict[int, _Node] = {}  # by the first token of the child's edge
        self.slot = 0  # the device checkpoint's pool slot, or 0
        self.host = 0  # the host checkpoint's host slot, or 0
        self.payload: Any = None
        self.below = 0  # device checkpoints strictly below this node: 0 makes it a leaf for eviction
        self.live = True  # False once unlinked or merged away: hits on it are stale
        self.gen = 0  # checkpoints made here so far: a hit on an earlier one is stale, even if the node lived on


class Trie:
    """Token prefixes by extra key (``space``): a root per key in use, created on the first link under it."""

    __slots__ = ("roots",)

    def __init__(self) -> None:
        self.roots: dict[Hashable, _Node] = {}

    def deepest(self, tokens: tuple[int, ...], space: Hashable) -> _Node | None:
        """The deepest node along ``tokens`` that holds a checkpoint on either tier, or None."""
        node = self.roots.get(space)
        best: _Node | None = None
        pos, n = 0, len(tokens)
        while node is not None and pos < n:
            node = node.children.get(tokens[pos])
            if node is None or tokens[pos : pos + len(node.key)] != node.key:
                break
            pos += len(node.key)
            if node.slot or node.host:
                best = node
        return best

    def find(self, tokens: tuple[int, ...], space: Hashable) -> _Node | None:
        """The node of exactly ``tokens`` if the trie has one (holding a checkpoint or not); links nothing."""
        node = self.roots.get(space)
        pos = 0
        while node is not None and pos < len(tokens):
            node = node.children.get(tokens[pos])
            if node is None or tokens[pos : pos + len(node.key)] != node.key:
                return None
            pos += len(node.key)
        return node

    def link(self, tokens: tuple[int, ...], space: Hashable) -> _Node:
        """The node of exactly ``tokens`` (non-empty), made now if needed, splitting the edge it falls inside."""
        node = self.roots.get(space)
        if node is None:
            node = self.roots[space] = _Node(None, (), 0, space)
        pos, n = 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = node.children[tokens[pos]] = _Node(node, tokens[pos:], n)
                return leaf
            key = child.key
            if tokens[pos : pos + len(key)] == key:
                node, pos = child, pos + len(key)
                continue
            common = 1  # the first tokens agree: that is how the child was found
            while common < len(key) and pos + common < n and key[common] == tokens[pos + common]:
                common += 1
            mid = node.children[tokens[pos]] = _Node(node, key[:common], node.length + common)
            child.key, child.parent = key[common:], mid
            mid.children[child.key[0]] = child
            mid.below = child.below + (1 if child.slot else 0)
            node, pos = mid, pos + common
        return node

    def prune(self, node: _Node) -> None:
        """Unlink ``node`` and its ancestors while they hold nothing and lead nowhere; merge one that leads one way.

        A root left without children is dropped too, so extra keys no longer in
        use (a finished adapter, a cache salt) cost nothing.
        """
        while node.parent is not None and not (node.slot or node.host):
            parent = node.parent
            if not node.children:
                del parent.children[node.key[0]]
            elif len(node.children) == 1:
                (child,) = node.children.values()
                child.key, child.parent = node.key + child.key, parent
                parent.children[node.key[0]] = child
            else:
                return
            node.live, node.payload, node.children = False, None, {}
            node = parent
        if node.parent is None and not node.children and self.roots.get(node.space) is node:
            del self.roots[node.space]

    def owns(self, node: _Node) -> bool:
        """Whether ``node`` is in this trie (not another cache's, nor one cleared since)."""
        while node.parent is not None:
            node = node.parent
        return self.roots.get(node.space) is node

    @staticmethod
    def adjust_below(node: _Node, delta: int) -> None:
        """Count a device checkpoint at ``node`` (+1) or no longer (-1) in the ``below`` of every ancestor."""
        parent = node.parent
        while parent is not None:
            parent.below += delta
            parent = parent.parent

    def nodes(self) -> Iterator[tuple[Hashable, tuple[int, ...], _Node]]:
        """Every node but the roots, with its extra key and its whole prefix (for checks and tests)."""
        stack: list[tuple[Hashable, tuple[int, ...], _Node]] = [(r.space, (), r) for r in self.roots.values()]
        while stack:
            space, prefix, node = stack.pop()
            for child in node.children.values():
                tokens = prefix + child.key
                yield space, tokens, child
                stack.append((space, tokens, child))
