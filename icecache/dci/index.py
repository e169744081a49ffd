"""``DCIIndex``: many independent multi-level DCI trees (one per KV head) whose leaves are KV pages.

This is the Python face of the C++ index in ``src/`` (design notes in docs/dci.md):
Prioritized DCI over random directions, its multi-level form, M-DCI's page-leaf B+ tree (at most 16 tokens per
leaf, 8-16 once a parent has more than one leaf) and the maximum-inner-product transform. Every operation is one
call over all instances, threaded in C++ with the GIL released. Arrays are float32 and C-contiguous; NumPy arrays
and CPU torch tensors are taken without a copy. An index made with ``key_dtype="bfloat16"`` takes its keys as
bfloat16 CPU tensors and holds them so: it is then the only host copy of them a KV cache needs (``gather_keys``
reads a page's rows from it).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _dci

PAGE_SLOTS: int = _dci.PAGE_SLOTS
BRUTE_FORCE_THRESHOLD = 3000  # numa_threshold: parents searched exhaustively up to this many upper-level points
SCORE_PRECISIONS = ("float32", "half", "int8")  # index = the C++ FirstPass value
KEY_DTYPES = ("float32", "bfloat16")


def _as_bfloat16_bits(name: str, tensor: Any, ndim: int) -> np.ndarray:
    """The bits of a bfloat16 CPU tensor as a C-contiguous uint16 array (a view unless it was not contiguous)."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.bfloat16:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a bfloat16 torch tensor for an index with key_dtype='bfloat16', got {got}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got one on {tensor.device}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if not bool(torch.isfinite(tensor.detach().sum(dtype=torch.float64))):  # no float copy: NaN and inf propagate
        raise ValueError(f"{name} contains NaN or infinite values")
    return tensor.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def _as_float32(name: str, array: Any, ndim: int) -> np.ndarray:
    """A float32 C-contiguous view of `array` (NumPy or CPU torch tensor), copying only a non-contiguous input."""
    if hasattr(array, "detach") and hasattr(array, "numpy"):  # torch.Tensor
        if array.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {array.device}")
        array = array.detach().numpy()
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array or a CPU torch tensor, got {type(array).__name__}")
    if array.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {array.shape}")
    if not np.isfinite(np.sum(array, dtype=np.float64)):  # one pass, no mask array: NaN and inf propagate
        raise ValueError(f"{name} contains NaN or infinite values")
    return np.ascontiguousarray(array)


def default_query_field_of_view(num_tokens: int) -> int:
    """IceCache's query field of view: max(int(1.5e-3 * n), 30)."""
    return max(int(1.5e-3 * num_tokens), 30)


class DCIIndex:
    """`num_instances` independent DCI trees over `dim`-dimensional keys.

    Token ids are 0..n-1 per instance in insertion order (every instance holds the same number of tokens). Page ids
    are dense per instance: 0..num_pages-1, where a freed id (after a merge) is reused before a new one is made.

    Args:
        dim: key dimension (head_dim).
        num_instances: number of independent trees (KV heads).
        num_comp_indices, num_simp_indices: composite x simple indices; L = their product random directions.
            IceCache uses 1 x 1; pages are the leaves of direction 0's tree.
        promotion_prob, promotion_prob_subseq: promotion probability from level 0 to 1, and above
            (0 means "same as promotion_prob").
        transform: index for maximum inner product (the augmented-key reduction) instead of Euclidean distance.
        deterministic_levels: IceCache's evenly spaced level schedule instead of random promotion.
        seed: seeds the directions (when not given) and random levels.
        num_threads: OpenMP threads for every call (default: all CPUs).
        directions: [L, dim+1] (transform) or [L, dim] unit rows, shared by all instances.
        score_precision: "float32" scores the last level of a query from the key rows as stored. "half" also keeps
            an IEEE half copy of them (2 dim + 4 bytes a key), "int8" 8-bit codes with a per-row scale (dim + 8
            bytes a key); either scores with its copy first and re-scores from the keys only the rows that error
            bounds cannot rule out: same results and scores, bit for bit, from fewer bytes read (half of float32
            keys', int8 of bfloat16 keys' too). Needs num_comp_indices * num_simp_indices == 1. See docs/dci.md.
        key_dtype: "float32" (keys are float32 arrays) or "bfloat16" (keys are bfloat16 torch tensors, held as
            such: half the bytes; each row is widened exactly when scored, so results equal the float32 index's
            over the same values).
    """

    def __init__(
        self,
        dim: int,
        num_instances: int,
        *,
        num_comp_indices: int = 1,
        num_simp_indices: int = 1,
        promotion_prob: float = 0.01,
        promotion_prob_subseq: float = 0.2,
        transform: bool = True,
        deterministic_levels: bool = True,
        seed: int = 0,
        num_threads: int | None = None,
        directions: np.ndarray | None = None,
        score_precision: str = "float32",
        key_dtype: str = "float32",
    ) -> None:
        if dim < 1 or num_instances < 1:
            raise ValueError(f"dim and num_instances must be positive, got {dim} and {num_instances}")
        if num_comp_indices < 1 or num_simp_indices < 1 or num_comp_indices * num_simp_indices > 64:
            raise ValueError("need 1 <= num_comp_indices * num_simp_indices <= 64")
        if not 0.0 < promotion_prob < 1.0 or not 0.0 <= promotion_prob_subseq < 1.0:
            raise ValueError("promotion probabilities must lie in (0, 1) (promotion_prob_subseq may be 0)")
        if score_precision not in SCORE_PRECISIONS:
            raise ValueError(f"score_precision must be one of {SCORE_PRECISIONS}, got {score_precision!r}")
        if key_dtype not in KEY_DTYPES:
            raise ValueError(f"key_dtype must be one of {KEY_DTYPES}, got {key_dtype!r}")
        if score_precision != "float32" and num_comp_indices * num_simp_indices != 1:
            raise ValueError(
                f"score_precision={score_precision!r} needs num_comp_indices * num_simp_indices == 1 (it speeds up "
                f"the L = 1 last-level scan); got {num_comp_indices} x {num_simp_indices}: use "
                "score_precision='float32'"
            )
        self.dim = dim
        self.num_instances = num_instances
        self.transform = transform
        self.key_dtype = key_dtype
        n_dirs = num_comp_indices * num_simp_indices
        width = dim + 1 if transform else dim
        if directions is None:
            # i.i.d. N(0, 1) coordinates in dim+1 (transform) dimensions, normalised there (sections 1.1, 1.2)
            directions = np.random.default_rng(seed).standard_normal((n_dirs, width))
            directions = (directions / np.linalg.norm(directions, axis=1, keepdims=True)).astype(np.float32)
        else:
            directions = _as_float32("directions", directions, 2)
            if directions.shape != (n_dirs, width):
                raise ValueError(f"directions must have shape {(n_dirs, width)}, got {directions.shape}")
            norms = np.linalg.norm(directions, axis=1)
            if not np.allclose(norms, 1.0, atol=1e-4):
                raise ValueError(f"directions must be unit rows; norms are {norms}")
        threads = num_threads if num_threads is not None else (os.cpu_count() or 1)
        if threads < 1:
            raise ValueError(f"num_threads must be positive, got {threads}")
        self._forest = _dci.Forest(
            dim, num_instances, num_comp_indices, num_simp_indices, promotion_prob, promotion_prob_subseq,
            transform, deterministic_levels, seed, directions, threads, SCORE_PRECISIONS.index(score_precision),
            key_dtype == "bfloat16",
        )

    # ------------------------------------------------------------------ threads
    @property
    def num_threads(self) -> int:
        """OpenMP threads used by build, insert and query."""
        return self._forest.num_threads

    @num_threads.setter
    def num_threads(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"num_threads must be positive, got {value}")
        self._forest.num_threads = int(value)

    @property
    def score_precision(self) -> str:
        """"float32", "half" or "int8": the key rows the last level of a query is scored with first (see __init__)."""
        return SCORE_PRECISIONS[self._forest.first_pass]

    # ------------------------------------------------------------------ building
    def _check_keys(self, keys: Any) -> np.ndarray:
        keys = _as_bfloat16_bits("keys", keys, 3) if self.key_dtype == "bfloat16" else _as_float32("keys", keys, 3)
        if keys.shape[0] != self.num_instances or keys.shape[2] != self.dim:
            raise ValueError(
                f"keys must have shape [num_instances={self.num_instances}, n, dim={self.dim}], got {keys.shape}"
            )
        return keys

    def build(
        self,
        keys: Any,
        *,
        field_of_view: int = 30,
        prop_to_retrieve: float = 1.0,
        prop_to_visit: float = 1.0,
        anchor_interval: int = 60,
        anchor_neighbours: int = 60,
        anchor_threshold: float = 1.02,
        brute_force_threshold: int = BRUTE_FORCE_THRESHOLD,
        reference: bool = False,
    ) -> None:
        """Bulk-build every instance from scratch over keys [num_instances, n, dim] (docs/dci.md, bulk build).

        field_of_view / prop_to_retrieve / prop_to_visit are the construction search settings used when a level
        above has more than `brute_force_threshold` points; the anchor settings enable the level-0 shortcut
        (anchor_interval 0 disables it). Any previous content is dropped; all pages are marked changed.
        reference=True builds the same index the slow way the build was first written (a float32 copy of bf16 keys,
        the shortcut's distances one pair at a time): what the tests hold the default build to, node for node.
        """
        keys = self._check_keys(keys)
        if keys.shape[1] >= 2**31 - 1:
            raise ValueError("too many keys")
        _check_search(field_of_view, prop_to_retrieve, prop_to_visit)
        if anchor_interval < 0 or anchor_neighbours < 0 or anchor_threshold < 0:
            raise ValueError("anchor settings must be non-negative")
        self._forest.build(
            keys, int(field_of_view), float(prop_to_retrieve), float(prop_to_visit), int(anchor_interval),
            int(anchor_neighbours), float(anchor_threshold), int(brute_force_threshold), bool(reference),
        )

    def insert(
        self,
        keys: Any,
        *,
        field_of_view: int = 20,
        prop_to_retrieve: float = 0.6,
        prop_to_visit: float = 1.0,
        as_batch: bool = True,
        brute_force_threshold: int = BRUTE_FORCE_THRESHOLD,
    ) -> None:
        """Add keys [num_instances, m, dim]; their token ids continue from `num_tokens` (docs/dci.md, insertion).

        as_batch=True merges the m keys as one batch (a page of tokens: M and projections take in the batch first,
        new points are placed top level first); False inserts them one by one. Pages whose content changes are
        flagged for `pop_changed_pages`. Inserting into an empty index builds it with the default build settings.
        """
        keys = self._check_keys(keys)
        if keys.shape[1] == 0:
            return
        if self.num_tokens == 0:
            self.build(keys)
            return
        _check_search(field_of_view, prop_to_retrieve, prop_to_visit)
        self._forest.insert(
            keys, int(field_of_view), float(prop_to_retrieve), float(prop_to_visit), bool(as_batch),
            int(brute_force_threshold),
        )

    # ------------------------------------------------------------------ querying
    def query(
        self,
        queries: Any,
        num_pages: int,
        *,
        field_of_view: int | None = None,
        prop_to_retrieve: float = 0.8,
        prop_to_visit: float = 1.0,
        ratio: int = 1,
        return_scores: bool = False,
        rank_tokens: bool = True,
    ) -> tuple[np.ndarray, ...]:
        """Pages and tokens for one decode step (docs/dci.md, page query: cumulative multi-level search).

        queries: [num_instances * ratio, dim]; query head h searches instance h // ratio (GQA).
        Returns (page_ids, token_ids), both int32 [nq, num_pages]: the pages ranked by their best token's score and
        the best tokens, -1 padded. With return_scores, also (page_scores, token_scores) float32: q.k of the best
        token of each page and of each token (-|q-k|^2 without the transform), NaN where padded.
        field_of_view None means max(int(1.5e-3 * n), 30).
        rank_tokens=False keeps no token list (token_ids all -1, token_scores NaN): the same pages, for less work,
        which is how IceCache's decode step searches (it reads only the pages).
        """
        if ratio < 1:
            raise ValueError(f"ratio must be >= 1, got {ratio}")
        queries = _as_float32("queries", queries, 2)
        if queries.shape != (self.num_instances * ratio, self.dim):
            raise ValueError(
                f"queries must have shape [num_instances*ratio={self.num_instances * ratio}, dim={self.dim}], "
                f"got {queries.shape}"
            )
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        fov = default_query_field_of_view(self.num_tokens) if field_of_view is None else field_of_view
        _check_search(fov, prop_to_retrieve, prop_to_visit)
        pages, tokens, page_scores, token_scores = self._forest.query(
            queries, int(num_pages), int(fov), float(prop_to_retrieve), float(prop_to_visit), int(ratio),
            bool(rank_tokens),
        )
        if return_scores:
            return pages, tokens, page_scores, token_scores
        return pages, tokens

    # ------------------------------------------------------------------ storage
    def reserve(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` tokens per instance, so that inserts up to there reallocate no per-token array
        (a KV cache announces its final length: no growth slack, no copy while it grows)."""
        self._forest.reserve(int(num_tokens))

    def keys(self, instance: int):
        """The stored keys of one instance by token id, [num_tokens, dim], copied out: a bfloat16 torch tensor
        (key_dtype bfloat16) or a float32 NumPy array. (The index stores them in leaf order after a build, so that a
        parent's children are one block: ``key_storage_rows``.)"""
        rows = self._forest.keys(self._instance(instance))
        if self.key_dtype == "bfloat16":
            import torch

            return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        return rows

    def key_storage_rows(self, instance: int) -> np.ndarray:
        """int64 [num_tokens]: the storage row of each token id's key (diagnostics and tests)."""
        return self._forest.key_storage_rows(self._instance(instance))

    def pages_items(self, instances: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """int32 [n, 16]: the token ids of page ``pages[r]`` of instance ``instances[r]`` in slot order, -1 padded."""
        return self._forest.pages_items(np.ascontiguousarray(instances, dtype=np.int64),
                                        np.ascontiguousarray(pages, dtype=np.int64))

    def gather_keys(self, instances: np.ndarray, token_ids: np.ndarray, out: np.ndarray) -> None:
        """Copy the stored key rows of ``token_ids [n, 16]`` (-1: a zero row) of ``instances [n]`` into the
        C-contiguous byte buffer ``out`` (row r * 16 + t), in the stored dtype."""
        self._forest.gather_keys(np.ascontiguousarray(instances, dtype=np.int64),
                                 np.ascontiguousarray(token_ids, dtype=np.int32), out)

    def last_query_stats(self) -> dict[str, int]:
        """What the last ``query`` read: ``rows_read`` key rows loaded (a row scored for several query heads of a
        GQA group counts once; a half first pass's rows too), ``bytes_read`` (their bytes as read: a half pass's at 2
        bytes a value, the others in the stored dtype),
        ``scores`` (exact (row, head) dot products; a half pass's approximate ones are not counted) and ``lists``
        (children lists searched or scanned)."""
        return dict(self._forest.last_query_stats())

    def last_query_phases(self) -> dict[str, int]:
        """Where the last query's wall-clock time went, in nanoseconds, for a query with one direction (IceCache's):
        ``fork`` (until the last thread of the team had started: the cost of waking it), ``descend`` (until every
        head had descended to the last level; the instances grouped by then are scanned meanwhile), ``group``
        (until the last instance's runs were grouped by parent), ``scan`` (the rest of the shared last-level scan,
        to its barrier) and ``merge`` (each head's result); they add up to the query's wall clock. ``scan_busy``
        is the scan's time in work items summed over threads. All zero after a query with several directions."""
        return dict(self._forest.last_query_phases())

    def memory_bytes(self) -> dict[str, int]:
        """Host bytes the index holds (reserved capacity included): ``keys`` (its key rows) and ``structure``
        (levels, trees, pages, projections)."""
        return dict(self._forest.memory_bytes())

    # ------------------------------------------------------------------ maps and state
    @property
    def num_tokens(self) -> int:
        """Tokens per instance."""
        return int(self._forest.num_tokens(0))

    def num_levels(self, instance: int) -> int:
        """Number of levels of one instance's tree."""
        return int(self._forest.num_levels(self._instance(instance)))

    def num_pages(self) -> np.ndarray:
        """int32 [num_instances]: page ids of instance i are 0..num_pages[i]-1 (freed ids show 0 valid tokens)."""
        return self._forest.num_pages()

    def page_tokens(self, instance: int) -> np.ndarray:
        """int32 [num_pages, 16]: token ids of each page in slot order, -1 padded."""
        return self._forest.page_tokens(self._instance(instance))

    def page_valid_counts(self) -> np.ndarray:
        """int32 [num_instances, max_pages]: valid tokens per page (get_valid_entries); 0 past an instance's last
        page."""
        return self._forest.page_valid_counts()

    def token_to_page(self, instance: int) -> tuple[np.ndarray, np.ndarray]:
        """(page [n], slot [n]) int32: where each token of one instance lives."""
        return self._forest.token_to_page(self._instance(instance))

    def pop_changed_pages(self) -> np.ndarray:
        """bool [num_instances, max_pages]: pages whose content changed since the last pop (or build); resets."""
        return self._forest.pop_changed_pages()

    def max_sq_norm(self) -> np.ndarray:
        """float64 [num_instances]: the running maximum squared key norm M of the MIPS transform."""
        return self._forest.max_sq_norm()

    @property
    def directions(self) -> np.ndarray:
        """float32 [L, dim+1] (transform) or [L, dim]: the unit projection directions."""
        return self._forest.directions()

    def node_info(self, instance: int) -> dict[str, np.ndarray]:
        """Per-token internals for tests and diagnostics: level, parent (-1 = root), parent_dist, sq_norm,
        projections [n, L], projection_sq_norm_max (M the projection is current at), free_pages."""
        return self._forest.node_info(self._instance(instance))

    def check(self, instance: int) -> str:
        """Checks every structural invariant of one instance; returns '' or the first violation found."""
        return self._forest.check(self._instance(instance))

    def _instance(self, instance: int) -> int:
        if not 0 <= instance < self.num_instances:
            raise IndexError(f"instance {instance} out of range 0..{self.num_instances - 1}")
        return int(instance)


def _check_search(field_of_view: int, prop_to_retrieve: float, prop_to_visit: float) -> None:
    if field_of_view < 1:
        raise ValueError(f"field_of_view must be >= 1, got {field_of_view}")
    if not 0.0 < prop_to_retrieve <= 1.0 or not 0.0 < prop_to_visit <= 1.0:
        raise ValueError(
            f"prop_to_retrieve and prop_to_visit must lie in (0, 1], got {prop_to_retrieve} and {prop_to_visit}"
        )
