"""A decoder layer's input, handed to the next layer's ``LayerKV`` before that layer runs: what a method needs to
start the next layer's work one layer early (a look-ahead search from a speculative query, as InfiniGen does).

A layer that wants it says so (``LayerKV.wants_previous_layer_input``); ``previous_layer_inputs`` then puts a
forward pre-hook on the decoder layer before it, which calls ``LayerKV.previous_layer_input(hidden, project)``
with that layer's input hidden states and ``project``: the wanting layer's own query projection (input norm,
``q_proj``, the per-head ``q_norm`` where the model has one, RoPE at the forward's positions). Applied to the
layer's own input, ``project`` gives the query its attention receives, to the bit (a test holds it to that);
applied to the previous layer's input, it gives the speculative query. The hooks are Python: inside a captured
decode step they run once, at capture, and what they enqueue replays with the graph.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from .rope import rotate_half


def project_query(decoder_layer: torch.nn.Module, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  hidden: torch.Tensor) -> torch.Tensor:
    """``decoder_layer``'s post-RoPE query ``[B, Hq, S, D]`` for the hidden states ``[B, S, hidden]``, computed as
    its attention computes it (the Llama, Mistral, Qwen2 and Qwen3 layers of transformers 5)."""
    attention = decoder_layer.self_attn
    normed = decoder_layer.input_layernorm(hidden)
    query = attention.q_proj(normed).view(*normed.shape[:-1], -1, attention.head_dim)
    q_norm = getattr(attention, "q_norm", None)
    if q_norm is not None:
        query = q_norm(query)
    query = query.transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return query * cos + rotate_half(query) * sin


def _decoder_layers(model) -> list[torch.nn.Module]:
    return list(model.model.layers[: model.config.num_hidden_layers])


@contextmanager
def previous_layer_inputs(model, layer_kvs: list | None = None, *, rows: list[list] | None = None) -> Iterator[int]:
    """Within the block, every ``layer_kvs[i]`` that ``wants_previous_layer_input`` receives decoder layer
    ``i - 1``'s input before that layer runs; yields the number of hooks put on (0 when no layer wants one). For a
    batch (``core.batch``), ``rows[b]`` is row ``b``'s layers, and each receives its own row of the input."""
    rows = rows if rows is not None else [layer_kvs]
    layers = _decoder_layers(model)
    handles = []
    for index in range(1, len(layers)):
        wanting = [(row, kvs[index]) for row, kvs in enumerate(rows)
                   if index < len(kvs) and kvs[index].wants_previous_layer_input]
        if not wanting:
            continue

        def hook(module, args, kwargs, wanting=wanting, target=layers[index]):
            hidden = args[0] if args else kwargs["hidden_states"]
            position_embeddings = kwargs.get("position_embeddings")
            if position_embeddings is None:  # a model that does not pass them cannot be projected here
                return None
            if len(rows) == 1:
                kv = wanting[0][1]
                kv.previous_layer_input(hidden, functools.partial(project_query, target, position_embeddings))
                return None
            cos, sin = position_embeddings
            for row, kv in wanting:
                kv.previous_layer_input(hidden[row : row + 1], functools.partial(
                    project_query, target, (cos[row : row + 1], sin[row : row + 1])))
            return None

        handles.append(layers[index - 1].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()
