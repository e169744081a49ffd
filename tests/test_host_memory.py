"""The host buffers offloading methods keep across sequences (core.host_memory): the pool's reuse, fit and trim
rules, the leases a sequence gives back, and every offloading method generating the same tokens on reused (stale)
buffers as on fresh ones. On a CUDA host, the prompt's copies on the side stream against the same run on the CPU are
in tests/test_gpu_methods.py (every method's GPU path against its CPU path)."""

from __future__ import annotations

import gc

import pytest
import torch

from eval.plugins import build_method, method_class
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.host_memory import REUSE_SLACK, HostPool, PromptCopies
from tests.conftest import tiny_model

CPU = torch.device("cpu")


def test_a_buffer_given_back_serves_the_next_request_of_its_size():
    pool = HostPool()
    first = pool.take((4, 100, 8), torch.bfloat16, CPU)
    address = first.data_ptr()
    pool.give_back(first)
    again = pool.take((4, 100, 8), torch.bfloat16, CPU)
    assert again.data_ptr() == address and pool.allocations == 1
    assert again.shape == (4, 100, 8) and again.dtype == torch.bfloat16
    # A leased buffer is never handed out twice.
    other = pool.take((4, 100, 8), torch.bfloat16, CPU)
    assert other.data_ptr() != address and pool.allocations == 2 and pool.leased_bytes == 2 * 6400


def test_a_request_takes_the_smallest_free_buffer_that_fits_within_the_slack():
    pool = HostPool()
    big, small = pool.take((1000,), torch.uint8, CPU), pool.take((500,), torch.uint8, CPU)
    big_address, small_address = big.data_ptr(), small.data_ptr()
    pool.give_back(big)
    pool.give_back(small)
    assert pool.take((450,), torch.uint8, CPU).data_ptr() == small_address  # the smaller of the two that fit
    assert pool.take((900,), torch.uint8, CPU).data_ptr() == big_address
    # A free buffer far larger than the request is not spent on it.
    pool = HostPool()
    pool.give_back(pool.take((1000,), torch.uint8, CPU))
    pool.take((int(1000 / REUSE_SLACK) - 1,), torch.uint8, CPU)
    assert pool.allocations == 2


@pytest.mark.parametrize("sizes", [(1000, 800, 600), (600, 800, 1000)])
def test_free_buffers_beyond_the_cap_are_released_largest_first(sizes):
    pool = HostPool(max_cached_bytes=1500)
    buffers = [pool.take((size,), torch.uint8, CPU) for size in sizes]
    for tensor in buffers:
        pool.give_back(tensor)
    # 2400 bytes free > 1500: the 1000-byte buffer goes, 1400 stay, wherever it was in the pool.
    assert pool.allocated_bytes == 1400 and pool.leased_bytes == 0 and pool.allocated_total_bytes == 2400
    kept = [pool.take((size,), torch.uint8, CPU) for size in (600, 800)]
    assert [tensor.numel() for tensor in kept] == [600, 800] and pool.allocations == 3  # both reused
    for tensor in kept:
        pool.give_back(tensor)
    pool.clear()
    assert pool.allocated_bytes == 0 and pool.take((600,), torch.uint8, CPU) is not None and pool.allocations == 4


def test_give_back_refuses_a_tensor_the_pool_did_not_lease():
    pool = HostPool()
    with pytest.raises(ValueError, match="not a leased buffer"):
        pool.give_back(torch.zeros(4))
    tensor = pool.take((4,), torch.float32, CPU)
    pool.give_back(tensor)
    with pytest.raises(ValueError, match="not a leased buffer"):
        pool.give_back(tensor)  # twice


def test_a_sequence_gives_its_buffers_back_at_close_or_when_dropped():
    pool = HostPool()
    copies = PromptCopies(pool)
    destination = copies.take((3, 5), torch.float32, CPU)
    source = torch.randn(3, 5)
    assert copies.copy(destination, source) is None  # on a CPU the copy is done at once
    assert torch.equal(destination, source) and pool.leased_bytes == 60
    copies.close()
    assert pool.leased_bytes == 0
    dropped = PromptCopies(pool)
    dropped.take((3, 5), torch.float32, CPU)
    del dropped
    gc.collect()
    assert pool.leased_bytes == 0 and pool.allocations == 1
    with pytest.raises(ValueError, match="contiguous destination"):
        PromptCopies(pool).copy(torch.zeros(5, 3).t(), source)


def test_a_zero_length_buffer_is_a_valid_empty_tensor():
    pool = HostPool()
    empty = pool.take((2, 0, 4), torch.bfloat16, CPU)
    assert empty.shape == (2, 0, 4) and empty.numel() == 0
    pool.give_back(empty)


OFFLOADING = ["arkvale", "omnikv", "shadowkv", "pqcache", "magicpig", "icecache", "icecache_reuse"]


@pytest.mark.parametrize("name", OFFLOADING)
def test_reused_buffers_give_the_tokens_of_fresh_ones(name):
    """A method's second sequence runs on the host buffers its first left behind (not cleared): its tokens must be
    those of the same sequence on a fresh method, and it must allocate nothing."""
    model, _, info = tiny_model("llama")
    settings = {"name": name, "budget": 64, "n_dense_layers": 1, **method_class(name).test_settings}

    def prompt(seed: int) -> list[int]:
        return torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(seed)).tolist()

    def generate(method, ids) -> list[int]:
        with HarnessCache(method) as cache:
            return greedy_generate(model, cache, GenerationRequest(ids, 12)).token_ids

    method = build_method(settings, info)
    generate(method, prompt(1))
    allocated, allocations = method.host_pool.allocated_bytes, method.host_pool.allocations
    assert allocated > 0, f"{name} keeps no host buffers from the pool"
    second = generate(method, prompt(2))
    assert method.host_pool.allocations == allocations and method.host_pool.allocated_bytes == allocated
    assert second == generate(build_method(settings, info), prompt(2))


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_icecache_gives_its_staged_prompt_back_for_a_sequence_alive_beside_it(name):
    """IceCache's prompt job copies the staged prompt into its index, token store and window: the staging buffers go
    back to the pool at the first decode step, so that a second sequence decoding while the first is still open
    (a batch) stages its prompt in them, allocating nothing, and still gets its own tokens."""
    model, _, info = tiny_model("llama")
    settings = {"name": name, "budget": 64, "n_dense_layers": 1, **method_class(name).test_settings}
    ids = [torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(seed)).tolist() for seed in (1, 2)]
    method = build_method(settings, info)
    with HarnessCache(method) as first:
        greedy_generate(model, first, GenerationRequest(ids[0], 12))
        assert first.seq.prompt_copies.leased_bytes == 0
        allocations = method.host_pool.allocations
        assert allocations > 0
        with HarnessCache(method) as second:
            tokens = greedy_generate(model, second, GenerationRequest(ids[1], 12)).token_ids
        assert method.host_pool.allocations == allocations
    with HarnessCache(build_method(settings, info)) as fresh:
        assert tokens == greedy_generate(model, fresh, GenerationRequest(ids[1], 12)).token_ids


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_icecache_prefill_short_of_host_memory_restages_in_finished_layers_buffers(name, monkeypatch):
    """Where the host's memory runs short, a layer's offload gives the oldest layer's staged prompt back once its
    job is done and stages in its buffers, so that the prefill does not hold a second copy of the whole prompt
    beside the index stores (which ran a 512k prompt out of a 128 GiB host); with the memory there, every layer
    keeps its own until the first decode step, as before. The tokens are the same either way."""
    import icecache.method.state as state

    model, _, info = tiny_model("llama")  # 4 layers: 3 offloaded past the one dense layer
    settings = {"name": name, "budget": 64, "n_dense_layers": 1, **method_class(name).test_settings}
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def prefill_then_decode(available: int | None) -> tuple[int, list[int]]:
        monkeypatch.setattr(state, "host_available_bytes", lambda: available)
        method = build_method(settings, info)
        with HarnessCache(method) as cache:
            greedy_generate(model, cache, GenerationRequest(ids, 1))  # the prefill alone
            staged = method.host_pool.allocations
            assert cache.seq.prompt_copies.leased_bytes == method.host_pool.allocated_bytes
        with HarnessCache(method) as cache:
            return staged, greedy_generate(model, cache, GenerationRequest(ids, 12)).token_ids

    plenty, expected = prefill_then_decode(2**50)
    assert plenty == 6  # keys and values, a pair for each of the 3 layers
    assert prefill_then_decode(None) == (6, expected)  # unknown: as before
    assert prefill_then_decode(0) == (2, expected)  # one pair, restaged in by every layer


def test_a_sequence_gives_a_buffer_back_early_only_if_it_leases_it():
    pool = HostPool()
    copies = PromptCopies(pool)
    staged = copies.take((2, 8), torch.float32, CPU)
    copies.give_back(staged)
    assert copies.leased_bytes == 0 and pool.take((2, 8), torch.float32, CPU).data_ptr() == staged.data_ptr()
    with pytest.raises(ValueError, match="not a buffer this sequence leases"):
        copies.give_back(staged)


@pytest.mark.parametrize("shape", [(3, 1000, 64), (1, 0, 8)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_buffers_are_exact_mapped_and_filled_beside_the_model_stream(shape):
    """A pinned pool buffer is exactly the requested size, pinned and readable in place by a kernel; the prompt's copy
    runs on the side stream, survives its source being freed and reused by the model's stream at once, and is what a
    kernel on the model's stream reads after ``join``."""
    from icecache.core.paged import mapped_device_view

    device = torch.device("cuda")
    pool = HostPool()
    copies = PromptCopies(pool)
    destination = copies.take(shape, torch.bfloat16, device)
    assert pool.allocated_bytes == max(1, destination.numel() * 2)
    assert destination.is_pinned() or not destination.numel()
    source = torch.randn(shape, device=device).to(torch.bfloat16)
    expected = source.cpu()
    torch.cuda._sleep(50_000_000)  # the model's stream is busy: the side stream must wait for the source
    done = copies.copy(destination, source.transpose(0, 1).contiguous().transpose(0, 1))
    del source
    clobber = torch.full(shape, 7.0, device=device, dtype=torch.bfloat16)  # may take the source's memory
    copies.join()
    on_device = mapped_device_view(destination, device) if destination.numel() else destination.to(device)
    read = (on_device.float() * 1).cpu()
    done.synchronize()
    assert torch.equal(destination, expected) and torch.equal(read.to(torch.bfloat16), expected)
    assert bool((clobber == 7.0).all())
    copies.close()
    again = PromptCopies(pool).take(shape, torch.bfloat16, device)
    assert again.data_ptr() == destination.data_ptr() and pool.allocations == 1


class _RecordingStream:
    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_a_timed_phase_waits_for_its_own_stream_and_not_for_the_device(monkeypatch):
    """A phase on a CUDA device synchronises the current stream when it starts and when it ends, and never the
    whole device: a layer's prompt copy on the side stream goes on under the next layers' phases (what the GPU
    test below checks on a device)."""
    from icecache.core.timing import PhaseTimer

    stream = _RecordingStream()

    def device_wide(*args, **kwargs):
        raise AssertionError("a phase waited for every stream of the device")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    timer = PhaseTimer(torch.device("cuda"), enabled=True)
    with timer.phase("offload"):
        assert stream.synchronized == 1
    assert stream.synchronized == 2
    assert set(timer.take_step()) == {"offload"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_timed_phase_does_not_wait_for_a_prompt_copy_on_the_side_stream():
    """A phase timed on another stream ends while a prompt copy still waits on the side stream (held there by a
    long kernel it must follow), and ``join`` then makes the model's stream wait for the copy: timing a phase
    serialises nothing beside it."""
    from icecache.core.timing import PhaseTimer

    device = torch.device("cuda")
    copies = PromptCopies(HostPool())
    destination = copies.take((4, 1024), torch.float32, device)
    source = torch.randn(4, 1024, device=device)
    expected = source.cpu()
    torch.cuda._sleep(2_000_000_000)  # the model's stream is busy for about a second, and the copy follows it
    done = copies.copy(destination, source)
    timer = PhaseTimer(device, enabled=True)
    other = torch.cuda.Stream(device)
    with torch.cuda.stream(other), timer.phase("offload"):
        torch.ones(8, device=device).sum()
    assert not done.query()
    copies.join()
    torch.cuda.current_stream(device).synchronize()
    assert done.query() and torch.equal(destination, expected)
    assert timer.take_step()["offload"] > 0
    copies.close()
