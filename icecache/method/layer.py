"""One IceCache layer: dense while the prompt fits in the budget, then sinks + DCI-selected pages + a window on the
GPU, every other token in CPU memory (the package's docstring walks through a decode step).

Host memory holds one copy of the offloaded tokens: an index owner's keys in its index (bfloat16 when the cache is,
scored in place), the values (and a reusing layer's own keys) in its ``TokenStore``, both by token id and sized from
the announced length. A page is a list of token ids in the index; loading it gathers those rows.

The layer is in parts: ``OffloadedState`` (offloaded.py) is what it holds once the prompt has left the GPU (the page
pool, the ``WindowRing`` of window.py, the token store, which page each selected slot holds), made once by
``offload_prompt``; ``DecodeBuffers`` (buffers.py) are the fixed buffers of its decode step, made at the first one;
the decode step here reads and updates both."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from icecache.core.kernels.page_scatter import PageScatterPlan, scatter_pages
from icecache.core.kernels.paged_decode_attention import PagedAttentionPlan, paged_decode_attention
from icecache.core.layer import DenseKV, ModelInfo, SequenceContext
from icecache.core.paged import GpuPagePool

from .buffers import DecodeBuffers
from .config import CPU_KV_DTYPES, IceCacheConfig
from .lookahead import LookaheadResult, SpeculativeQuery, is_hit
from .offloaded import OffloadedState
from .selection import diff_selection, merge_group_pages
from .state import GroupState, IceCacheSequence
from .stores import TokenStore
from .window import WindowRing

# Tokens' room the token store keeps between steps, in pages: a captured step inserts from a host function, where
# the store must not grow, and one window offload adds a page per head every page_size steps.
STORE_HEADROOM_PAGES = 64
# Index key dtypes by host KV dtype: the index holds the keys in the store's dtype where it can, and the store then
# holds no keys. A float16 store keeps its own keys beside the index's float32 ones.
INDEX_KEY_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


class IceCacheLayer(DenseKV):
    """One sparsified layer: dense until offloaded, then sinks + DCI-selected pages + window on the GPU."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, cfg: IceCacheConfig):
        super().__init__(layer_idx, model, seq)
        self.cfg = cfg
        self.is_owner = cfg.owner_of(layer_idx) == layer_idx
        self.sequence = seq.state(IceCacheSequence)
        self.sequence.n_indexed_layers = model.n_layers - self.cfg.n_dense_layers
        self.sequence.n_workers = cfg.prompt_workers
        # The index and selection this layer uses: its own, or its reuse group's owner's.
        self.group: GroupState = self.sequence.group(cfg.owner_of(layer_idx))
        self.state: OffloadedState | None = None  # made once, when the prompt is offloaded
        self.buffers: DecodeBuffers | None = None  # made at the first decode step: prefill does no pinned allocation
        self._ready: Future | None = None  # the prompt job (index build and token store), on a worker thread
        self._lookahead: Future | None = None  # this step's look-ahead job (lookahead.py), taken by the host step
        self._speculative: SpeculativeQuery | None = None  # made with the decode buffers, for an owner looking ahead
        self._attention_plan = PagedAttentionPlan()
        self._scatter_plan = PageScatterPlan()

    @property
    def offloaded(self) -> bool:
        return self.state is not None

    def wait_until_indexed(self) -> None:
        """Block until this layer's prompt job (index build and page layout) is done; raises its error."""
        if self._ready is not None:
            self._ready.result()

    # ------------------------------------------------------------------ prefill and offload
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("icecache runs batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        over_budget = self.length > self.cfg.gpu_tokens
        if not self.seq.more_prefill_chunks and (over_budget or self.cfg.offload_short_prompts):
            self.offload_prompt()
        return out

    def offload_prompt(self) -> None:
        """The end of the prompt: keep the sink and window pages on the GPU, copy the rest to the CPU, and submit the
        job that indexes it (``_index_prompt``, on the sequence's worker thread, beside the next layers' prefill)."""
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
        host_dtype = dtype if cfg.cpu_kv_dtype == "auto" else CPU_KV_DTYPES[cfg.cpu_kv_dtype]
        pool = GpuPagePool(cfg.page_budget, n_kv_heads, ps, head_dim, dtype, device)
        window = WindowRing.empty(cfg.n_sink_pages + cfg.n_selected_pages, cfg.n_window_pages, ps, middle_end,
                                  window_len, n_kv_heads, head_dim, host_dtype)
        _fill_slots(pool, 0, keys[:, :sink_len], values[:, :sink_len])
        _fill_slots(pool, window.first_slot, keys[:, middle_end:], values[:, middle_end:])
        # The owner's index holds the keys (in the store's dtype) unless that dtype has no index form.
        keys_in_index = self.is_owner and host_dtype in INDEX_KEY_DTYPES
        empty = torch.empty(n_kv_heads, 0, head_dim, dtype=host_dtype)  # until the prompt job's store replaces it
        state = OffloadedState(
            pool, sink_len, window, host_dtype, keys_in_index, TokenStore(None if keys_in_index else empty, empty),
            positions=np.arange(sink_len, middle_end),
            resident=np.full((n_kv_heads, cfg.n_selected_pages), -1, dtype=np.int64),
            stale=np.zeros((n_kv_heads, 0), dtype=bool),
        )
        # The middle goes to the index; the window's host copy is what its pages are offloaded from later.
        pin = device.type == "cuda"
        offloaded_k = keys[:, sink_len:].to("cpu", host_dtype, non_blocking=pin)
        offloaded_v = values[:, sink_len:].to("cpu", host_dtype, non_blocking=pin)
        copied = torch.cuda.Event() if pin else None
        if copied is not None:
            copied.record()
        self._keys = self._values = None  # the full prompt leaves the GPU
        self.state = state
        self._ready = self.sequence.submit_prompt_job(self._index_prompt, state, offloaded_k, offloaded_v,
                                                       middle_end - sink_len, copied)

    @torch.inference_mode()  # inference mode is per thread; the store's tensors were made under it
    def _index_prompt(self, state: OffloadedState, offloaded_k: torch.Tensor, offloaded_v: torch.Tensor,
                      n_middle: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        middle_k, middle_v = offloaded_k[:, :n_middle], offloaded_v[:, :n_middle]
        state.window.fill_host_copy(offloaded_k[:, n_middle:], offloaded_v[:, n_middle:])
        # Every token the sequence will offload: the announced length less the sinks (no growth, no slack).
        capacity = max(n_middle, (self.seq.max_total_tokens or 0) - state.sink_len)
        with self.seq.timer.span("token_store"):
            state.tokens = TokenStore(state.store_keys(middle_k), middle_v, capacity=capacity)
        if self.is_owner:
            cfg = self.cfg
            from icecache.dci import DCIIndex

            index = DCIIndex(
                self.model.head_dim, self.model.n_kv_heads, promotion_prob=cfg.promotion_prob,
                promotion_prob_subseq=cfg.promotion_prob_subseq, transform=True, deterministic_levels=True,
                seed=cfg.seed, num_threads=self.cfg.index_threads, score_precision=cfg.dci_score_precision,
                key_dtype=INDEX_KEY_DTYPES.get(state.host_dtype, "float32"),
            )
            index.reserve(capacity)
            index.num_threads = cfg.prompt_build_threads
            if middle_k.shape[1]:
                with self.seq.timer.span("index_build"):
                    index.build(
                        self._index_keys(index, middle_k), field_of_view=cfg.build_field_of_view,
                        prop_to_retrieve=cfg.build_prop_to_retrieve, anchor_interval=cfg.anchor_interval,
                        anchor_neighbours=cfg.anchor_neighbours, anchor_threshold=cfg.anchor_threshold,
                    )
                index.pop_changed_pages()  # every page is new: none is resident yet
            index.num_threads = self.cfg.index_threads
            self.group.index = index
            self.group.changed = None
            self.group.page_counts = None
        self.sequence.layer_indexed()

    @staticmethod
    def _index_keys(index, keys: torch.Tensor):
        """``keys`` in the form ``index`` takes them: bfloat16 tensors as they are, else float32 arrays."""
        return keys if index.key_dtype == "bfloat16" else keys.float().numpy()

    # ------------------------------------------------------------------ the window
    def _evict_oldest_window_page(self) -> None:
        with self.seq.timer.host_phase("insert"):
            self._offload_window_page()

    def _offload_window_page(self) -> None:
        """Offload the window's oldest page from its host copy (the ring turns): into the token store and the
        owner's index, whose changed pages are then stale where resident."""
        state, group = self.state, self.group
        page_k, page_v, positions = state.window.pop_oldest_page()
        self.sequence.wait_for_prompt_jobs()
        state.add_tokens(page_k, page_v, positions)
        if self.is_owner:
            cfg = self.cfg
            group.index.insert(
                self._index_keys(group.index, page_k), field_of_view=cfg.insert_field_of_view,
                prop_to_retrieve=cfg.insert_prop_to_retrieve, as_batch=True,
            )
            group.changed = group.index.pop_changed_pages()
            group.page_counts = None
        state.mark_stale(group.changed)

    # ------------------------------------------------------------------ decode
    #
    # A decode step is split into device work before the host (send the query and the new token to the host), the
    # host work (``_host_step``: window bookkeeping, search, diff, gather) and device work after it (one copy of
    # what the host prepared, the new token's write, the scatter, the attention), through the layer's
    # ``HostExchange`` (``core.host_step``). Eagerly the host waits for its inputs; when the generation loop
    # captures the step in a CUDA graph the host step is enqueued as a host function instead, and the whole decode
    # step, every layer's host work included, replays from the graph.

    @property
    def graph_ready(self) -> bool:
        return self.offloaded

    def between_steps(self) -> None:
        # Inserts add pages inside the step, where a captured step cannot pin new memory: keep room for a few
        # window offloads ahead (one adds at most page_size pages per head, one every page_size steps).
        if self.offloaded:
            self._ready.result()  # the token store is the prompt job's until it is done
            tokens = self.state.tokens
            ahead = tokens.n_tokens + STORE_HEADROOM_PAGES * self.cfg.page_size
            final = (self.seq.max_total_tokens or 0) - self.state.sink_len  # the most the announced length offloads
            # Room up to the announced length covers every insert the sequence makes; past it, room for several.
            tokens.reserve(min(ahead, final) if final >= tokens.n_tokens + self.cfg.page_size else ahead)

    def _make_decode_buffers(self, device: torch.device) -> None:
        """The step's fixed buffers (``DecodeBuffers``), with the sink slots' counts, which never change; and the
        speculative query's exchange where this layer looks ahead."""
        cfg, ps, n_kv_heads = self.cfg, self.cfg.page_size, self.model.n_kv_heads
        # A traced sequence of fixed trace width gets its trace in the buffers too: the host step writes it from
        # the host's state, so a captured step's trace is that of each replay.
        buffers = DecodeBuffers.make(
            self.model.n_heads, n_kv_heads, cfg.page_budget, n_kv_heads * cfg.n_selected_pages, ps,
            self.model.head_dim, self.state.host_dtype, device, self.seq.host_functions,
            trace_width=self.seq.fixed_trace_width,
        )
        sink_starts = np.arange(cfg.n_sink_pages) * ps
        buffers.counts[:, : cfg.n_sink_pages] = np.clip(self.state.sink_len - sink_starts, 0, ps)
        self.buffers = buffers
        if self.wants_previous_layer_input:
            self._speculative = SpeculativeQuery(self.model.n_heads, self.model.head_dim, device,
                                                 self.seq.host_functions)

    # ------------------------------------------------------------------ look-ahead (lookahead.py; opt-in)
    @property
    def wants_previous_layer_input(self) -> bool:
        return self.cfg.lookahead and self.is_owner and self.layer_idx > 0

    def previous_layer_input(self, hidden: torch.Tensor, project_query) -> None:
        """Start this layer's search from the previous layer's input: its speculative query goes to the host and a
        worker offloads the due window page and searches, while the previous layer runs."""
        if not self.offloaded or hidden.shape[-2] != 1:
            return  # the prompt, or a step before the prompt is offloaded: nothing to search yet
        if self.buffers is None:
            self._make_decode_buffers(self.state.pool.key_pages.device)
        self._speculative.send(project_query(hidden)[0, :, 0, :], self._start_lookahead)

    def _start_lookahead(self) -> None:
        self._lookahead = self.sequence.submit_search(self._search_ahead, self._speculative.read())

    @torch.inference_mode()  # a worker thread: the host copies were made under it
    def _search_ahead(self, query: np.ndarray) -> LookaheadResult:
        with self.seq.timer.span("lookahead_search"):
            self._ready.result()
            if self.state.window.is_full():
                self._offload_window_page()
            if self.group.index.num_tokens == 0:
                return LookaheadResult(query, None)
            return LookaheadResult(query, *self._search(query))

    def _search(self, query: np.ndarray) -> tuple[np.ndarray, dict]:
        """The owner's index searched for ``query [Hq, D]``: each query head's ranked pages, and what the search read
        (``last_query_stats``, which is per thread: read here, on the thread that searched)."""
        index = self.group.index
        pages, _ = index.query(query, self.cfg.n_selected_pages, field_of_view=self.cfg.query_field_of_view,
                               prop_to_retrieve=self.cfg.query_prop_to_retrieve, ratio=self.model.group_size)
        return pages, index.last_query_stats()

    def _take_lookahead(self) -> LookaheadResult | None:
        """This step's look-ahead result, once its job is done (None: no job was started for this step)."""
        if self._lookahead is None:
            return None
        job, self._lookahead = self._lookahead, None
        with self.seq.timer.host_phase("query"):  # what the step still waits for of the search
            return job.result()

    # ------------------------------------------------------------------ decode step
    def decode(self, query, key, value, scaling):
        if not self.offloaded:
            if self.length + 1 <= self.cfg.gpu_tokens:
                out = super().decode(query, key, value, scaling)
                self.seq.counters.record_attention(self.length)
                return out
            self.offload_prompt()
        pool = self.state.pool
        if self.buffers is None:
            self._make_decode_buffers(pool.key_pages.device)
        exchange = self.buffers.exchange
        exchange.send(query=query[0, :, 0, :], key=key[0, :, 0, :], value=value[0, :, 0, :])
        exchange.run(self._host_step)
        staged = exchange.receive()
        head_dim = self.model.head_dim
        pool.key_pages.view(-1, head_dim).index_copy_(0, staged["window_rows"], key[0, :, 0, :])
        pool.value_pages.view(-1, head_dim).index_copy_(0, staged["window_rows"], value[0, :, 0, :])
        scatter_pages(staged["keys"], staged["values"], pool.key_pages, pool.value_pages, staged["slots"],
                      staged["heads"], self._scatter_plan)
        if self.seq.trace_selection:
            traced = staged.get("attended")  # written by the host step (a fixed width), else made here
            self.last_attended = (traced.view(torch.bool).repeat_interleave(self.model.group_size, dim=0)
                                  if traced is not None else self._attended_positions())
        out = paged_decode_attention(
            query[0, :, 0, :], pool.key_pages, pool.value_pages, self.buffers.slot_table, staged["counts"], scaling,
            self._attention_plan,
        )
        return out[None, None]

    @torch.inference_mode()  # the host copies were made under it, on the index worker's thread
    def _host_step(self) -> None:
        """The host's part of a decode step: make room in the window and place the new token, select, diff against
        the slots, gather the pages to load and write the slots' valid counts, all into the decode buffers. Must
        not call CUDA (it may run as a host function). Timed as the span ``host_step``, its search and its loads as
        the phases ``query`` and ``load``."""
        with self.seq.timer.span("host_step"):
            self._host_step_parts()

    def _host_step_parts(self) -> None:
        self._ready.result()
        ahead = self._take_lookahead()  # before anything else: its job offloads the window page that was due
        window, buffers = self.state.window, self.buffers
        if window.is_full():
            self._evict_oldest_window_page()
        buffers.window_rows[:] = window.append(buffers.key, buffers.value)
        selection = self._select(buffers.query, ahead)
        with self.seq.timer.host_phase("load"):
            self._stage_pages(selection)
        self.seq.counters.record_attention(self._write_valid_counts())
        if buffers.attended is not None:
            self._trace_on_host(buffers.attended)

    def _select(self, query: np.ndarray, ahead: LookaheadResult | None = None) -> np.ndarray:
        """K distinct pages per KV head ``[Hkv, K]`` (-1 padded) for ``query [Hq, D]`` (float32, host): the owner
        searches (or takes its look-ahead's pages when the speculation holds), reusers read its choice."""
        group = self.group
        if not self.is_owner:
            return group.selection
        k_sel = self.cfg.n_selected_pages
        if group.index.num_tokens == 0:
            group.selection = np.full((self.model.n_kv_heads, k_sel), -1, dtype=np.int64)
            return group.selection
        counters = self.seq.counters
        held = False
        if ahead is not None and ahead.pages is not None:
            counters.add("lookahead_searches", 1)
            held = is_hit(ahead.query, query, self.cfg.lookahead_min_cosine)
            if not held:
                counters.add("lookahead_misses", 1)
        if held:
            pages, stats = ahead.pages, ahead.stats
        else:
            with self.seq.timer.host_phase("query"):
                pages, stats = self._search(query)
        group.selection = merge_group_pages(pages, self.model.group_size, k_sel)
        for name, value in stats.items():  # what the search read (a measure of its floor)
            counters.add(f"search_{name}", value)
        return group.selection

    def _stage_pages(self, selection: np.ndarray) -> None:
        """Diff ``selection`` against the slots and gather the pages to load into the decode buffers, with their
        slot and head; the entries after them are marked unused."""
        state, buffers = self.state, self.buffers
        state.cover_pages(self._page_counts().shape[1])
        slots, pages, heads = diff_selection(state.resident, state.stale, selection)
        n = pages.size
        buffers.slots[:n] = slots + self.cfg.n_sink_pages
        buffers.slots[n:] = -1
        if n == 0:
            return
        buffers.heads[:n] = heads
        state.stale[heads, pages] = False
        index = self.group.index
        state.gather(index, heads, index.pages_items(heads, pages), buffers.keys[:n], buffers.values[:n])
        self.seq.counters.pages_loaded += n
        self.seq.counters.bytes_to_gpu += buffers.keys[:n].nbytes + buffers.values[:n].nbytes

    def _page_counts(self) -> np.ndarray:
        """Valid tokens of every page of the owner's index ``[Hkv, pages]``; read again only after the index
        changes (a build or an insert clears it: searches leave the pages as they are)."""
        group = self.group
        if group.page_counts is None:
            group.page_counts = group.index.page_valid_counts()
        return group.page_counts

    def _write_valid_counts(self) -> float:
        """Write this step's valid tokens per slot (sinks, selected pages, window) into the decode buffers; returns
        the mean number of tokens a KV head attends."""
        n_sink, k_sel = self.cfg.n_sink_pages, self.cfg.n_selected_pages
        state, counts = self.state, self.buffers.counts
        selected = counts[:, n_sink : n_sink + k_sel]  # a view: written in place
        held = state.resident >= 0
        selected.fill(0)
        selected[held] = self._page_counts()[np.nonzero(held)[0], state.resident[held]]
        counts[:, n_sink + k_sel :] = state.window.slot_counts()
        # The float32 mean over KV heads, as the device reduction this replaces computed it.
        return float(np.float32(counts.sum()) / np.float32(counts.shape[0]))

    def _attended_positions(self) -> torch.Tensor:
        """bool ``[Hq, trace_width()]`` of the positions each query head attends, for a trace whose width the
        sequence does not fix (so not in the decode buffers)."""
        attended = np.zeros((self.model.n_kv_heads, self.trace_width()), dtype=np.uint8)
        self._trace_on_host(attended)
        traced = torch.from_numpy(attended).view(torch.bool).to(self.state.pool.key_pages.device)
        return traced.repeat_interleave(self.model.group_size, dim=0)

    def _trace_on_host(self, attended: np.ndarray) -> None:
        """This step's trace into ``attended`` (``[Hkv, width]`` bytes, 1: attended) from the host's state after
        the step's selection: the sinks, the window up to the new token, and the tokens of each KV head's resident
        pages. Calls no CUDA (it runs in the host step)."""
        state = self.state
        attended.fill(0)
        attended[:, : state.sink_len] = 1
        attended[:, state.window.start : state.window.start + state.window.count] = 1
        index = self.group.index
        for head in range(self.model.n_kv_heads):
            pages = state.resident[head][state.resident[head] >= 0]
            if pages.size:
                tokens = index.page_tokens(head)[pages].reshape(-1)
                attended[head, state.positions[tokens[tokens >= 0]]] = 1

    def gpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return super().gpu_kv_bytes()
        pool = self.state.pool
        return pool.nbytes() if pool.key_pages.is_cuda else 0

    def offloaded_kv_bytes(self) -> int:
        if not self.offloaded:
            return 0
        per_token = 2 * self.model.n_kv_heads * self.model.head_dim * self.state.pool.key_pages.element_size()
        return self.state.tokens.n_tokens * per_token

    def cpu_kv_bytes(self) -> int:
        """Host bytes of the offloaded tokens and, on an owner, of its whole index (keys and structure)."""
        if not self.offloaded:
            return 0
        index = self.group.index if self.is_owner else None
        index_bytes = 0 if index is None else sum(index.memory_bytes().values())
        return self.state.tokens.nbytes() + index_bytes


def _fill_slots(pool: GpuPagePool, first_slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Tokens ``[Hkv, n, D]`` into consecutive pool slots from ``first_slot``, a page of them per slot."""
    ps = pool.page_size
    for page, begin in enumerate(range(0, keys.shape[1], ps)):
        n = min(ps, keys.shape[1] - begin)
        pool.key_pages[first_slot + page, :, :n] = keys[:, begin : begin + n]
        pool.value_pages[first_slot + page, :, :n] = values[:, begin : begin + n]
