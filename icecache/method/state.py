"""What IceCache's layers of one sequence share, typed: per reuse group the index and its selection, and per
sequence the worker threads that build the prompt's indexes (with their progress bar) and run the look-ahead
searches, closed when the sequence ends."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass
class GroupState:
    """The index and the selection of one reuse group, owned by its first layer (every layer is its own group
    without reuse). The other layers of the group read them; only the owner writes."""

    index: Any = None  # icecache.dci.DCIIndex, built by the owner's prompt job
    # Pages whose content changed at the last insert, bool [Hkv, pages]: resident copies of them are stale.
    changed: np.ndarray | None = None
    # Valid tokens of every page [Hkv, pages], read from the index again only after it changes.
    page_counts: np.ndarray | None = None
    selection: np.ndarray | None = None  # this step's pages per KV head [Hkv, K], -1 padded


@dataclass
class IceCacheSequence:
    """One sequence's IceCache state (``SequenceContext.state(IceCacheSequence)``): the groups, and the workers of
    the prompt jobs (``n_workers`` at once, submitted in layer order). The jobs are independent: an owner's job
    builds its index, a reusing layer's only stores its tokens; a layer's decode waits for its own job, and a
    reuser's decode comes after its owner's."""

    groups: dict[int, GroupState] = field(default_factory=dict)
    prompt_jobs: list[Future] = field(default_factory=list)
    n_indexed_layers: int = 0  # the progress bar's total
    n_layers_done: int = 0
    n_workers: int = 1
    _worker: ThreadPoolExecutor | None = None
    # One thread for the look-ahead jobs (lookahead.py): they search one at a time, each with the index's threads.
    _search_worker: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the progress bar, updated by every worker
    _progress: Any = None

    def group(self, owner: int) -> GroupState:
        return self.groups.setdefault(owner, GroupState())

    def submit_prompt_job(self, job: Callable[..., None], *args) -> Future:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max(1, self.n_workers), thread_name_prefix="icecache-index")
        future = self._worker.submit(job, *args)
        self.prompt_jobs.append(future)
        return future

    def submit_search(self, job: Callable[..., Any], *args) -> Future:
        if self._search_worker is None:
            self._search_worker = ThreadPoolExecutor(1, thread_name_prefix="icecache-lookahead")
        return self._search_worker.submit(job, *args)

    def wait_for_prompt_jobs(self) -> None:
        """Every layer's prompt job done (and its error raised): an owner's index must not change under the feet
        of a reuser that is still laying its pages out."""
        for job in self.prompt_jobs:
            job.result()

    def layer_indexed(self) -> None:
        """One more layer's prompt indexed: one bar per sequence over its sparsified layers, on a terminal only."""
        with self._lock:
            self._layer_indexed()

    def _layer_indexed(self) -> None:
        self.n_layers_done += 1
        if self._progress is None:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=self.n_indexed_layers, desc="indexing prompt", unit="layer", leave=False,
                                  disable=None)
        self._progress.update()

    def close(self) -> None:
        """End the workers (after the jobs they have) and the progress bar; called when the sequence ends."""
        for worker in (self._worker, self._search_worker):
            if worker is not None:
                worker.shutdown(wait=True)
        self._worker = self._search_worker = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None
