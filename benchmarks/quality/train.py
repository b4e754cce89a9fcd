"""Train the quality lab's MoE model from scratch on the corpus, within a wall-clock budget.

    python -m benchmarks.quality.train --preset h200 --out runs/quality --budget-s 510

Builds the corpus manifest and the tokenizer, trains a transformers Qwen3-MoE (bf16 autocast on
CUDA, fp32 on CPU) with AdamW, logs validation loss, stops before the budget with time left to
save, and writes `<out>/model` (bf16 safetensors + tokenizer, loadable by transformers) and
`<out>/training.json` (corpus and tokenizer hashes, token counts, losses, samples, provenance).
The learning-rate schedule follows elapsed time by default; `--max-steps` makes it follow steps
(then the run is step-for-step reproducible from the seed, up to GPU nondeterminism).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.quality.corpus import Corpus
from benchmarks.quality.data import WindowSampler, prompt_set, validation_windows
from benchmarks.quality.presets import PRESETS, TrainPreset
from benchmarks.quality.provenance import provenance
from benchmarks.quality.tokenizer import (END_OF_TEXT, PAD, encode_documents, load_tokenizer_file, save_hf_tokenizer,
                                          tokenizer_hash, train_tokenizer)
from benchmarks.quality.train_experts import use_padded_experts

SAVE_RESERVE_S = 30.0  # kept free at the end of the budget for the last evaluation, samples and saving
SAMPLE_PROMPTS = 4
SAMPLE_PROMPT_TOKENS = 24
SAMPLE_NEW_TOKENS = 64


def learning_rate(preset: TrainPreset, progress: float) -> float:
    """Linear warm-up over `warmup_fraction`, then cosine decay to `min_lr_ratio` at progress 1."""
    if progress < preset.warmup_fraction:
        return preset.learning_rate * progress / preset.warmup_fraction
    decay = (progress - preset.warmup_fraction) / (1.0 - preset.warmup_fraction)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(decay, 1.0)))
    return preset.learning_rate * (preset.min_lr_ratio + (1.0 - preset.min_lr_ratio) * cosine)


def optimizer_for(model: torch.nn.Module, preset: TrainPreset, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2) only, not on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": preset.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=preset.learning_rate, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


@torch.no_grad()
def validation_loss(model, windows: torch.Tensor, device: torch.device, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over every position of the validation windows."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        ids = chunk.to(device)  # [b, L]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids).logits[:, :-1].float()  # [b, L-1, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += ids[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: torch.Tensor, device: torch.device) -> list[dict]:
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = model.generate(input_ids=prompts.to(device), max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(prompts, device=device))
    model.train()
    width = prompts.shape[1]
    return [{"prompt": tokenizer.decode(row[:width].tolist()), "continuation": tokenizer.decode(row[width:].tolist())}
            for row in out.cpu()]


def prepare(corpus: Corpus, preset: TrainPreset, out: Path):
    """Manifest, tokenizer (saved under out/model) and the two token arrays."""
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "corpus_manifest.json").write_text(json.dumps(corpus.manifest(), indent=1) + "\n", encoding="utf-8")
    train_texts, val_texts = corpus.texts("train"), corpus.texts("validation")
    tokenizer = train_tokenizer(train_texts, preset.vocab_size)
    save_hf_tokenizer(tokenizer, out / "model", preset.seq_len)
    tokenizer = load_tokenizer_file(out / "model" / "tokenizer.json")  # as saved: the hash names this file
    return tokenizer, encode_documents(tokenizer, train_texts), encode_documents(tokenizer, val_texts), val_texts


def train(preset: TrainPreset, out: Path, budget_s: float, seed: int, device: torch.device,
          corpus_root: Path | None = None, max_steps: int | None = None, log=print) -> dict:
    started = time.monotonic()
    import transformers

    corpus = Corpus(corpus_root, preset.corpus_packages)
    tokenizer, train_ids, val_ids, val_texts = prepare(corpus, preset, out)
    log(f"corpus {corpus.corpus_hash[:16]}: {len(train_ids):,} train / {len(val_ids):,} validation tokens "
        f"({time.monotonic() - started:.0f} s)")
    torch.manual_seed(seed)
    config = preset.model_config(tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(END_OF_TEXT),
                                 tokenizer.token_to_id(PAD))
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    use_padded_experts(model)
    model.train()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    optimizer = optimizer_for(model, preset, device)
    sampler = WindowSampler(train_ids, preset.seq_len, preset.batch_size, seed, device)
    windows = validation_windows(val_ids, preset.seq_len, preset.eval_windows)
    history, train_losses = [], []
    best = BestWeights()
    train_started = time.monotonic()
    deadline = started + budget_s - SAVE_RESERVE_S
    last_eval, step, step_s = train_started, 0, 0.0
    while max_steps is None or step < max_steps:
        now = time.monotonic()
        if now + step_s > deadline:
            break
        progress = step / max_steps if max_steps else (now - train_started) / max(deadline - train_started, 1e-9)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(preset, progress)
        ids = sampler.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            output = model(input_ids=ids, labels=ids)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_losses.append(float(output.loss.detach()))  # syncs once per step; also paces the time checks
        step_s = time.monotonic() - now
        if preset.eval_every_s and time.monotonic() - last_eval >= preset.eval_every_s:
            history.append(_evaluation(model, windows, device, preset, step, train_started, train_losses, log))
            best.offer(model, history[-1])
            last_eval = time.monotonic()
    train_s = time.monotonic() - train_started
    history.append(_evaluation(model, windows, device, preset, step, train_started, train_losses, log))
    best.offer(model, history[-1])
    selected = best.restore(model)
    log(f"keeping the weights of step {selected['step']} (validation loss {selected['validation_loss']:.4f})")
    model.config.output_router_logits = False  # inference needs no load-balancing loss
    try:  # the samples are a look at the model, not part of it: a failure here must not lose the run
        samples = greedy_samples(model, tokenizer,
                                 prompt_set(tokenizer, val_texts, SAMPLE_PROMPTS, SAMPLE_PROMPT_TOKENS), device)
    except Exception as error:  # noqa: BLE001 - recorded in training.json and printed
        samples = [{"error": f"{type(error).__name__}: {error}"}]
        log(f"greedy samples failed: {samples[0]['error']}")
    model.to(torch.bfloat16).save_pretrained(str(out / "model"))
    record = {
        "preset": preset.as_dict(), "seed": seed, "budget_s": budget_s, "max_steps": max_steps,
        "schedule": "steps" if max_steps else "elapsed time",
        "corpus_hash": corpus.corpus_hash, "corpus_python": corpus.manifest()["python_version"],
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "tokens": {"train": int(len(train_ids)), "validation": int(len(val_ids)),
                   "seen": step * preset.batch_size * preset.seq_len,
                   "validation_evaluated": int(windows.numel())},
        "steps": step, "train_seconds": round(train_s, 1),
        "tokens_per_second": round(step * preset.batch_size * preset.seq_len / max(train_s, 1e-9)),
        "corpus_packages": list(preset.corpus_packages),
        "validation": history, "selected": selected, "final_validation_loss": selected["validation_loss"],
        "samples": samples, "provenance": provenance(device), "wall_seconds": round(time.monotonic() - started, 1),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log(f"saved {out / 'model'} after {step} steps ({record['tokens_per_second']:,} tokens/s), "
        f"validation loss {record['final_validation_loss']:.4f}")
    return record


class BestWeights:
    """The weights at the lowest validation loss seen so far (a CPU copy), to restore at the end."""

    def __init__(self):
        self.entry: dict | None = None
        self.state: dict[str, torch.Tensor] | None = None

    def offer(self, model: torch.nn.Module, entry: dict) -> None:
        if self.entry is None or entry["validation_loss"] < self.entry["validation_loss"]:
            self.entry = entry
            self.state = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}

    def restore(self, model: torch.nn.Module) -> dict:
        model.load_state_dict(self.state)
        return self.entry


def _evaluation(model, windows, device, preset, step, train_started, train_losses, log) -> dict:
    loss = validation_loss(model, windows, device, preset.batch_size)
    recent = train_losses[-50:]
    entry = {"step": step, "seconds": round(time.monotonic() - train_started, 1), "validation_loss": loss,
             "train_loss_recent": sum(recent) / len(recent) if recent else None}
    log(json.dumps(entry))
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=510.0, help="wall-clock budget for the whole script")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--corpus-root", type=Path, default=None, help="default: this Python's stdlib")
    args = parser.parse_args(argv)
    train(PRESETS[args.preset], args.out, args.budget_s, args.seed, torch.device(args.device), args.corpus_root,
          args.max_steps, log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
