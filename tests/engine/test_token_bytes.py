"""`Tokenizer.token_bytes`: every token's own UTF-8 bytes, for byte-level BPE and byte fallback."""

from __future__ import annotations

import pytest

from sits.engine.tokenizer import Tokenizer
from sits.testing.tokenizer import save_tiny_tokenizer

TEXT = "x = 'héllo 世界 🙂'\n"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok512")
    save_tiny_tokenizer(path, 512)
    return Tokenizer(path)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback: ASCII letters and "▁" as pieces, every
    other byte as "<0xNN>"."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "abcdefghijklmnopqrstuvwxyz'=\n":
        vocab.setdefault(char, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Replace(" ", "▁")
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>"))


def test_byte_level_tokens_carry_their_bytes(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(TEXT)
    pieces = [byte_level.token_bytes(i) for i in ids]
    assert "\ufffd" in [byte_level.decode_token(i) for i in ids]  # split characters
    assert b"".join(pieces) == TEXT.encode("utf-8")
    assert not all(_is_utf8(piece) for piece in pieces)  # some hold part of a character
    assert byte_level.token_bytes(0) == b"<|endoftext|>"  # a special token: its text


def test_byte_fallback_pieces_are_their_byte() -> None:
    tok = _byte_fallback_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode("utf-8")
    head = pieces[: pieces.index(b"h") + 3]
    assert head == [b"x", b" ", b"=", b" ", b"'", b"h", b"\xc3", b"\xa9"]
