"""One IceCache layer: dense while the prompt fits in the budget, then sinks + DCI-selected pages + a window on the
GPU, every other token in CPU memory (the package's docstring walks through a decode step).

Host memory holds one copy of the offloaded tokens: an index owner's keys in its index (bfloat16 when the cache is,
scored in place), the values (and a reusing layer's own keys) in its ``TokenStore``, both by token id and sized from
the announced length. A page is a list of token ids in the index; loading it gathers those rows.

The layer is in parts: ``OffloadedState`` (offloaded.py) is what it holds once the prompt has left the GPU (the page
pool, the ``WindowRing`` of window.py, the token store, and the C++ decode step ``_dci.DecodeStep``), made once by
``offload_prompt``; ``DecodeBuffers`` (buffers.py) are the fixed buffers of its decode step, made at the first one.
The decode step's host work is one C++ call (icecache/method/src/decode_step.cpp) on those buffers and that state,
run with no Python; this file makes the state, points it at the memory Python allocates, runs the device side of
the step, and folds what the C++ step counted and timed into the sequence's counters and timer."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from icecache.core.kernels.page_scatter import PageScatterPlan, scatter_pages
from icecache.core.kernels.paged_decode_attention import PagedAttentionPlan, paged_decode_attention
from icecache.core.layer import DenseKV, ModelInfo, SequenceContext
from icecache.core.paged import GpuPagePool
from icecache.dci import _dci

from .buffers import DecodeBuffers
from .config import CPU_KV_DTYPES, IceCacheConfig
from .lookahead import SpeculativeQuery
from .offloaded import OffloadedState
from .state import GroupState, IceCacheSequence
from .stores import TokenStore
from .window import WindowRing

# Tokens' room the token store keeps between steps, in pages: a captured step inserts from a host function, where
# the store must not grow, and one window offload adds a page per head every page_size steps.
STORE_HEADROOM_PAGES = 64
# Index key dtypes by host KV dtype: the index holds the keys in the store's dtype where it can, and the store then
# holds no keys. A float16 store keeps its own keys beside the index's float32 ones.
INDEX_KEY_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The C++ step's codes of the host dtypes (decode_step.cpp, HostDtype).
NATIVE_HOST_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# What the C++ step's search counters are called in the results (the index's last_query_stats names).
SEARCH_COUNTERS = ("rows_read", "bytes_read", "scores", "lists")


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
        self.group: GroupState = self.sequence.group(cfg.owner_of(layer_idx), model.n_kv_heads,
                                                     cfg.n_selected_pages)
        self.state: OffloadedState | None = None  # made once, when the prompt is offloaded
        self.buffers: DecodeBuffers | None = None  # made at the first decode step: prefill does no pinned allocation
        self._ready: Future | None = None  # the prompt job (index build and token store), on a worker thread
        # The pinned copies of the prompt the job reads, until it is done with them (``_prepare_native_step``).
        self._prompt_staging: tuple[torch.Tensor, ...] = ()
        self._store_bound = False  # the prompt job's token store given to the C++ step (at the first decode step)
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
        # The owner's index holds the keys (in the store's dtype) unless that dtype has no index form.
        keys_in_index = self.is_owner and host_dtype in INDEX_KEY_DTYPES
        native = self._make_native_step(host_dtype, keys_in_index)
        window = WindowRing.empty(cfg.n_sink_pages + cfg.n_selected_pages, cfg.n_window_pages, ps, n_kv_heads,
                                  head_dim, host_dtype, native)
        native.set_window(window.host_keys.data_ptr(), window.host_values.data_ptr(), middle_end, window_len)
        native.set_positions(np.arange(sink_len, middle_end, dtype=np.int64))
        native.set_sink_len(sink_len)
        _fill_slots(pool, 0, keys[:, :sink_len], values[:, :sink_len])
        _fill_slots(pool, window.first_slot, keys[:, middle_end:], values[:, middle_end:])
        empty = torch.empty(n_kv_heads, 0, head_dim, dtype=host_dtype)  # until the prompt job's store replaces it
        state = OffloadedState(pool, sink_len, window, host_dtype, keys_in_index,
                               TokenStore(None if keys_in_index else empty, empty), native)
        # The middle goes to the index; the window's host copy is what its pages are offloaded from later.
        # Into host buffers the method keeps across sequences, on the side stream beside the next layers' prefill
        # (core.host_memory); the index job waits for the copy's event.
        copies, staged_shape = self.seq.prompt_copies, (n_kv_heads, total - sink_len, head_dim)
        self.sequence.make_room_for_staging(copies.pool, staged_shape, host_dtype, device)
        offloaded_k = copies.take(staged_shape, host_dtype, device)
        offloaded_v = copies.take(staged_shape, host_dtype, device)
        copies.copy(offloaded_k, keys[:, sink_len:])
        copied = copies.copy(offloaded_v, values[:, sink_len:])
        self._keys = self._values = None  # the full prompt leaves the GPU
        self.state = state
        self._ready = self.sequence.submit_prompt_job(self._index_prompt, state, offloaded_k, offloaded_v,
                                                       middle_end - sink_len, copied)
        self._prompt_staging = (offloaded_k, offloaded_v)
        self.sequence.staging_layers.append(self)

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
            index.num_threads = self.cfg.search_threads
            self.group.set_index(index)
        self.sequence.layer_indexed()

    @staticmethod
    def _index_keys(index, keys: torch.Tensor):
        """``keys`` in the form ``index`` takes them: bfloat16 tensors as they are, else float32 arrays."""
        return keys if index.key_dtype == "bfloat16" else keys.float().numpy()

    def _make_native_step(self, host_dtype: torch.dtype, keys_in_index: bool):
        """The layer's C++ decode step (``_dci.DecodeStep``), with the settings it runs with."""
        cfg, model = self.cfg, self.model
        return _dci.DecodeStep(
            self.sequence.native, self.group.native, layer=self.layer_idx, n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads, head_dim=model.head_dim, page_size=cfg.page_size,
            n_sink_pages=cfg.n_sink_pages, n_selected=cfg.n_selected_pages, n_window_pages=cfg.n_window_pages,
            first_window_slot=cfg.n_sink_pages + cfg.n_selected_pages, owner=self.is_owner,
            keys_in_index=keys_in_index, host_dtype=NATIVE_HOST_DTYPES[host_dtype],
            query_field_of_view=-1 if cfg.query_field_of_view is None else cfg.query_field_of_view,
            query_prop_to_retrieve=cfg.query_prop_to_retrieve, insert_field_of_view=cfg.insert_field_of_view,
            insert_prop_to_retrieve=cfg.insert_prop_to_retrieve, lookahead_min_cosine=cfg.lookahead_min_cosine,
            lookahead_after_host_step=self.layer_idx - 1 >= cfg.n_dense_layers,
        )

    # ------------------------------------------------------------------ decode
    #
    # A decode step is split into device work before the host (send the query and the new token to the host), the
    # host work (the C++ step: window bookkeeping, search, diff, gather) and device work after it (one copy of what
    # the host prepared, the new token's write, the scatter, the attention), through the layer's ``HostExchange``
    # (``core.host_step``, ``run_native``). Eagerly the host waits for its inputs; when the generation loop
    # captures the step in a CUDA graph the C++ step is enqueued as a host function by its raw address instead,
    # and the whole decode step, every layer's host work included, replays from the graph with no Python. What
    # the C++ step needs from Python (room in the token store, every prompt job done before a window offload) is
    # made ready before the step (``_prepare_native_step``) or between replays (``between_steps``), and what it
    # counted and timed is folded into the sequence after it (``_after_native_step``).

    @property
    def graph_ready(self) -> bool:
        return self.offloaded

    def between_steps(self) -> None:
        """After a replayed step (and before a capture): raise what the C++ steps of the replay failed with, fold
        what they counted and timed, and keep room in the token store for the next replays."""
        if self.offloaded:
            self._after_native_step()
            self._prepare_native_step()
            self.sequence.wait_for_prompt_jobs()  # a replay offloads window pages with no Python to wait first

    def _prepare_native_step(self) -> None:
        """What the C++ step needs before it runs: the prompt job done and its token store given to the step, room
        in the store, and every prompt job done when a window page is due (an owner's index must not change under
        a reuser still laying out its pages)."""
        self._ready.result()  # the token store is the prompt job's until it is done
        tokens = self.state.tokens
        self.give_back_staging()
        if not self._store_bound:
            tokens.bind(self.state.native)
            self._store_bound = True
        # Inserts add pages inside the step, where a captured step cannot pin new memory: keep room for a few
        # window offloads ahead (one adds at most page_size pages per head, one every page_size steps).
        ahead = tokens.n_tokens + STORE_HEADROOM_PAGES * self.cfg.page_size
        final = (self.seq.max_total_tokens or 0) - self.state.sink_len  # the most the announced length offloads
        # Room up to the announced length covers every insert the sequence makes; past it, room for several.
        tokens.reserve(min(ahead, final) if final >= tokens.n_tokens + self.cfg.page_size else ahead)
        if self.state.native.window_full:
            self.sequence.wait_for_prompt_jobs()

    def give_back_staging(self) -> None:
        """The staged prompt back to the pool once the prompt job is done with it (waiting for it: the job copies
        it into the index, the token store and the window), on the model's thread, which took it: during the
        prefill where host memory runs short (``IceCacheSequence.make_room_for_staging``), and at the latest at the
        first decode step, so that sequences alive together (a batch) do not each keep a second copy of their
        prompt. A store made without room still views the staging and keeps it."""
        if not self._prompt_staging:
            return
        self._ready.result()  # a failed job raises here, on the model's thread
        if not any(self.state.tokens.shares_memory_with(staged) for staged in self._prompt_staging):
            for staged in self._prompt_staging:
                self.seq.prompt_copies.give_back(staged)
        self._prompt_staging = ()
        if self in self.sequence.staging_layers:
            self.sequence.staging_layers.remove(self)

    def _after_native_step(self) -> None:
        """Raise the error a C++ step of the sequence kept (every later one did nothing), then fold what this
        layer's step counted and timed into the sequence's counters and timer, under the names the results use."""
        error = self.sequence.native.error()
        if error:
            raise RuntimeError(f"IceCache's decode step failed on the host: {error}")
        records = self.state.native.take_records()
        counters, timer = self.seq.counters, self.seq.timer
        for mean in records["attended"]:
            counters.record_attention(mean)
        counters.pages_loaded += records["pages_loaded"]
        counters.bytes_to_gpu += records["bytes_to_gpu"]
        for name in ("lookahead_searches", "lookahead_misses"):
            if records[name]:
                counters.add(name, records[name])
        if records["searches"]:  # what the searches read (a measure of their floor)
            for name in SEARCH_COUNTERS:
                counters.add(f"search_{name}", records[name])
            # Where the searches' time went (QueryPhases): timings, so only where a timer is on; a plain run's
            # counters are the same every run.
            if timer.enabled:
                for name, ns in records["search_phase_ns"].items():
                    counters.add(f"search_{name}_ns", ns)
        for name, seconds in records["phases"].items():
            timer.add_host_phase(name, seconds)
        timer.add_spans("host_step", records["host_step"])
        timer.add_spans("lookahead_search", records["lookahead_search"])

    def _make_decode_buffers(self, device: torch.device) -> None:
        """The step's fixed buffers (``DecodeBuffers``), with the sink slots' counts, which never change; and the
        speculative query's exchange where this layer looks ahead."""
        cfg, ps, n_kv_heads = self.cfg, self.cfg.page_size, self.model.n_kv_heads
        self.sequence.native.team_spin = cfg.search_team_spin_s(device.type)
        # A traced sequence of fixed trace width gets its trace in the buffers too: the host step writes it from
        # the host's state, so a captured step's trace is that of each replay.
        buffers = DecodeBuffers.make(
            self.model.n_heads, n_kv_heads, cfg.page_budget, n_kv_heads * cfg.n_selected_pages, ps,
            self.model.head_dim, self.state.host_dtype, device, self.seq.host_functions,
            trace_width=self.seq.fixed_trace_width,
        )
        sink_starts = np.arange(cfg.n_sink_pages) * ps
        buffers.counts[:, : cfg.n_sink_pages] = np.clip(self.state.sink_len - sink_starts, 0, ps)
        buffers.point(self.state.native)
        self.buffers = buffers
        if self.wants_previous_layer_input:
            self._speculative = SpeculativeQuery(self.model.n_heads, self.model.head_dim, device,
                                                 self.seq.host_functions)
            self.state.native.set_speculative(self._speculative.address)

    # ------------------------------------------------------------------ look-ahead (lookahead.py; opt-in)
    @property
    def wants_previous_layer_input(self) -> bool:
        return self.cfg.lookahead and self.is_owner and self.layer_idx > 0

    def previous_layer_input(self, hidden: torch.Tensor, project_query) -> None:
        """Start this layer's search from the previous layer's input: its speculative query goes to the host, where
        the C++ step's start hands the job (offload the due window page, search) to the sequence's search thread,
        which runs it while the previous layer runs."""
        if not self.offloaded or hidden.shape[-2] != 1:
            return  # the prompt, or a step before the prompt is offloaded: nothing to search yet
        if self.buffers is None:
            self._make_decode_buffers(self.state.pool.key_pages.device)
        self._prepare_native_step()
        self._speculative.send(project_query(hidden)[0, :, 0, :], self.state.native.lookahead_entry())

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
        # A look-ahead started for this step (previous_layer_input prepared the step before it) may be writing the
        # window, the token store and the index on the search thread now: the store is left alone until the step,
        # and the room reserved then covers the one page the job may offload.
        if not (self._speculative is not None and self.state.native.lookahead_pending):
            self._prepare_native_step()
        exchange.send(query=query[0, :, 0, :], key=key[0, :, 0, :], value=value[0, :, 0, :])
        # The host's part (decode_step.cpp): make room in the window and place the new token, select, diff against
        # the slots, gather the pages to load and write the slots' valid counts (and a fixed-width trace), all
        # into the decode buffers. Timed as the span ``host_step``, its search and its loads as the phases
        # ``query`` and ``load``, its own window offload as ``insert``.
        exchange.run_native(*self.state.native.step_entry())
        self._after_native_step()  # nothing ran yet while capturing: between_steps folds a replay's
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

    def _attended_positions(self) -> torch.Tensor:
        """bool ``[Hq, trace_width()]`` of the positions each query head attends, for a trace whose width the
        sequence does not fix (so not in the decode buffers): the sinks, the window up to the new token, and the
        tokens of each KV head's resident pages, from the C++ step's state after the step's selection."""
        attended = np.zeros((self.model.n_kv_heads, self.trace_width()), dtype=np.uint8)
        self.state.native.trace_into(attended)
        traced = torch.from_numpy(attended).view(torch.bool).to(self.state.pool.key_pages.device)
        return traced.repeat_interleave(self.model.group_size, dim=0)

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
