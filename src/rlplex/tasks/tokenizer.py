"""A character-level tokenizer over the tasks' alphabet: no vocabulary files, no downloads."""

from __future__ import annotations

import string
from collections.abc import Sequence

from rlplex.errors import RlplexError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class CharTokenizer:
    specials = (PAD, BOS, EOS)
    alphabet = string.digits + string.ascii_lowercase + "+=:> "

    def __init__(self) -> None:
        self.id_to_token = [*self.specials, *self.alphabet]
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        try:
            ids = [self.token_to_id[ch] for ch in text]
        except KeyError as error:
            raise RlplexError(f"character {error.args[0]!r} is not in the tokenizer's alphabet") from None
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first EOS; special tokens are dropped."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(self.specials):
                out.append(self.id_to_token[i])
        return "".join(out)
