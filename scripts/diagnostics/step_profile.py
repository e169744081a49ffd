#!/usr/bin/env python
"""Where a method's decode step spends its GPU time: the kernels of a few eager decode steps after one prompt,
with their count and time per step, from torch.profiler. With ``--prefill``: where its prefill spends its time.

    python scripts/diagnostics/step_profile.py --methods shadowkv pqcache --length 32768 --steps 8
    python scripts/diagnostics/step_profile.py --prefill --methods full pqcache magicpig --length 32768

For each method: one prompt of ``--length`` random tokens on the Llama-3.1-8B architecture (random weights, as the
latency benchmark), two eager decode steps to warm up, then ``--steps`` profiled eager steps. Prints, per method,
the kernels by device time (per step: launches and microseconds) and the step's device and wall time, and the
time the GPU was busy (some kernel running on any stream: side streams' kernels that overlap count once); writes
``step_profile_<host>_<date>.json`` with provenance to ``--out``. Eager steps launch every kernel from Python, so
the wall time is above a captured step's; the device times and counts are what a captured step replays.

``--prefill`` profiles one prompt's prefill up to its first token (what TTFT times), after an unprofiled prompt of
the same length on the same method (so that host buffers the method keeps between sequences are already pinned,
as in the latency benchmark's second round). It prints the prefill's wall time, the host operations with the most
time of their own on the host (a prefill that waits on the host, or is slowed by host work on the model's thread,
shows there) and the kernels by device time (work on side streams is counted with the model's: a side stream's
kernels that the model's stream waits for or competes with show there).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eval.latency import method_values, model_spec

REPO = Path(__file__).resolve().parents[2]


def _gpu_busy_us(prof) -> float:
    """The time some kernel (or device copy) ran on the GPU during the profile, on any stream: the union of their
    intervals. Kernels on side streams that overlap the model's add to the summed device time but not to this."""
    from eval.throughput import busy_time, device_work

    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events() if device_work(e)]
    return busy_time(intervals, (float("-inf"), float("inf")))[0]


def _device_us(event) -> float:
    """An averaged profiler event's own device time (the attribute's name changed across torch versions)."""
    device_us = getattr(event, "self_device_time_total", None)
    return getattr(event, "self_cuda_time_total", 0) if device_us is None else device_us


def profile_method(model, info, name: str, budget: int, length: int, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eval.plugins import build_method
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import _forward

    method = build_method(method_values(name, budget, []), info)
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with HarnessCache(method) as cache, torch.inference_mode():
        cache.seq.max_total_tokens = length + steps + 3
        logits = _forward(model, prompt.to(device), 0, cache)
        cache.seq.prompt_copies.join()
        position = length

        def step(logits):
            nonlocal position
            token = logits.argmax().view(1)
            out = _forward(model, token, position, cache)
            position += 1
            return out

        for _ in range(2):
            logits = step(logits)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                logits = step(logits)
            torch.cuda.synchronize(device)
            wall = (time.perf_counter() - start) / steps
    kernels = []
    for event in prof.key_averages():
        device_us = _device_us(event)
        if device_us and event.device_type.name == "CUDA":
            kernels.append({"kernel": event.key[:90], "launches_per_step": event.count / steps,
                            "us_per_step": device_us / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    return {"method": name, "wall_ms_per_step": wall * 1e3,
            "device_ms_per_step": sum(k["us_per_step"] for k in kernels) / 1e3,
            "gpu_busy_ms_per_step": _gpu_busy_us(prof) / steps / 1e3,
            "launches_per_step": sum(k["launches_per_step"] for k in kernels), "kernels": kernels[:top]}


def profile_prefill(model, info, name: str, budget: int, length: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from eval.plugins import build_method
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import GenerationRequest, pick_token, prefill_sequence
    from icecache.core.timing import synchronize

    method = build_method(method_values(name, budget, []), info)
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    request = GenerationRequest(input_ids=prompt.tolist(), max_new_tokens=4)

    def first_token() -> float:
        with HarnessCache(method) as cache, torch.inference_mode():
            synchronize(device)
            start = time.perf_counter()
            logits, _ = prefill_sequence(model, cache, request, request.max_new_tokens, None, False, False)
            pick_token(logits, request, 0)
            wall = time.perf_counter() - start
            cache.seq.prompt_copies.join()
            synchronize(device)
        return wall

    first_token()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = first_token()
    host_ops, kernels = [], []
    for event in prof.key_averages():
        device_us = _device_us(event)
        if event.device_type.name == "CUDA":
            if device_us:
                kernels.append({"kernel": event.key[:90], "launches": event.count, "us": device_us})
        elif event.self_cpu_time_total:
            host_ops.append({"op": event.key[:90], "calls": event.count, "us": event.self_cpu_time_total})
    kernels.sort(key=lambda k: -k["us"])
    host_ops.sort(key=lambda k: -k["us"])
    return {"method": name, "wall_ms": wall * 1e3, "device_ms": sum(k["us"] for k in kernels) / 1e3,
            "gpu_busy_ms": _gpu_busy_us(prof) / 1e3 if device.type == "cuda" else None,
            "launches": sum(k["launches"] for k in kernels), "host_ops": host_ops[:top], "kernels": kernels[:top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama31_8b")
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--prefill", action="store_true", help="profile the prefill up to the first token instead")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)

    import torch

    from eval import provenance
    from icecache.core.cache import ATTENTION_NAME
    from icecache.core.models import load_model, model_info

    if not torch.cuda.is_available() and not args.prefill:
        parser.error("step_profile.py profiles CUDA kernels: run it on a CUDA host (--prefill also runs on the CPU)")
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args.model, "random", "auto", "auto")
    model, _ = load_model(spec, ATTENTION_NAME)
    info = model_info(spec)
    results = []
    for name in args.methods:
        if args.prefill:
            found = profile_prefill(model, info, name, args.budget, args.length, args.top)
            results.append(found)
            busy = f", the GPU busy {found['gpu_busy_ms']:.1f} ms" if found["gpu_busy_ms"] is not None else ""
            print(f"\n{name} at {args.length}, prefill to the first token: {found['wall_ms']:.1f} ms wall (profiled), "
                  f"{found['device_ms']:.1f} ms of kernels on all streams{busy}, {found['launches']} launches")
            for op in found["host_ops"]:
                print(f"  host {op['us'] / 1e3:9.2f} ms  {op['calls']:6d}x  {op['op']}")
            for kernel in found["kernels"]:
                print(f"  gpu  {kernel['us'] / 1e3:9.2f} ms  {kernel['launches']:6d}x  {kernel['kernel']}")
            continue
        found = profile_method(model, info, name, args.budget, args.length, args.steps, args.top)
        results.append(found)
        print(f"\n{name} at {args.length}: {found['wall_ms_per_step']:.2f} ms wall (eager), "
              f"{found['device_ms_per_step']:.2f} ms of kernels, the GPU busy {found['gpu_busy_ms_per_step']:.2f} ms, "
              f"{found['launches_per_step']:.0f} launches per step")
        for kernel in found["kernels"]:
            print(f"  {kernel['us_per_step']:9.1f} us  {kernel['launches_per_step']:6.1f}x  {kernel['kernel']}")
        torch.cuda.empty_cache()
    kind = "prefill_profile" if args.prefill else "step_profile"
    payload = {"kind": kind, "settings": vars(args), "provenance": provenance.collect(), "results": results}
    provenance.write_result(args.out, kind, payload)


if __name__ == "__main__":
    main()
