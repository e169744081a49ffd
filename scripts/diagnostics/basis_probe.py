#!/usr/bin/env python
"""Time ShadowKV's prompt factorisation (``baselines.shadowkv.key_basis``) with each basis solver, one layer's
pre-RoPE keys at a time, and check that the solvers agree: the rank-``rank`` basis of ``[n_kv_heads, T, head_dim]``
keys with a decaying spectrum (pre-RoPE keys are nearly low-rank), as the prompt of a Llama-3.1-8B layer gives it.

    python scripts/diagnostics/basis_probe.py --tokens 32768 131072

Prints, per length and solver, the fastest of ``--repeats`` calls (after one untimed) and how far its subspace is
from the first solver's (the Frobenius norm of the projectors' difference) and the keys' relative rebuild error;
writes results/bench/basis_probe_<host>_<date>.json with provenance.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def probe_keys(n_tokens: int, n_kv_heads: int, head_dim: int, device, seed: int = 0):
    """float32 ``[n_kv_heads, n_tokens, head_dim]`` keys whose singular values fall from 100 to 0.01."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    width = n_kv_heads * head_dim
    spectrum = torch.logspace(2, -2, width, device=device)
    mixing = torch.linalg.qr(torch.randn(width, width, generator=gen, device=device)).Q
    matrix = (torch.randn(n_tokens, width, generator=gen, device=device) * spectrum) @ mixing
    return matrix.view(n_tokens, n_kv_heads, head_dim).transpose(0, 1).contiguous()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="prompt lengths")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rank", type=int, default=160)
    parser.add_argument("--solvers", nargs="+", default=None, help="default: every one in BASIS_SOLVERS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto: cuda where there is one")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)

    import torch

    from baselines.shadowkv import BASIS_SOLVERS, key_basis
    from eval import provenance

    solvers = args.solvers or list(BASIS_SOLVERS)
    unknown = [name for name in solvers if name not in BASIS_SOLVERS]
    if unknown:
        raise SystemExit(f"error: --solvers {' '.join(unknown)}: not a solver; the solvers are {sorted(BASIS_SOLVERS)}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for n_tokens in args.tokens:
        keys = probe_keys(n_tokens, args.kv_heads, args.head_dim, device)
        matrix = keys.transpose(0, 1).reshape(n_tokens, -1).double()
        reference = None
        for solver in solvers:
            basis = key_basis(keys, args.rank, solver)
            synchronize()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                basis = key_basis(keys, args.rank, solver)
                synchronize()
                times.append(time.perf_counter() - start)
            b = basis.double()
            projector = b.T @ b
            reference = projector if reference is None else reference
            rebuilt = matrix @ projector
            row = {"tokens": n_tokens, "solver": solver, "rank": basis.shape[0], "seconds": min(times),
                   "projector_diff_to_first": float((projector - reference).norm()),
                   "rebuild_error": float((rebuilt - matrix).norm() / matrix.norm())}
            rows.append(row)
            print(f"{n_tokens:>8} tokens  {solver:>5}: {1e3 * row['seconds']:9.1f} ms  projector diff to "
                  f"{solvers[0]} {row['projector_diff_to_first']:.2e}  rebuild error {row['rebuild_error']:.4f}",
                  flush=True)
        del keys, matrix
        if device.type == "cuda":
            torch.cuda.empty_cache()
    settings = {**vars(args), "solvers": solvers, "device": str(device)}
    payload = {"kind": "basis_probe", "settings": settings, "provenance": provenance.collect(), "rows": rows}
    provenance.write_result(args.out, "basis_probe", payload)
    return rows


if __name__ == "__main__":
    main()
