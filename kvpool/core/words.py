"""The demo's word-level tokenizer: ``"w17"`` is token ``17 + 4``, anything else ``<unk>``.

Why: the demo runs with no hub download, on the reference model or on the tiny random-weight
Llama of ``kvpool.connectors.vllm_testing``, whose tokenizer is exactly this word level
(``<unk> <s> </s> <pad>``, then ``w0..``). The router tokenizes every prompt itself (it hashes
the tokens to find the cached prefix) and sends token ids to the engines, so both engines
see the same tokens for the same text, and the same ids always print the same text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID = 0
_WORD = re.compile(r"w(\d{1,9})")


@dataclass(frozen=True)
class WordTokenizer:
    """``words`` words after the special tokens (ids ``4 .. 4 + words - 1``)."""

    words: int

    def __post_init__(self) -> None:
        if self.words <= 0:
            raise InvalidArgument(f"a tokenizer needs at least one word, got {self.words}")

    @staticmethod
    def for_vocab(vocab_size: int, max_words: int = 2000) -> WordTokenizer:
        return WordTokenizer(min(max_words, vocab_size - len(SPECIAL_TOKENS)))

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            m = _WORD.fullmatch(word)
            n = int(m.group(1)) if m else -1
            ids.append(n + len(SPECIAL_TOKENS) if 0 <= n < self.words else UNK_ID)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.piece(i) for i in ids)

    def piece(self, token_id: int) -> str:
        if 0 <= token_id < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id]
        return f"w{token_id - len(SPECIAL_TOKENS)}"


def render_chat(messages: Sequence[dict[str, str]]) -> str:
    """The tiny model's chat template (``vllm_testing.CHAT_TEMPLATE``), with the generation prompt."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
