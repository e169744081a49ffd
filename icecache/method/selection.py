"""The host-side selection steps of a decode step: merging a GQA group's ranked pages, and diffing the selection
against the pages already in the GPU slots."""

from __future__ import annotations

import numpy as np


def merge_group_pages(pages: np.ndarray, group_size: int, k: int) -> np.ndarray:
    """Per KV head, interleave its query heads' ranked page lists rank by rank; keep the first ``k`` distinct.

    ``pages [Hq, K]`` (-1 padded) -> ``[Hkv, k]`` (-1 padded).
    """
    n_kv_heads, n_ranks = pages.shape[0] // group_size, pages.shape[1]
    # Row g: KV head g's candidates rank-major (rank 0 of each of its query heads, then rank 1, ...).
    ranked = (
        pages[: n_kv_heads * group_size].reshape(n_kv_heads, group_size, n_ranks).transpose(0, 2, 1)
        .reshape(n_kv_heads, -1)
    )
    flat, width = ranked.reshape(-1), ranked.shape[1]
    # A stable sort of each row puts equal pages side by side in their order of appearance: the first of each run
    # is the page's first appearance in the row. ``order`` indexes the flat array, so no per-axis helper is needed.
    order = np.argsort(ranked, axis=1, kind="stable")
    order += np.arange(0, flat.size, width)[:, None]
    in_order = flat[order]
    starts_run = np.empty(in_order.shape, dtype=bool)
    starts_run[:, :1] = True
    np.not_equal(in_order[:, 1:], in_order[:, :-1], out=starts_run[:, 1:])
    first_seen = np.empty(flat.shape, dtype=bool)
    first_seen[order.reshape(-1)] = starts_run.reshape(-1)
    keep = first_seen.reshape(ranked.shape) & (ranked >= 0)
    column = np.cumsum(keep, axis=1) - 1  # where a kept page goes in its row of the result
    keep &= column < k
    merged = np.full((n_kv_heads, k), -1, dtype=np.int64)
    merged[np.nonzero(keep)[0], column[keep]] = ranked[keep]
    return merged


def diff_selection(
    resident: np.ndarray, stale: np.ndarray, selection: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Update ``resident [Hkv, K]`` (page per slot) in place to hold ``selection [Hkv, K]``.

    Pages still selected and not stale keep their slot; the others are loaded into freed slots, the n-th freed slot
    of a head (in slot order) taking the n-th page to load (in selection order). Returns the (slot, page, head)
    triples to load as three int64 arrays, by head then slot. Slots that end up unused hold -1.
    """
    held = resident >= 0
    same = resident[:, :, None] == selection[:, None, :]  # [head, slot, rank]: the slot holds that selected page
    # Page ids beyond the stale map have never been flagged.
    in_map = held & (resident < stale.shape[1])
    was_stale = np.zeros_like(held)
    was_stale[in_map] = stale[np.nonzero(in_map)[0], resident[in_map]]
    kept = held & ~was_stale & same.any(axis=2)
    free = ~kept
    to_load = (selection >= 0) & ~(same & kept[:, :, None]).any(axis=1)
    # Pair the n-th free slot with the n-th page to load, up to the shorter of the two lists.
    n_pairs = np.minimum(free.sum(axis=1), to_load.sum(axis=1))[:, None]
    filled = free & (np.cumsum(free, axis=1) <= n_pairs)
    loaded = to_load & (np.cumsum(to_load, axis=1) <= n_pairs)
    heads, slots = np.nonzero(filled)
    pages = selection[loaded].astype(np.int64, copy=False)
    resident[free] = -1
    resident[heads, slots] = pages
    return slots, pages, heads
