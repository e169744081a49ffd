"""A NumPy/PyTorch reference of IceCache's host step, for tests only: the package runs the step in C++
(icecache/method/src/decode_step.cpp); this is the same work written the direct way (the implementation the
harness had before the step moved to C++), so that tests can compare the two bit for bit, buffer by buffer."""

from __future__ import annotations

import numpy as np
import torch

from icecache.dci import DCIIndex


def merge_group_pages(pages: np.ndarray, group_size: int, k: int) -> np.ndarray:
    """Per KV head, its query heads' ranked pages interleaved rank by rank, the first ``k`` distinct."""
    n_kv_heads, n_ranks = pages.shape[0] // group_size, pages.shape[1]
    ranked = pages[: n_kv_heads * group_size].reshape(n_kv_heads, group_size, n_ranks).transpose(0, 2, 1)
    ranked = ranked.reshape(n_kv_heads, -1)
    merged = np.full((n_kv_heads, k), -1, dtype=np.int64)
    for head in range(n_kv_heads):
        kept: list[int] = []
        for page in ranked[head]:
            if page >= 0 and page not in kept and len(kept) < k:
                kept.append(int(page))
        merged[head, : len(kept)] = kept
    return merged


def diff_selection(resident: np.ndarray, stale: np.ndarray, selection: np.ndarray):
    """The vectorised NumPy diff: ``resident`` updated in place; (slots, pages, heads) to load."""
    held = resident >= 0
    same = resident[:, :, None] == selection[:, None, :]
    in_map = held & (resident < stale.shape[1])
    was_stale = np.zeros_like(held)
    was_stale[in_map] = stale[np.nonzero(in_map)[0], resident[in_map]]
    kept = held & ~was_stale & same.any(axis=2)
    free = ~kept
    to_load = (selection >= 0) & ~(same & kept[:, :, None]).any(axis=1)
    n_pairs = np.minimum(free.sum(axis=1), to_load.sum(axis=1))[:, None]
    filled = free & (np.cumsum(free, axis=1) <= n_pairs)
    loaded = to_load & (np.cumsum(to_load, axis=1) <= n_pairs)
    heads, slots = np.nonzero(filled)
    pages = selection[loaded].astype(np.int64, copy=False)
    resident[free] = -1
    resident[heads, slots] = pages
    return slots, pages, heads


def head_cosines(speculative: np.ndarray, exact: np.ndarray) -> np.ndarray:
    speculative, exact = speculative.astype(np.float64), exact.astype(np.float64)
    a, b = np.linalg.norm(speculative, axis=1), np.linalg.norm(exact, axis=1)
    norms = a * b
    dots = np.einsum("hd,hd->h", speculative, exact)
    both_zero = (a == 0) & (b == 0)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), np.where(both_zero, 1.0, 0.0))


class Group:
    """A reuse group's index and selection, and what its owner's last insert changed."""

    def __init__(self):
        self.index: DCIIndex | None = None
        self.changed: np.ndarray | None = None
        self.selection: np.ndarray | None = None


class ReferenceStep:
    """One layer's host step on its own copy of the state: the window ring and its host copy, the token store
    (values, and keys unless the index holds them), positions, resident and stale pages, and the counters.

    ``layer`` is the IceCacheLayer whose settings and prompt split it follows; ``keys``/``values`` ``[Hkv, T, D]``
    the prompt in the model's dtype (what the layer offloaded)."""

    def __init__(self, layer, group: Group, keys: torch.Tensor, values: torch.Tensor):
        cfg, model = layer.cfg, layer.model
        self.cfg, self.model, self.group, self.is_owner = cfg, model, group, layer.is_owner
        ps = cfg.page_size
        total = keys.shape[1]
        self.sink_len = min(cfg.n_sink_pages * ps, total)
        tail = total % ps
        window_len = (cfg.n_window_pages - 1) * ps + tail if tail else cfg.n_window_pages * ps
        window_len = min(window_len, total - self.sink_len)
        middle_end = total - window_len
        host_dtype = layer.state.host_dtype
        self.host_dtype = host_dtype
        self.keys_in_index = layer.state.keys_in_index
        self.capacity = cfg.n_window_pages * ps
        self.host_k = torch.zeros(model.n_kv_heads, self.capacity, model.head_dim, dtype=host_dtype)
        self.host_v = torch.zeros_like(self.host_k)
        self.host_k[:, :window_len] = keys[:, middle_end:].to(host_dtype)
        self.host_v[:, :window_len] = values[:, middle_end:].to(host_dtype)
        self.start, self.count, self.head = middle_end, window_len, 0
        self.first_slot = cfg.n_sink_pages + cfg.n_selected_pages
        middle_k = keys[:, self.sink_len : middle_end].to(host_dtype)
        self.store_v = values[:, self.sink_len : middle_end].to(host_dtype)
        self.store_k = None if self.keys_in_index else middle_k
        self.positions = np.arange(self.sink_len, middle_end)
        self.resident = np.full((model.n_kv_heads, cfg.n_selected_pages), -1, dtype=np.int64)
        self.stale = np.zeros((model.n_kv_heads, 0), dtype=bool)
        self.page_bytes = ps * model.head_dim * host_dtype.itemsize
        self.counters = {"attended": [], "pages_loaded": 0, "bytes_to_gpu": 0, "searches": 0,
                         "lookahead_searches": 0, "lookahead_misses": 0, "rows_read": 0, "scores": 0}
        if self.is_owner:
            index = DCIIndex(model.head_dim, model.n_kv_heads, promotion_prob=cfg.promotion_prob,
                             promotion_prob_subseq=cfg.promotion_prob_subseq, seed=cfg.seed, num_threads=2,
                             score_precision=cfg.dci_score_precision,
                             key_dtype="bfloat16" if host_dtype == torch.bfloat16 else "float32")
            if middle_k.shape[1]:
                index.build(self._index_keys(index, middle_k), field_of_view=cfg.build_field_of_view,
                            prop_to_retrieve=cfg.build_prop_to_retrieve, anchor_interval=cfg.anchor_interval,
                            anchor_neighbours=cfg.anchor_neighbours, anchor_threshold=cfg.anchor_threshold)
                index.pop_changed_pages()
            group.index = index
        self.ahead: tuple | None = None

    @staticmethod
    def _index_keys(index, keys):
        return keys if index.key_dtype == "bfloat16" else keys.float().numpy()

    # ------------------------------------------------------------------ the window
    def _append(self, key: torch.Tensor, value: torch.Tensor) -> np.ndarray:
        ps, n_kv = self.cfg.page_size, self.model.n_kv_heads
        self.host_k[:, self.count] = key
        self.host_v[:, self.count] = value
        page, offset = divmod(self.count, ps)
        slot = self.first_slot + (self.head + page) % self.cfg.n_window_pages
        self.count += 1
        return (slot * n_kv) * ps + np.arange(n_kv) * ps + offset

    def _offload_window_page(self) -> None:
        ps, cfg, group = self.cfg.page_size, self.cfg, self.group
        page_k, page_v = self.host_k[:, :ps].clone(), self.host_v[:, :ps].clone()
        self.host_k[:, :-ps] = self.host_k[:, ps:].clone()
        self.host_v[:, :-ps] = self.host_v[:, ps:].clone()
        self.count -= ps
        self.head = (self.head + 1) % cfg.n_window_pages
        self.positions = np.concatenate([self.positions, np.arange(self.start, self.start + ps)])
        self.start += ps
        self.store_v = torch.cat([self.store_v, page_v], 1)
        if self.store_k is not None:
            self.store_k = torch.cat([self.store_k, page_k], 1)
        if self.is_owner:
            group.index.insert(self._index_keys(group.index, page_k), field_of_view=cfg.insert_field_of_view,
                               prop_to_retrieve=cfg.insert_prop_to_retrieve, as_batch=True)
            group.changed = group.index.pop_changed_pages()
        if group.changed is not None:
            self._cover(group.changed.shape[1])
            self.stale[:, : group.changed.shape[1]] |= group.changed

    def _cover(self, n_pages: int) -> None:
        if self.stale.shape[1] < n_pages:
            self.stale = np.pad(self.stale, ((0, 0), (0, n_pages - self.stale.shape[1])))

    # ------------------------------------------------------------------ the step
    def start_lookahead(self, query: np.ndarray) -> None:
        if self.count == self.capacity:
            self._offload_window_page()
        if self.group.index.num_tokens == 0:
            self.ahead = (query, None, {})
            return
        self.ahead = (query, *self._search(query))

    def _search(self, query: np.ndarray):
        cfg, index = self.cfg, self.group.index
        pages, _ = index.query(query, cfg.n_selected_pages, field_of_view=cfg.query_field_of_view,
                               prop_to_retrieve=cfg.query_prop_to_retrieve, ratio=self.model.group_size)
        return pages, index.last_query_stats()

    def step(self, query: np.ndarray, key: torch.Tensor, value: torch.Tensor, n_slots: int, max_blocks: int,
             trace_width: int = 0) -> dict[str, np.ndarray]:
        """The step's outputs: what the C++ step writes into its decode buffers."""
        cfg, model = self.cfg, self.model
        ahead, self.ahead = self.ahead, None
        if self.count == self.capacity:
            self._offload_window_page()
        window_rows = self._append(key.to(self.host_dtype), value.to(self.host_dtype))
        selection = self._select(query, ahead)
        page_counts = self.group.index.page_valid_counts()
        self._cover(page_counts.shape[1])
        slots, pages, heads = diff_selection(self.resident, self.stale, selection)
        n = pages.size
        out_slots = np.full(max_blocks, -1, dtype=np.int32)
        out_slots[:n] = slots + cfg.n_sink_pages
        out_heads = heads.astype(np.int32)
        self.stale[heads, pages] = False
        keys_out = np.zeros((n, self.page_bytes), dtype=np.uint8)
        values_out = np.zeros((n, self.page_bytes), dtype=np.uint8)
        if n:
            ids = self.group.index.pages_items(heads, pages)
            self._gather(self.store_v, heads, ids, values_out)
            if self.store_k is not None:
                self._gather(self.store_k, heads, ids, keys_out)
            else:
                self.group.index.gather_keys(heads, ids, keys_out)
        self.counters["pages_loaded"] += n
        self.counters["bytes_to_gpu"] += 2 * n * self.page_bytes
        counts = np.zeros((model.n_kv_heads, n_slots), dtype=np.int32)
        counts[:, : cfg.n_sink_pages] = np.clip(self.sink_len - np.arange(cfg.n_sink_pages) * cfg.page_size, 0,
                                                cfg.page_size)
        held = self.resident >= 0
        selected = counts[:, cfg.n_sink_pages : cfg.n_sink_pages + cfg.n_selected_pages]
        selected[held] = page_counts[np.nonzero(held)[0], self.resident[held]]
        logical = (np.arange(cfg.n_window_pages) - self.head) % cfg.n_window_pages
        counts[:, cfg.n_sink_pages + cfg.n_selected_pages :] = np.clip(self.count - logical * cfg.page_size, 0,
                                                                       cfg.page_size)
        self.counters["attended"].append(float(np.float32(counts.sum()) / np.float32(counts.shape[0])))
        out = {"window_rows": window_rows, "counts": counts, "slots": out_slots, "heads": out_heads[:n],
               "keys": keys_out, "values": values_out, "selection": selection.copy(),
               "resident": self.resident.copy(), "positions": self.positions.copy()}
        if trace_width:
            out["attended"] = self.trace(trace_width)
        return out

    def _select(self, query: np.ndarray, ahead) -> np.ndarray:
        cfg, group = self.cfg, self.group
        if not self.is_owner:
            return group.selection
        if group.index.num_tokens == 0:
            group.selection = np.full((self.model.n_kv_heads, cfg.n_selected_pages), -1, dtype=np.int64)
            return group.selection
        held = False
        if ahead is not None and ahead[1] is not None:
            self.counters["lookahead_searches"] += 1
            held = bool(head_cosines(ahead[0], query).min() >= cfg.lookahead_min_cosine)
            self.counters["lookahead_misses"] += not held
        pages, stats = (ahead[1], ahead[2]) if held else self._search(query)
        group.selection = merge_group_pages(pages, self.model.group_size, cfg.n_selected_pages)
        self.counters["searches"] += 1
        self.counters["rows_read"] += stats["rows_read"]
        self.counters["scores"] += stats["scores"]
        return group.selection

    @staticmethod
    def _gather(store: torch.Tensor, heads: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        rows = store.reshape(-1, store.shape[2])
        flat = (heads[:, None] * store.shape[1] + np.maximum(ids, 0)).reshape(-1)
        source = rows.view(torch.uint8).numpy()
        np.take(source, flat, axis=0, out=out.reshape(flat.size, -1), mode="clip")

    def trace(self, width: int) -> np.ndarray:
        attended = np.zeros((self.model.n_kv_heads, width), dtype=np.uint8)
        attended[:, : self.sink_len] = 1
        attended[:, self.start : self.start + self.count] = 1
        index = self.group.index
        for head in range(self.model.n_kv_heads):
            pages = self.resident[head][self.resident[head] >= 0]
            if pages.size:
                tokens = index.page_tokens(head)[pages].reshape(-1)
                attended[head, self.positions[tokens[tokens >= 0]]] = 1
        return attended
