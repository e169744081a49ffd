"""IceCache (ICLR 2026): KV pages offloaded to CPU memory, chosen per decode step by a multi-level DCI index.

**The paper.** Per sparsified layer and KV head the prompt is split into sink pages (the first tokens), a recent
window and the middle. Prefill attends densely; then the middle keys are indexed into one DCI tree per KV head
(Prioritized DCI on a MIPS transform, M-DCI's page-leaf tree: the leaves are the pages) by CPU worker threads while
the GPU goes on with the next layers, and the middle lives in CPU memory. Only the sink and window pages stay on
the GPU, in a page pool sized by the budget. At each decode step each query head searches its KV head's tree for
the best pages, the selection is diffed against the resident pages and only the missing ones are loaded.

**Budget.** ``budget // page_size`` page slots per head (page size 16, the DCI leaf capacity): ``n_sink_pages`` (2)
sink slots, ``K = budget // 16 - n_sink_pages - n_window_pages`` selected slots (12 at budget 256) and
``n_window_pages`` (2) window slots. At budgets the fixed pages would fill, each shrinks to one page
(``IceCacheConfig.fitted_to_budget``; docs/eval.md, Budgets). A prompt that fits in the pool
(``length <= budget // 16 * 16``) is kept and attended densely until a decode step would exceed it, as in the
reference code; then it is offloaded as below.

**Prompt.** After the last prefill chunk each layer splits its prompt into the sinks (the first
``n_sink_pages * 16`` tokens), the window (the last partial page plus ``n_window_pages - 1`` full pages, or
``n_window_pages`` full pages when the length is a multiple of 16) and the middle. Sinks and window go into their
GPU slots, the prompt's device copy is released, and the middle and window keys and values are copied to host
memory in the model's dtype (``cpu_kv_dtype: auto``; bf16 on GPU). Worker threads of the sequence
(``prompt_workers``, 4, jobs in layer order), beside the GPU's prefill of the next layers, then

* put the values into the layer's token store (``TokenStore``, by token id, sized from the announced length);
* build a ``DCIIndex`` with one tree per KV head over the middle keys: deterministic level schedule, promotion
  probabilities 0.01 (level 0 to 1) and 0.2 (above), one composite and one simple index, build field of view 30 and
  ``prop_to_retrieve`` 1.0, the level-0 anchor shortcut (interval 60, 60 neighbours, threshold 1.02), on
  ``cpu_threads / prompt_workers`` OpenMP threads (the index does not depend on its thread count). The index holds
  the keys in the cache's dtype, by token id, and scores them in place, each row widened to float32 exactly, so its
  results are those of a float32 index over the same values.

A page is a leaf of 8 to 16 tokens with nearby keys (not consecutive positions), a list of token ids; loading it
gathers its rows from the index's keys and the token store's values, so host memory holds the offloaded tokens
once (plus the index's structure, about 12% of them at head_dim 128). The first decode step waits for its layer's
job, so TT2T includes the builds that the prefill did not hide.

**Decode step**, per sparsified layer:

1. the query and the new token's key and value go to the host in one fixed-size transfer
   (``core.host_step.HostExchange``);
2. window: when it holds ``n_window_pages * 16`` tokens its oldest page is offloaded from the window's host copy,
   its 16 keys inserted into the index as one batch (field of view 20, ``prop_to_retrieve`` 0.6), which may split
   or change leaves (changed pages are flagged stale and reloaded if resident); on the GPU the window is a ring, so
   the freed slot becomes the newest window page without moving data;
3. search: each query head (float32, unnormalised; the index normalises) queries its KV head's tree for its K best
   pages (field of view ``max(int(1.5e-3 * tokens), 30)`` unless set, ``prop_to_retrieve`` 0.8); the query heads of
   a GQA group are searched together (their shared parents' key rows are read once);
4. merge: per KV head the group's ranked lists are interleaved rank by rank and the first K distinct pages kept;
5. diff: a selected page already in a slot, and not stale, stays; the other slots receive the missing pages in
   selection order;
6. load: the missing (page, KV head) blocks are gathered into the transfer buffer (always sized for all
   ``n_kv_heads * K`` blocks, unused entries marked), copied to the GPU in one transfer and scattered into the
   slots, cast to the pool's dtype;
7. attention: the paged decode kernel over every slot with each slot's valid-token count (sink pages, the selected
   leaves' 8 to 16 tokens, the window ring's fill; 0 for an empty slot).

Steps 2 to 6 and the count writing are one C++ call per layer (``_dci.DecodeStep``, src/decode_step.cpp, compiled
into the index's extension module so that it calls the index on raw buffers), run with the GIL released on state
C++ holds (the window ring, positions, resident and stale pages; per reuse group the selection, the index's page
counts and the pages its last insert changed) and on memory Python allocated once (the pinned decode buffers, the
window's host copy, the token store, re-pointed when the store grows between steps). Python calls it through
``HostExchange.run_native`` and afterwards folds what it counted and timed into the sequence's counters and timer;
an error inside it is kept, every later step of the sequence does nothing, and the layer raises it after the step.
The counters record the mean over KV heads of the tokens attended, the blocks loaded and their bytes. With
``cuda_graph`` (on by default; it acts only on CUDA with Triton) the whole decode step is captured once and
replayed: the C++ host step runs as a CUDA host function between the two copies, enqueued by its raw address, so a
replay runs no Python; the dense layers keep their cache in static buffers (``core.static_kv.StaticDenseKV``) so
that they are captured too; the replayed step is bitwise the eager one. ``dci_score_precision: half`` (or
``int8``) keeps a half (or 8-bit) copy of the index's key rows and scores them first, re-scoring exactly whatever its
error bound cannot rule out: the same pages bit for bit, fewer bytes read per search, a slower build (docs/dci.md).
The opt-in look-ahead search (``lookahead: true``, not the paper's method) is in ``lookahead.py``.

**IceCache-reuse** (``icecache_reuse``, ``n_reuse_layers = R``, default 3): the sparsified layers form groups of R
consecutive layers; the first (the owner) builds the index, inserts window pages and searches; the others keep
their own keys and values (in their own token store) and load the owner's selection at every step, the same page
ids per KV head (KV head ``h`` with the owner's KV head ``h``), gathered from their own tensors through the
owner's page map. A window offload, in any layer, first waits until every layer's prompt job is done. Searching and
building a third as often is where its lower TPOT and TT2T come from.

**Choices where the two public code versions differ** (we follow v4434): all middle pages are offloaded at
prefill, a full window page is inserted as a batch, the anchor settings are (60, 60, 1.02) and the host KV is in
the model's dtype (``cpu_kv_dtype: float32`` gives the main branch's float32 store). The index is our own C++
implementation of multi-level Prioritized DCI with M-DCI's page-leaf tree; where it differs from M-DCI is listed in
docs/dci.md.

The package:

    config.py     the settings and how the budget divides into pages
    method.py     the registered methods (icecache, icecache_reuse): checks, page counts, the owner of a layer
    layer.py      one sparsified layer: prefill and offload, the prompt job, the decode step's device side and glue
    offloaded.py  what a layer holds once offloaded (pool, window, token store, its C++ step), made once
    window.py     the window: a ring of pool slots and its host copy, which a full page is offloaded from
    buffers.py    the decode step's fixed buffers: its exchange with the host (core.host_step), as typed arrays
    lookahead.py  the opt-in look-ahead search (lookahead=true): a speculative query, its check, its correction
    selection.py  merging a GQA group's ranked pages, and diffing a selection against the resident pages
    state.py      what a sequence's layers share (a reuse group's index and selection, the prompt worker, the
                  C++ steps' search thread and first error)
    stores.py     the host-memory token store
    src/          the decode step's host work in C++ (decode_step.cpp), built into icecache.dci._dci
"""

from .config import DCI_LEAF_CAPACITY, IceCacheConfig, IceCacheReuseConfig
from .layer import IceCacheLayer
from .method import IceCache, IceCacheReuse
from .selection import diff_selection, merge_group_pages
from .state import GroupState, IceCacheSequence
from .stores import TokenStore

__all__ = [
    "DCI_LEAF_CAPACITY", "GroupState", "IceCache", "IceCacheConfig", "IceCacheLayer", "IceCacheReuse",
    "IceCacheReuseConfig", "IceCacheSequence", "TokenStore", "diff_selection", "merge_group_pages",
]
