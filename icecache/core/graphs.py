"""A decode step captured in a CUDA graph, for methods whose decode makes no host decision a replay would skip.

Batch-1 decode of an 8B model issues ~500 small kernels per token; launched one by one from Python that takes
~25 ms on our host while the GPU needs ~5 ms. Capturing the whole step (all layers, the LM head) once and
replaying it removes the host from the loop. What changes between steps lives in device tensors that the graph
reads on every replay: the input id, the position (RoPE and the cache's write index, through
``SequenceContext.position``). Python code in the model and the cache runs once, at capture; so only methods that
declare ``captures_decode_step`` are captured, and their Python-side counters are advanced here per replay. Host
work that must run at every step (IceCache's index search) is handed off by the layer through the sequence's
channel (``cuda_driver.HostFunctions``), which the graph records as nodes and which runs the work at every replay;
``counters`` records which channel carried it.
"""

from __future__ import annotations

import warnings

import torch

from .batch import BatchCache, forward_step
from .cache import HarnessCache


class GraphedDecodeStep:
    """Decode steps of ``model`` on ``cache``: steps run eagerly until one has run with every layer
    ``graph_ready`` (it warms up kernels and library handles on the capture stream), the next is captured and every
    later one replays the graph."""

    def __init__(self, model, cache: HarnessCache | BatchCache):
        self.model = model
        self.cache = cache
        device = model.device
        self.stream = torch.cuda.Stream(device)
        self.batch_size = len(cache.sequences)
        # The rows' one channel (a batch's sequences share it: core.batch).
        self.host_functions = cache.sequences[0].host_functions
        self.input_ids = torch.zeros(self.batch_size, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.batch_size, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.eager_steps = 0
        self.warmed = False
        self.replays = 0
        self.capture_error: str | None = None  # why the step is not captured, if a capture failed
        self._finished = torch.cuda.Event(blocking=True)  # a replay's end, waited for without spinning

    def _forward(self) -> torch.Tensor:
        logits = forward_step(self.model, self.cache, self.input_ids, self.positions)
        return logits[0] if isinstance(self.cache, HarnessCache) else logits

    def __call__(self, token: int | list[int], position: int | list[int]) -> torch.Tensor:
        """Logits of the next token after ``token`` at ``position`` (a view that the next call overwrites): ``[V]``
        for one sequence's cache; for a batch, ``[B, V]`` after each row's token at each row's position (lists)."""
        if isinstance(token, int):
            self.input_ids.fill_(token)
            self.positions.fill_(position)
        else:
            self.input_ids.copy_(torch.tensor(token, dtype=torch.long).view(-1, 1))
            self.positions.copy_(torch.tensor(position, dtype=torch.long).view(-1, 1))
        if self.graph is not None:
            self.graph.replay()
            return self._replayed(advance_layers=True)
        ready = all(layer.graph_ready for layer in self.cache.layer_kvs) and self.capture_error is None
        current = torch.cuda.current_stream(self.input_ids.device)
        self.stream.wait_stream(current)
        if not (ready and self.warmed):
            with torch.cuda.stream(self.stream):
                logits = self._forward()
            self.eager_steps += 1
            self.warmed = ready  # this step ran every kernel a capture would record
            current.wait_stream(self.stream)
            return logits
        for layer in self.cache.layer_kvs:  # room for what the host functions of the first replays will add
            layer.between_steps()
        graph = torch.cuda.CUDAGraph()
        seq_lens = [layer.seq_len for layer in self.cache.layer_kvs]
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.logits = self._forward()
        except Exception as error:  # noqa: BLE001  a capture runs no step: go on eagerly, and say so
            # Nothing ran during the capture; only the layers' Python counters moved, so put them back.
            for layer, seq_len in zip(self.cache.layer_kvs, seq_lens):
                layer.seq_len = seq_len
            self.capture_error = f"{type(error).__name__}: {error}"
            _release_rng_from_failed_capture(self.input_ids.device)
            warnings.warn(f"CUDA-graph capture of the decode step failed ({self.capture_error}); decoding eagerly",
                          RuntimeWarning, stacklevel=2)
            return self(token, position)
        self.graph = graph
        current.wait_stream(self.stream)
        graph.replay()  # capture records; this step's work runs here
        return self._replayed(advance_layers=False)  # the layers' Python ran during the capture

    def close(self) -> None:
        """Drop the graph and the host functions it replays, once the stream is done with them, so that the cache
        is freed as soon as the caller lets go of it (see ``HostFunctions.release``)."""
        self.stream.synchronize()
        torch.cuda.current_stream(self.input_ids.device).synchronize()
        self.graph = None
        self.logits = None
        self.host_functions.release()

    def counters(self) -> dict[str, int | str]:
        """What a result records of the graph: replays, why there were none if a capture failed, and the channel
        that carried the step's host work where it had some (``HostFunctions.kind``)."""
        channel = self.host_functions.kind
        return {"graph_replays": self.replays,
                **({"graph_capture_error": self.capture_error} if self.capture_error else {}),
                **({"host_channel": channel} if channel is not None else {})}

    def _replayed(self, advance_layers: bool) -> torch.Tensor:
        # Python host work in the graph takes the GIL on the channel's worker (or the driver's thread), so wait here
        # with it released (a stream synchronisation does), then surface any error it raised or the channel met.
        # Where the step has host work the wait sleeps instead of spinning: a spinning waiter holds one of the cores
        # the host work's threads (the index search's 16) need, and every barrier of theirs then waits for the one
        # of them the scheduler put off that core.
        stream = torch.cuda.current_stream(self.input_ids.device)
        if self.host_functions.kind is not None:
            self._finished.record(stream)
            self._finished.synchronize()
        else:
            stream.synchronize()
        self.host_functions.raise_pending()
        self.replays += 1
        for layer in self.cache.layer_kvs:
            if advance_layers:  # what LayerKV.forward does in Python, skipped by a replay
                layer.seq_len += 1
            layer.between_steps()
        return self.logits


def _release_rng_from_failed_capture(device: torch.device) -> None:
    """A capture that fails ends before PyTorch tells the device's default generator that capturing is over, and
    every later random draw on that device would then fail ("Offset increment outside graph capture"). Give the
    generator a fresh copy of its state (same seed and offset, not capturing); the failed graph keeps the old one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())
