"""Tiny byte-level BPE tokenizers trained locally, for tests and demos (no download).

`save_tiny_tokenizer` trains a GPT-2-style byte-level BPE (Sennrich et al. 2016, "Neural Machine
Translation of Rare Words with Subword Units"; byte-level as in GPT-2) with the `tokenizers`
library on a built-in corpus and saves it as a transformers fast tokenizer with a ChatML chat
template. Invariants:
- ids 0, 1, 2 are "<|endoftext|>" (EOS and padding), "<|im_start|>", "<|im_end|>"; with
  `bos=True` id 3 is "<|begin_of_text|>", which encoding adds in front and the chat template
  also writes (the double-BOS trap of case C12).
- all 256 byte tokens are in the vocabulary, so every string encodes and decodes losslessly;
  characters of 2-4 UTF-8 bytes (accents, CJK, emoji) are often split across tokens.
- chat turns end with "<|im_end|>\n"; `add_generation_prompt` appends "<|im_start|>assistant\n".
- the same arguments on the same Python version give byte-identical files (the corpus includes
  standard library docstrings, which differ slightly between Python versions).
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|begin_of_text|>"

# ChatML; `bos_token` is written first only by the BOS variant's template.
_CHATML_BODY = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CHATML_TEMPLATE = _CHATML_BODY
CHATML_TEMPLATE_WITH_BOS = "{{- bos_token -}}" + _CHATML_BODY

_DOC_MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "math",
    "numbers",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "random",
    "re",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "traceback",
    "types",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "Once upon a time, there was a small model that wanted to serve many users at once.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Please answer the question briefly and politely.",
    "You are a helpful assistant.",
    "What is the weather like in Berlin this afternoon?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "def main() -> None:\n    print('hello')\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828",
)

_NON_ASCII = (
    "Café, naïve, façade, jalapeño, Straße, Müller, Ångström, crème brûlée, São Paulo.",
    "Žluťoučký kůň úpěl ďábelské ódy. Zażółć gęślą jaźń. Dziękuję bardzo!",
    "Привет, как дела? Спасибо, хорошо. Москва и Санкт-Петербург.",
    "Γειά σου κόσμε. Ελληνικά γράμματα: α β γ δ ε ζ η θ.",
    "你好，世界。今天天气很好。我们一起学习机器学习和自然语言处理。",
    "こんにちは世界。東京は日本の首都です。ありがとうございます。",
    "안녕하세요 세계. 감사합니다.",
    "مرحبا بالعالم. شكرا جزيلا.",
    "नमस्ते दुनिया। धन्यवाद।",
    "Emoji: 😀 😃 😄 😁 🚀 🎉 👍 ❤️ 🌍 🐍 🤖 ✨ 🔥 💡 👨‍👩‍👧‍👦 🇫🇷 🇯🇵",
)


def tiny_corpus() -> list[str]:
    """The training corpus: English sentences, non-ASCII lines and stdlib docstrings.

    Returns:
        Lines of text in a fixed order (non-ASCII lines repeated so that some multi-byte
        characters become whole tokens while others stay split into byte tokens).
    """
    lines: list[str] = []
    lines.extend(_SENTENCES * 4)
    lines.extend(_NON_ASCII * 8)
    with warnings.catch_warnings():  # some stdlib members warn when their docs are read
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in _DOC_MODULES:
            module = importlib.import_module(module_name)
            lines.extend((inspect.getdoc(module) or "").splitlines())
            for name, obj in sorted(vars(module).items()):
                if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                lines.extend((inspect.getdoc(obj) or "").splitlines())
    return lines


def save_tiny_tokenizer(path: str | os.PathLike[str], vocab_size: int, bos: bool = False) -> None:
    """Train a tiny byte-level BPE tokenizer and save it as a transformers fast tokenizer.

    Args:
        path: directory to write (tokenizer.json, tokenizer_config.json, chat_template.jinja);
            created if missing.
        vocab_size: vocabulary size asked of the BPE trainer (the result has exactly this many
            ids when the corpus allows, never more); at least 256 + number of special tokens.
        bos: when True, also add "<|begin_of_text|>" (id 3) as BOS: encoding with special
            tokens prepends it and the chat template writes it too.

    Raises:
        ValueError: vocab_size is too small to hold the byte alphabet and special tokens.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = [EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN] + ([BOS_TOKEN] if bos else [])
    min_vocab_size = 256 + len(special_tokens)
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size must be >= {min_vocab_size}, got {vocab_size}")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(tiny_corpus(), trainer=trainer)
    if bos:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, raw.token_to_id(BOS_TOKEN))],
        )
    assert [raw.token_to_id(t) for t in special_tokens] == list(range(len(special_tokens)))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS_TOKEN if bos else None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHATML_TEMPLATE_WITH_BOS if bos else CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(str(path))


def save_tiny_tokenizer_with_bos(path: str | os.PathLike[str], vocab_size: int) -> None:
    """`save_tiny_tokenizer(path, vocab_size, bos=True)`: a tokenizer that adds BOS (case C12)."""
    save_tiny_tokenizer(path, vocab_size, bos=True)
