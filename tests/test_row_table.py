"""One launch for a batch's rows (``core.kernels.row_table``): the tables, the kernels that read them, and ShadowKV's
batched step (``ShadowKVKV.decode_rows``) and the core's hook for it (``LayerKV.decode_rows``).

A kernel given a row table must compute, for each row, exactly what it computes when called on that row alone: the
same programs on the same data, only found through the table. So every batched result here is compared bit for bit
with the rows' own calls of the same kernel. The tests marked ``gpu`` run the Triton kernels: on CUDA, or on CPU
under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import baselines.arkvale as arkvale_module
import baselines.shadowkv as shadowkv_module
from eval.plugins import build_method
from icecache.core.batched_generation import batched_greedy_generate
from icecache.core.generation import GenerationRequest
from icecache.core.kernels import arkvale_step, shadowkv_step
from icecache.core.kernels.block_copy import COPY_ROW_COLUMNS, copy_blocks_triton
from icecache.core.kernels.gqa_scores import gqa_scores_triton
from icecache.core.kernels.paged_decode_attention import (
    ATTENTION_ROW_COLUMNS,
    PagedAttentionPlan,
    paged_decode_attention_triton,
)
from icecache.core.kernels.row_table import ROW_ALIGNMENT, KeptRowTables, row_offsets, row_table, step_layout
from icecache.core.layer import DenseKV, LayerKV
from icecache.core.method import ModelInfo, SequenceContext
from tests.conftest import kernel_device, tiny_model
from tests.test_paged_attention import random_pages_and_selection
from tests.test_shadowkv_kernels import GROUP, HEAD_DIM, N_KV_HEADS, ROTARY

# --- the table -----------------------------------------------------------------------------------------------------


def test_a_row_table_holds_each_rows_distance_from_row_zero_in_elements():
    separate = [torch.zeros(3, 16) for _ in range(3)]
    batch = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    rows = [{"own": separate[b], "sliced": batch[b]} for b in range(3)]
    table = row_offsets(rows)
    for b in range(3):
        assert table[b][0] * 4 == separate[b].data_ptr() - separate[0].data_ptr()
        assert table[b][1] == b * 4 * 32  # one batch tensor: whole rows apart
    made = row_table(rows)
    assert made.columns == ("own", "sliced") and made.n_rows == 3
    assert made.offsets.dtype == torch.int64 and made.offsets.tolist() == table


def test_a_row_table_refuses_rows_laid_out_differently_or_unaligned_naming_the_column():
    with pytest.raises(ValueError, match="column 'pages'.*row 1"):
        row_offsets([{"pages": torch.zeros(4, 16)}, {"pages": torch.zeros(5, 16)}])
    with pytest.raises(ValueError, match="row 1 names the columns"):
        row_offsets([{"a": torch.zeros(16)}, {"b": torch.zeros(16)}])
    positions = torch.zeros(3, 1, dtype=torch.long)  # rows one element (8 bytes) apart
    rows = [{"position": positions[b]} for b in range(3)]
    with pytest.raises(ValueError, match=f"multiple of {ROW_ALIGNMENT} bytes"):
        row_offsets(rows)
    assert row_offsets(rows, unaligned=("position",)) == [[0], [1], [2]]


def test_kept_tables_hold_only_for_the_same_buffers_and_the_same_step_layout():
    """A batch layer's tables are reused at the next step only while every row keeps the buffers they were made for
    (the same token objects, not equal ones) and the step's tensors keep their rows' distances."""
    tokens = (object(), object())
    query, positions = torch.zeros(2, 4, 16), torch.zeros(2, 1, dtype=torch.long)
    key = step_layout((query,), [positions[0], positions[1]])
    kept = KeptRowTables(tokens, key, tables="tables")
    assert kept.hold_for(tokens, step_layout((torch.ones(2, 4, 16),), list(torch.ones(2, 1, dtype=torch.long))))
    assert not kept.hold_for((tokens[0], object()), key)  # a row reallocated its buffers
    assert not kept.hold_for(tokens[:1], key)  # another batch
    assert not kept.hold_for(tokens, step_layout((torch.zeros(2, 4, 32),), [positions[0], positions[1]]))
    apart = torch.zeros(4, 1, dtype=torch.long)
    assert not kept.hold_for(tokens, step_layout((query,), [apart[0], apart[2]]))  # positions two rows apart


def test_a_kernel_refuses_a_table_made_for_another_kernel():
    table = row_table([{name: torch.zeros(16) for name in ATTENTION_ROW_COLUMNS}])
    with pytest.raises(ValueError, match="copy_blocks: a row table of columns"):
        table.check(COPY_ROW_COLUMNS, "copy_blocks")


# --- kernels with a table: each row as alone -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{"entries_per_program": 1}, {"entries_per_program": 4},
                                    {"programs": 3, "chunk_elements": 32}],
                         ids=["one_a_program", "four_a_program", "three_programs_in_turn"])
def test_a_batched_block_copy_copies_each_rows_blocks_as_alone(launch):
    device = kernel_device()
    gen = torch.Generator().manual_seed(3)
    n_rows, n_pages, n_slots, n_kv_heads, page_size, head_dim, n = 3, 12, 6, 2, 8, 16, 7

    def row():
        source = torch.randn(n_pages, n_kv_heads, page_size, head_dim, generator=gen).to(device)
        target = torch.randn(n_slots, n_kv_heads, page_size, head_dim, generator=gen).to(device)
        # Distinct (slot, head) targets, as the methods' copy lists have: two entries writing one block would race.
        targets = torch.randperm(n_slots * n_kv_heads, generator=gen)[:n]
        slots = torch.where(torch.rand(n, generator=gen) < 0.3, -1, targets // n_kv_heads)
        return {"source_keys": source, "source_values": source * 2, "target_keys": target,
                "target_values": target.clone(), "pages": torch.randint(0, n_pages, (n,), generator=gen).to(device),
                "slots": slots.to(device), "heads": (targets % n_kv_heads).to(device)}

    rows = [row() for _ in range(n_rows)]
    order = ("source_keys", "source_values", "pages", "target_keys", "target_values", "slots", "heads")
    alone = [{name: tensor.clone() for name, tensor in r.items()} for r in rows]
    for r in alone:
        copy_blocks_triton(*(r[name] for name in order))
    # 7 entries: with 4 a program, the second program's last entry lies past the list; with 3 programs in turn, the
    # third program's last turn does, and each block (8 x 16 elements) moves in four chunks
    copy_blocks_triton(*(rows[0][name] for name in order), rows=row_table(rows), **launch)
    for batched, single in zip(rows, alone):
        for name in ("target_keys", "target_values"):
            assert torch.equal(batched[name], single[name]), name
    assert all((r["slots"] >= 0).any() and (r["slots"] < 0).any() for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("n_splits", [1, 3])
def test_a_batched_paged_attention_attends_each_row_as_alone(n_splits):
    """With three splits the partial results of the rows share one scratch and must not overlap."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(11 + n_splits)
    names = ("query", "key_pages", "value_pages", "page_table", "valid_counts")
    rows = []
    for _ in range(3):
        row = dict(zip(names, random_pages_and_selection(gen, 2, 4, 64, 16, 41, 64, torch.float32, device)))
        row["page_table"] = row["page_table"].contiguous()
        row["valid_counts"] = row["valid_counts"].contiguous()
        rows.append(row)
    alone = [paged_decode_attention_triton(*(r[name] for name in names), 0.125, PagedAttentionPlan(n_splits=n_splits))
             for r in rows]
    out = torch.empty(3, *rows[0]["query"].shape, dtype=rows[0]["query"].dtype, device=device)
    table = row_table([{**r, "out": out[b]} for b, r in enumerate(rows)])
    paged_decode_attention_triton(*(rows[0][name] for name in names), 0.125, PagedAttentionPlan(n_splits=n_splits),
                                  out=out[0], rows=table)
    for b in range(3):
        assert torch.equal(out[b], alone[b]), b


# --- ShadowKV's and ArkVale's batched steps ---------------------------------------------------------------------------


def small_layer(config: dict, device, dtype=torch.float32):
    """A layer of a one-layer geometry for ``config``, its sequence announced at 340 tokens."""
    info = ModelInfo(n_layers=1, n_heads=N_KV_HEADS * GROUP, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM,
                     rotary=ROTARY, device=device, dtype=dtype)
    seq = SequenceContext()
    seq.max_total_tokens = 340
    return build_method({**config, "n_dense_layers": 0}, info).make_layer(0, seq)


SHADOWKV = {"name": "shadowkv", "budget": 64, "rank": 8, "n_local_chunks": 2}
ARKVALE = {"name": "arkvale", "budget": 64, "page_size": 8}


def random_qkv(gen, device, n_rows, n_tokens):
    return tuple(torch.randn(n_rows, heads, n_tokens, HEAD_DIM, generator=gen).to(device)
                 for heads in (N_KV_HEADS * GROUP, N_KV_HEADS, N_KV_HEADS))


def step_together_and_alone(config: dict, n_steps: int, seed: int, n_rows: int = 3):
    """``n_rows`` layers of ``config`` prefilled with 300 random tokens each, then stepped ``n_steps`` times together
    (``decode_rows``) beside copies stepped alone (``forward``); every step's outputs must be equal, bit for bit.
    Returns the two lists of layers."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed)
    prompts, steps = random_qkv(gen, device, n_rows, 300), [random_qkv(gen, device, n_rows, 1) for _ in range(n_steps)]
    together, alone = ([small_layer(config, device) for _ in range(n_rows)] for _ in range(2))
    for b in range(n_rows):
        for layer in (together[b], alone[b]):
            layer.forward(*(x[b : b + 1] for x in prompts), None, 0.25)
    for query, key, value in steps:
        out = type(together[0]).decode_rows(tuple(together), query, key, value, 0.25)
        assert out is not None and out.shape == (n_rows, 1, N_KV_HEADS * GROUP, HEAD_DIM)
        for layer in together:
            layer.seq_len += 1
        for b, layer in enumerate(alone):
            single = layer.forward(query[b : b + 1], key[b : b + 1], value[b : b + 1], None, 0.25)
            assert torch.equal(out[b : b + 1], single), b
    return together, alone


@pytest.mark.gpu
def test_shadowkv_rows_stepped_together_match_each_row_stepped_alone(monkeypatch):
    """Three rows of one length, prompts apart, stepped 24 times (turning the window, loading chunks): every output,
    slot table, pool and counter of the batched steps equals the row's own steps, bit for bit, the Triton kernels
    on both sides."""
    for module in (shadowkv_step, shadowkv_module):
        monkeypatch.setattr(module, "runs_triton", lambda tensor: True)
    monkeypatch.setattr(shadowkv_module, "copy_blocks", copy_blocks_triton)
    monkeypatch.setattr(shadowkv_module, "paged_decode_attention", paged_decode_attention_triton)
    together, alone = step_together_and_alone(SHADOWKV, n_steps=24, seed=7)
    device = together[0].pool_keys.device
    for mine, theirs in zip(together, alone):
        for name in ("pool_keys", "pool_values", "landmarks", "coefficients", "slot_chunk", "store_values"):
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        assert torch.equal(mine.seq.counters.device_totals(device), theirs.seq.counters.device_totals(device))
    assert float(together[0].seq.counters.device_totals(device)[2]) > 0  # chunks were loaded


@pytest.mark.gpu
def test_arkvale_rows_stepped_together_match_each_row_stepped_alone(monkeypatch):
    """Three rows of one length stepped 30 times (pages finishing, the ring turning, pages recalled): every output,
    pool, digest, host backup, counter and slot (the scratch row aside: it takes whatever the top-k's padding names)
    of the batched steps equals the row's own steps, the Triton kernels on both sides."""
    monkeypatch.setattr(arkvale_step, "runs_triton", lambda tensor: True)
    monkeypatch.setattr(arkvale_module, "copy_blocks", copy_blocks_triton)
    monkeypatch.setattr(arkvale_module, "paged_decode_attention", paged_decode_attention_triton)
    monkeypatch.setattr(arkvale_module, "page_bounds", lambda q, hi, lo, n: gqa_scores_triton(q, hi, 1.0, n,
                                                                                             second_keys=lo))
    n_steps = 30
    together, alone = step_together_and_alone(ARKVALE, n_steps=n_steps, seed=9)
    device = together[0].pool_keys.device
    n_finished = (300 + n_steps) // 8  # the host store holds what its pool left there past the finished pages
    for mine, theirs in zip(together, alone):
        for name in ("pool_keys", "pool_values", "digest_hi", "digest_lo"):
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
        for name in ("store_keys", "store_values"):
            assert torch.equal(getattr(mine, name)[:n_finished], getattr(theirs, name)[:n_finished]), name
        assert torch.equal(mine.slot_page[:-1], theirs.slot_page[:-1])
        assert torch.equal(mine.seq.counters.device_totals(device), theirs.seq.counters.device_totals(device))
    assert float(together[0].seq.counters.device_totals(device)[2]) > 0  # pages were recalled


@pytest.mark.gpu
def test_shadowkv_rows_of_different_lengths_step_one_by_one(monkeypatch):
    device = kernel_device()
    monkeypatch.setattr(shadowkv_module, "runs_triton", lambda tensor: True)
    gen = torch.Generator().manual_seed(8)
    layers = (small_layer(SHADOWKV, device), small_layer(SHADOWKV, device))
    layers[1].seq.max_total_tokens = 700  # another capacity: another layout
    for layer in layers:
        layer.forward(*random_qkv(gen, device, 1, 300), None, 0.25)
    step = random_qkv(gen, device, 2, 1)
    assert shadowkv_module.ShadowKVKV.decode_rows(layers, *step, 0.25) is None
    alike = (layers[0], small_layer(SHADOWKV, device))
    alike[1].forward(*random_qkv(gen, device, 1, 300), None, 0.25)
    for layer in alike:  # one layout, but the setting asks for each row's own launches
        layer.cfg = dataclasses.replace(layer.cfg, batch_kernels=False)
    assert shadowkv_module.ShadowKVKV.decode_rows(alike, *step, 0.25) is None


def test_shadowkv_and_arkvale_rows_step_one_by_one_where_the_kernels_cannot_run():
    step = random_qkv(torch.Generator().manual_seed(1), torch.device("cpu"), 1, 1)
    for config in (SHADOWKV, ARKVALE):
        layer = small_layer(config, torch.device("cpu"))
        layer.forward(*random_qkv(torch.Generator().manual_seed(2), torch.device("cpu"), 1, 300), None, 0.25)
        assert type(layer).decode_rows((layer,), *step, 0.25) is None


# --- the core's hook -------------------------------------------------------------------------------------------------


def test_a_batch_attends_through_its_methods_decode_rows_and_counts_each_rows_token(monkeypatch):
    """A method's ``decode_rows`` (here the full cache's, made to answer with each row's own decode) serves every
    decode step of a batch: the rows' tokens are those of the row-by-row path, and each row counts its tokens."""
    model, info = tiny_model("llama")[::2]
    method = build_method({"name": "full"}, info)
    calls = []

    def rows_at_once(cls, layers, query, key, value, scaling):
        calls.append(len(layers))
        return torch.cat([layer.decode(query[b : b + 1], key[b : b + 1], value[b : b + 1], scaling)
                          for b, layer in enumerate(layers)])

    requests = [GenerationRequest(list(range(5 + b, 45 + b)), 6) for b in range(3)]
    expected, _ = batched_greedy_generate(model, method, requests)
    assert LayerKV.decode_rows(None, None, None, None, 1.0) is None  # the default: row by row
    monkeypatch.setattr(DenseKV, "decode_rows", classmethod(rows_at_once), raising=False)
    rows, _ = batched_greedy_generate(model, method, requests)
    assert [row.generated for row in rows] == [row.generated for row in expected]
    assert calls and set(calls) == {3}
    assert len(calls) == 5 * info.n_layers  # the 5 decode steps after each row's first token, every layer
    assert all(kv.seq_len == 40 + 5 for row in rows for kv in row.cache.layer_kvs)


def test_a_batch_in_row_groups_attends_each_group_through_decode_rows(monkeypatch):
    """Five rows in two groups: the method's ``decode_rows`` serves a group of three and one of two at every decode
    step, and the tokens are the row-by-row path's; a later group it declines attends row by row, and a declined
    first group sends every row the way it goes without groups, with the same tokens."""
    from icecache.core.batch import row_groups

    assert row_groups(5, 2) == [slice(0, 3), slice(3, 5)]
    assert row_groups(4, 3) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert row_groups(2, 8) == [slice(0, 1), slice(1, 2)]
    model, info = tiny_model("llama")[::2]
    method = build_method({"name": "full"}, info)
    calls, declining = [], {"size": None}

    def rows_at_once(cls, layers, query, key, value, scaling):
        calls.append(len(layers))
        if len(layers) == declining["size"]:
            return None
        return torch.cat([layer.decode(query[b : b + 1], key[b : b + 1], value[b : b + 1], scaling)
                          for b, layer in enumerate(layers)])

    requests = [GenerationRequest(list(range(5 + b, 45 + b)), 6) for b in range(5)]
    expected, _ = batched_greedy_generate(model, method, requests)
    monkeypatch.setattr(DenseKV, "decode_rows", classmethod(rows_at_once), raising=False)
    for declined, groups_asked in ((None, [2, 3]), (2, [2, 3]), (3, [3])):
        declining["size"] = declined
        calls.clear()
        rows, _ = batched_greedy_generate(model, method, requests, row_groups=2)
        assert [row.generated for row in rows] == [row.generated for row in expected]
        assert sorted(set(calls)) == groups_asked and len(calls) == len(groups_asked) * 5 * info.n_layers
        assert all(kv.seq_len == 40 + 5 for row in rows for kv in row.cache.layer_kvs)
    with pytest.raises(ValueError, match="row_groups=0"):
        batched_greedy_generate(model, method, requests, row_groups=0)
