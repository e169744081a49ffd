"""One IceCache layer: dense while the prompt fits in the budget, then sinks + DCI-selected pages + a window on the
GPU, every other token in CPU memory (the package's docstring walks through a decode step).

Host memory holds one copy of the offloaded tokens: an index owner's keys in its index (bfloat16 when the cache is,
scored in place), the values (and a reusing layer's own keys) in its ``TokenStore``, both by token id and sized from
the announced length. A page is a list of token ids in the index; loading it gathers those rows."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from icecache.core.attention import paged_decode_attention
from icecache.core.layer import DenseKV, ModelInfo, SequenceContext
from icecache.core.paged import GpuPagePool, StepTransit, scatter_pages

from .config import CPU_KV_DTYPES, IceCacheConfig
from .lookahead import LookaheadResult, SpeculativeQuery, is_hit
from .selection import diff_selection, merge_group_pages
from .state import GroupState, IceCacheSequence
from .stores import TokenStore

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
        self.offloaded = False
        self._ready: Future | None = None
        self._lookahead: Future | None = None  # this step's look-ahead job (lookahead.py), taken by the host step
        self._speculative: SpeculativeQuery | None = None
        self.sequence = seq.state(IceCacheSequence)
        self.sequence.n_indexed_layers = model.n_layers - self.cfg.n_dense_layers
        self.sequence.n_workers = cfg.prompt_workers
        # The index and selection this layer uses: its own, or its reuse group's owner's.
        self.group: GroupState = self.sequence.group(cfg.owner_of(layer_idx))

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
        k_sel = self.cfg.n_selected_pages
        self.sink_slots = -(-sink_len // ps)
        self.window_slot0 = cfg.n_sink_pages + k_sel
        self.pool = GpuPagePool(self.cfg.page_budget, n_kv_heads, ps, head_dim, dtype, device)
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
        cpu_dtype = dtype if cfg.cpu_kv_dtype == "auto" else CPU_KV_DTYPES[cfg.cpu_kv_dtype]
        self.cpu_dtype = cpu_dtype
        pin = device.type == "cuda"
        self._transit = None  # decode buffers, made at the first decode step: prefill does no pinned allocation
        # The owner's index holds the keys (in the store's dtype) unless that dtype has no index form.
        self.keys_in_index = self.is_owner and cpu_dtype in INDEX_KEY_DTYPES
        # Token store by offloaded-token id (the DCI's ids), filled by the prompt job.
        empty = torch.empty(n_kv_heads, 0, head_dim, dtype=cpu_dtype)
        self.tokens = TokenStore(None if self.keys_in_index else empty, empty)
        self.token_positions = np.arange(sink_len, middle_end)
        # The middle goes to the index; the window's host copy is what its pages are offloaded from later.
        offloaded_k = keys[:, sink_len:].to("cpu", cpu_dtype, non_blocking=pin)
        offloaded_v = values[:, sink_len:].to("cpu", cpu_dtype, non_blocking=pin)
        copied = torch.cuda.Event() if pin else None
        if copied is not None:
            copied.record()
        self._keys = self._values = None  # the full prompt leaves the GPU
        self.offloaded = True
        self._ready = self.sequence.submit_prompt_job(self._index_prompt, offloaded_k, offloaded_v,
                                                       middle_end - sink_len, copied)

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
        # Every token the sequence will offload: the announced length less the sinks (no growth, no slack).
        capacity = max(n_middle, (self.seq.max_total_tokens or 0) - self.sink_len)
        with self.seq.timer.span("token_store"):
            self.tokens = TokenStore(None if self.keys_in_index else middle_k, middle_v, capacity=capacity)
        if self.is_owner:
            cfg = self.cfg
            from icecache.dci import DCIIndex

            index = DCIIndex(
                self.model.head_dim, self.model.n_kv_heads, promotion_prob=cfg.promotion_prob,
                promotion_prob_subseq=cfg.promotion_prob_subseq, transform=True, deterministic_levels=True,
                seed=cfg.seed, num_threads=self.cfg.index_threads, score_precision=cfg.dci_score_precision,
                key_dtype=INDEX_KEY_DTYPES.get(self.cpu_dtype, "float32"),
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

    def _mark_stale(self, changed: np.ndarray | None) -> None:
        """Pages flagged in ``changed [Hkv, pages]`` hold other tokens now: a resident copy must be loaded again."""
        if changed is None:
            return
        self._cover_pages(changed.shape[1])
        self.stale[:, : changed.shape[1]] |= changed

    def _cover_pages(self, n_pages: int) -> None:
        """``stale`` has a flag for each of ``n_pages`` pages (new pages are not stale)."""
        if self.stale.shape[1] < n_pages:
            self.stale = np.pad(self.stale, ((0, 0), (0, n_pages - self.stale.shape[1])))

    # ------------------------------------------------------------------ the window
    def _window_is_full(self) -> bool:
        return self.window_count == self.cfg.n_window_pages * self.cfg.page_size

    def _evict_oldest_window_page(self) -> None:
        with self.seq.timer.host_phase("insert"):
            self._offload_window_page()

    def _offload_window_page(self) -> None:
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
        self.sequence.wait_for_prompt_jobs()
        self.tokens.append(None if self.keys_in_index else page_k, page_v)
        self.token_positions = np.concatenate([self.token_positions, positions])
        group = self.group
        if self.is_owner:
            cfg = self.cfg
            group.index.insert(
                self._index_keys(group.index, page_k), field_of_view=cfg.insert_field_of_view,
                prop_to_retrieve=cfg.insert_prop_to_retrieve, as_batch=True,
            )
            group.changed = group.index.pop_changed_pages()
            group.page_counts = None
        self._mark_stale(group.changed)

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
            self._ready.result()  # the token store is the prompt job's until it is done
            ahead = self.tokens.n_tokens + STORE_HEADROOM_PAGES * self.cfg.page_size
            final = (self.seq.max_total_tokens or 0) - self.sink_len  # what the announced length offloads at most
            # Room up to the announced length covers every insert the sequence makes; past it, room for several.
            self.tokens.reserve(min(ahead, final) if final >= self.tokens.n_tokens + self.cfg.page_size else ahead)

    def _make_decode_buffers(self, device: torch.device) -> None:
        """The attention's page table and the step's fixed-size transit buffers (``StepTransit``).

        Made once, so that a step's host work builds no tensor and a step has the same copies at every step. The
        page table is slot ``i`` -> page ``i`` for good: an empty slot needs no -1 entry, as a count of 0 already
        masks all its positions (in the Triton kernel and in the PyTorch reference alike); only the counts change.
        """
        ps, n_kv_heads, n_slots = self.cfg.page_size, self.model.n_kv_heads, self.cfg.page_budget
        self._slot_table = torch.arange(n_slots, device=device).expand(n_kv_heads, n_slots)
        # A traced sequence of fixed trace width gets its trace in the transit buffer too: the host step writes it
        # from the host's state, so a captured step's trace is that of each replay.
        self._transit = StepTransit(
            self.model.n_heads, n_kv_heads, n_slots, n_kv_heads * self.cfg.n_selected_pages, ps,
            self.model.head_dim, self.cpu_dtype, device, trace_width=self.seq.fixed_trace_width,
        )
        counts = self._transit.host["counts"]
        sink_starts = np.arange(self.cfg.n_sink_pages) * ps
        counts[:, : self.cfg.n_sink_pages] = np.clip(self.sink_len - sink_starts, 0, ps)
        # Ring slot r holds logical window page (r - window_head) mod n_window_pages.
        self._window_slots = np.arange(self.cfg.n_window_pages)
        self._head_rows = np.arange(n_kv_heads) * ps
        self._inputs_arrived = torch.cuda.Event() if device.type == "cuda" else None
        if self.wants_previous_layer_input:
            self._speculative = SpeculativeQuery(self.model.n_heads, self.model.head_dim, device)

    # ------------------------------------------------------------------ look-ahead (lookahead.py; opt-in)
    @property
    def wants_previous_layer_input(self) -> bool:
        return self.cfg.lookahead and self.is_owner and self.layer_idx > 0

    def previous_layer_input(self, hidden: torch.Tensor, project_query) -> None:
        """Start this layer's search from the previous layer's input: its speculative query goes to the host and a
        worker offloads the due window page and searches, while the previous layer runs."""
        if not self.offloaded or hidden.shape[-2] != 1:
            return  # the prompt, or a step before the prompt is offloaded: nothing to search yet
        if self._transit is None:
            self._make_decode_buffers(self.pool.key_pages.device)
        self._speculative.to_host(project_query(hidden)[0, :, 0, :])
        self._run_on_host(self._start_lookahead)

    def _start_lookahead(self) -> None:
        self._lookahead = self.sequence.submit_search(self._search_ahead, self._speculative.read())

    @torch.inference_mode()  # a worker thread: the host copies were made under it
    def _search_ahead(self, query: np.ndarray) -> LookaheadResult:
        with self.seq.timer.span("lookahead_search"):
            self._ready.result()
            if self._window_is_full():
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
            traced = staged.get("attended")  # written by the host step (a fixed width), else made here
            self.last_attended = (traced.view(torch.bool).repeat_interleave(self.model.group_size, dim=0)
                                  if traced is not None else self._attended_positions())
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
        not call CUDA (it may run as a host function). Timed as the span ``host_step``, its search and its loads as
        the phases ``query`` and ``load``."""
        with self.seq.timer.span("host_step"):
            self._host_step_parts()

    def _host_step_parts(self) -> None:
        self._ready.result()
        ahead = self._take_lookahead()  # before anything else: its job offloads the window page that was due
        cfg, ps, n_heads, n_kv_heads = self.cfg, self.cfg.page_size, self.model.n_heads, self.model.n_kv_heads
        transit = self._transit
        if self._window_is_full():
            self._evict_oldest_window_page()
        inputs = transit.inputs_host
        self.window_keys[:, self.window_count] = inputs[n_heads : n_heads + n_kv_heads]
        self.window_values[:, self.window_count] = inputs[n_heads + n_kv_heads :]
        page, offset = divmod(self.window_count, ps)
        slot = self.window_slot0 + (self.window_head + page) % cfg.n_window_pages
        transit.host["window_rows"][:] = (slot * n_kv_heads) * ps + self._head_rows + offset
        self.window_count += 1
        selection = self._select(transit.inputs[:n_heads], ahead)
        with self.seq.timer.host_phase("load"):
            self._stage_pages(selection)
        self.seq.counters.record_attention(self._write_valid_counts())
        if "attended" in transit.host:
            self._trace_on_host(transit.host["attended"])

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
        """Diff ``selection`` against the slots and gather the pages to load into the transit buffer, with their
        slot and head; the entries after them are marked unused."""
        self._cover_pages(self._page_counts().shape[1])
        slots, pages, heads = diff_selection(self.resident, self.stale, selection)
        staged, n = self._transit.host, pages.size
        staged["slots"][:n] = slots + self.cfg.n_sink_pages
        staged["slots"][n:] = -1
        if n == 0:
            return
        staged["heads"][:n] = heads
        self.stale[heads, pages] = False
        index = self.group.index
        token_ids = index.pages_items(heads, pages)
        self.tokens.gather(heads, token_ids, None if self.keys_in_index else staged["keys"][:n], staged["values"][:n])
        if self.keys_in_index:
            index.gather_keys(heads, token_ids, staged["keys"][:n])
        self.seq.counters.pages_loaded += n
        self.seq.counters.bytes_to_gpu += staged["keys"][:n].nbytes + staged["values"][:n].nbytes

    def _page_counts(self) -> np.ndarray:
        """Valid tokens of every page of the owner's index ``[Hkv, pages]``; read again only after the index
        changes (a build or an insert clears it: searches leave the pages as they are)."""
        group = self.group
        if group.page_counts is None:
            group.page_counts = group.index.page_valid_counts()
        return group.page_counts

    def _write_valid_counts(self) -> float:
        """Write this step's valid tokens per slot (sinks, selected pages, window) into the transit buffer; returns
        the mean number of tokens a KV head attends."""
        n_sink, k_sel, ps = self.cfg.n_sink_pages, self.cfg.n_selected_pages, self.cfg.page_size
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
        """bool ``[Hq, trace_width()]`` of the positions each query head attends, for a trace whose width the
        sequence does not fix (so not in the transit buffer)."""
        attended = np.zeros((self.model.n_kv_heads, self.trace_width()), dtype=np.uint8)
        self._trace_on_host(attended)
        traced = torch.from_numpy(attended).view(torch.bool).to(self.pool.key_pages.device)
        return traced.repeat_interleave(self.model.group_size, dim=0)

    def _trace_on_host(self, attended: np.ndarray) -> None:
        """This step's trace into ``attended`` (``[Hkv, width]`` bytes, 1: attended) from the host's state after
        the step's selection: the sinks, the window up to the new token, and the tokens of each KV head's resident
        pages. Calls no CUDA (it runs in the host step)."""
        attended.fill(0)
        attended[:, : self.sink_len] = 1
        attended[:, self.window_start : self.window_start + self.window_count] = 1
        index = self.group.index
        for head in range(self.model.n_kv_heads):
            pages = self.resident[head][self.resident[head] >= 0]
            if pages.size:
                tokens = index.page_tokens(head)[pages].reshape(-1)
                attended[head, self.token_positions[tokens[tokens >= 0]]] = 1

    def gpu_kv_bytes(self) -> int:
        if not self.offloaded:
            return super().gpu_kv_bytes()
        return self.pool.nbytes() if self.pool.key_pages.is_cuda else 0

    def offloaded_kv_bytes(self) -> int:
        if not self.offloaded:
            return 0
        per_token = 2 * self.model.n_kv_heads * self.model.head_dim * self.pool.key_pages.element_size()
        return self.tokens.n_tokens * per_token

    def cpu_kv_bytes(self) -> int:
        """Host bytes of the offloaded tokens and, on an owner, of its whole index (keys and structure)."""
        if not self.offloaded:
            return 0
        index = self.group.index if self.is_owner else None
        index_bytes = 0 if index is None else sum(index.memory_bytes().values())
        return self.tokens.nbytes() + index_bytes
