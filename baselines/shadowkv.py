"""ShadowKV (Sun et al., ICML 2025): low-rank pre-RoPE keys and chunk landmarks on the GPU, values in CPU memory.

The paper. Keys before RoPE are nearly low-rank, values are not. After the prompt ShadowKV keeps on the GPU a
rank-``r`` factorisation of the prompt's pre-RoPE keys (the SVD of the ``[T, n_kv_heads * head_dim]`` matrix of
all KV heads together, rank 160), one landmark per chunk of 8 tokens (the mean of its post-RoPE keys), the
"outlier" chunks whose keys are least like their landmark (lowest minimum cosine similarity) kept exactly, and the
last chunks (the local window) exactly; the values go to CPU memory. At a decode step each query head scores the
landmarks, ``softmax(q . landmark / sqrt(d))`` over the chunks, the scores are maximised over the query heads of a
KV group, and each KV head takes its top chunks; their keys are rebuilt on the GPU from the factorisation and
rotated by RoPE at their positions, while their values are copied from the CPU (chunks already on the GPU from the
step before are not copied again), the copy overlapping the rebuild. Attention runs over the outliers, the selected
chunks and the window. Its Llama-3.1-8B setting: a sparse budget of 2048 tokens (256 chunks of 8), 48 outlier
chunks, 4 local chunks, rank 160.

Pre-RoPE keys. Layers see keys after RoPE (``LayerKV`` receives what the attention function receives), so the
keys before it are recovered by the inverse rotation with the model's own frequencies (``core.rope.Rotary``, read
from the model's config into ``ModelInfo.rotary``); rebuilt keys are rotated with the same frequencies. A model
whose RoPE changes with the sequence length is refused. A bare geometry with no rotary information (the core's unit
tests) is taken as having no RoPE.

This code. ``budget`` slots per query head, all chunks of ``chunk_size`` tokens: ``n_local_chunks`` (4) window chunks
(the current, partly filled chunk counts whole, as page methods count their current page), outlier chunks and selected
chunks. Of the chunks besides the window, 48 in 304 are outliers (round half to even) unless ``n_outlier_chunks`` is
set, the share of the paper's Llama-3.1-8B setting: at its budget, 8 x (4 + 48 + 256) = 2464 tokens, that is 48 outliers
and 256 selected chunks; at budget 256, 4 window, 4 outlier and 24 selected chunks. The budget must be a multiple of
``chunk_size``. A sequence that fits the budget (its announced length at most ``budget``) keeps its cache whole
(``StaticDenseKV``) and is attended in full. Otherwise, after the prompt's last chunk: the pre-RoPE keys of the whole
prompt are factorised (``rank`` at or above ``n_kv_heads * head_dim``: the factorisation is the identity, and rebuilt
keys are exact; ``basis_solver``: ``svd``, the top right singular vectors from the SVD of the tall matrix's R factor, or
``gram``, the same vectors as the top eigenvectors of its float64 Gram matrix, one GEMM and one small symmetric
eigensolve instead of a QR of the tall matrix and an SVD); the chunks before the window are candidates, their landmarks
computed and their outliers chosen per KV head; everything goes into one device pool of chunk slots (outliers, selected,
window ring, one scratch slot) and the candidates' values into the host store (a buffer of the core's host pool, pinned
on CUDA and read in place by the copy kernel). On CUDA all of this but the buffers' allocation runs on a worker thread
and a side stream beside the next layers' prefill, since the first token needs none of it; the layer's first decode step
waits for it, so TT2T carries what the prefill did not hide. The factor kept per token is its coefficients on the
rank-``r`` basis (``pre-RoPE key @ basis^T``, which is ``U S`` of the SVD for a prompt token), so a chunk that leaves
the window later gets its coefficients, landmark and host copy of its values the same way and becomes a candidate
(outliers are chosen once, at the prompt, as in ShadowKV). A decode step, every decision on the device and its shapes
fixed, is captured in a CUDA graph on CUDA; its operations are ``core.kernels.shadowkv_step``'s (Triton kernels on CUDA,
their PyTorch references elsewhere): ``turn_window`` (when a chunk starts, the chunk leaving the window becomes a
candidate), ``select_and_plan`` (score the landmarks, take each KV head's top chunks, keep the chunks already resident
and plan the others into the freed slots), the values of the missing chunks from the host store with ``copy_blocks``
(``core.kernels.block_copy``; its two block arrays are the two halves of each chunk) on a side stream, while the main
stream runs ``finish_step`` (the new token, the loaded chunks' keys rebuilt and rotated, the counters; phase
``rebuild``); then one paged attention over all slots.

Differences from the paper: the first ``n_dense_layers`` (default 2) layers keep the full cache (ShadowKV sparsifies
every layer of its prompts over 4k tokens); the window is a fixed ring of chunks, so tokens generated after the prompt
leave it and become candidates (ShadowKV keeps every generated token on the GPU); the window is chunk-aligned from
position 0 (ShadowKV keeps the prompt's last 4 chunks plus the remainder, aligned to 8 chunks); a resident chunk
keeps its slot (ShadowKV compacts the resident chunks); the landmark
softmax uses the model's scaling (ShadowKV's ``1 / sqrt(128)``); no initial selection by the last prompt query (the
first step loads its chunks). The counters record the tokens attended and the (chunk, KV head) value blocks copied and
their bytes. Rule tests (inverse RoPE against each tiny model's projected keys, the SVD rebuild, landmarks, outliers,
chosen and loaded chunks, a chunk leaving the window): ``tests/test_shadowkv.py``; the step kernels against their
references: ``tests/test_shadowkv_kernels.py``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from icecache.core.kernels.block_copy import copy_blocks, copy_blocks_triton
from icecache.core.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_triton
from icecache.core.kernels.row_table import KeptRowTables, RowTable, row_table, step_layout
from icecache.core.kernels.shadowkv_step import (
    SCORE_PRODUCTS,
    ScoreLaunch,
    ShadowKVRowTables,
    ShadowKVSlots,
    ShadowKVStepPlan,
    finish_step,
    finish_step_triton,
    key_coefficients,
    ring_chunks,
    runs_triton,
    select_and_plan,
    select_and_plan_triton,
    turn_window,
    turn_window_triton,
    window_base,
)
from icecache.core.layer import attended_from_positions
from icecache.core.method import (
    METHODS,
    Method,
    MethodConfig,
    SpeedGoal,
    StaticDenseKV,
    in_run_identity_unless_default,
    prompt_offload_goals,
    storage_capacity,
)
from icecache.core.paged import mapped_device_view
from icecache.errors import ConfigError

# The paper's Llama-3.1-8B setting: 48 outlier chunks beside 256 selected ones (2048 tokens of sparse budget).
PAPER_OUTLIER_CHUNKS, PAPER_SELECTED_CHUNKS = 48, 256


@dataclass
class ShadowKVConfig(MethodConfig):
    name: str = "shadowkv"
    chunk_size: int = 8  # tokens per chunk (one landmark each)
    rank: int = 160  # rank of the pre-RoPE key factorisation (all KV heads together)
    n_local_chunks: int = 4  # the window, in chunks, the current one included
    n_outlier_chunks: int | None = None  # None: 48 in 304 of the chunks besides the window (the paper's share)
    # How the prompt's key basis is found: "svd" (QR, then SVD) or "gram" (float64 eigh).
    basis_solver: str = in_run_identity_unless_default("svd")
    # A batch's rows share each kernel launch (decode_rows); False: each row its own.
    batch_kernels: bool = in_run_identity_unless_default(True)
    # How the GPU's landmark scores multiply (core.kernels.shadowkv_step.ScoreLaunch.products): "dot" (tensor cores,
    # float32 tiles), "dot_16bit" (tensor cores on 16-bit tiles) or "fma" (ordinary cores); float rounding apart,
    # the same scores
    score_products: str = in_run_identity_unless_default("dot")

    def check_budget(self) -> None:
        super().check_budget()
        if self.chunk_size > 0 and self.budget % self.chunk_size:
            raise ConfigError(f"shadowkv: budget={self.budget} must be a multiple of chunk_size={self.chunk_size}")

    def min_budget(self) -> int:
        fixed = self.n_local_chunks + (self.n_outlier_chunks or 0)
        return (fixed + 1) * self.chunk_size

    def min_budget_reason(self) -> str:
        return (f"(n_local_chunks={self.n_local_chunks} + the outliers + 1 selected chunk) x "
                f"chunk_size={self.chunk_size}")


def chunk_split(config: ShadowKVConfig) -> tuple[int, int, int]:
    """``(window, outlier, selected)`` chunks of a budget of ``budget // chunk_size`` chunks."""
    rest = config.budget // config.chunk_size - config.n_local_chunks
    if config.n_outlier_chunks is not None:
        n_outlier = config.n_outlier_chunks
    else:
        n_outlier = round(rest * PAPER_OUTLIER_CHUNKS / (PAPER_OUTLIER_CHUNKS + PAPER_SELECTED_CHUNKS))
    return config.n_local_chunks, n_outlier, rest - n_outlier


# --- the paper's definitions ---------------------------------------------------------------------------------------


def _basis_by_svd(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The top right singular vectors of the float32 ``matrix [T, W]``: the SVD of its R factor when it is tall
    (the right singular vectors of a tall matrix are those of R, which is far smaller)."""
    if matrix.shape[0] > matrix.shape[1]:
        matrix = torch.linalg.qr(matrix, mode="r").R
    _, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    return vh[:rank]


def _basis_by_gram(matrix: torch.Tensor, rank: int, rows_per_block: int = 8192) -> torch.Tensor:
    """The same vectors as the eigenvectors of the Gram matrix ``matrix^T matrix [W, W]`` with the largest
    eigenvalues, the Gram summed in float64 a block of rows at a time (squaring the singular values halves the
    digits they keep, which float64 more than covers). One GEMM and one symmetric eigensolve of ``W x W``, no
    factorisation of the tall matrix (which ShadowKV's prompt cost is mostly: docs/performance.md)."""
    width = matrix.shape[1]
    gram = torch.zeros(width, width, dtype=torch.float64, device=matrix.device)
    for start in range(0, matrix.shape[0], rows_per_block):
        block = matrix[start : start + rows_per_block].double()
        gram.addmm_(block.T, block)
    _, vectors = torch.linalg.eigh(gram)  # eigenvalues ascending
    return vectors[:, -rank:].flip(-1).T.float()


# How the basis is computed (``ShadowKVConfig.basis_solver``): the same subspace up to float rounding.
BASIS_SOLVERS = {"svd": _basis_by_svd, "gram": _basis_by_gram}


def basis_rows(rank: int, n_tokens: int, width: int) -> int:
    """How many rows ``key_basis`` returns for ``n_tokens`` keys of ``width`` channels: the whole width (the
    identity) when ``rank`` covers it, else ``min(rank, n_tokens, width)``."""
    return width if rank >= width else min(rank, n_tokens, width)


def key_basis(pre_rope_keys: torch.Tensor, rank: int, solver: str = "svd") -> torch.Tensor:
    """The rank-``rank`` basis of ``pre_rope_keys [Hkv, T, D]``, all heads together: the top right singular vectors
    of the ``[T, Hkv * D]`` matrix, ``[r, Hkv * D]`` float32 with ``r = min(rank, T, Hkv * D)``; the identity when
    ``rank`` covers every dimension (then a rebuilt key is the key itself). ``solver`` names how
    (``BASIS_SOLVERS``); a singular vector's sign is either, which the factorisation does not see."""
    n_kv_heads, n_tokens, head_dim = pre_rope_keys.shape
    width = n_kv_heads * head_dim
    if rank >= width:
        return torch.eye(width, device=pre_rope_keys.device)
    matrix = pre_rope_keys.float().transpose(0, 1).reshape(n_tokens, width)
    return BASIS_SOLVERS[solver](matrix, basis_rows(rank, n_tokens, width))


def chunk_landmarks(keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[Hkv, C * chunk_size, D]`` post-RoPE keys -> ``[Hkv, C, D]`` float32 chunk means."""
    n_kv_heads, n_tokens, head_dim = keys.shape
    return keys.float().view(n_kv_heads, n_tokens // chunk_size, chunk_size, head_dim).mean(dim=2)


def outlier_chunks(keys: torch.Tensor, chunk_size: int, n_outliers: int) -> torch.Tensor:
    """``[Hkv, n]`` ids of the chunks whose keys are least like their landmark: the smallest minimum cosine
    similarity between a chunk's landmark and its keys (``n = min(n_outliers, chunks)``)."""
    n_kv_heads, n_tokens, head_dim = keys.shape
    chunks = keys.float().view(n_kv_heads, n_tokens // chunk_size, chunk_size, head_dim)
    landmarks = chunks.mean(dim=2, keepdim=True)
    similarity = torch.nn.functional.cosine_similarity(landmarks.expand_as(chunks), chunks, dim=-1)
    worst = similarity.amin(dim=-1)  # [Hkv, C]
    return worst.topk(min(n_outliers, worst.shape[1]), dim=-1, largest=False).indices


@dataclass
class ShadowKVSequence:
    """What a sequence's ShadowKV layers share: one side stream for the value copies, made at the first step; on
    CUDA, the worker thread and stream that factorise the layers' prompts, in layer order, beside the prefill of
    the later layers."""

    copy_stream: torch.cuda.Stream | None = None
    prompt_worker: ThreadPoolExecutor | None = None
    prompt_stream: torch.cuda.Stream | None = None

    def enter_sparse_later(self, layer: "ShadowKVKV", n_tokens: int) -> Future:
        """Queue ``layer``'s factorisation of its first ``n_tokens`` (``ShadowKVKV._fill_sparse``) on the prompt
        worker: it runs on the prompt stream after what the model's stream has queued so far (the layer's keys and
        values), and its future gives the event that ends it, for the layer's first decode step to wait for."""
        device = layer._keys.device
        if self.prompt_worker is None:
            self.prompt_worker = ThreadPoolExecutor(1, thread_name_prefix="shadowkv-prompt")
            self.prompt_stream = torch.cuda.Stream(device)
        side, model_stream = self.prompt_stream, torch.cuda.current_stream(device)
        produced = model_stream.record_event()
        # The dense buffers are read on the prompt stream and dropped by the worker: the model's stream may reuse
        # their memory only once the prompt stream is past them.
        layer._keys.record_stream(side)
        layer._values.record_stream(side)

        @torch.inference_mode()
        def run() -> torch.cuda.Event:
            with torch.cuda.stream(side), layer.seq.timer.span("prompt_factorisation"):
                side.wait_event(produced)
                values_copy = layer._fill_sparse(n_tokens)
                if values_copy is not None:  # after the factorisation's stream; the first step joins it
                    layer.seq.prompt_copies.copy(*values_copy)
                for kept in (layer.basis, layer._inv_freq):  # made here, read by the model's stream from now on
                    if kept is not None:
                        kept.record_stream(model_stream)
                return side.record_event()

        return self.prompt_worker.submit(run)

    def close(self) -> None:
        if self.prompt_worker is not None:
            self.prompt_worker.shutdown(wait=True)
            self.prompt_worker = None


class _NoRotary:
    """RoPE of a geometry without rotary information: none."""

    def frequencies(self, device):
        return None

    def apply(self, x, positions, inv_freq=None):
        return x.float()

    invert = apply


# --- the layer -----------------------------------------------------------------------------------------------------


class ShadowKVKV(StaticDenseKV):
    """Dense (``StaticDenseKV``) while the sequence fits the budget; otherwise one device pool of chunk slots
    ``[n_outlier + n_selected + n_local + 1, Hkv, chunk_size, D]`` (the last a scratch slot), the landmarks, the
    per-token key coefficients and the basis on the device, the values of candidate chunks in host memory."""

    def __init__(self, layer_idx, model, seq, config: ShadowKVConfig):
        super().__init__(layer_idx, model, seq, page_size=config.chunk_size)
        self.cfg = config
        self.budget = config.budget
        self.chunk_size = config.chunk_size
        self.n_local, self.n_outlier, self.n_selected = chunk_split(config)
        self.layout = ShadowKVSlots(self.chunk_size, self.n_outlier, self.n_selected, self.n_local)
        self.rotary = model.rotary if model.rotary is not None else _NoRotary()
        self.sparse = False
        self._entering: Future | None = None  # the prompt's factorisation on the worker (CUDA), until joined
        # A new object at each allocation of the sparse buffers: a batch's row tables (decode_rows) were made for the
        # buffers of the tokens they hold (kept with the tables, so that no later object takes their identity).
        self._buffers_token: object | None = None
        self._batch_tables: KeptRowTables | None = None  # a batch's, kept on its row-0 layer

    # --- prompt ----------------------------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            n_tokens = self.seq_len + key.shape[2]
            announced = self.seq.max_total_tokens
            if (announced if announced is not None else n_tokens + 1) > self.budget:
                if self._keys.is_cuda:
                    # The first token needs none of it: the factorisation and the rest run on a worker thread
                    # and a side stream beside the next layers' prefill, and the first decode step waits for them.
                    self._prepare_sparse(n_tokens)
                    self._entering = self.seq.state(ShadowKVSequence).enter_sparse_later(self, n_tokens)
                else:
                    with self.seq.timer.phase("offload"):
                        values_copy = self._enter_sparse(n_tokens)
                    if values_copy is not None:
                        self.seq.prompt_copies.copy(*values_copy)
        return out

    def _enter_sparse(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Factorise, pick landmarks and outliers, lay out the pool and the host store; the dense buffers go.
        Returns the host store's fill for the caller to queue, ``(destination, source)`` (None: no candidates)."""
        self._prepare_sparse(n_tokens)
        return self._fill_sparse(n_tokens)

    def _prepare_sparse(self, n_tokens: int) -> None:
        """The sparse layout's buffers for ``n_tokens`` (device tensors and the host store, from the sequence's
        pool), made on the thread that runs the model."""
        n_kv_heads, _, head_dim = self._keys.shape
        rank = basis_rows(self.cfg.rank, n_tokens, n_kv_heads * head_dim)
        # Capacity in chunks, plus one scratch chunk (and its rows) that fixed-shape writes go to when idle.
        n_chunks = -(-storage_capacity(self.seq, n_tokens + 1, 0) // self.chunk_size)
        self._allocate_sparse(n_chunks, n_kv_heads, head_dim, rank, self._keys.device, self._keys.dtype)

    def _fill_sparse(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Factorise the prompt into the buffers ``_prepare_sparse`` made, pick landmarks and outliers and lay out
        the pool; the dense buffers go. Returns the host store's fill, ``(destination, source)`` (None: no
        candidates)."""
        cs, n_local = self.chunk_size, self.n_local
        keys, values = self._keys[:, :n_tokens], self._values[:, :n_tokens]
        n_kv_heads, _, head_dim = keys.shape
        device, dtype = keys.device, keys.dtype
        self._inv_freq = self.rotary.frequencies(device)
        positions = torch.arange(n_tokens, device=device)
        pre_rope = self.rotary.invert(keys, positions, self._inv_freq)
        basis = key_basis(pre_rope, self.cfg.rank, self.cfg.basis_solver)
        self.basis = basis.to(dtype)  # [r, Hkv * D]
        self.coefficients[:n_tokens] = key_coefficients(pre_rope, basis).to(dtype)

        # The window of the last prompt token; the chunks before it are candidates.
        n_candidates = max(0, (n_tokens - 1) // cs - n_local + 1)
        split = n_candidates * cs
        self.store_values[n_candidates:].zero_()  # a pool buffer: what the candidates' copy does not fill
        if n_candidates:
            self.landmarks[:, :n_candidates] = chunk_landmarks(keys[:, :split], cs).to(dtype)
            chunk_values = values[:, :split].reshape(n_kv_heads, n_candidates, cs, head_dim).transpose(0, 1)
            values_copy = (self.store_values[:n_candidates], chunk_values)
            outliers = outlier_chunks(keys[:, :split], cs, self.n_outlier)  # [Hkv, n]
            n = outliers.shape[1]
            self.outlier_ids[:, :n] = outliers
            self.is_outlier.scatter_(1, outliers, True)
            heads = torch.arange(n_kv_heads, device=device)[:, None]
            chunk_keys = keys[:, :split].reshape(n_kv_heads, n_candidates, cs, head_dim)
            slots = torch.arange(n, device=device)[None, :].expand(n_kv_heads, -1)
            self.pool_keys[slots, heads] = chunk_keys[heads, outliers]
            self.pool_values[slots, heads] = values[:, :split].reshape_as(chunk_keys)[heads, outliers]
        window = torch.arange(split, n_tokens, device=device)
        ring = self.layout.window_slot0 + (window // cs) % n_local
        self.pool_keys[ring, :, window % cs] = keys[:, split:].transpose(0, 1)
        self.pool_values[ring, :, window % cs] = values[:, split:].transpose(0, 1)
        self._keys = self._values = None  # the dense copy goes
        self.sparse = True
        return values_copy if n_candidates else None

    def _allocate_sparse(self, n_chunks, n_kv_heads, head_dim, rank, device, dtype) -> None:
        cs = self.chunk_size
        self.n_chunks = n_chunks
        self._buffers_token = object()
        n_slots = self.layout.n_attended_slots + 1
        self.pool_keys = torch.zeros(n_slots, n_kv_heads, cs, head_dim, dtype=dtype, device=device)
        self.pool_values = torch.zeros_like(self.pool_keys)
        self.landmarks = torch.zeros(n_kv_heads, n_chunks + 1, head_dim, dtype=dtype, device=device)
        self.is_outlier = torch.zeros(n_kv_heads, n_chunks + 1, dtype=torch.bool, device=device)
        self.coefficients = torch.zeros((n_chunks + 1) * cs, rank, dtype=dtype, device=device)
        self.outlier_ids = torch.full((n_kv_heads, self.n_outlier), -1, dtype=torch.long, device=device)
        # The chunk each selected slot holds per KV head (-1: empty); the last column takes writes with no target.
        self.slot_chunk = torch.full((n_kv_heads, self.n_selected + 1), -1, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        # From the host pool (kept across sequences): the prompt's candidates are copied in, the rest is cleared.
        self.store_values = self.seq.prompt_copies.take((n_chunks + 1, n_kv_heads, cs, head_dim), dtype, device)
        self._store_on_device = mapped_device_view(self.store_values, device) if pin else self.store_values
        self._slot_table = torch.arange(self.layout.n_attended_slots, device=device, dtype=torch.int32).expand(
            n_kv_heads, -1)
        self._step_plan = ShadowKVStepPlan(self.layout, n_kv_heads, self.model.n_heads // n_kv_heads, n_chunks + 1,
                                           device, score_launch=ScoreLaunch(products=self.cfg.score_products))

    def _grow(self, n_tokens: int) -> None:
        """Room for ``n_tokens`` (only outside the generation loop, which announces the length)."""
        cs = self.chunk_size
        n_chunks = max(-(-n_tokens // cs), 2 * self.n_chunks)
        old = (self.landmarks, self.is_outlier, self.coefficients, self.store_values, self.pool_keys, self.pool_values,
               self.outlier_ids, self.slot_chunk)
        kept = self.n_chunks
        if self.pool_keys.is_cuda:
            torch.cuda.synchronize(self.pool_keys.device)
        n_kv_heads, _, head_dim = self.landmarks.shape
        self._allocate_sparse(n_chunks, n_kv_heads, head_dim, self.coefficients.shape[1], self.pool_keys.device,
                              self.pool_keys.dtype)
        self.landmarks[:, :kept], self.is_outlier[:, :kept] = old[0][:, :kept], old[1][:, :kept]
        self.coefficients[: kept * cs] = old[2][: kept * cs]
        self.store_values[:kept] = old[3][:kept]
        self.store_values[kept:].zero_()
        self.pool_keys.copy_(old[4])
        self.pool_values.copy_(old[5])
        self.outlier_ids.copy_(old[6])
        self.slot_chunk.copy_(old[7])

    # --- decode ----------------------------------------------------------------------------------------------------
    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        self._join_prompt_work(key.device)
        if not self.sparse:
            if self.seq_len + 1 <= self.budget:
                self.seq.counters.record_on_device((self.decode_position(key.device) + 1).float())
                return super().decode(query, key, value, scaling)
            values_copy = self._enter_sparse(self.seq_len)  # an unannounced sequence outgrew the budget (never
            if values_copy is not None:  # captured)
                self.seq.prompt_copies.copy(*values_copy)
        self.seq.prompt_copies.join()
        if self.seq_len + 1 > self.n_chunks * self.chunk_size:
            self._grow(self.seq_len + 1)
        position = self.decode_position(key.device)
        layout, plan = self.layout, self._step_plan
        turn_window(layout, position, self.pool_keys, self.pool_values, self.landmarks, self._store_on_device,
                    self.coefficients, self.basis, self.rotary, self._inv_freq)
        q = query[0, :, 0]
        with self.seq.timer.phase("select"):
            select_and_plan(layout, position, q, self.landmarks, self.is_outlier, self.outlier_ids, self.slot_chunk,
                            scaling, plan)
        side = self._load_values()
        with self.seq.timer.phase("rebuild"):
            finish_step(layout, position, key[0, :, 0], value[0, :, 0], self.pool_keys, self.pool_values,
                        self.coefficients, self.basis, self.rotary, self._inv_freq, plan,
                        self.seq.counters.device_totals(key.device), self.pool_values[0, 0].nbytes)
        if side is not None:
            torch.cuda.current_stream(key.device).wait_stream(side)
        out = paged_decode_attention(q, self.pool_keys, self.pool_values, self._slot_table, plan.counts, scaling,
                                     self._attention_plan)
        if self.seq.trace_selection:
            self.last_attended = self._attended_positions(plan.counts, window_base(layout, position))
        return out.view(1, 1, *q.shape)

    def _copy_arguments(self) -> dict[str, torch.Tensor]:
        """``copy_blocks``' arguments by name (``COPY_ROW_COLUMNS``): it moves two arrays of blocks of one layout; a
        chunk's values are one, so it is passed as its two halves."""
        half = self.chunk_size // 2
        plan, source, target = self._step_plan, self._store_on_device, self.pool_values
        return {"source_keys": source[:, :, :half], "source_values": source[:, :, half:],
                "target_keys": target[:, :, :half], "target_values": target[:, :, half:],
                "pages": plan.copy_pages, "slots": plan.copy_slots, "heads": plan.copy_heads}

    def _load_values(self, rows: RowTable | None = None):
        """The missing chunks' values from the host store into their slots: one block-copy kernel, on a side stream
        on CUDA so that it overlaps the key rebuild (the caller joins it); with ``rows``, every row's of a batch."""
        arguments = self._copy_arguments()
        copy = partial(copy_blocks, **arguments) if rows is None else partial(copy_blocks_triton, **arguments,
                                                                              rows=rows)
        if not self.pool_values.is_cuda:
            copy()
            return None
        shared = self.seq.state(ShadowKVSequence)
        if shared.copy_stream is None:
            shared.copy_stream = torch.cuda.Stream(self.pool_values.device)
        side = shared.copy_stream
        side.wait_stream(torch.cuda.current_stream(self.pool_values.device))
        with torch.cuda.stream(side), self.seq.timer.phase("load"):
            copy()  # the copy list is the plan's, kept across steps: no temporary to outlive
        return side

    # --- a batch's step ---------------------------------------------------------------------------------------------
    @classmethod
    def decode_rows(cls, layers, query, key, value, scaling):
        """Every row's step at once: each kernel of ``decode`` launched once for the batch, a program finding its
        row's buffers through a row table (``kernels.row_table``), so that a batch of B rows costs the launches of
        one. On CUDA with Triton, when every row's layer is sparse and laid out as row 0's (rows of one length);
        otherwise (a row still dense or about to grow, ragged rows, a traced selection, ``batch_kernels=false``)
        the rows decode one by one.
        Each row computes what its own ``decode`` computes, bit for bit: the same kernels on the same buffers."""
        device = key.device
        if not (layers[0].cfg.batch_kernels and runs_triton(key)) or any(layer.seq.trace_selection
                                                                        for layer in layers):
            return None
        for layer in layers:
            layer._join_prompt_work(device)
            layer.seq.prompt_copies.join()
        if not all(layer.sparse and layer.seq_len + 1 <= layer.n_chunks * layer.chunk_size for layer in layers):
            return None
        if len({(layer.n_chunks, layer.layout, tuple(layer.basis.shape)) for layer in layers}) != 1:
            return None
        n_rows, n_heads, _, head_dim = query.shape
        q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]
        out = torch.empty(n_rows, n_heads, head_dim, dtype=query.dtype, device=device)
        positions = [layer.decode_position(device) for layer in layers]
        step_rows, copy_rows, attention_rows = cls._row_tables(layers, q, k, v, out, positions)
        first, position = layers[0], positions[0]
        layout, plan = first.layout, first._step_plan
        turn_window_triton(layout, position, first.pool_keys, first.pool_values, first.landmarks,
                           first._store_on_device, first.coefficients, first.basis, first.rotary, first._inv_freq,
                           rows=step_rows.turn)
        select_and_plan_triton(layout, position, q[0], first.landmarks, first.is_outlier, first.outlier_ids,
                               first.slot_chunk, scaling, plan, rows=step_rows)
        side = first._load_values(rows=copy_rows)
        finish_step_triton(layout, position, k[0], v[0], first.pool_keys, first.pool_values, first.coefficients,
                           first.basis, first.rotary, first._inv_freq, plan, first.seq.counters.device_totals(device),
                           first.pool_values[0, 0].nbytes, rows=step_rows.finish)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
        paged_decode_attention_triton(q[0], first.pool_keys, first.pool_values, first._slot_table, plan.counts,
                                      scaling, first._attention_plan, out=out[0], rows=attention_rows)
        return out.view(n_rows, 1, n_heads, head_dim)

    @staticmethod
    def _row_tables(layers, q, k, v, out, positions) -> tuple[ShadowKVRowTables, RowTable, RowTable]:
        """The step's row tables, made once for these rows' buffers and kept on row 0's layer: the step's own
        tensors (``q``, ``k``, ``v``, ``out``, one batch tensor each, and the positions) keep their rows' distances
        from step to step, which the key holds."""
        tokens = tuple(layer._buffers_token for layer in layers)
        step_key = step_layout((q, k, v, out), positions)
        kept = layers[0]._batch_tables
        if kept is not None and kept.hold_for(tokens, step_key):
            return kept.tables
        step, copies, attention = [], [], []
        for b, layer in enumerate(layers):
            plan = layer._step_plan
            step.append({
                "pool_keys": layer.pool_keys, "pool_values": layer.pool_values, "landmarks": layer.landmarks,
                "store_values": layer._store_on_device, "coefficients": layer.coefficients, "basis": layer.basis,
                "position": positions[b], "query": q[b], "is_outlier": layer.is_outlier, "scores": plan.scores,
                "block_max": plan.block_max, "block_sum": plan.block_sum, "probabilities": plan.probabilities,
                "block_keys": plan.block_keys, "top": plan.top, "outlier_ids": layer.outlier_ids,
                "slot_chunk": layer.slot_chunk, "copy_pages": plan.copy_pages, "copy_slots": plan.copy_slots,
                "counts": plan.counts, "loaded": plan.loaded, "key": k[b], "value": v[b],
                "totals": layer.seq.counters.device_totals(k.device)})
            copies.append(layer._copy_arguments())
            attention.append({"query": q[b], "key_pages": layer.pool_keys, "value_pages": layer.pool_values,
                              "page_table": layer._slot_table, "valid_counts": plan.counts, "out": out[b]})
        tables = (ShadowKVRowTables.of(step), row_table(copies), row_table(attention))
        layers[0]._batch_tables = KeptRowTables(tokens, step_key, tables)
        return tables

    def _attended_positions(self, counts: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """bool ``[Hq, trace_width()]``: the valid tokens of the attended chunks (outliers, selected, window), in
        the order of ``counts``' slots."""
        cs = self.chunk_size
        ring_chunk = ring_chunks(self.layout, base)
        chunks = torch.cat([self.outlier_ids, self.slot_chunk[:, : self.n_selected],
                            ring_chunk.expand(self.outlier_ids.shape[0], -1)], dim=1)  # [Hkv, slots]
        offsets = torch.arange(cs, device=chunks.device)
        positions = chunks[..., None] * cs + offsets
        valid = (offsets < counts[..., None]) & (chunks[..., None] >= 0)
        return attended_from_positions(positions, valid, self.trace_width(), self.model.n_heads // chunks.shape[0])

    def _join_prompt_work(self, device: torch.device | None = None) -> None:
        """Wait for the prompt's factorisation queued at the prefill, if any (on CUDA): the worker's end on the host,
        then its stream's on ``device``'s current stream, or on the host when no device is named. A failure on the
        worker is raised here."""
        if self._entering is None:
            return
        entering, self._entering = self._entering, None
        done = entering.result()
        if device is None:
            done.synchronize()
        else:
            torch.cuda.current_stream(device).wait_event(done)

    def gpu_kv_bytes(self) -> int:
        self._join_prompt_work()
        if not self.sparse:
            return super().gpu_kv_bytes()
        if self.pool_keys.device.type != "cuda":
            return 0
        return (self.pool_keys.nbytes + self.pool_values.nbytes + self.landmarks.nbytes + self.coefficients.nbytes
                + self.basis.nbytes)

    def cpu_kv_bytes(self) -> int:
        self._join_prompt_work()
        return self.store_values.nbytes if self.sparse else 0


@METHODS.register("shadowkv")
class ShadowKV(Method):
    display_name = "ShadowKV"
    display_order = 110
    config_class = ShadowKVConfig
    traces_in_graph = True
    speed_goals = (
        SpeedGoal(131072, "tpot", 0.85, "0.81x its full cache at 128k, batch 1 (ParisKV's head-to-head with its "
                                         "efficient class)"),
        SpeedGoal(32768, "tpot", 1.1, "its efficient class: selection and gathers on the GPU, values zero-copy"),
        SpeedGoal(131072, "throughput", 3.0, "3.04x its full cache's throughput in its paper (an A100, long contexts, "
                                             "large batches)"),
        *prompt_offload_goals("the prompt's KV copied to the host beside the next layers' prefill"),
    )
    # At the shared tests' budget of 64 with chunks of 8: 2 window, 1 outlier and 5 selected chunks.
    test_settings = {"n_local_chunks": 2}

    def check(self) -> None:
        super().check()
        c = self.config
        cs = c.chunk_size
        if cs < 2 or cs % 2:
            raise ConfigError(f"shadowkv: chunk_size={cs} must be even and >= 2")
        if self.model.device.type == "cuda" and (cs & (cs - 1) or cs > 64):
            raise ConfigError(f"shadowkv: chunk_size={cs} must be a power of two <= 64 for the CUDA paged attention")
        if c.basis_solver not in BASIS_SOLVERS:
            raise ConfigError(f"shadowkv: basis_solver={c.basis_solver!r} must be one of {sorted(BASIS_SOLVERS)}")
        if c.score_products not in SCORE_PRODUCTS:
            raise ConfigError(f"shadowkv: score_products={c.score_products!r} must be one of {list(SCORE_PRODUCTS)}")
        if c.rank < 1 or c.n_local_chunks < 1 or (c.n_outlier_chunks is not None and c.n_outlier_chunks < 0):
            raise ConfigError(f"shadowkv: rank={c.rank} and n_local_chunks={c.n_local_chunks} must be >= 1, "
                              f"n_outlier_chunks={c.n_outlier_chunks} >= 0 or null")
        rotary = self.model.rotary
        if rotary is not None and not rotary.supported:
            raise ConfigError(f"shadowkv: the model's RoPE ({rotary.rope_type}) is not one fixed rotation, so its "
                              f"pre-RoPE keys cannot be recovered: use a model with default or fixed-scaled RoPE")

    def forced_positions(self, n_tokens):
        c = self.config  # the window: the current chunk and the n_local_chunks - 1 before it
        first = max(0, ((n_tokens - 1) // c.chunk_size - c.n_local_chunks + 1) * c.chunk_size)
        return list(range(first, n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return ShadowKVKV(layer_idx, self.model, seq, self.config)
