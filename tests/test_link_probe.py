"""The link probe (icecache/core/link_probe.py): its copy plans on the CPU through the block copy's reference, and the
probe itself on CUDA (`pytest -m gpu tests/test_link_probe.py`, in make test-gpu), with the device timing that the
probe and the kernel sweeps share (icecache/core/device_timing.py)."""

from __future__ import annotations

import json

import pytest
import torch

from eval.throughput import ThroughputSettings, measure_link
from icecache.core import link_probe
from icecache.core.kernels.block_copy import copy_blocks_reference


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_a_plan_draws_distinct_blocks_inside_the_store(order):
    pages = link_probe.block_plan(1000, 300, order, torch.Generator().manual_seed(1))
    assert pages.numel() == 300 and pages.unique().numel() == 300
    assert 0 <= int(pages.min()) and int(pages.max()) < 1000
    if order == "sequential":
        assert torch.equal(pages, torch.arange(int(pages[0]), int(pages[0]) + 300))
    else:
        assert not torch.equal(pages.sort().values, pages)


def test_a_plan_refuses_more_entries_than_blocks_and_an_unknown_order():
    with pytest.raises(ValueError, match="at least 11 blocks"):
        link_probe.block_plan(10, 11, "random", torch.Generator())
    with pytest.raises(ValueError, match="'random' or 'sequential'"):
        link_probe.block_plan(10, 2, "strided", torch.Generator())


def test_the_copy_arguments_move_each_half_s_planned_blocks_into_the_two_targets():
    elements = 8
    store = torch.arange(40 * elements, dtype=torch.float32).view(40, 1, 1, elements)
    target = torch.zeros(2, 5, 1, 1, elements)
    pages = link_probe.block_plan(20, 5, "random", torch.Generator().manual_seed(3))
    arguments = link_probe.copy_arguments(store, target, pages)
    copy_blocks_reference(**arguments)
    assert torch.equal(target[0], store[pages])
    assert torch.equal(target[1], store[20 + pages])
    with pytest.raises(ValueError, match="past the store's first half"):
        link_probe.copy_arguments(store, target, torch.tensor([20]))


def test_the_table_names_every_block_size_and_both_orders():
    result = {"device": "GPU", "store_gib": 2.0, "entries": 4096, "repeats": 20, "dma_gbps": 52.0,
              "zero_copy_gbps": {"1024": {"random": 20.5, "sequential": 30.25},
                                 "8192": {"random": 40.0, "sequential": 45.0}}}
    table = link_probe.format_table(result)
    assert "52.0 GB/s" in table
    assert "blocks of 1024 B" in table and "20.5 GB/s random" in table and "30.2 GB/s sequential" in table
    assert "blocks of 8192 B" in table and "40.0 GB/s random" in table


def test_the_throughput_benchmark_records_no_link_off_cuda_or_when_told_not_to():
    assert measure_link(ThroughputSettings(device="cpu")) is None
    assert measure_link(ThroughputSettings(link_probe=False)) is None


def test_bad_probe_arguments_stop_with_one_line_before_any_work():
    done = link_probe.run_probe_process(["--store-gib", "0.001"])
    assert done.returncode == 2
    assert "too small" in done.stderr.strip().splitlines()[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_probe_measures_every_block_size_and_order_in_a_process_of_its_own():
    done = link_probe.run_probe_process(["--json", "--store-gib", "0.0625", "--block-bytes", "1024", "4096",
                                         "--entries", "512", "--repeats", "3"])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["dma_gbps"] > 0
    assert set(result["zero_copy_gbps"]) == {"1024", "4096"}
    for by_order in result["zero_copy_gbps"].values():
        assert set(by_order) == {name for name, _, _ in link_probe.VARIANTS} and min(by_order.values()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_timing_replays_every_captured_call_and_gives_one_call_s_time():
    from icecache.core.device_timing import graph_call_us

    counter = torch.zeros(1, device="cuda")
    us = graph_call_us(lambda: counter.add_(1), calls_per_graph=5, replays=3)
    # One call before capture, then 2 warm-up and 3 timed replays of 5 calls each (capture itself runs nothing).
    assert int(counter.item()) == 1 + 5 * (2 + 3)
    assert us > 0


def test_a_link_probe_that_fails_is_recorded_in_one_line_and_the_run_goes_on(monkeypatch):
    """Where the probe's process fails (here: the machine has no CUDA device, though torch was told it has), the
    throughput file records the probe's last error line instead of stopping."""
    if torch.cuda.is_available():
        pytest.skip("checks the failure path where the probe's process finds no CUDA device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    recorded = measure_link(ThroughputSettings(device="cuda"))
    assert recorded == {"error": "error: the link probe needs a CUDA device"}
