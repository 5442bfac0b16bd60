"""The demo model's model card (README.md of the checkpoint directory).

One responsibility: render, from one finished training run of ``tools/train_demo.py``, the
markdown that records what the model is, its files and their sha256, the exact command, the
corpus (standard library and every package with version, licence and token count, and the
packages refused), the held-out loss curve and greedy samples. Pure text: no training here.
"""

from __future__ import annotations

import hashlib
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import demo_corpus as corpus_lib

SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
)


@dataclass(frozen=True, slots=True)
class RunFacts:
    """Facts of one run that the config does not hold.

    Attributes:
        command: the command line, as run from the repository root.
        num_params: model parameters.
        device_name: the GPU's name, or "CPU".
        held_windows: held-out windows evaluated.
        nats_per_byte: best held-out loss per UTF-8 byte of the predicted tokens.
    """

    command: str
    num_params: int
    device_name: str
    held_windows: int
    nats_per_byte: float


def sha256_file(path: Path) -> str:
    """Hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _package_table(data) -> str:
    rows = [
        f"| {s.name} | {s.version} | {s.licence.replace('|', '/')} | {s.num_files:,} | "
        f"{s.num_tokens:,} |"
        for s in data.packages
        if s.num_files
    ]
    head = "| package | version | licence (metadata) | files | tokens |"
    return "\n".join([head, "| --- | --- | --- | --- | --- |", *rows]) if rows else "(none)"


def _rejected_list(data) -> str:
    if not data.rejected:
        return "(none)"
    return "; ".join(
        f"{name} {version} ({licence or '?'})" for name, version, licence in data.rejected
    )


def model_card(cfg, data, result, samples: list[tuple[str, str]], run: RunFacts) -> str:
    """The README.md model card text (markdown).

    Args:
        cfg: the run's TrainConfig; data: its prepared Data; result: its TrainResult.
        samples: (prompt, greedy completion) pairs.
    """
    import tokenizers
    import torch
    import transformers

    weights = cfg.out_dir / "model.safetensors"
    curve = "\n".join(f"| {s} | {loss:.4f} | {ppl:.2f} |" for s, loss, ppl in result.curve)
    held_files = "\n".join(f"- `{rel}`" for rel, _ in data.stdlib.held_out)
    sample_text = "\n\n".join(f"```python\n{p}{c}\n```" for p, c in samples)
    smoke_note = "\n**SMOKE RUN: not a usable model.**\n" if cfg.smoke else ""
    num_package_tokens = sum(s.num_tokens for s in data.packages)
    num_package_files = sum(s.num_files for s in data.packages)
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(data.skipped.items())) or "none"
    error_note = f" Stopped early by an error: {result.error}." if result.error else ""
    epochs = result.num_tokens / max(1, data.train_ids.size)
    return f"""# sits demo model: tiny Python-completion Mixture-of-Experts

**What this is:** a tiny demo model ({run.num_params:,} parameters) trained from scratch in a few
minutes, so that sits can serve a real Mixture-of-Experts checkpoint without downloading
anything. It only completes Python source code, and not well. It is not an assistant: the
ChatML chat template exists for API plumbing tests; its chat tokens were never trained.
{smoke_note}
## Files

- `model.safetensors`: bfloat16, {weights.stat().st_size:,} bytes, Hugging Face per-expert keys.
  sha256 `{sha256_file(weights)}`
- `config.json`: `Qwen3MoeForCausalLM`. {cfg.num_layers} layers, hidden {cfg.hidden_size}, \
{cfg.num_heads} query / {cfg.num_kv_heads} key-value heads of dim {cfg.head_dim}, \
{cfg.num_experts} experts of width {cfg.moe_intermediate_size}, top-{cfg.top_k}, \
norm_topk_prob, tied embeddings, RoPE theta 10000, {cfg.max_position_embeddings} positions.
- `tokenizer.json`, `tokenizer_config.json`: byte-level BPE, {cfg.vocab_size} tokens. Ids 0
  `<|endoftext|>` (eos and pad), 1 `<|im_start|>`, 2 `<|im_end|>`; ChatML chat template.
- `generation_config.json`: eos and pad id 0.

## Training

Command, run from the repository root (`--out` is only the destination):

```
{run.command}
```

Corpus ({data.train_ids.size:,} training tokens; each file ends with `<|endoftext|>`):

- The `.py` files of the Python {platform.python_version()} standard library \
(`{data.stdlib.root}`), skipping directories named \
{", ".join(sorted(corpus_lib.STDLIB_EXCLUDED_DIRS))}. PSF licence. \
{len(data.stdlib.train)} training files ({data.num_stdlib_train_tokens:,} tokens), \
{len(data.stdlib.held_out)} held-out files ({data.held_ids.size:,} tokens), \
{data.stdlib.num_skipped_files} undecodable files skipped.
- Held-out rule (unchanged from the first demo model): a standard library file is held out when \
`int(sha256(relative_posix_path).hexdigest(), 16) % 100 < {cfg.held_out_percent}`. \
Package files are never held out; one whose text equals a standard library file is dropped.
- The `.py` files of the installed distributions whose metadata names only permissive licences \
(PEP 639 `License-Expression` when present, else the `License` field and `License ::` \
classifiers): {num_package_files:,} files, {num_package_tokens:,} tokens. Skipped: directories \
named {", ".join(sorted(corpus_lib.PACKAGE_EXCLUDED_DIRS))}; `test_*.py`, `*_test.py`, \
`conftest.py`, `*_pb2.py`; files over {cfg.max_file_kb} KiB; and, when read: {skipped} \
(generated = a "generated"/"do not edit" marker in the first 2000 characters; long_lines = a \
line over {corpus_lib.MAX_LINE_CHARS} characters; duplicate = same text as a file kept before). \
At most {cfg.max_package_mb:g} MiB of source per package, {cfg.max_package_total_mb:g} MiB in all \
(files taken in sha256(name/path) order).

{_package_table(data)}

Distributions not used (licence metadata not permissive, or not recognised): \
{_rejected_list(data)}.

- Tokenizer: trained on the standard library training files plus a \
{cfg.tokenizer_sample_mb:g} MiB sample of the package files (sha256(name/path) order); never on \
held-out files.
- Optimisation: AdamW (betas 0.9/0.95, weight decay {cfg.weight_decay}), peak lr {cfg.lr}, \
{cfg.warmup_steps} warmup steps then cosine to {cfg.min_lr_ratio}x following elapsed time, \
bf16 autocast, {cfg.batch_size} random {cfg.seq_len_tokens}-token windows per step, \
load-balancing loss x{cfg.aux_loss_coef}, attention dropout {cfg.attention_dropout}, \
seed {cfg.seed}. Experts during training: {result.experts}.
- Ran {result.num_steps} steps ({result.num_tokens:,} tokens, {epochs:.2f} passes over the \
corpus) in {result.train_s:.0f} s on {run.device_name}; data preparation took \
{data.prep_s:.0f} s.{error_note} Python {platform.python_version()}, torch {torch.__version__}, \
transformers {transformers.__version__}, tokenizers {tokenizers.__version__}. \
The saved weights are those of step {result.best_step}, the lowest held-out loss. GPU kernels \
are not bit-deterministic and the schedule follows elapsed time, so a rerun is close, not equal.

**Held-out loss {result.best_loss:.4f} nats/token, perplexity {math.exp(result.best_loss):.2f}; \
{run.nats_per_byte:.4f} nats per UTF-8 byte** (over {run.held_windows} non-overlapping \
{cfg.seq_len_tokens}-token windows of the held-out files; per-token figures depend on the \
tokenizer, per-byte ones do not).

| step | held-out loss | perplexity |
| --- | --- | --- |
{curve}

Held-out files:

{held_files}

## Greedy samples (64 new tokens, transformers `generate`)

{sample_text}
"""
