"""What IceCache's layers of one sequence share, typed: per reuse group the index and its selection, and per
sequence the worker threads that build the prompt's indexes (with their progress bar) and the C++ side of the
decode steps (the look-ahead searches' thread, the first error of a step), closed when the sequence ends."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from icecache.core.host_memory import HostPool, host_available_bytes, tensor_bytes
from icecache.dci import _dci

# Host memory a prefill leaves free beyond what its prompt jobs will still allocate (the process's other needs).
STAGING_RESERVE_BYTES = 4 * 2**30
# A layer's index and token store per byte of its staged prompt (the latency files' host_kv_ratio: 1.16 for IceCache,
# 1.05 for IceCache-reuse), with some room.
STORE_PER_STAGED_BYTE = 1.25


@dataclass
class GroupState:
    """The index and the selection of one reuse group, owned by its first layer (every layer is its own group
    without reuse). The other layers of the group read them; only the owner writes.

    ``native`` (``_dci.ReuseGroup``) is what the group's C++ decode steps share: the owner's index (given by
    ``set_index``), this step's selection, the index's page counts (read again only after it changes) and the pages
    its last insert changed (resident copies of them are stale)."""

    native: Any
    index: Any = None  # icecache.dci.DCIIndex, built by the owner's prompt job

    def set_index(self, index) -> None:
        self.index = index
        self.native.set_forest(index._forest)

    @property
    def selection(self) -> np.ndarray | None:
        """This step's pages per KV head ``[Hkv, K]``, -1 padded (a copy; None before the first step)."""
        return self.native.selection()


@dataclass
class IceCacheSequence:
    """One sequence's IceCache state (``SequenceContext.state(IceCacheSequence)``): the groups, and the workers of
    the prompt jobs (``n_workers`` at once, submitted in layer order). The jobs are independent: an owner's job
    builds its index, a reusing layer's only stores its tokens; a layer's decode waits for its own job, and a
    reuser's decode comes after its owner's."""

    groups: dict[int, GroupState] = field(default_factory=dict)
    # The C++ decode steps' shared part: the look-ahead searches' thread (one at a time, each with the index's
    # threads) and the first error a step raised, after which every step of the sequence does nothing.
    native: Any = field(default_factory=lambda: _dci.NativeSequence())
    prompt_jobs: list[Future] = field(default_factory=list)
    # Layers whose staged prompt (the pinned copy their prompt job reads) has not gone back to the pool yet, oldest
    # first (``give_back_staging``)
    staging_layers: list[Any] = field(default_factory=list)
    n_indexed_layers: int = 0  # the progress bar's total
    n_layers_done: int = 0
    n_workers: int = 1
    _worker: ThreadPoolExecutor | None = None
    _all_prompt_jobs_done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the progress bar, updated by every worker
    _progress: Any = None

    def group(self, owner: int, n_kv_heads: int, n_selected: int) -> GroupState:
        found = self.groups.get(owner)
        if found is None:
            found = self.groups[owner] = GroupState(_dci.ReuseGroup(n_kv_heads, n_selected))
        return found

    def submit_prompt_job(self, job: Callable[..., None], *args) -> Future:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max(1, self.n_workers), thread_name_prefix="icecache-index")
        future = self._worker.submit(job, *args)
        self.prompt_jobs.append(future)
        self._all_prompt_jobs_done = False
        return future

    def make_room_for_staging(self, pool: HostPool, shape: tuple[int, ...], dtype: torch.dtype,
                              device: torch.device) -> None:
        """Before a layer stages its prompt in two buffers (keys, values) of ``shape`` from ``pool``: while
        the pool has no two free ones for it and the host's available memory, less them, would not hold what the
        layers not yet indexed will still allocate (an index and a token store each), the oldest layer's staged
        prompt goes back to the pool, once its job is done (waiting for it), for this layer to stage in. A layer's
        staging is otherwise kept until the first decode step, which lets the prefill run ahead of the index builds
        (at 300k tokens they end 50 s after it); but then the prefill holds a second copy of the whole prompt
        beside the index stores it is copied into, 2.2 bytes of host memory a byte of offloaded KV, more than a
        128 GiB host holds at 512k. Where the memory is there, nothing changes; the prefill waits for the builds
        only where it is not."""
        staged = 2 * tensor_bytes(shape, dtype)
        while self.staging_layers and pool.free_fitting(shape, dtype, device) < 2:
            available = host_available_bytes()
            to_come = (self.n_indexed_layers - self.n_layers_done) * staged * STORE_PER_STAGED_BYTE
            if available is None or available - staged - to_come > STAGING_RESERVE_BYTES:
                return
            self.staging_layers.pop(0).give_back_staging()

    def wait_for_prompt_jobs(self) -> None:
        """Every layer's prompt job done (and its error raised): an owner's index must not change under the feet
        of a reuser that is still laying its pages out. Cheap once they are."""
        if self._all_prompt_jobs_done:
            return
        for job in self.prompt_jobs:
            job.result()
        self._all_prompt_jobs_done = bool(self.prompt_jobs)

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
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._worker = None
        self.staging_layers.clear()  # the layers refer to this sequence: no cycle left for the collector
        self.native.stop()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
