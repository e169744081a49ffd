"""The GPU operations of the shared core, one module per operation.

Each module holds the operation's PyTorch reference (``<operation>_reference``: runs on any device and defines the
semantics), its Triton kernel (``<operation>_triton``) and its dispatch (``<operation>``: the kernel for CUDA tensors
when ``triton_runtime.available()``, the reference otherwise). A kernel that keeps launch state between calls (split
counts, scratch buffers, compiled kernels) keeps it in a plan object that the calling layer creates once and passes
to every call (``PagedAttentionPlan``, ``PageScatterPlan``); nothing is cached at module level.
``triton_runtime`` holds what the kernels share: the optional Triton import and direct launches.

One host operation lives here too, compiled rather than Triton: ``_magicpig_host`` (``src/magicpig_host.cpp``, built
by setup.py), MagicPIG's host step, a C entry that a decode step calls or hands off through ``HostExchange``; its
torch definition is ``tests/magicpig_reference.py``.
"""
