"""IceCache's settings: the paper's parameters, and how the budget divides into sink, selected and window pages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from icecache.core.method import MethodConfig, not_in_run_identity
from icecache.errors import ConfigError

DCI_LEAF_CAPACITY = 16
CPU_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class IceCacheConfig(MethodConfig):
    name: str = "icecache"
    budget: int | None = 256
    page_size: int = 16  # must equal the DCI leaf capacity
    n_sink_pages: int = 2
    n_window_pages: int = 2
    n_dense_layers: int = 2  # layers 0..n-1 keep the full cache
    n_reuse_layers: int = 1  # 1: every layer owns its index; R > 1: IceCache-reuse
    promotion_prob: float = 0.01  # DCI: the chance a point of level 0 is promoted to level 1
    promotion_prob_subseq: float = 0.2  # DCI: the same from each higher level to the next
    build_field_of_view: int = 30
    build_prop_to_retrieve: float = 1.0
    # The anchor shortcut for the parents of level-0 points (v4434: 60, 60, 1.02).
    anchor_interval: int = 60
    anchor_neighbours: int = 60
    anchor_threshold: float = 1.02
    insert_field_of_view: int = 20
    insert_prop_to_retrieve: float = 0.6
    query_field_of_view: int | None = None  # None: max(int(1.5e-3 * tokens), 30)
    query_prop_to_retrieve: float = 0.8
    # OpenMP threads of the index (None: torch's CPU threads, the process's share of the host: the run's `threads`,
    # which a sweep sets to cores / workers when it runs several jobs at once)
    cpu_threads: int | None = None
    # How long the search team's threads spin for the next search before they sleep (None: 2 ms where the decode
    # step runs on a GPU, which covers the GPU's work between two layers' searches; 0 on the CPU, where that gap is
    # the model's own work on the same cores). Never changes a result.
    search_team_spin_us: int | None = not_in_run_identity(None)
    # The prompt's layers are indexed by this many jobs at once, beside the prefill: a build gains little from more
    # threads (1.8x for 8x on the H200 host), so several builds with fewer threads each finish the prompt sooner. A
    # layer's index does not depend on its thread count, so the pages are the same.
    prompt_workers: int = 4
    # Threads of each prompt build (None: cpu_threads / prompt_workers). Searches and inserts, which the decode step
    # waits for, always use cpu_threads.
    build_threads: int | None = None
    # Key rows a search scores first: "half" keeps an IEEE half copy of every key, "int8" 8-bit codes with a per-row
    # scale, and either re-scores exactly only what error bounds cannot rule out; the same pages and scores bit for
    # bit as "float32" (docs/dci.md). Half was 14-23% faster when the index scored float32 copies; now that it scores
    # the bf16 keys in place the half copy reads as many bytes. Int8 reads ~40% fewer bytes but costs 136 B of host
    # memory a key and head, and its bounds' bookkeeping ate the saving on the hosts measured: off by default.
    dci_score_precision: str = "float32"
    # Opt-in, not the paper's method: an owner layer's search starts one layer early from a speculative query (the
    # previous layer's input through this layer's projection); a step whose exact query has a cosine below
    # lookahead_min_cosine with it, for any query head, searches again with the exact query (lookahead.py).
    lookahead: bool = False
    lookahead_min_cosine: float = 0.9
    cpu_kv_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    offload_short_prompts: bool = False  # index even prompts that fit in the budget (tests, analysis)
    seed: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "IceCacheConfig":
        config = super().from_dict(values).fitted_to_budget()
        config.check_pages()  # needs no model: a sweep refuses such a cell before any job runs
        return config

    def budget_page_size(self) -> int | None:
        return self.page_size

    def min_budget(self) -> int:
        """Three pages with one sink and one window page (the fixed pages shrink to those where they would leave
        nothing to select, ``fitted_to_budget``); two without sinks."""
        return (min(self.n_sink_pages, 1) + min(self.n_window_pages, 1) + 1) * self.page_size

    def min_budget_reason(self) -> str:
        return (f"({min(self.n_sink_pages, 1)} sink + 1 selected + {min(self.n_window_pages, 1)} window page) x "
                f"page_size={self.page_size}")

    def check_pages(self) -> None:
        """``ConfigError`` unless the budget's pages hold the fixed pages and at least one selected page."""
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0 or self.page_size <= 0:
            return  # no budget, a wrong type, a bad page size: the method's check says which
        pages = self.budget // self.page_size
        if pages - self.n_sink_pages - self.n_window_pages < 1:
            # Fitted already (fitted_to_budget): below min_budget the sink and window pages cannot shrink further.
            raise ConfigError(
                f"budget {self.budget} gives {pages} pages of {self.page_size} tokens; {self.name} needs at least "
                f"{self.min_budget()} = {self.min_budget_reason()}: use budget={self.min_budget()} or more"
            )

    @property
    def page_budget(self) -> int:
        """GPU pages per KV head: sinks + selected + window."""
        return self.budget // self.page_size

    @property
    def gpu_tokens(self) -> int:
        """Tokens the budget's GPU pages hold; a sequence no longer than this is attended densely."""
        return self.page_budget * self.page_size

    @property
    def n_selected_pages(self) -> int:
        return self.page_budget - self.n_sink_pages - self.n_window_pages

    @property
    def index_threads(self) -> int:
        """OpenMP threads of the index: ``cpu_threads``, or torch's CPU threads. Not every core the process may run
        on: 14 jobs of a sweep on 16 cores would each start 16 search threads (224 on 16 cores, a step's searches
        waiting on descheduled threads), where each job's share is one."""
        if self.cpu_threads:
            return self.cpu_threads
        return torch.get_num_threads()

    @property
    def search_threads(self) -> int:
        """OpenMP threads of a decode step's search: ``index_threads``, one fewer with the look-ahead, whose search
        runs on its own thread while the step's host work goes on on another (two busy masters on as many cores as
        threads make every barrier of the search wait for a descheduled thread). Results do not depend on it."""
        return max(1, self.index_threads - 1) if self.lookahead else self.index_threads

    def search_team_spin_s(self, device_type: str) -> float:
        """Seconds the search team spins after a job (``search_team_spin_us``, or its default for the device)."""
        if self.search_team_spin_us is not None:
            return self.search_team_spin_us * 1e-6
        return 2e-3 if device_type != "cpu" else 0.0

    @property
    def prompt_build_threads(self) -> int:
        """OpenMP threads of one prompt build: ``build_threads``, or an equal share of ``index_threads``."""
        return self.build_threads or max(1, self.index_threads // max(1, self.prompt_workers))

    def owner_of(self, layer_idx: int) -> int:
        """The layer whose index and selection ``layer_idx`` uses (itself unless reused)."""
        position = layer_idx - self.n_dense_layers
        return layer_idx - position % self.n_reuse_layers

    def fitted_to_budget(self) -> "IceCacheConfig":
        """The settings IceCache runs with at this budget (docs/eval.md, "IceCache at small budgets").

        The budget counts every GPU slot of a head: sink + selected + window pages of ``page_size`` tokens. When the
        configured fixed pages leave no page to select (64 tokens are 4 pages; the default 2 sink + 2 window pages
        fill them), the sink and the window shrink to one page each, which leaves 2 selected pages at 64 and 1 at
        48. Budgets where the fixed pages already leave a selected page are untouched. Below 3 pages (48 tokens)
        nothing is changed and ``IceCache.check`` refuses the budget. The runner records the settings returned here,
        so a run's config.yaml and directory say what was attended.
        """
        budget = self.budget
        if not isinstance(budget, int) or isinstance(budget, bool) or self.page_size <= 0:
            return self
        pages = budget // self.page_size
        if pages - self.n_sink_pages - self.n_window_pages >= 1:
            return self
        sink, window = min(self.n_sink_pages, 1), min(self.n_window_pages, 1)
        if pages - sink - window < 1:
            return self
        return dataclasses.replace(self, n_sink_pages=sink, n_window_pages=window)


@dataclass
class IceCacheReuseConfig(IceCacheConfig):
    name: str = "icecache_reuse"
    n_reuse_layers: int = 3
