"""The tiny tokenizer maker and the `Tokenizer` wrapper: ids, chat template (C11), one BOS (C12)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import sits
from sits.core.errors import InvalidParameterError, ModelNotFoundError
from sits.engine.tokenizer import Tokenizer
from sits.testing.tokenizer import save_tiny_tokenizer, save_tiny_tokenizer_with_bos

TEXT = "Hello, world! Café naïve 你好，世界 こんにちは 😀🚀 done."
MESSAGES = [
    {"role": "system", "content": "You are a terse pirate."},
    {"role": "user", "content": "Where is the treasure?"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok512")
    save_tiny_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok512bos")
    save_tiny_tokenizer_with_bos(path, 512)
    return path


@pytest.mark.parametrize("vocab_size", [512, 8000])
def test_tiny_tokenizer_vocab_and_special_ids(tmp_path: Path, vocab_size: int) -> None:
    save_tiny_tokenizer(tmp_path, vocab_size)
    tok = Tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == len(hf) == vocab_size
    assert hf.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 0, None)
    assert sorted(tok.all_special_ids) == [0, 1, 2]
    ids = tok.encode(TEXT)
    assert ids == hf.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert all(3 <= i < vocab_size for i in ids)
    # Special tokens in text are single ids, never split into bytes.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path / "a", 600)
    save_tiny_tokenizer(tmp_path / "b", 600)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_small_vocab_splits_multibyte_characters(tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    ids = tok.encode("你好😀")
    # 2 CJK characters (3 bytes each) and one emoji (4 bytes) need more than 3 tokens at 512.
    assert len(ids) > 3
    assert "\ufffd" in [tok.decode_token(i) for i in ids]
    assert tok.decode(ids) == "你好😀"


def test_too_small_vocab_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        save_tiny_tokenizer(tmp_path, 100)


def test_chat_template_matches_transformers_c11(tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    text = tok.render_chat(MESSAGES)
    assert text == (
        "<|im_start|>system\nYou are a terse pirate.<|im_end|>\n"
        "<|im_start|>user\nWhere is the treasure?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(MESSAGES)
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected_ids = expected["input_ids"] if not isinstance(expected, list) else expected
    assert ids == list(expected_ids)
    assert ids[-len(tok.encode("<|im_start|>assistant\n")) :] == tok.encode(
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("treasure?<|im_end|>\n")
    assert ids[: len(no_prompt)] == no_prompt


def test_chat_content_parts_render_like_strings(tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"text": "there"}]}]
    plain = [{"role": "user", "content": "Hi there"}]
    assert tok.render_chat(parts) == tok.render_chat(plain)


def test_bos_tokenizer_adds_exactly_one_bos_c12(bos_dir: Path) -> None:
    tok = Tokenizer(bos_dir)
    hf = AutoTokenizer.from_pretrained(bos_dir)
    bos = tok.bos_token_id
    assert bos == 3
    assert hf.convert_ids_to_tokens(bos) == "<|begin_of_text|>"
    assert tok.encode("hello")[0] == bos
    assert tok.encode("hello").count(bos) == 1
    assert tok.encode("hello", add_special_tokens=False)[0] != bos
    assert tok.render_chat(MESSAGES).startswith("<|begin_of_text|><|im_start|>system\n")
    ids = tok.apply_chat_template(MESSAGES)
    assert ids[0] == bos
    assert ids.count(bos) == 1
    assert ids[1] == 1  # <|im_start|>
    # Tokenizing the rendered text WITH special tokens would have doubled the BOS.
    assert tok.encode(tok.render_chat(MESSAGES))[:2] == [bos, bos]
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected_ids = expected["input_ids"] if not isinstance(expected, list) else expected
    assert len(ids) == len(expected_ids)


def test_empty_messages_raise(tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    with pytest.raises(InvalidParameterError) as info:
        tok.apply_chat_template([])
    assert info.value.param == "messages"


def test_no_chat_template_raises(tok_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tok_dir)
    hf.chat_template = None
    tok = Tokenizer(hf)
    assert not tok.has_chat_template
    with pytest.raises(InvalidParameterError, match="no chat template") as info:
        tok.apply_chat_template(MESSAGES)
    assert info.value.param == "messages"


def test_template_error_becomes_invalid_parameter(tok_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tok_dir)
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidParameterError, match="roles must alternate") as info:
        Tokenizer(hf).apply_chat_template(MESSAGES)
    assert info.value.param == "messages"


def test_decode_token_and_convert_ids(tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    hello = tok.encode("Hello")
    assert "".join(tok.decode_token(i) for i in hello) == "Hello"
    assert tok.decode_token(0) == "<|endoftext|>"
    assert tok.decode([0, *hello, 2]) == "Hello"
    assert tok.decode([0, *hello, 2], skip_special_tokens=False) == "<|endoftext|>Hello<|im_end|>"
    space_a = tok.encode(" a")
    assert len(space_a) == 1
    assert tok.convert_ids_to_tokens(space_a) == ["Ġa"]


def test_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        Tokenizer(tmp_path)  # exists but holds no tokenizer files


def test_a_text_longer_than_the_model_encodes_without_transformers_warning(caplog) -> None:
    """The server refuses such prompts itself (400); transformers' own warning only repeated
    it in the log. Same ids as transformers."""
    demo_dir = str(Path(sits.__file__).parent / "demo_model")  # model_max_length 2048
    tok = Tokenizer(demo_dir)
    text = "hello " * 3000
    with caplog.at_level(logging.WARNING):
        ids = tok.encode(text)
    warned = [r for r in caplog.records if "sequence length is longer" in r.getMessage()]
    with caplog.at_level(logging.WARNING):  # the check's own check: transformers does warn
        expected = AutoTokenizer.from_pretrained(demo_dir).encode(text)
    assert ids == expected and len(ids) > tok.hf_tokenizer.model_max_length
    assert warned == [] and "sequence length is longer" in caplog.text


@pytest.mark.parametrize("which", ["tiny", "tiny_bos", "demo"])
def test_decode_equals_transformers_decode_without_clean_up(which, tok_dir, bos_dir) -> None:
    """The Rust-backend fast path gives what transformers' decode gives, special tokens and
    split multi-byte characters included, with and without skip_special_tokens."""
    import random

    source = {"tiny": tok_dir, "tiny_bos": bos_dir}.get(which)
    source = source or Path(sits.__file__).parent / "demo_model"
    tok = Tokenizer(source)
    hf = AutoTokenizer.from_pretrained(source)
    assert tok._backend is not None  # the fast path is the one under test
    rng = random.Random(0)
    specials = [i for i in (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) if i is not None]
    windows = [tok.encode(TEXT, add_special_tokens=False)[i : i + 5] for i in range(0, 30, 3)]
    windows += [[rng.randrange(hf.vocab_size) for _ in range(rng.randint(1, 8))] + specials
                for _ in range(50)]  # fmt: skip
    for ids in windows:
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tok.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
