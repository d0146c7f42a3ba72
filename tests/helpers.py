"""What the generation tests share: the prompt, a run of the loop, and a minimal tokenizer."""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.generation import SpeculativeStats, speculative_generate_step

PROMPT = [1, 2, 3, 4, 5]


def run(prompt, model, draft, **kwargs) -> tuple[list[int], list[bool], SpeculativeStats]:
    """The tokens, ``from_draft`` flags and counts of one speculative generation."""
    stats = SpeculativeStats()
    tokens, flags = [], []
    for token, _, from_draft in speculative_generate_step(
        mx.array(prompt), model, draft, stats=stats, **kwargs
    ):
        tokens.append(token)
        flags.append(from_draft)
    return tokens, flags, stats


class ByteTokenizer:
    """The least a tokenizer needs for mlx-lm's ``TokenizerWrapper``: token ``i`` is a letter."""

    eos_token_id = 0
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 200 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if i != 0)
