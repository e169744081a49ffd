"""IceCache-reuse diagnosis on SmolLM2-135M passkey at 4k.

Runs full (greedy), then icecache and icecache_reuse teacher-forced on the full run's tokens, with
trace_selection. Checks reuse mechanics at every decode step of every sparsified layer, and measures attention
mass captured by each run's selection under the full run's queries/keys.

usage (from the repository root): python scripts/diagnostics/reuse_diagnosis.py SAMPLE_INDEX [R ...]
(BENCHMARKS.md gives what it found; results/bench/reuse_diagnosis_smollm2_20261130.json summarises the raw output.)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval import provenance
from eval.latency import model_spec
from eval.plugins import build_method
from eval.tasks.base import PromptContext, build_task
from icecache.core.cache import ATTENTION_NAME, HarnessCache
from icecache.core.generation import GenerationRequest, _forward, greedy_generate
from icecache.core.models import load_model, model_info

torch.set_num_threads(1)
sample_index = int(sys.argv[1]) if len(sys.argv) > 1 else 1
reuse_rs = [int(r) for r in sys.argv[2:]] or [3]

spec = model_spec("smollm2_135m", None, "cpu", "float32")
model, tokenizer = load_model(spec, ATTENTION_NAME)
info = model_info(spec)
task = build_task({"name": "passkey", "lengths": [4096], "num_depths": 10})
sample = list(task.samples(PromptContext(tokenizer=tokenizer)))[sample_index]
ids = sample.input_ids
answer_ids = sample.meta["answer_ids"]
n_prompt = len(ids)
print(sample.sample_id, "key", sample.answers, "answer ids", answer_ids, "prompt", n_prompt, flush=True)

# Needle positions: every occurrence of the answer's ids in the prompt.
needle = []
for start in range(n_prompt - len(answer_ids) + 1):
    if ids[start : start + len(answer_ids)] == answer_ids:
        needle.extend(range(start, start + len(answer_ids)))
print("needle positions", needle, flush=True)


def instrument(cache, record_kv: bool):
    """Wrap each layer's prefill/decode to record q, k, v, out and the attended mask per step."""
    log = {"q": {}, "k": {}, "v": {}, "out": {}, "mask": {}, "checks": []}
    for layer in cache.layer_kvs:
        li = layer.layer_idx
        log["q"][li], log["mask"][li], log["out"][li] = [], [], []
        log["k"][li], log["v"][li] = [], []

        def prefill(query, key, value, mask, scaling, layer=layer, li=li, orig=layer.prefill):
            if record_kv:
                log["k"][li].append(key[0].clone())
                log["v"][li].append(value[0].clone())
            return orig(query, key, value, mask, scaling)

        def decode(query, key, value, scaling, layer=layer, li=li, orig=layer.decode):
            out = orig(query, key, value, scaling)
            log["q"][li].append(query[0, :, 0, :].clone())
            if record_kv:
                log["k"][li].append(key[0].clone())
                log["v"][li].append(value[0].clone())
            log["out"][li].append(out[0, 0].clone())
            if layer.last_attended is not None:
                log["mask"][li].append(layer.last_attended.clone())
            if getattr(layer, "offloaded", False) and record_kv:
                log["checks"].append(check_layer(cache, layer, log, query[0, :, 0, :], out[0, 0], scaling))
            return out

        layer.prefill, layer.decode = prefill, decode
    return log


def check_layer(cache, layer, log, q, out, scaling):
    """Mechanics of one sparsified layer right after its decode: attended set, page contents, output."""
    li = layer.layer_idx
    config = layer.cfg  # the reuse grouping and page counts the layer runs with
    owner = cache.layer_kvs[config.owner_of(li)]
    total = layer.seq_len + 1
    K = torch.cat(log["k"][li], dim=1)  # this layer's own [Hkv, total, D] in this run
    V = torch.cat(log["v"][li], dim=1)
    K_owner = torch.cat(log["k"][owner.layer_idx], dim=1)
    assert K.shape[1] == total, (K.shape, total)
    index = layer.group.index
    selection = layer.group.selection
    res = {"layer": li, "owner": owner.layer_idx, "step": len(log["q"][li]) - 1}
    res["resident_eq_owner"] = bool(np.array_equal(layer.state.resident, owner.state.resident))
    res["resident_is_selection"] = all(
        sorted(layer.state.resident[h][layer.state.resident[h] >= 0].tolist())
        == sorted(selection[h][selection[h] >= 0].tolist())
        for h in range(info.n_kv_heads)
    )
    res["positions_eq_owner"] = bool(np.array_equal(layer.state.positions, owner.state.positions)) and (
        layer.state.window.start == owner.state.window.start and layer.state.sink_len == owner.state.sink_len
    )
    # Expected attended set from the OWNER's state.
    expected = torch.zeros(info.n_kv_heads, total, dtype=torch.bool)
    expected[:, : owner.state.sink_len] = True
    expected[:, owner.state.window.start : total] = True
    ns = config.n_sink_pages
    ps = config.page_size
    kv_ok, kv_not_owner, prefix_ok, count_ok = True, True, True, True
    counts_dev = layer.buffers.exchange.device_out["counts"]
    page_counts = index.page_valid_counts()
    for h in range(info.n_kv_heads):
        ptoks = index.page_tokens(h)
        for j, page in enumerate(owner.state.resident[h]):
            if page < 0:
                continue
            toks = ptoks[page]
            valid = toks >= 0
            n = int(valid.sum())
            if not valid[:n].all():
                prefix_ok = False
            if int(counts_dev[h, ns + j]) != n or page_counts[h, page] != n:
                count_ok = False
            positions = owner.state.positions[toks[:n]]
            expected[h, positions] = True
            slot = ns + j
            # layer.state.resident equals owner.state.resident (checked), so slot j of the layer holds page `page`.
            kp = layer.state.pool.key_pages[slot, h, :n]
            vp = layer.state.pool.value_pages[slot, h, :n]
            if not (torch.equal(kp, K[h, positions]) and torch.equal(vp, V[h, positions])):
                kv_ok = False
            if layer is not owner and torch.equal(kp, K_owner[h, positions]):
                kv_not_owner = False
        # sinks and window
        sl = layer.state.sink_len
        for s in range(-(-sl // ps)):
            n = min(ps, sl - s * ps)
            if not torch.equal(layer.state.pool.key_pages[s, h, :n], K[h, s * ps : s * ps + n]):
                kv_ok = False
        n_window = config.n_window_pages  # the window is a ring starting at window_head
        ring = [layer.state.window.first_slot + (layer.state.window.head + j) % n_window for j in range(n_window)]
        wk = layer.state.pool.key_pages[ring, h].reshape(-1, K.shape[-1])[: layer.state.window.count]
        if not torch.equal(wk, K[h, layer.state.window.start : total]):
            kv_ok = False
    res["mask_ok"] = bool(torch.equal(layer.last_attended, expected.repeat_interleave(info.group_size, 0)))
    res["kv_own_ok"] = kv_ok
    res["kv_not_owner"] = kv_not_owner
    res["page_prefix_ok"] = prefix_ok
    res["counts_ok"] = count_ok
    # Output = exact softmax over the expected set with this layer's own K/V.
    g = info.group_size
    Kq = K.repeat_interleave(g, 0).double()
    Vq = V.repeat_interleave(g, 0).double()
    scores = torch.einsum("hd,htd->ht", q.double(), Kq) * scaling
    scores = scores.masked_fill(~expected.repeat_interleave(g, 0), float("-inf"))
    ref = torch.einsum("ht,htd->hd", torch.softmax(scores, -1), Vq)
    res["n_offloaded"] = int(len(layer.state.positions))
    res["index_tokens"] = int(index.num_tokens)
    res["max_position_offloaded"] = int(layer.state.positions.max())
    res["out_err"] = float((ref - out.double()).abs().max())
    if FULL and res["step"] < FULL["n_steps"]:
        res.update(ownrank(layer, owner, index, res["step"], total))
    return res


FULL = {}


def ownrank(layer, owner, index, t, total):
    """Oracle: the k_sel pages of the owner's current layout with most of THIS layer's full-run attention mass."""
    li = layer.layer_idx
    g = info.group_size
    k_sel = layer.cfg.n_selected_pages
    q = FULL["log"]["q"][li][t].double()
    K = FULL["K"][li][:, :total].repeat_interleave(g, 0).double()
    p = torch.softmax(torch.einsum("hd,htd->ht", q, K) * info.head_dim ** -0.5, -1).view(info.n_kv_heads, g, total)
    nd = torch.zeros(total, dtype=torch.bool)
    nd[FULL["needle"]] = True
    mass = needle_mass = 0.0
    for h in range(info.n_kv_heads):
        ptoks = index.page_tokens(h)
        valid = ptoks >= 0
        pos = torch.from_numpy(np.where(valid, owner.state.positions[np.clip(ptoks, 0, None)], 0))
        vmask = torch.from_numpy(valid)
        page_mass = (p[h][:, pos] * vmask).sum(-1)  # [g, pages]
        best = page_mass.sum(0).topk(min(k_sel, page_mass.shape[1])).indices
        chosen = torch.zeros(total, dtype=torch.bool)
        chosen[: owner.state.sink_len] = True
        chosen[owner.state.window.start : total] = True
        sel_pos = pos[best][vmask[best]]
        chosen[sel_pos] = True
        mass += float(p[h][:, chosen].sum())
        needle_mass += float(p[h][:, chosen & nd].sum())
    return {"ownrank_mass": mass / info.n_heads, "ownrank_needle": needle_mass / info.n_heads}


@torch.inference_mode()
def forced(method_values, tokens, record_kv):
    method = build_method(method_values, info)
    cache = HarnessCache(method, trace_selection=True)
    log = instrument(cache, record_kv)
    prompt = torch.tensor(ids)
    logits = _forward(model, prompt, 0, cache)
    all_logits = [logits.float().clone()]
    position = n_prompt
    for tok in tokens[:-1]:
        logits = _forward(model, torch.tensor([tok]), position, cache)
        position += 1
        all_logits.append(logits.float().clone())
    return cache, log, all_logits


t0 = time.time()
n_new = int(os.environ.get("NEW", sample.max_new_tokens))
full_result = greedy_generate(model, HarnessCache(build_method({"name": "full"}, info)),
                              GenerationRequest(ids, n_new, eos_token_ids=[]))
tokens = full_result.token_ids
print("full greedy:", tokens, repr(tokenizer.decode(tokens)), f"{time.time()-t0:.0f}s", flush=True)
full_cache, full_log, full_logits = forced({"name": "full"}, tokens, record_kv=True)
print(f"full forced done {time.time()-t0:.0f}s", flush=True)
FULL.update(log=full_log, K={li: torch.cat(full_log["k"][li], dim=1) for li in full_log["k"]}, needle=needle,
            n_steps=min(len(tokens), sample.max_new_tokens) - 1)

runs = {"icecache": {"name": "icecache", "budget": 256}}
for r in reuse_rs:
    runs[f"reuse{r}"] = {"name": "icecache_reuse", "budget": 256, "n_reuse_layers": r}
logs, logits_by_run = {}, {}
for name, mv in runs.items():
    cache, log, lg = forced(mv, tokens, record_kv=True)
    logs[name], logits_by_run[name] = (cache, log), lg
    # Free-running greedy for comparison of the prediction.
    free = greedy_generate(model, HarnessCache(build_method(mv, info)),
                           GenerationRequest(ids, sample.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id]))
    print(f"{name}: free greedy {free.token_ids} {tokenizer.decode(free.token_ids)!r}  ({time.time()-t0:.0f}s)",
          flush=True)
    checks = log["checks"]
    keys = ["resident_eq_owner", "resident_is_selection", "positions_eq_owner", "mask_ok", "kv_own_ok",
            "kv_not_owner", "page_prefix_ok", "counts_ok"]
    summary = {k: sum(bool(c[k]) for c in checks) for k in keys}
    print(f"  offloaded tokens: min {min(c['n_offloaded'] for c in checks)} max {max(c['n_offloaded'] for c in checks)}"
          f"; all equal index size: {all(c['n_offloaded'] == c['index_tokens'] for c in checks)}; max offloaded "
          f"position {max(c['max_position_offloaded'] for c in checks)} (prompt {n_prompt})", flush=True)
    print(f"  mechanics over {len(checks)} (layer, step) checks: {summary}; max out_err "
          f"{max(c['out_err'] for c in checks):.2e}", flush=True)
    bad = [c for c in checks if not all(c[k] for k in keys if not (k == 'kv_not_owner' and c['layer'] == c['owner']))]
    if bad:
        print("  FAILED checks (first 5):", bad[:5], flush=True)
    # teacher-forced correctness of each step
    steps = []
    for t, lgt in enumerate(lg):
        target = tokens[t]
        logp = torch.log_softmax(lgt, -1)
        steps.append((int(lgt.argmax()), target, float(logp[target]), int((lgt > lgt[target]).sum())))
    print("  per step (argmax, target, logp(target), rank):", steps, flush=True)

# ----------------------------------------------------------------------------- attention mass
ncfg = build_method(runs["icecache"], info).config
first_sparse = ncfg.n_dense_layers
scaling = info.head_dim ** -0.5
g = info.group_size
n_steps = min(len(tokens), sample.max_new_tokens) - 1  # answer decode steps only (first token from prefill)
table = {}  # run -> layer -> list over steps of (mass, middle_frac, needle_mass_frac)
K_full = {li: torch.cat(full_log["k"][li], dim=1) for li in full_log["k"]}
V_full = {li: torch.cat(full_log["v"][li], dim=1) for li in full_log["v"]}
rows = []
for li in range(first_sparse, info.n_layers):
    for t in range(n_steps):
        total = n_prompt + t + 1
        q = full_log["q"][li][t].double()
        K = K_full[li][:, :total].repeat_interleave(g, 0).double()
        p = torch.softmax(torch.einsum("hd,htd->ht", q, K) * scaling, -1)  # [Hq, total]
        base = torch.zeros(total, dtype=torch.bool)
        base[: ncfg.n_sink_pages * ncfg.page_size] = True
        row = {"layer": li, "step": t}
        nd = torch.zeros(total, dtype=torch.bool)
        nd[needle] = True
        row["needle_mass"] = float(p[:, nd].sum(-1).mean())
        for name in runs:
            mask = logs[name][1]["mask"][li][t]
            m = (p * mask).sum(-1)
            row[f"{name}_mass"] = float(m.mean())
            row[f"{name}_mass_min"] = float(m.min())
            row[f"{name}_needle"] = float((p * (mask & nd)).sum(-1).mean())
            row[f"{name}_size"] = float(mask.sum(-1).float().mean())
            row[f"{name}_needle_per_kvhead"] = (p * (mask & nd)).sum(-1).view(info.n_kv_heads, g).sum(-1).tolist()
        row["needle_per_kvhead"] = p[:, nd].sum(-1).view(info.n_kv_heads, g).sum(-1).tolist()
        # Oracle top-256 tokens per head with the layer's own query (upper bound at the same budget).
        row["top256_mass"] = float(p.topk(256, -1).values.sum(-1).mean())
        rows.append(row)

for name in runs:
    for c in logs[name][1]["checks"]:
        if "ownrank_mass" in c:
            for row in rows:
                if row["layer"] == c["layer"] and row["step"] == c["step"]:
                    row[f"{name}_ownrank_mass"] = c["ownrank_mass"]
                    row[f"{name}_ownrank_needle"] = c["ownrank_needle"]

out = {"sample": sample.sample_id, "tokens": tokens, "needle": needle, "rows": rows,
       "checks": {n: logs[n][1]["checks"] for n in runs},
       "logits_steps": {n: [(int(step.argmax()), float(torch.log_softmax(step, -1)[tokens[i]]))
                            for i, step in enumerate(logits_by_run[n])] for n in runs}}
out["provenance"] = provenance.collect()
out_dir = Path(os.environ.get("REUSE_DIAG_OUT", "/tmp/reuse_diag"))  # raw output: ~300 KB per sample
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"diag_{sample.sample_id}_{'_'.join(map(str, reuse_rs))}_new{n_new}.json").write_text(json.dumps(out))

# Summary by group position for each reuse run.
print("\nAttention mass captured (full-run q over full-run K), mean over query heads, decode steps, layers")
for r in reuse_rs:
    name = f"reuse{r}"
    print(f"-- R={r}")
    for pos in range(r):
        sel = [row for row in rows if (row["layer"] - first_sparse) % r == pos]

        def avg(key, sel=sel):
            vals = [row[key] for row in sel if key in row]
            return np.mean(vals) if vals else float("nan")

        print(f"  pos +{pos} ({len(set(x['layer'] for x in sel))} layers): icecache {avg('icecache_mass'):.3f} "
              f"reuse {avg(name + '_mass'):.3f} ownrank-over-owner-layout {avg(name + '_ownrank_mass'):.3f} "
              f"top256 {avg('top256_mass'):.3f} | needle mass total {avg('needle_mass'):.4f} "
              f"ice {avg('icecache_needle'):.4f} reuse {avg(name + '_needle'):.4f} "
              f"ownrank {avg(name + '_ownrank_needle'):.4f}")
print("\nPer layer (mean over steps): layer pos | icecache  " + "  ".join(f"reuse{r}" for r in reuse_rs)
      + " | top256 | needle total / ice / " + " / ".join(f"reuse{r}" for r in reuse_rs))
for li in range(first_sparse, info.n_layers):
    sel = [row for row in rows if row["layer"] == li]

    def m(k, sel=sel):
        return np.mean([row[k] for row in sel])

    print(f"  L{li:2d} " + " ".join(f"+{(li - first_sparse) % r}" for r in reuse_rs)
          + f" | {m('icecache_mass'):.3f} " + " ".join(f"{m(f'reuse{r}_mass'):.3f}" for r in reuse_rs)
          + f" | {m('top256_mass'):.3f} | {m('needle_mass'):.4f} / {m('icecache_needle'):.4f} / "
          + " / ".join(f"{m(f'reuse{r}_needle'):.4f}" for r in reuse_rs))
print(f"done {time.time()-t0:.0f}s")
