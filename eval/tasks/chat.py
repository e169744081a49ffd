"""Chat-template rules per model family, shared by the tasks that wrap prompts (LongBench, RULER).

The rules are those of the IceCache evaluation scripts (``eval.tasks.longbench``, step 3):

* ``llama3``: ``apply_chat_template`` with the system prompt "You are a helpful assistant." and the user prompt,
  ``add_generation_prompt=True``;
* ``mistral``: ``"[INST]{prompt}[/INST]"`` with no spaces (the Llama-2 convention, as in THUDM's and IceCache's code);
* ``qwen``: ``apply_chat_template`` with the user prompt, ``add_generation_prompt=True, enable_thinking=False``;
* ``plain``: the tokenizer's own ``apply_chat_template`` with just the user prompt and a generation prompt;
* ``none``: the raw prompt.

The wrapped text is then tokenised with the tokenizer's default special tokens, except that a BOS the template has
already written is not added a second time. (The IceCache script tokenises the Llama-3 template output with default
special tokens, which probably yields two BOS tokens [INF]; we treat that as a bug, not a protocol.)
"""

from __future__ import annotations

from typing import Any

from icecache.errors import ConfigError

CHAT_TEMPLATES = ("llama3", "mistral", "qwen", "plain", "none")
LLAMA3_SYSTEM_PROMPT = "You are a helpful assistant."


def _render_with_tokenizer(tokenizer: Any, messages: list[dict[str, str]], chat_template: str, **kwargs) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"chat_template={chat_template!r} needs a tokenizer with a chat template, and this one has none; "
            "set the model's chat_template to 'none' (raw prompts) or 'mistral'"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def wrap_chat(prompt: str, tokenizer: Any, chat_template: str) -> str:
    """The prompt text as the model family's chat format presents it, ready for ``encode_prompt``."""
    if chat_template == "none":
        return prompt
    if chat_template == "mistral":
        return f"[INST]{prompt}[/INST]"
    if chat_template == "llama3":
        messages = [
            {"role": "system", "content": LLAMA3_SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        return _render_with_tokenizer(tokenizer, messages, chat_template)
    if chat_template == "qwen":
        return _render_with_tokenizer(
            tokenizer, [{"role": "user", "content": prompt}], chat_template, enable_thinking=False
        )
    if chat_template == "plain":
        return _render_with_tokenizer(tokenizer, [{"role": "user", "content": prompt}], chat_template)
    raise ConfigError(f"unknown chat_template {chat_template!r}; known: {', '.join(CHAT_TEMPLATES)}")


def encode_prompt(text: str, tokenizer: Any) -> list[int]:
    """Token ids of ``text`` with the tokenizer's default special tokens, without doubling a BOS already in ``text``."""
    bos_token = getattr(tokenizer, "bos_token", None)
    add_special_tokens = not (bos_token and text.startswith(bos_token))
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def newline_token_id(tokenizer: Any) -> int:
    """The id LongBench's samsum rule adds to the EOS ids: the last id of ``encode("\\n")`` without special tokens."""
    return tokenizer.encode("\n", add_special_tokens=False)[-1]
