"""Train sits' tiny demo Mixture-of-Experts model on the Python standard library.

One responsibility: produce the checkpoint directory shipped as ``src/sits/demo_model``: a
transformers ``Qwen3MoeForCausalLM`` (8 experts, top-2) with a byte-level BPE tokenizer, trained
from scratch on the ``.py`` files of the standard library of the interpreter that runs this
script (PSF licence), and a model card describing exactly how it was made.

Invariants:
- Reproducible: fixed seeds, files read in sorted order, held-out files chosen by a hash of
  their relative path (``sha256(path) % 100 < held_out_percent``), never by chance. Bit-exact
  replay is limited only by GPU kernel non-determinism and by the wall-clock cap (which may end
  training at a different step on a slower machine).
- Special tokens are ids 0 ``<|endoftext|>`` (eos and pad), 1 ``<|im_start|>``, 2 ``<|im_end|>``.
- The output directory holds exactly: config.json, model.safetensors (bfloat16),
  generation_config.json, tokenizer.json, tokenizer_config.json (with a ChatML chat_template),
  README.md (model card). The saved weights are those with the lowest held-out loss seen.
- The whole script ends within ``--max-total-minutes`` (training stops early enough).

Usage (GPU, about 10 minutes at most):  python3 tools/train_demo.py --out DIR
Usage (CPU check, under a minute):      python3 tools/train_demo.py --smoke --out /tmp/demo
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import random
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Every knob of one training run (command-line flags, smoke overrides applied).

    Attributes:
        out_dir: directory that receives the checkpoint files and README.md.
        seed: seed for python, torch and the batch sampler.
        max_files: 0 = all stdlib files, else the first N training files (sorted).
        held_out_percent: a file is held out when sha256(relative path) % 100 < this.
        vocab_size: BPE vocabulary size, special tokens included.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim: transformer shape.
        num_experts, top_k, moe_intermediate_size: MoE shape (every layer is sparse).
        max_position_embeddings: RoPE positions the saved config advertises.
        seq_len_tokens, batch_size: one step sees batch_size windows of seq_len_tokens.
        lr, min_lr_ratio, warmup_steps, weight_decay, grad_clip: AdamW with linear warmup
            then cosine decay to lr * min_lr_ratio.
        attention_dropout: used while training only (saved config says 0.0).
        aux_loss_coef: weight of the Switch-Transformer load-balancing loss.
        max_steps: the cosine schedule's length; training stops there at the latest.
        train_minutes: wall-clock budget of the training loop; the schedule follows
            whichever of steps or time is further along.
        max_total_minutes: the whole script (data, tokenizer, training, saving, samples)
            ends within about this; training stops `reserve_s` before it.
        eval_every_steps: held-out evaluation period.
        patience_evals: stop after this many evaluations without a new best (0 = never).
        smoke: tiny CPU-sized run that checks every code path.
    """

    out_dir: Path
    seed: int = 1234
    max_files: int = 0
    held_out_percent: int = 3
    vocab_size: int = 8192
    num_layers: int = 5
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seq_len_tokens: int = 512
    batch_size: int = 32
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    attention_dropout: float = 0.1
    aux_loss_coef: float = 0.01
    max_steps: int = 4000
    train_minutes: float = 9.0
    max_total_minutes: float = 9.6
    reserve_s: float = 40.0
    eval_every_steps: int = 100
    patience_evals: int = 10
    smoke: bool = False


# Smoke mode: every code path on a CPU in well under a minute (the result is useless).
# fmt: off
SMOKE_OVERRIDES = dict(
    max_files=40, vocab_size=512, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
    head_dim=32, moe_intermediate_size=32, max_position_embeddings=256, seq_len_tokens=64,
    batch_size=4, warmup_steps=5, max_steps=30, train_minutes=0.5, max_total_minutes=1.0,
    reserve_s=10.0, eval_every_steps=10,
)
# fmt: on


@dataclass(frozen=True, slots=True)
class Corpus:
    """The stdlib sources split into training and held-out files.

    Attributes:
        root: the stdlib directory (sysconfig "stdlib" path).
        train: (relative posix path, text) pairs, sorted by path.
        held_out: same, for the held-out files.
        num_skipped_files: files that could not be decoded as Python source.
    """

    root: Path
    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    num_skipped_files: int


def is_held_out(rel_path: str, held_out_percent: int) -> bool:
    """Deterministic split: True when int(sha256(rel_path utf-8)) % 100 < held_out_percent."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % 100 < held_out_percent


def collect_corpus(cfg: TrainConfig) -> Corpus:
    """Read every stdlib ``.py`` file outside test dirs and site-packages, in sorted order.

    Files are decoded with their PEP 263 coding cookie (``tokenize.open``); undecodable ones
    are skipped and counted. Smoke mode keeps the first ``max_files`` training files and at
    most two held-out files.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    train: list[tuple[str, str]] = []
    held_out: list[tuple[str, str]] = []
    num_skipped = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_DIRS for part in path.relative_to(root).parts[:-1]):
            continue
        try:
            with tokenize.open(path) as f:
                text = f.read()
        except (OSError, SyntaxError, UnicodeDecodeError):
            num_skipped += 1
            continue
        if not text.strip():
            continue
        (held_out if is_held_out(rel, cfg.held_out_percent) else train).append((rel, text))
    if cfg.max_files:
        train, held_out = train[: cfg.max_files], held_out[:2]
    if not train or not held_out:
        raise RuntimeError(f"no usable stdlib sources under {root}")
    return Corpus(root=root, train=train, held_out=held_out, num_skipped_files=num_skipped)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style pre-tokenization, no prefix space) on `texts`.

    Returns a ``tokenizers.Tokenizer`` whose ids 0, 1, 2 are SPECIAL_TOKENS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == expected_id, token
    return tok


def tokenizer_config_dict(max_len_tokens: int) -> dict:
    """The tokenizer_config.json content: fast tokenizer, eos = pad = id 0, ChatML template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len_tokens,
        "chat_template": CHAT_TEMPLATE,
    }


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """Concatenate the token ids of `texts`, each followed by EOS_ID.

    Returns: [num_tokens] int64 on the CPU.
    """
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int64)


def build_model(cfg: TrainConfig):
    """A freshly initialised ``Qwen3MoeForCausalLM`` (float32 weights, eager experts loop).

    The eager experts loop runs its linears under autocast; the grouped-mm path would cast
    activations to the float32 master weights instead.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_cfg = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,  # unused: every layer is sparse
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_dropout=cfg.attention_dropout,
        router_aux_loss_coef=cfg.aux_loss_coef,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    return Qwen3MoeForCausalLM._from_config(
        model_cfg, experts_implementation="eager", attn_implementation="sdpa"
    )


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from lr to lr * min_lr_ratio.

    `progress` in [0, 1] is how far the run is (the larger of step and time fractions).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices (>= 2 dims) only, betas (0.9, 0.95)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over positions.

    Args:
        logits: [batch, seq, vocab], any float dtype (upcast to float32).
        input_ids: [batch, seq] int64.
    """
    vocab = logits.shape[-1]
    shifted = logits[:, :-1].float().reshape(-1, vocab)  # [batch * (seq - 1), vocab]
    targets = input_ids[:, 1:].reshape(-1)  # [batch * (seq - 1)]
    return F.cross_entropy(shifted, targets)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Mean next-token loss (nats) over all held-out windows.

    Args:
        windows: [num_windows, seq] int64 on `device`, non-overlapping held-out chunks.
    """
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # [b, seq]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch, use_cache=False).logits  # [b, seq, vocab]
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += lm_loss(logits, batch).item() * n
        count += n
    model.train()
    return total / count


@dataclass(slots=True)
class TrainResult:
    """What the training loop reports back (mutable while training)."""

    best_state: dict[str, torch.Tensor]
    best_loss: float = float("inf")
    best_step: int = 0
    num_steps: int = 0
    num_tokens: int = 0
    train_s: float = 0.0
    curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)


def train(model, cfg, train_ids, held_windows, device, deadline_s: float) -> TrainResult:
    """Run the training loop; keep the weights with the lowest held-out loss.

    Args:
        train_ids: [num_train_tokens] int64 on `device`; batches are random windows of it.
        held_windows: [num_windows, seq] int64 on `device`.
        deadline_s: time.monotonic() value at which the loop must stop.
    """
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg, device)
    offsets = torch.arange(cfg.seq_len_tokens, device=device)  # [seq]
    t0 = time.monotonic()
    stop_at = min(t0 + 60.0 * cfg.train_minutes, deadline_s)
    result = TrainResult(best_state={})
    running, running_n, evals_since_best = 0.0, 0, 0
    print(f"{'step':>6} {'train':>7} {'held':>7} {'ppl':>8} {'lr':>9} {'tokens':>11} {'s':>6}")
    for step in range(cfg.max_steps + 1):
        now = time.monotonic()
        if step % cfg.eval_every_steps == 0 or step == cfg.max_steps or now >= stop_at:
            held = evaluate(model, held_windows, 2 * cfg.batch_size, device)
            result.curve.append((step, held, math.exp(held)))
            train_avg = f"{running / running_n:7.4f}" if running_n else f"{'-':>7}"
            print(
                f"{step:6d} {train_avg} {held:7.4f} {math.exp(held):8.2f} "
                f"{opt.param_groups[0]['lr']:9.2e} {result.num_tokens:11d} {now - t0:6.1f}",
                flush=True,
            )
            running, running_n = 0.0, 0
            if held < result.best_loss:
                result.best_loss, result.best_step, evals_since_best = held, step, 0
                result.best_state = {
                    k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                }
            else:
                evals_since_best += 1
            patience_over = cfg.patience_evals and evals_since_best >= cfg.patience_evals
            if step == cfg.max_steps or now >= stop_at or patience_over:
                break
        progress = max(step / cfg.max_steps, (now - t0) / (stop_at - t0))
        lr = lr_at(cfg, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            0, train_ids.numel() - cfg.seq_len_tokens, (cfg.batch_size,), generator=gen
        ).to(device)
        batch = train_ids[starts[:, None] + offsets[None, :]]  # [batch, seq]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(input_ids=batch, use_cache=False, output_router_logits=True)
            loss_lm = lm_loss(out.logits, batch)
            loss = loss_lm + cfg.aux_loss_coef * out.aux_loss.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        running += loss_lm.item()
        running_n += 1
        result.num_steps = step + 1
        result.num_tokens += batch.numel()
    result.train_s = time.monotonic() - t0
    return result


def save_checkpoint(model, fast_tokenizer_json: str, cfg: TrainConfig, out_dir: Path) -> None:
    """Write config, bf16 weights, generation config and tokenizer files flat into out_dir."""
    from transformers import GenerationConfig

    model.config.attention_dropout = 0.0
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        for name in ("model.safetensors", "generation_config.json"):
            shutil.copyfile(Path(tmp) / name, out_dir / name)
        model_cfg = json.loads((Path(tmp) / "config.json").read_text())
    # Hub Qwen3-MoE configs name the expert count "num_experts"; transformers 5 writes
    # "num_local_experts" (an alias). Keep both so either reader finds it.
    model_cfg["num_experts"] = model_cfg.get("num_local_experts", cfg.num_experts)
    (out_dir / "config.json").write_text(json.dumps(model_cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "tokenizer.json").write_text(fast_tokenizer_json, encoding="utf-8")
    tok_cfg = tokenizer_config_dict(cfg.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def generate_samples(out_dir: Path, device: torch.device) -> list[tuple[str, str]]:
    """Reload the saved checkpoint and greedy-decode 64 new tokens for each sample prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).to(device)
    model.eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False)
        samples.append((prompt, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)))
    return samples


def sha256_file(path: Path) -> str:
    """Hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_card(cfg, corpus, num_tokens, num_params, result, samples, command) -> str:
    """The README.md model card text (markdown).

    Args:
        num_tokens: (training tokens, held-out tokens), end-of-text separators included.
    """
    import tokenizers
    import transformers

    weights = cfg.out_dir / "model.safetensors"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not cfg.smoke else "CPU"
    curve = "\n".join(f"| {s} | {loss:.4f} | {ppl:.2f} |" for s, loss, ppl in result.curve)
    held_files = "\n".join(f"- `{rel}`" for rel, _ in corpus.held_out)
    sample_text = "\n\n".join(f"```python\n{p}{c}\n```" for p, c in samples)
    smoke_note = "\n**SMOKE RUN: not a usable model.**\n" if cfg.smoke else ""
    return f"""# sits demo model: tiny Python-completion Mixture-of-Experts

**What this is:** a tiny demo model ({num_params:,} parameters) trained from scratch in a few
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
{command}
```

- Corpus: the `.py` files of the Python {platform.python_version()} standard library \
(`{corpus.root}`), skipping directories named {", ".join(sorted(EXCLUDED_DIRS))}. \
PSF licence. {len(corpus.train)} training files ({num_tokens[0]:,} tokens), \
{len(corpus.held_out)} held-out files ({num_tokens[1]:,} tokens), \
{corpus.num_skipped_files} undecodable files skipped. Each file ends with `<|endoftext|>`.
- Held-out rule: a file is held out when \
`int(sha256(relative_posix_path).hexdigest(), 16) % 100 < {cfg.held_out_percent}`. \
The tokenizer was trained on the training files only.
- Optimisation: AdamW (betas 0.9/0.95, weight decay {cfg.weight_decay}), peak lr {cfg.lr}, \
{cfg.warmup_steps} warmup steps then cosine to {cfg.min_lr_ratio}x, bf16 autocast, \
{cfg.batch_size} random {cfg.seq_len_tokens}-token windows per step, \
load-balancing loss x{cfg.aux_loss_coef}, attention dropout {cfg.attention_dropout} \
(training only), seed {cfg.seed}.
- Ran {result.num_steps} steps ({result.num_tokens:,} tokens) in {result.train_s:.0f} s on \
{gpu}; Python {platform.python_version()}, torch {torch.__version__}, \
transformers {transformers.__version__}, tokenizers {tokenizers.__version__}. \
The saved weights are those of step {result.best_step}, the lowest held-out loss.

**Held-out loss {result.best_loss:.4f} nats/token, perplexity {math.exp(result.best_loss):.2f}**
(per BPE token, over non-overlapping {cfg.seq_len_tokens}-token windows of the held-out files).

| step | held-out loss | perplexity |
| --- | --- | --- |
{curve}

Held-out files:

{held_files}

## Greedy samples (64 new tokens, transformers `generate`)

{sample_text}
"""


def parse_args(argv: list[str]) -> TrainConfig:
    """Command line -> TrainConfig (every TrainConfig field is a --flag)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (< 1 minute)")
    for field in dataclasses.fields(TrainConfig):
        if field.name in ("out_dir", "smoke"):
            continue
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=None)
    args = parser.parse_args(argv)
    values = dict(SMOKE_OVERRIDES) if args.smoke else {}
    for field in dataclasses.fields(TrainConfig):
        given = getattr(args, field.name, None)
        if given is not None and field.name not in ("out_dir", "smoke"):
            values[field.name] = given
    return TrainConfig(out_dir=args.out, smoke=args.smoke, **values)


def seed_everything(seed: int) -> None:
    """Seed python's and torch's generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def main(argv: list[str] | None = None) -> int:
    """Entry point: corpus -> tokenizer -> model -> train -> save -> card -> samples."""
    script_t0 = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg.out_dir.mkdir(parents=True, exist_ok=True)

    corpus = collect_corpus(cfg)
    tok = train_tokenizer([t for _, t in corpus.train], cfg.vocab_size)
    train_ids = encode_stream(tok, [t for _, t in corpus.train])
    held_ids = encode_stream(tok, [t for _, t in corpus.held_out])
    num_windows = held_ids.numel() // cfg.seq_len_tokens
    held_windows = held_ids[: num_windows * cfg.seq_len_tokens].view(num_windows, -1)
    print(
        f"python {platform.python_version()} stdlib {corpus.root}: "
        f"{len(corpus.train)} train files ({train_ids.numel()} tokens), "
        f"{len(corpus.held_out)} held-out files ({held_ids.numel()} tokens, "
        f"{num_windows} windows), {corpus.num_skipped_files} skipped; device {device}; "
        f"prep {time.monotonic() - script_t0:.1f}s",
        flush=True,
    )

    model = build_model(cfg).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params} ({num_params * 2 / 2**20:.2f} MiB in bf16)", flush=True)
    deadline = script_t0 + 60.0 * cfg.max_total_minutes - cfg.reserve_s
    result = train(model, cfg, train_ids.to(device), held_windows.to(device), device, deadline)
    model.load_state_dict(result.best_state)
    print(
        f"best held-out loss {result.best_loss:.4f} (ppl {math.exp(result.best_loss):.2f}) "
        f"at step {result.best_step}; {result.num_steps} steps, {result.num_tokens} tokens, "
        f"{result.train_s:.1f}s",
        flush=True,
    )

    save_checkpoint(model, tok.to_str(), cfg, cfg.out_dir)
    samples = generate_samples(cfg.out_dir, device)
    command = shlex.join(["python3", "tools/train_demo.py", *argv])
    card = model_card(
        cfg, corpus, (train_ids.numel(), held_ids.numel()), num_params, result, samples, command
    )
    (cfg.out_dir / "README.md").write_text(card, encoding="utf-8")
    for prompt, completion in samples:
        print(f"--- prompt: {prompt!r}\n{prompt}{completion}\n", flush=True)
    written = sorted(p.name for p in cfg.out_dir.iterdir())
    print(f"total {time.monotonic() - script_t0:.1f}s; wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
