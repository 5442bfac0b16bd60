"""Train sits' tiny demo Mixture-of-Experts model on permissively licensed Python source.

One responsibility: produce the checkpoint directory shipped as ``src/sits/demo_model``: a
transformers ``Qwen3MoeForCausalLM`` (8 experts, top-2) with a byte-level BPE tokenizer, trained
from scratch on the standard library of the interpreter that runs this script (PSF licence)
plus the permissively licensed packages installed for it (``tools/demo_corpus.py`` picks and
reads them), and a model card describing exactly how it was made.

Invariants:
- Reproducible: fixed seeds, files chosen and ordered by path and sha256, held-out stdlib files
  chosen by a hash of their relative path, never by chance. Bit-exact replay is limited by GPU
  kernel non-determinism and by the wall-clock cap (a slower machine stops at another step).
- Special tokens are ids 0 ``<|endoftext|>`` (eos and pad), 1 ``<|im_start|>``, 2 ``<|im_end|>``.
- The output directory holds exactly: config.json, model.safetensors (bfloat16),
  generation_config.json, tokenizer.json, tokenizer_config.json (with a ChatML chat_template),
  README.md (model card). The saved weights are those with the lowest held-out loss seen.
- Training may run the experts through a grouped matmul (``tools/demo_experts.py``) instead of
  transformers' per-expert loop; it is used only when a probe on the first batch shows the same
  loss and gradients as the loop and a higher speed. The saved checkpoint does not depend on it.
- An error late in training does not lose the run: the best weights so far are saved and the
  model card says why training stopped.
- The whole script ends within ``--max-total-minutes`` (training stops early enough).

Usage (GPU, about 10 minutes at most):  python3 tools/train_demo.py --out DIR
Usage (CPU check, about a minute):      python3 tools/train_demo.py --smoke --out /tmp/demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_card  # noqa: E402
import demo_corpus as corpus_lib  # noqa: E402
import demo_experts  # noqa: E402

EOS_ID = corpus_lib.EOS_ID


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Every knob of one training run (command-line flags, smoke overrides applied).

    Attributes:
        out_dir: directory that receives the checkpoint files and README.md.
        seed: seed for python, torch and the batch sampler.
        max_files: 0 = all stdlib files, else the first N training files (sorted).
        held_out_percent: a stdlib file is held out when sha256(relative path) % 100 < this.
        max_package_total_mb, max_package_mb: caps on the package source bytes read (all
            packages together, one package); 0 total = standard library only.
        max_file_kb: package files larger than this are skipped.
        tokenizer_sample_mb: package bytes added to the stdlib for tokenizer training.
        num_workers: processes that read and tokenize package files (0 = usable CPUs).
        vocab_size: BPE vocabulary size, special tokens included.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim: transformer shape.
        num_experts, top_k, moe_intermediate_size: MoE shape (every layer is sparse).
        max_position_embeddings: RoPE positions the saved config advertises.
        seq_len_tokens, batch_size: one step sees batch_size windows of seq_len_tokens.
        lr, min_lr_ratio, warmup_steps, weight_decay, grad_clip: AdamW with linear warmup
            then cosine decay to lr * min_lr_ratio.
        attention_dropout: used while training only (saved config says 0.0).
        aux_loss_coef: weight of the Switch-Transformer load-balancing loss.
        experts: "auto" (probe the grouped matmul against the loop, keep the faster if they
            agree) or "eager" (transformers' per-expert loop).
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
    max_package_total_mb: float = 700.0
    max_package_mb: float = 32.0
    max_file_kb: int = 200
    tokenizer_sample_mb: float = 32.0
    num_workers: int = 0
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
    batch_size: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    attention_dropout: float = 0.0
    aux_loss_coef: float = 0.01
    experts: str = "auto"
    max_steps: int = 100000
    train_minutes: float = 9.0
    max_total_minutes: float = 9.6
    reserve_s: float = 40.0
    eval_every_steps: int = 200
    patience_evals: int = 10
    smoke: bool = False


# Smoke mode: every code path on a CPU in about a minute (the result is useless).
# fmt: off
SMOKE_OVERRIDES = dict(
    max_files=40, max_package_total_mb=2.0, max_package_mb=0.5, tokenizer_sample_mb=0.5,
    vocab_size=512, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
    head_dim=32, moe_intermediate_size=32, max_position_embeddings=256, seq_len_tokens=64,
    batch_size=4, warmup_steps=5, max_steps=30, train_minutes=0.5, max_total_minutes=1.5,
    reserve_s=10.0, eval_every_steps=10,
)
# fmt: on


@dataclass(slots=True)
class Data:
    """The prepared corpus (filled once by `prepare_data`).

    Attributes:
        stdlib: the standard library split (texts kept for the card's counts).
        tokenizer: the trained ``tokenizers.Tokenizer``.
        train_ids: [num_train_tokens] int32, stdlib training files then package files.
        held_ids: [num_held_tokens] int32, the held-out stdlib files.
        num_stdlib_train_tokens: tokens of train_ids that come from the standard library.
        packages: per-package stats; rejected: (name, version, licence) not used.
        skipped: package files skipped, by reason.
        prep_s: seconds spent preparing.
    """

    stdlib: corpus_lib.StdlibSplit
    tokenizer: object
    train_ids: np.ndarray
    held_ids: np.ndarray
    num_stdlib_train_tokens: int
    packages: list
    rejected: list
    skipped: dict
    prep_s: float


def prepare_data(cfg: TrainConfig) -> Data:
    """Stdlib split -> licensed packages -> tokenizer -> token streams (parallel where slow)."""
    import multiprocessing

    t0 = time.monotonic()
    num_workers = cfg.num_workers or corpus_lib.default_num_workers()
    stdlib = corpus_lib.read_stdlib(cfg.held_out_percent, cfg.max_files)
    packages, rejected = [], []
    if cfg.max_package_total_mb > 0:
        packages, rejected = corpus_lib.find_packages(
            max_file_bytes=cfg.max_file_kb * 1024,
            max_bytes_per_package=int(cfg.max_package_mb * 2**20),
            max_total_bytes=int(cfg.max_package_total_mb * 2**20),
        )
    with multiprocessing.get_context("fork").Pool(num_workers) as pool:
        sample = corpus_lib.read_tokenizer_sample(
            packages, int(cfg.tokenizer_sample_mb * 2**20), pool
        )
    print(
        f"[prep {time.monotonic() - t0:5.1f}s] {len(packages)} packages accepted "
        f"({sum(len(p.files) for p in packages)} files, "
        f"{sum(p.num_candidate_bytes for p in packages) / 2**20:.1f} MiB), "
        f"{len(rejected)} rejected; tokenizer sample {len(sample)} files",
        flush=True,
    )
    stdlib_texts = [t for _, t in stdlib.train]
    tok = corpus_lib.train_tokenizer(stdlib_texts + sample, cfg.vocab_size)
    stdlib_ids = corpus_lib.encode_texts(tok, stdlib_texts)
    held_ids = corpus_lib.encode_texts(tok, [t for _, t in stdlib.held_out])
    print(f"[prep {time.monotonic() - t0:5.1f}s] tokenizer trained", flush=True)
    seen = {corpus_lib._sha256_text(t) for _, t in stdlib.train + stdlib.held_out}
    package_ids, stats, skipped = corpus_lib.tokenize_packages(
        tok.to_str(), packages, seen, num_workers
    )
    train_ids = np.concatenate([stdlib_ids, package_ids])
    prep_s = time.monotonic() - t0
    print(
        f"[prep {prep_s:5.1f}s] python {platform.python_version()} stdlib {stdlib.root}: "
        f"{len(stdlib.train)} train files ({stdlib_ids.size} tokens), {len(stdlib.held_out)} "
        f"held-out files ({held_ids.size} tokens), {stdlib.num_skipped_files} skipped; "
        f"packages {sum(s.num_files for s in stats)} files ({package_ids.size} tokens), "
        f"skipped {dict(skipped)}; {num_workers} workers",
        flush=True,
    )
    return Data(stdlib, tok, train_ids, held_ids, int(stdlib_ids.size), stats, rejected,
                dict(skipped), prep_s)  # fmt: skip


def build_model(cfg: TrainConfig):
    """A freshly initialised ``Qwen3MoeForCausalLM`` (float32 weights, eager experts loop)."""
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


def train_step(model, opt, batch: torch.Tensor, cfg: TrainConfig, device) -> torch.Tensor:
    """One optimizer step on `batch` ([batch, seq] int64); returns the LM loss (no sync)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(input_ids=batch, use_cache=False, output_router_logits=True)
        loss_lm = lm_loss(out.logits, batch)
        loss = loss_lm + cfg.aux_loss_coef * out.aux_loss.float()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss_lm.detach()


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
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
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
    """Mean next-token loss (nats) over all held-out windows, through transformers' experts loop.

    Args:
        windows: [num_windows, seq] int64 on `device`, non-overlapping held-out chunks.
    """
    training_experts = model.config._experts_implementation
    model.set_experts_implementation("eager")
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # [b, seq]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch, use_cache=False).logits  # [b, seq, vocab]
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += lm_loss(logits, batch).item() * n
        count += n
    model.set_experts_implementation(training_experts)
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
    experts: str = "eager"
    error: str = ""
    curve: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)


def train(model, cfg, train_ids, held_windows, device, deadline_s: float) -> TrainResult:
    """Run the training loop; keep the weights with the lowest held-out loss.

    Args:
        train_ids: [num_train_tokens] int32 on `device`; batches are random windows of it.
        held_windows: [num_windows, seq] int64 on `device`.
        deadline_s: time.monotonic() value at which the loop must stop.
    """
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # on the GPU: no copy per step
    opt = make_optimizer(model, cfg, device)
    offsets = torch.arange(cfg.seq_len_tokens, device=device)  # [seq]

    def sample_batch() -> torch.Tensor:
        high = train_ids.numel() - cfg.seq_len_tokens
        starts = torch.randint(0, high, (cfg.batch_size,), generator=gen, device=device)
        return train_ids[starts[:, None] + offsets[None, :]].long()  # [batch, seq]

    result = TrainResult(best_state={})
    if cfg.experts == "eager":
        result.experts = "eager (requested)"
    else:
        result.experts = demo_experts.pick_experts(model, sample_batch(), lm_loss, device)
    print(f"experts: {result.experts}", flush=True)
    t0 = time.monotonic()
    try:
        _train_loop(model, cfg, opt, sample_batch, held_windows, device, deadline_s, result)
    except Exception as exc:  # noqa: BLE001 - an error late in training must not lose the run
        if not result.best_state:
            raise
        result.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"training stopped by an error, saving the best weights: {result.error}")
    result.train_s = time.monotonic() - t0
    return result


def _train_loop(model, cfg, opt, sample_batch, held_windows, device, deadline_s, result) -> None:
    """The steps and evaluations of `train`, filling `result`; stops on time, steps, patience.

    A step that fails in the grouped experts path switches to the loop and goes on; any other
    error propagates.
    """
    t0 = time.monotonic()
    stop_at = min(t0 + 60.0 * cfg.train_minutes, deadline_s)
    running = torch.zeros((), device=device)
    running_n, evals_since_best, last_eval = 0, 0, (t0, 0)
    header = f"{'step':>6} {'train':>7} {'held':>7} {'ppl':>8} {'lr':>9} {'tokens':>11} {'s':>6}"
    print(header + f" {'tok/s':>9}")
    for step in range(cfg.max_steps + 1):
        now = time.monotonic()
        if step % cfg.eval_every_steps == 0 or step == cfg.max_steps or now >= stop_at:
            held = evaluate(model, held_windows, 2 * cfg.batch_size, device)
            result.curve.append((step, held, math.exp(held)))
            train_avg = f"{running.item() / running_n:7.4f}" if running_n else f"{'-':>7}"
            rate = (result.num_tokens - last_eval[1]) / max(1e-9, now - last_eval[0])
            print(
                f"{step:6d} {train_avg} {held:7.4f} {math.exp(held):8.2f} "
                f"{opt.param_groups[0]['lr']:9.2e} {result.num_tokens:11d} {now - t0:6.1f} "
                f"{rate:9.0f}",
                flush=True,
            )
            running.zero_()
            running_n, last_eval = 0, (time.monotonic(), result.num_tokens)
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
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, progress)
        batch = sample_batch()  # [batch, seq]
        try:
            loss_lm = train_step(model, opt, batch, cfg, device)
        except Exception as exc:
            if not result.experts.startswith(demo_experts.GROUPED_EXPERTS):
                raise
            opt.zero_grad(set_to_none=True)
            result.experts = f"eager from step {step} (grouped failed: {exc!r:.200}); " + (
                result.experts
            )
            print(f"experts: {result.experts}", flush=True)
            model.set_experts_implementation("eager")
            continue
        running += loss_lm
        running_n += 1
        result.num_steps = step + 1
        result.num_tokens += batch.numel()


def save_checkpoint(model, fast_tokenizer_json: str, cfg: TrainConfig, out_dir: Path) -> None:
    """Write config, bf16 weights, generation config and tokenizer files flat into out_dir."""
    from transformers import GenerationConfig

    model.set_experts_implementation("eager")
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
    tok_cfg = corpus_lib.tokenizer_config_dict(cfg.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def generate_samples(out_dir: Path, device: torch.device) -> list[tuple[str, str]]:
    """Reload the saved checkpoint and greedy-decode 64 new tokens for each sample prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.bfloat16, experts_implementation="eager"
    ).to(device)
    model.eval()
    samples = []
    for prompt in demo_card.SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False)
        samples.append((prompt, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)))
    return samples


def parse_args(argv: list[str]) -> TrainConfig:
    """Command line -> TrainConfig (every TrainConfig field is a --flag)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint output directory")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (about a minute)")
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
    if values.get("experts", "auto") not in ("auto", "eager"):
        parser.error("--experts must be auto or eager")
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

    data = prepare_data(cfg)  # forks its workers before CUDA starts in this process
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    num_windows = data.held_ids.size // cfg.seq_len_tokens
    held = torch.from_numpy(data.held_ids[: num_windows * cfg.seq_len_tokens].astype(np.int64))
    held_windows = held.view(num_windows, -1)  # [num_windows, seq]
    byte_lengths = corpus_lib.token_byte_lengths(data.tokenizer)
    held_target_bytes = int(byte_lengths[held_windows[:, 1:].numpy()].sum())

    model = build_model(cfg).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params} ({num_params * 2 / 2**20:.2f} MiB in bf16)", flush=True)
    deadline = script_t0 + 60.0 * cfg.max_total_minutes - cfg.reserve_s
    train_ids = torch.from_numpy(data.train_ids).to(device)
    result = train(model, cfg, train_ids, held_windows.to(device), device, deadline)
    if result.error:  # the GPU context may be unusable: finish on the CPU
        device = torch.device("cpu")
        model = build_model(cfg)
    model.load_state_dict(result.best_state)
    nats_per_byte = result.best_loss * held_windows[:, 1:].numel() / held_target_bytes
    print(
        f"best held-out loss {result.best_loss:.4f} (ppl {math.exp(result.best_loss):.2f}, "
        f"{nats_per_byte:.4f} nats/byte) at step {result.best_step}; {result.num_steps} steps, "
        f"{result.num_tokens} tokens, {result.train_s:.1f}s",
        flush=True,
    )

    save_checkpoint(model, data.tokenizer.to_str(), cfg, cfg.out_dir)
    samples = generate_samples(cfg.out_dir, device)
    run = demo_card.RunFacts(
        command=shlex.join(["python3", "tools/train_demo.py", *argv]),
        num_params=num_params,
        device_name=device_name,
        held_windows=num_windows,
        nats_per_byte=nats_per_byte,
    )
    card = demo_card.model_card(cfg, data, result, samples, run)
    (cfg.out_dir / "README.md").write_text(card, encoding="utf-8")
    for prompt, completion in samples:
        print(f"--- prompt: {prompt!r}\n{prompt}{completion}\n", flush=True)
    written = sorted(p.name for p in cfg.out_dir.iterdir())
    print(f"total {time.monotonic() - script_t0:.1f}s; wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
