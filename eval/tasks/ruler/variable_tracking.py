"""RULER's variable tracking (``vt``): a 4-hop chain of assignments among noise lines, after one worked example."""

from __future__ import annotations

import string

from .common import NOISE, Prompt, Streams, Wrap

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
VT_HOPS = 4
VT_EXAMPLE_TOKENS = 500  # the worked example's length budget


def _variable_chains(streams: Streams, num_hops: int, example: bool) -> tuple[list[list[str]], list[list[str]]]:
    """RULER's chain draw: 5 names (more while one repeats), the value from NumPy (12345 in the example).

    Names past the first five make a second, shorter chain here; RULER's loop fails on them (IndexError), so no
    RULER sample has one."""
    rng, name_length = streams.rng, 3 if example else 5
    names = ["".join(rng.choices(string.ascii_uppercase, k=name_length)) for _ in range(num_hops + 1)]
    while len(set(names)) < num_hops + 1:
        names.append("".join(rng.choices(string.ascii_uppercase, k=name_length)))
    chains_names, chains = [], []
    for start in range(0, len(names), num_hops + 1):
        chain_names = names[start:start + num_hops + 1]
        chains_names.append(chain_names)
        value = "12345" if example else str(streams.np_rng.randint(10000, 99999))
        chain = [f"VAR {chain_names[0]} = {value}"]
        chain += [f"VAR {chain_names[hop + 1]} = VAR {chain_names[hop]} " for hop in range(len(chain_names) - 1)]
        chains.append(chain)
    return chains_names, chains


def _variable_tracking_body(streams: Streams, size: int, example: bool) -> tuple[str, str, list[str]]:
    names, chains = _variable_chains(streams, VT_HOPS, example)
    value = chains[0][0].split("=")[-1].strip()
    lines = [NOISE] * size
    for chain in chains:
        positions = sorted(streams.rng.sample(range(len(lines)), len(chain)))
        for offset, (position, assignment) in enumerate(zip(positions, chain)):
            lines.insert(position + offset, assignment)
    context = "\n".join(lines).replace(". \n", ".\n")
    body = VT_TEMPLATE.format(context=context, query=value)
    return body, VT_ANSWER_PREFIX.format(num_v=VT_HOPS + 1, query=value), names[0]


def vt_example_prompt(streams: Streams, size: int) -> Prompt:
    """The worked example: RULER fits it to 500 tokens without the model template."""
    body, answer_prefix, names = _variable_tracking_body(streams, size, example=True)
    return Prompt(text=body + answer_prefix, answers=names)


def redraw_example(streams: Streams, example: str) -> str:
    """RULER's per-sample copy of the example: its answer names and its value 12345 drawn anew."""
    for name in example.strip().split()[-(VT_HOPS + 1):]:
        example = example.replace(name, "".join(streams.rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(streams.np_rng.randint(10000, 99999)))


def vt_prompt(streams: Streams, size: int, wrap: Wrap, example: str | None) -> Prompt:
    """One chain among ``size`` noise lines; with ``example``, the redrawn example opens the task text."""
    body, answer_prefix, names = _variable_tracking_body(streams, size, example=False)
    if example is not None:
        body = redraw_example(streams, example) + "\n" + body
    return Prompt(text=wrap(body) + answer_prefix, answers=names)
