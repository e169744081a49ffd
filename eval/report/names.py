"""How a method with settings is written in every table and figure: ``icecache (lookahead)``.

Result files keep what they recorded, in one of two spellings of the same thing: a latency file names a variant by
the settings given inline on its command line (``icecache:lookahead=true``, ``icecache:prompt_workers=1``), a run
by its declared variant's label (``icecache+lookahead``, ``Method.variants``). Both are shown as the method's name
with its settings in brackets, a setting that is simply switched on by its name alone. Nothing here imports the
methods, torch or pandas, so every report module can use it.
"""

from __future__ import annotations

# The latency files' references: every row's ratios are to plain transformers decode (full) and to the fast full
# cache (full_static: static buffers and a CUDA-graphed step), the fair one; both run in every measurement.
LATENCY_REFERENCES = ("full", "full_static")


def split_method(recorded: str) -> tuple[str, str]:
    """``icecache:lookahead=true`` or ``icecache+lookahead`` -> ``("icecache", "lookahead")``;
    ``icecache:prompt_workers=1,cpu_threads=8`` -> ``("icecache", "prompt_workers=1, cpu_threads=8")``;
    a written one (``icecache (lookahead)``) -> the same; a plain method -> ``(name, "")``."""
    recorded = str(recorded)
    if recorded.endswith(")") and " (" in recorded:  # already written: ``icecache (lookahead)``
        base, _, settings = recorded[:-1].partition(" (")
        return base, settings
    base, colon, inline = recorded.partition(":")
    if colon:
        settings = []
        for assignment in filter(None, inline.split(",")):
            key, _, value = assignment.partition("=")
            settings.append(key if value.strip().lower() == "true" else f"{key}={value}")
        return base, ", ".join(settings)
    base, _, variant = recorded.partition("+")
    return base, variant


def method_text(recorded: str) -> str:
    """The one written form of a method and its settings: ``icecache (lookahead)``, ``icecache``."""
    base, settings = split_method(recorded)
    return f"{base} ({settings})" if settings else base
