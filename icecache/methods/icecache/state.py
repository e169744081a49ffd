"""What IceCache's layers of one sequence share, typed: per reuse group the index and its selection, and per
sequence the worker thread that builds the prompt's indexes (with their progress bar), closed when the sequence
ends."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass
class GroupState:
    """The index and the selection of one reuse group, owned by its first layer (every layer is its own group
    without reuse). The other layers of the group read them; only the owner writes."""

    index: Any = None  # icecache.dci.DCIIndex, built by the owner's prompt job
    # Pages whose content changed at the last build or insert, bool [Hkv, pages], to be rewritten in the CPU store.
    changed: np.ndarray | None = None
    # Valid tokens of every page [Hkv, pages], read from the index again only after it changes.
    page_counts: np.ndarray | None = None
    # The index as built from the prompt: what every layer's prompt job lays out. A prompt that fitted in the budget
    # is offloaded at a decode step, layer by layer, and the owner's first window insert (the same step) can come
    # before its reusers' prompt jobs run, so those must not read the live index.
    prompt_changed: np.ndarray | None = None
    prompt_layout: list[np.ndarray] | None = None
    selection: np.ndarray | None = None  # this step's pages per KV head [Hkv, K], -1 padded


@dataclass
class IceCacheSequence:
    """One sequence's IceCache state (``SequenceContext.state(IceCacheSequence)``): the groups, and one worker for
    the prompt jobs, so that they run in layer order and an owner's index is built before its reusers read it."""

    groups: dict[int, GroupState] = field(default_factory=dict)
    prompt_jobs: list[Future] = field(default_factory=list)
    n_indexed_layers: int = 0  # the progress bar's total
    n_layers_done: int = 0
    _worker: ThreadPoolExecutor | None = None
    _progress: Any = None

    def group(self, owner: int) -> GroupState:
        return self.groups.setdefault(owner, GroupState())

    def submit_prompt_job(self, job: Callable[..., None], *args) -> Future:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        future = self._worker.submit(job, *args)
        self.prompt_jobs.append(future)
        return future

    def wait_for_prompt_jobs(self) -> None:
        """Every layer's prompt job done (and its error raised): an owner's index must not change under the feet
        of a reuser that is still laying its pages out."""
        for job in self.prompt_jobs:
            job.result()

    def layer_indexed(self) -> None:
        """One more layer's prompt indexed: one bar per sequence over its sparsified layers, on a terminal only."""
        self.n_layers_done += 1
        if self._progress is None:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=self.n_indexed_layers, desc="indexing prompt", unit="layer", leave=False,
                                  disable=None)
        self._progress.update()

    def close(self) -> None:
        """End the worker (after the jobs it has) and the progress bar; called when the sequence ends."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None
