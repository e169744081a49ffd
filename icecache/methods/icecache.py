"""IceCache (ICLR 2026): KV pages offloaded to CPU memory, chosen per decode step by a multi-level DCI index.

Per sparsified layer and KV head the prompt is split into sink pages (the first tokens), a recent window and the
middle. Prefill attends densely; then the middle tokens are indexed into one DCI tree per KV head (MIPS
transform, pages = B+-tree leaves of 8-16 tokens) on a CPU worker thread, while the GPU goes on with the next
layer, and the middle pages live in CPU (pinned) memory. Only the sink and window pages stay on the GPU, in a
page pool sized by the budget. At each decode step:

1. the layer's query goes to the CPU and each query head searches its KV head's tree for the K best pages;
2. the query heads of a KV group are merged rank by rank into K distinct pages;
3. the selection is diffed against the pages already in the GPU slots (kept pages stay unless their content
   changed since they were loaded);
4. the missing pages are gathered into one pinned buffer, copied to the GPU in one transfer and scattered into
   the freed slots (``icecache.core.paged.StepTransit``);
5. attention runs over sinks + selected pages + window with per-page valid-token counts.

When the window is full, its oldest page is offloaded (from the window's host copy): inserted into the tree as a
batch (pages split and change; changed pages are rewritten in the CPU store and reloaded if resident).

With ``cuda_graph`` (on by default; it only acts on CUDA) the decode step, host work included, is captured
in one CUDA graph: each layer's host work runs as a host function of the graph, so the transformer's kernels are
launched by the graph
rather than one by one from Python. The dense layers then keep their cache in static buffers
(``core.static_kv.StaticDenseKV``) so that they can be captured too.

IceCache-reuse (``n_reuse_layers = R``) lets the first layer of each group of R consecutive sparsified layers
own the index and the selection; the other layers lay out their own keys and values with the owner's pages and
load the owner's selection.

Choices where the two public code versions differ (docs/algorithms.md, IceCache): we follow v4434: all middle pages are
offloaded at prefill, batch insertion of a full window page, anchors (60, 60, 1.02), CPU KV in the model's dtype
by default (bf16 on GPU; ``cpu_kv_dtype=float32`` gives the main branch's float32 store). Budget
(docs/design.md, Budget semantics): ``budget // page_size`` pages per head in all, of which ``n_sink_pages`` +
``n_window_pages`` are fixed and K = the rest are selected; at budgets the fixed pages would fill, they shrink to
one page each (``IceCacheConfig.fitted_to_budget``). A prompt that fits in the budget is attended densely, as in
the reference code.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from icecache.core.attention import paged_decode_attention
from icecache.core.cuda_driver import in_host_function
from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, DenseKV, Method, MethodConfig, ModelInfo, SequenceContext  # noqa: F401
from icecache.core.paged import CpuPageStore, GpuPagePool, StepTransit, gather_blocks, scatter_pages

DCI_LEAF_CAPACITY = 16
_STORE_HEADROOM_PAGES = 4 * DCI_LEAF_CAPACITY
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class IceCacheConfig(MethodConfig):
    name: str = "icecache"
    budget: int | None = 256
    page_size: int = 16  # must equal the DCI leaf capacity
    n_sink_pages: int = 2
    n_window_pages: int = 2
    n_dense_layers: int = 2
    n_reuse_layers: int = 1  # 1: every layer owns its index; R > 1: IceCache-reuse
    promotion_prob: float = 0.01
    promotion_prob_subseq: float = 0.2
    build_field_of_view: int = 30
    build_prop_to_retrieve: float = 1.0
    anchor_interval: int = 60
    anchor_neighbours: int = 60
    anchor_threshold: float = 1.02
    insert_field_of_view: int = 20
    insert_prop_to_retrieve: float = 0.6
    query_field_of_view: int | None = None  # None: max(int(1.5e-3 * tokens), 30)
    query_prop_to_retrieve: float = 0.8
    cpu_threads: int | None = None  # OpenMP threads of the index (None: all cores)
    # Threads of the prompt's index builds, which run beside the prefill (None: cpu_threads). Searches and inserts,
    # which the decode step waits for, always use cpu_threads.
    build_threads: int | None = None
    # Key rows a search scores first: "half" keeps a half copy and re-scores in float32 only what error bounds cannot
    # rule out; the same pages and scores bit for bit as "float32", from about half the bytes (docs/dci.md). It
    # searches 14-23% faster on the H200 host but builds slower (TT2T +1.9 s at 32k) and holds 25% more index
    # memory, so it pays off only for outputs of several hundred tokens: off by default.
    dci_score_precision: str = "float32"
    cpu_kv_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    offload_short_prompts: bool = False  # index even prompts that fit in the budget (tests, analysis)
    seed: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "IceCacheConfig":
        config = super().from_dict(values).fitted_to_budget()
        config.check_pages()  # needs no model: a sweep refuses such a cell before any job runs
        return config

    def check_pages(self) -> None:
        """``ConfigError`` unless the budget's pages hold the fixed pages and at least one selected page."""
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0 or self.page_size <= 0:
            return  # no budget, a wrong type, a bad page size: the method's check says which
        pages = self.budget // self.page_size
        if pages - self.n_sink_pages - self.n_window_pages < 1:
            raise ConfigError(
                f"budget {self.budget} gives {pages} pages of {self.page_size} tokens, but n_sink_pages "
                f"({self.n_sink_pages}) + n_window_pages ({self.n_window_pages}) + 1 selected page need "
                f"{(self.n_sink_pages + self.n_window_pages + 1) * self.page_size}: raise the budget (IceCache needs "
                f"at least {3 * self.page_size}: 1 sink + 1 selected + 1 window page)"
            )

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


@METHODS.register("icecache")
class IceCache(Method):
    display_name = "IceCache"
    config_class = IceCacheConfig
    # 64 tokens are 4 pages: 1 sink + 2 selected + 1 window.
    test_settings = {"n_sink_pages": 1, "n_window_pages": 1}

    def min_budget(self) -> int:
        """Three pages with one sink and one window page (the fixed pages shrink to those where they would leave
        nothing to select, ``IceCacheConfig.fitted_to_budget``); two without sinks."""
        cfg = self.config
        return (min(cfg.n_sink_pages, 1) + min(cfg.n_window_pages, 1) + 1) * cfg.page_size

    def forced_positions(self, n_tokens):
        # The sink pages, and the window, which always holds its n_window_pages - 1 full pages and one more token.
        cfg = self.config
        n_window = (cfg.n_window_pages - 1) * cfg.page_size + 1
        sinks = list(range(min(cfg.n_sink_pages * cfg.page_size, n_tokens)))
        return sinks + list(range(max(0, n_tokens - n_window), n_tokens))

    @property
    def page_budget(self) -> int:
        return self.config.budget // self.config.page_size

    @property
    def gpu_tokens(self) -> int:
        """Tokens the budget's GPU pages hold; a sequence no longer than this is attended densely."""
        return self.page_budget * self.config.page_size

    @property
    def n_selected_pages(self) -> int:
        return self.page_budget - self.config.n_sink_pages - self.config.n_window_pages

    def check(self) -> None:
        super().check()
        cfg = self.config
        if cfg.page_size != DCI_LEAF_CAPACITY:
            raise ConfigError(
                f"icecache page_size must be {DCI_LEAF_CAPACITY} (the DCI leaf capacity), not {cfg.page_size}")
        if cfg.n_sink_pages < 0 or cfg.n_window_pages < 1:
            raise ConfigError("icecache needs n_sink_pages >= 0 and n_window_pages >= 1")
        cfg.check_pages()
        if cfg.n_reuse_layers < 1:
            raise ConfigError("n_reuse_layers must be >= 1 (1 = no reuse)")
        if cfg.dci_score_precision not in ("float32", "half"):
            raise ConfigError(f"dci_score_precision={cfg.dci_score_precision}: use float32 or half")
        if cfg.cpu_kv_dtype != "auto" and cfg.cpu_kv_dtype not in _DTYPES:
            raise ConfigError(f"cpu_kv_dtype={cfg.cpu_kv_dtype}: use auto, {', '.join(_DTYPES)}")

    @property
    def index_threads(self) -> int:
        """OpenMP threads of the index: ``cpu_threads``, or every core this process may run on."""
        if self.config.cpu_threads:
            return self.config.cpu_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def owner_of(self, layer_idx: int) -> int:
        """The layer whose index and selection ``layer_idx`` uses (itself unless reused)."""
        position = layer_idx - self.config.n_dense_layers
        return layer_idx - position % self.config.n_reuse_layers

    @property
    def captures_decode_step(self) -> bool:
        # The host step writes into the Triton kernels' fixed buffers; without Triton the step runs eagerly.
        from icecache.core import triton_kernels

        return super().captures_decode_step and triton_kernels.available()

    def make_sparse_layer(self, layer_idx: int, seq: SequenceContext):
        return IceCacheLayer(layer_idx, self.model, seq, self)


@dataclass
class IceCacheReuseConfig(IceCacheConfig):
    name: str = "icecache_reuse"
    n_reuse_layers: int = 3


@METHODS.register("icecache_reuse")
class IceCacheReuse(IceCache):
    """IceCache(r): one index and selection per group of ``n_reuse_layers`` consecutive layers (default 3)."""

    display_name = "IceCache(r)"
    config_class = IceCacheReuseConfig


class IceCacheLayer(DenseKV):
    """One sparsified layer: dense until offloaded, then sinks + DCI-selected pages + window on the GPU."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, method: IceCache):
        super().__init__(layer_idx, model, seq)
        self.method = method
        self.cfg: IceCacheConfig = method.config
        self.is_owner = method.owner_of(layer_idx) == layer_idx
        self.offloaded = False
        self._ready: Future | None = None

    # ------------------------------------------------------------------ shared per-sequence state
    def _shared(self, owner: int | None = None) -> dict[str, Any]:
        owner = self.method.owner_of(self.layer_idx) if owner is None else owner
        return self.seq.shared.setdefault(("icecache", owner), {})

    def _worker(self) -> ThreadPoolExecutor:
        # One worker per sequence: jobs run in layer order, so an owner's index is built before its reusers read it.
        worker = self.seq.shared.get("icecache_worker")
        if worker is None:
            worker = self.seq.shared["icecache_worker"] = ThreadPoolExecutor(1, thread_name_prefix="icecache-index")
        return worker

    # ------------------------------------------------------------------ prefill and offload
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("icecache runs batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        over_budget = self.length > self.method.gpu_tokens
        if not self.seq.more_prefill_chunks and (over_budget or self.cfg.offload_short_prompts):
            self._offload_prompt()
        return out

    def _offload_prompt(self) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        keys, values = self.keys[0], self.values[0]  # [Hkv, T, D]
        total = keys.shape[1]
        sink_len = min(cfg.n_sink_pages * ps, total)
        tail = total % ps
        window_len = (cfg.n_window_pages - 1) * ps + tail if tail else cfg.n_window_pages * ps
        window_len = min(window_len, total - sink_len)
        middle_end = total - window_len
        device, dtype = keys.device, keys.dtype
        n_kv_heads, head_dim = self.model.n_kv_heads, self.model.head_dim
        k_sel = self.method.n_selected_pages
        self.sink_slots = -(-sink_len // ps)
        self.window_slot0 = cfg.n_sink_pages + k_sel
        self.pool = GpuPagePool(self.method.page_budget, n_kv_heads, ps, head_dim, dtype, device)
        self._fill_slots(0, keys[:, :sink_len], values[:, :sink_len])
        self.sink_len = sink_len
        # The window pages are a ring: logical window page j (oldest first) sits in slot
        # window_slot0 + (window_head + j) % n_window_pages, so offloading the oldest page moves nothing on the GPU.
        self.window_head = 0
        self.window_start = middle_end  # absolute position of the window's first token
        self._fill_slots(self.window_slot0, keys[:, middle_end:], values[:, middle_end:])
        self.window_count = window_len
        self.resident = np.full((n_kv_heads, k_sel), -1, dtype=np.int64)  # page id held by each selected slot
        self.stale = np.zeros((n_kv_heads, 0), dtype=bool)  # page content changed since it was loaded
        cpu_dtype = dtype if cfg.cpu_kv_dtype == "auto" else _DTYPES[cfg.cpu_kv_dtype]
        pin = device.type == "cuda"
        self.store = CpuPageStore(n_kv_heads, ps, head_dim, cpu_dtype, pin_memory=pin)
        self._transit = None  # decode buffers, made at the first decode step: prefill does no pinned allocation
        # Token store by offloaded-token id (the DCI's ids); pages are rewritten from it when they change.
        empty = torch.empty(n_kv_heads, 0, head_dim, dtype=cpu_dtype)
        self.tokens = TokenStore(empty, empty)
        self.token_positions = np.arange(sink_len, middle_end)
        # The middle goes to the index; the window's host copy is what its pages are offloaded from later.
        offloaded_k = keys[:, sink_len:].to("cpu", cpu_dtype, non_blocking=pin)
        offloaded_v = values[:, sink_len:].to("cpu", cpu_dtype, non_blocking=pin)
        copied = torch.cuda.Event() if pin else None
        if copied is not None:
            copied.record()
        self._keys = self._values = None  # the full prompt leaves the GPU
        self.offloaded = True
        self._ready = self._worker().submit(self._index_prompt, offloaded_k, offloaded_v, middle_end - sink_len, copied)
        self.seq.shared.setdefault("icecache_jobs", []).append(self._ready)

    def _fill_slots(self, first_slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Tokens ``[Hkv, n, D]`` into consecutive pool slots from ``first_slot``, a page of them per slot."""
        ps = self.cfg.page_size
        for page, begin in enumerate(range(0, keys.shape[1], ps)):
            n = min(ps, keys.shape[1] - begin)
            self.pool.key_pages[first_slot + page, :, :n] = keys[:, begin : begin + n]
            self.pool.value_pages[first_slot + page, :, :n] = values[:, begin : begin + n]

    @torch.inference_mode()  # inference mode is per thread; the store's tensors were made under it
    def _index_prompt(self, offloaded_k: torch.Tensor, offloaded_v: torch.Tensor, n_middle: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        middle_k, middle_v = offloaded_k[:, :n_middle], offloaded_v[:, :n_middle]
        window_capacity = self.cfg.n_window_pages * self.cfg.page_size
        self.window_keys = offloaded_k.new_zeros(offloaded_k.shape[0], window_capacity, offloaded_k.shape[2])
        self.window_values = torch.zeros_like(self.window_keys)
        n_window = offloaded_k.shape[1] - n_middle
        self.window_keys[:, :n_window] = offloaded_k[:, n_middle:]
        self.window_values[:, :n_window] = offloaded_v[:, n_middle:]
        self.tokens = TokenStore(middle_k, middle_v)
        shared = self._shared()
        if self.is_owner:
            cfg = self.cfg
            from icecache.dci import DCIIndex

            index = DCIIndex(
                self.model.head_dim, self.model.n_kv_heads, promotion_prob=cfg.promotion_prob,
                promotion_prob_subseq=cfg.promotion_prob_subseq, transform=True, deterministic_levels=True,
                seed=cfg.seed, num_threads=self.method.index_threads, score_precision=cfg.dci_score_precision,
            )
            index.num_threads = cfg.build_threads or self.method.index_threads
            if middle_k.shape[1]:
                index.build(
                    middle_k.float().numpy(), field_of_view=cfg.build_field_of_view,
                    prop_to_retrieve=cfg.build_prop_to_retrieve, anchor_interval=cfg.anchor_interval,
                    anchor_neighbours=cfg.anchor_neighbours, anchor_threshold=cfg.anchor_threshold,
                )
            index.num_threads = self.method.index_threads
            shared["index"] = index
            shared["changed"] = index.pop_changed_pages() if middle_k.shape[1] else None
            shared["page_counts"] = None
            # What every layer's prompt job lays out: the index as built. A prompt that fitted in the budget is
            # offloaded at a decode step, layer by layer, and the owner's first window insert (the same step) can
            # come before its reusers' prompt jobs run, so they must not read the live index.
            shared["prompt_changed"] = shared["changed"]
            shared["prompt_layout"] = (None if shared["changed"] is None else
                                       [index.page_tokens(head).copy() for head in range(self.model.n_kv_heads)])
        self._rewrite_pages(shared["prompt_changed"], shared["prompt_layout"])
        self._progress().update()

    def _progress(self):
        """One bar per sequence over the sparsified layers' prompt indexing (shown on a terminal only)."""
        bar = self.seq.shared.get("icecache_progress")
        if bar is None:
            from tqdm.auto import tqdm

            n_layers = self.model.n_layers - self.cfg.n_dense_layers
            bar = self.seq.shared["icecache_progress"] = tqdm(
                total=n_layers, desc="indexing prompt", unit="layer", leave=False, disable=None
            )
        return bar

    def _rewrite_pages(self, changed: np.ndarray | None, layout: list[np.ndarray] | None = None) -> None:
        """Lay out the pages flagged in ``changed [Hkv, pages]`` from the token store, by the owner's page map
        (``layout``: per head, the token ids of each page, -1 padded; default the index as it is now)."""
        if changed is None or not changed.any():
            return
        index = self._shared()["index"]
        page_ids, heads, rows = [], [], []
        for head in range(self.model.n_kv_heads):
            pages = np.flatnonzero(changed[head])
            if pages.size == 0:
                continue
            tokens = (index.page_tokens(head) if layout is None else layout[head])[pages]  # [n, 16], -1 padded
            page_ids.append(pages)
            heads.append(np.full(pages.size, head))
            rows.append(tokens)
        page_ids_np, heads_np = np.concatenate(page_ids), np.concatenate(heads)
        tokens = np.concatenate(rows).astype(np.int64, copy=False)
        key_rows, value_rows, head_stride = self.tokens.rows()
        source = np.where(tokens >= 0, heads_np[:, None] * head_stride + tokens, -1)
        self.store.write_pages_from_rows(page_ids_np, heads_np, key_rows, value_rows, source)
        n_pages = changed.shape[1]
        if self.stale.shape[1] < n_pages:
            self.stale = np.pad(self.stale, ((0, 0), (0, n_pages - self.stale.shape[1])))
        self.stale[:, :n_pages] |= changed

    # ------------------------------------------------------------------ the window
    def _evict_oldest_window_page(self) -> None:
        """Offload the window's oldest page from its host copy: into the token store and the owner's index. On the
        GPU its slot becomes the window's newest page (the ring turns); counts hide what the new tokens have not yet
        overwritten."""
        ps = self.cfg.page_size
        page_k = self.window_keys[:, :ps].clone()
        page_v = self.window_values[:, :ps].clone()
        self.window_keys[:, :-ps] = self.window_keys[:, ps:].clone()
        self.window_values[:, :-ps] = self.window_values[:, ps:].clone()
        self.window_count -= ps
        self.window_head = (self.window_head + 1) % self.cfg.n_window_pages
        positions = np.arange(self.window_start, self.window_start + ps)
        self.window_start += ps
        with self.seq.timer.host_phase("insert"):
            # Every layer's prompt job must be done before the owner's index changes under the reusers' feet.
            for job in self.seq.shared["icecache_jobs"]:
                job.result()
            self.tokens.append(page_k, page_v)
            self.token_positions = np.concatenate([self.token_positions, positions])
            shared = self._shared()
            if self.is_owner:
                cfg = self.cfg
                shared["index"].insert(
                    page_k.float().numpy(), field_of_view=cfg.insert_field_of_view,
                    prop_to_retrieve=cfg.insert_prop_to_retrieve, as_batch=True,
                )
                shared["changed"] = shared["index"].pop_changed_pages()
                shared["page_counts"] = None
            self._rewrite_pages(shared["changed"])

    # ------------------------------------------------------------------ decode
    #
    # A decode step is split into device work before the host (stage the query and the new token for the host),
    # the host work (``_host_step``: window bookkeeping, search, diff, gather) and device work after it (one copy
    # of what the host prepared, the new token's write, the scatter, the attention). Eagerly the host waits for
    # its inputs; when the generation loop captures the step in a CUDA graph the host step is enqueued as a host
    # function instead, and the whole decode step, every layer's host work included, replays from the graph.

    @property
    def graph_ready(self) -> bool:
        return self.offloaded

    def between_steps(self) -> None:
        # Inserts add pages inside the step, where a captured step cannot pin new memory: keep room for a few
        # window offloads ahead (one adds at most page_size pages per head, one every page_size steps).
        if self.offloaded:
            self.store.reserve(self.store.n_pages + _STORE_HEADROOM_PAGES)
            self._ready.result()  # the token store is the prompt job's until it is done
            self.tokens.reserve(self.tokens.n_tokens + _STORE_HEADROOM_PAGES * self.cfg.page_size)

    def _make_decode_buffers(self, device: torch.device) -> None:
        """The attention's page table and the step's fixed-size transit buffers (``StepTransit``).

        Made once, so that a step's host work builds no tensor and a step has the same copies at every step. The
        page table is slot ``i`` -> page ``i`` for good: an empty slot needs no -1 entry, as a count of 0 already
        masks all its positions (in the Triton kernel and in the PyTorch reference alike); only the counts change.
        """
        ps, n_kv_heads, n_slots = self.cfg.page_size, self.model.n_kv_heads, self.method.page_budget
        self._slot_table = torch.arange(n_slots, device=device).expand(n_kv_heads, n_slots)
        self._transit = StepTransit(
            self.model.n_heads, n_kv_heads, n_slots, n_kv_heads * self.method.n_selected_pages, ps,
            self.model.head_dim, self.store.dtype, device,
        )
        counts = self._transit.host["counts"]
        sink_starts = np.arange(self.cfg.n_sink_pages) * ps
        counts[:, : self.cfg.n_sink_pages] = np.clip(self.sink_len - sink_starts, 0, ps)
        # Ring slot r holds logical window page (r - window_head) mod n_window_pages.
        self._window_slots = np.arange(self.cfg.n_window_pages)
        self._head_rows = np.arange(n_kv_heads) * ps
        self._inputs_arrived = torch.cuda.Event() if device.type == "cuda" else None

    def decode(self, query, key, value, scaling):
        if not self.offloaded:
            if self.length + 1 <= self.method.gpu_tokens:
                out = super().decode(query, key, value, scaling)
                self.seq.counters.record_attention(self.length)
                return out
            self._offload_prompt()
        if self._transit is None:
            self._make_decode_buffers(self.pool.key_pages.device)
        transit = self._transit
        transit.inputs_to_host(query[0, :, 0, :], key[0, :, 0, :], value[0, :, 0, :])
        self._run_on_host(self._host_step)
        transit.outputs_to_device()
        staged = transit.device_views
        head_dim = self.model.head_dim
        self.pool.key_pages.view(-1, head_dim).index_copy_(0, staged["window_rows"], key[0, :, 0, :])
        self.pool.value_pages.view(-1, head_dim).index_copy_(0, staged["window_rows"], value[0, :, 0, :])
        scatter_pages(staged["keys"], staged["values"], self.pool.key_pages, self.pool.value_pages, staged["slots"],
                      staged["heads"])
        if self.seq.trace_selection:
            self.last_attended = self._attended_positions()
        out = paged_decode_attention(
            query[0, :, 0, :], self.pool.key_pages, self.pool.value_pages, self._slot_table, staged["counts"],
            scaling,
        )
        return out[None, None]

    def _run_on_host(self, host_work) -> None:
        """Run ``host_work`` once this step's inputs are on the host: now (CPU), after waiting for them (eager
        CUDA, the step's one synchronisation per layer), or as a host function of the stream being captured."""
        if self._inputs_arrived is None:
            host_work()
        elif torch.cuda.is_current_stream_capturing():
            self.seq.host_functions.launch(host_work, self.pool.key_pages.device)
        else:
            self._inputs_arrived.record()
            self._inputs_arrived.synchronize()
            host_work()

    @torch.inference_mode()  # the host copies were made under it, on the index worker's thread
    def _host_step(self) -> None:
        """The host's part of a decode step: make room in the window and place the new token, select, diff against
        the slots, gather the pages to load and write the slots' valid counts, all into the transit buffers. Must
        not call CUDA (it may run as a host function)."""
        self._ready.result()
        cfg, ps, n_heads, n_kv_heads = self.cfg, self.cfg.page_size, self.model.n_heads, self.model.n_kv_heads
        transit = self._transit
        if self.window_count == cfg.n_window_pages * ps:
            self._evict_oldest_window_page()
        inputs = transit.inputs_host
        self.window_keys[:, self.window_count] = inputs[n_heads : n_heads + n_kv_heads]
        self.window_values[:, self.window_count] = inputs[n_heads + n_kv_heads :]
        page, offset = divmod(self.window_count, ps)
        slot = self.window_slot0 + (self.window_head + page) % cfg.n_window_pages
        transit.host["window_rows"][:] = (slot * n_kv_heads) * ps + self._head_rows + offset
        self.window_count += 1
        selection = self._select(transit.inputs[:n_heads])
        with self.seq.timer.host_phase("load"):
            self._stage_pages(selection)
        self.seq.counters.record_attention(self._write_valid_counts())

    def _select(self, query: np.ndarray) -> np.ndarray:
        """K distinct pages per KV head ``[Hkv, K]`` (-1 padded) for ``query [Hq, D]`` (float32, host): the owner
        searches, reusers read its choice."""
        shared = self._shared()
        if not self.is_owner:
            return shared["selection"]
        k_sel = self.method.n_selected_pages
        index = shared["index"]
        if index.num_tokens == 0:
            shared["selection"] = np.full((self.model.n_kv_heads, k_sel), -1, dtype=np.int64)
            return shared["selection"]
        with self.seq.timer.host_phase("query"):
            pages, _ = index.query(
                query, k_sel, field_of_view=self.cfg.query_field_of_view,
                prop_to_retrieve=self.cfg.query_prop_to_retrieve, ratio=self.model.group_size,
            )
            shared["selection"] = merge_group_pages(pages, self.model.group_size, k_sel)
        return shared["selection"]

    def _stage_pages(self, selection: np.ndarray) -> None:
        """Diff ``selection`` against the slots and gather the pages to load into the transit buffer, with their
        slot and head; the entries after them are marked unused."""
        slots, pages, heads = diff_selection(self.resident, self.stale, selection)
        staged, n = self._transit.host, pages.size
        staged["slots"][:n] = slots + self.cfg.n_sink_pages
        staged["slots"][n:] = -1
        if n == 0:
            return
        staged["heads"][:n] = heads
        self.stale[heads, pages] = False
        gather_blocks(self.store, pages * self.model.n_kv_heads + heads, staged["keys"][:n], staged["values"][:n])
        self.seq.counters.pages_loaded += n
        self.seq.counters.bytes_to_gpu += staged["keys"][:n].nbytes + staged["values"][:n].nbytes

    def _page_counts(self) -> np.ndarray:
        """Valid tokens of every page of the owner's index ``[Hkv, pages]``; read again only after the index
        changes (a build or an insert clears it: searches leave the pages as they are)."""
        shared = self._shared()
        if shared.get("page_counts") is None:
            shared["page_counts"] = shared["index"].page_valid_counts()
        return shared["page_counts"]

    def _write_valid_counts(self) -> float:
        """Write this step's valid tokens per slot (sinks, selected pages, window) into the transit buffer; returns
        the mean number of tokens a KV head attends."""
        n_sink, k_sel, ps = self.cfg.n_sink_pages, self.method.n_selected_pages, self.cfg.page_size
        counts = self._transit.host["counts"]
        selected = counts[:, n_sink : n_sink + k_sel]  # a view: written in place
        held = self.resident >= 0
        selected.fill(0)
        selected[held] = self._page_counts()[np.nonzero(held)[0], self.resident[held]]
        logical = (self._window_slots - self.window_head) % self.cfg.n_window_pages
        counts[:, n_sink + k_sel :] = np.clip(self.window_count - logical * ps, 0, ps)
        # The float32 mean over KV heads, as the device reduction this replaces computed it.
        return float(np.float32(counts.sum()) / np.float32(counts.shape[0]))

    def _attended_positions(self) -> torch.Tensor:
        """bool [Hq, seq_len + 1] of the positions each query head attends (trace_selection)."""
        total = self.seq_len + 1
        index = self._shared()["index"]
        mask = torch.zeros(self.model.n_kv_heads, total, dtype=torch.bool, device=self.pool.key_pages.device)
        mask[:, : self.sink_len] = True
        mask[:, self.window_start : total] = True
        for head in range(self.model.n_kv_heads):
            pages = self.resident[head][self.resident[head] >= 0]
            if pages.size:
                tokens = index.page_tokens(head)[pages].reshape(-1)
                mask[head, self.token_positions[tokens[tokens >= 0]]] = True
        return mask.repeat_interleave(self.model.group_size, dim=0)

    def gpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return super().gpu_kv_bytes()
        return self.pool.nbytes() if self.pool.key_pages.is_cuda else 0

    def cpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return 0
        return self.store.nbytes() + self.tokens.nbytes()


class TokenStore:
    """A layer's offloaded keys and values by DCI token id, ``[Hkv, n, D]`` each, in CPU memory.

    Appending a window page must not copy the whole store (at 32k tokens that is 128 MB per layer every 16 steps),
    so the storage grows by an eighth of its size at a time; ``nbytes`` counts what is held, spare room included.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        if keys.stride() != values.stride():  # ``rows`` addresses both with one stride
            keys, values = keys.contiguous(), values.contiguous()
        self._keys, self._values = keys, values
        self.n_tokens = keys.shape[1]

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, : self.n_tokens]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, : self.n_tokens]

    def reserve(self, n_tokens: int) -> None:
        """Grow the storage (contents kept) so that ``n_tokens`` tokens fit. A captured decode step appends from a
        host function, where this growth once hung the step on the H200 (cause not isolated: the page store's
        pageable growth there completes), so the caller reserves between steps and a growth there is an error."""
        if n_tokens > self._keys.shape[1]:
            if in_host_function():  # growing there hung a captured step on the H200: fail loudly instead
                raise RuntimeError("IceCache's token store must grow between decode steps (LayerKV.between_steps), "
                                   "not inside a captured step's host function")
            capacity = n_tokens + max(n_tokens // 8, 256)
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                grown = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype)
                grown[:, : self.n_tokens] = old[:, : self.n_tokens]
                setattr(self, name, grown)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        needed = self.n_tokens + keys.shape[1]
        self.reserve(needed)
        self._keys[:, self.n_tokens : needed] = keys
        self._values[:, self.n_tokens : needed] = values
        self.n_tokens = needed

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys and values as ``[rows, D]`` views of the storage, and the row stride between heads: token ``t`` of
        head ``h`` is row ``h * stride + t`` (no copy; the views change when the store grows)."""
        n_heads, _, head_dim = self._keys.shape
        stride = self._keys.stride(0) // head_dim
        size = ((n_heads - 1) * stride + self.n_tokens, head_dim)
        return (torch.as_strided(self._keys, size, (head_dim, 1)), torch.as_strided(self._values, size, (head_dim, 1)),
                stride)

    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes


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
