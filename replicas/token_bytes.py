"""The bytes each token stands for (what a chat answer's ``logprobs`` give as ``bytes``).

A byte-level BPE (GPT-2's and Qwen's kind, which Dream and SDAR use) and a SentencePiece
model with byte fallback split a character's UTF-8 bytes over several tokens. Decoding one
such token alone gives U+FFFD, whose bytes are not the token's; yet OpenAI's ``bytes`` field
exists for exactly these tokens: a client joins consecutive tokens' bytes to get the
characters back. So the bytes come from the token's own piece, read through the byte-level
alphabet or from a ``<0xAB>`` byte-fallback piece; any other token's are its decoded text's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """Each character a byte-level pre-tokenizer writes, back to its byte: the printable
    Latin-1 bytes stand for themselves, the other bytes, in order, for U+0100, U+0101, ..."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = sorted(set(range(256)) - set(kept))
    return {chr(b): b for b in kept} | {chr(0x100 + i): b for i, b in enumerate(shifted)}


def _decoder_types(tokenizer) -> set[str]:
    """The types of a fast tokenizer's decoder and of its parts (none for a slow one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return {decoder.get("type")} | {part.get("type") for part in decoder.get("decoders") or ()}


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """A function of a token id to the bytes it stands for, for this tokenizer."""
    types = _decoder_types(tokenizer)
    alphabet = byte_level_alphabet() if "ByteLevel" in types else None
    byte_fallback = "ByteFallback" in types

    def of(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if alphabet is not None and piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        if byte_fallback and piece and (match := BYTE_FALLBACK_PIECE.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        return tokenizer.decode([token_id]).encode()

    return of
