"""The host-side selection steps of a decode step: merging a GQA group's ranked pages, and diffing the selection
against the pages already in the GPU slots. Both run in C++ (icecache/method/src/decode_step.cpp), inside the
decode step; these are their Python faces, for tests and diagnostics."""

from __future__ import annotations

import numpy as np

from icecache.dci import _dci


def merge_group_pages(pages: np.ndarray, group_size: int, k: int) -> np.ndarray:
    """Per KV head, interleave its query heads' ranked page lists rank by rank; keep the first ``k`` distinct.

    ``pages [Hq, K]`` (-1 padded) -> ``[Hkv, k]`` (-1 padded).
    """
    return _dci.merge_group_pages(np.ascontiguousarray(pages, dtype=np.int32), int(group_size), int(k))


def diff_selection(
    resident: np.ndarray, stale: np.ndarray, selection: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Update ``resident [Hkv, K]`` (page per slot, int64, C-contiguous) in place to hold ``selection [Hkv, K]``.

    Pages still selected and not stale keep their slot; the others are loaded into freed slots, the n-th freed slot
    of a head (in slot order) taking the n-th page to load (in selection order). Returns the (slot, page, head)
    triples to load as three int64 arrays, by head then slot. Slots that end up unused hold -1.
    """
    if resident.dtype != np.int64 or not resident.flags.c_contiguous:
        raise TypeError("resident must be a C-contiguous int64 array (it is updated in place)")
    return _dci.diff_selection(resident, np.ascontiguousarray(stale, dtype=bool), selection)
