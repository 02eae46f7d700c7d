"""Tokenizers behind one small interface: `encode(text) -> list[int]`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`.

`byte` needs nothing: ids 0..255 are the UTF-8 bytes, then BOS, EOS, PAD (vocab 259). Anything else is the
path of a Hugging Face `tokenizers` JSON file (`tokenizer.json` of Llama, Mistral, GPT-2, ...).
"""

from __future__ import annotations

import hashlib
import os
from typing import Protocol, Sequence

from lumen_jax.data.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS=256, EOS=257, PAD=258."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Special-token spellings of the common model families, most specific first.
_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")
_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` loaded from its JSON file.

    BOS/EOS/PAD are found by their usual spellings (`<|begin_of_text|>`, `<s>`, `<bos>`, ...); PAD falls
    back to EOS (padding is always masked, its id never matters). `encode` adds no special tokens: the
    pipeline adds BOS/EOS itself, so a post-processor that prepends BOS would otherwise double it.
    """

    def __init__(self, path: str):
        import tokenizers  # only needed for this tokenizer

        if not os.path.isfile(path):
            raise DataError(f"data.tokenizer={path!r}: no such file; use 'byte' or the path of a "
                            "Hugging Face tokenizer.json")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"data.tokenizer={path!r}: not a Hugging Face tokenizers JSON file "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._find(_BOS, "BOS")
        self.eos_id = self._find(_EOS, "EOS")
        pad = [self._tok.token_to_id(t) for t in _PAD]
        self.pad_id = next((i for i in pad if i is not None), self.eos_id)

    def _find(self, names: tuple[str, ...], what: str) -> int:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        raise DataError(f"data.tokenizer={self.path!r} has no {what} token (looked for "
                        f"{', '.join(names)}); add one as a special token")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str, sha256: str = "") -> ByteTokenizer | HFTokenizer:
    """`'byte'` or the path of a Hugging Face tokenizers JSON file; with `sha256` (what a run recorded,
    `data.tokenizer_sha256`) the file must still hold exactly that, else one-line DataError."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if sha256 and os.path.isfile(path):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != sha256:
            raise DataError(f"data.tokenizer={spec!r} has sha256 {digest[:12]}, not the tokenizer the run recorded "
                            f"(sha256 {sha256[:12]}): the file changed since; put the run's tokenizer back at "
                            "that path (or pass data.tokenizer=PATH of a copy of it)")
    return HFTokenizer(path)
