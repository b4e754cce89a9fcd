"""Quality of W2, FP4 and the gate against the FP4 checkpoint, on held-out text and greedy generations.

    python -m benchmarks.quality.evaluate --checkpoint benchmarks/quality/checkpoint \
        --out benchmarks/results/quality.json --trace-dir benchmarks/results/quality-traces

Configurations (`CONFIGURATIONS`) are weight substitutions in the transformers model: a base
precision per expert tensor (variants.py), an optional static FP4 pool (the hottest fraction of
all (layer, expert) pairs by the reference's routing counts on training-split windows) and an
optional gate threshold (decoding.py). Sections of the JSON:
- `heldout`: teacher-forced validation windows, full forwards (configurations without a gate);
- `heldout_decode`: the first validation windows decoded token by token, teacher-forced, with the
  gate where configured (all configurations, so gated and ungated rows are comparable);
- `generation`: the reference's greedy continuations of the fixed prompts, scored by each
  configuration (agreement with the reference's picks, perplexity), and each configuration's own
  greedy continuation judged by the degeneration detector;
- `codebook`: the per-tensor codebook report over every expert tensor, and its summary;
- routing traces of greedy generation (tierstore-trace-v1 npz) for the configurations in TRACED.
The corpus and tokenizer must be those the checkpoint was trained on (hash check), else it refuses.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.quality import degeneration
from benchmarks.quality.checkpoint_model import load_model
from benchmarks.quality.corpus import Corpus, CorpusMismatchError, require_same_corpus
from benchmarks.quality.data import leading_windows, prompt_set, validation_windows
from benchmarks.quality.decoding import DecodeResult, GatedDecoder, compare, teacher_forced_logits
from benchmarks.quality.provenance import provenance
from benchmarks.quality.tokenizer import encode_documents, load_tokenizer_file, tokenizer_hash
from benchmarks.quality.variants import CheckpointExperts
from tierstore.formats import summarise_codebook_reports
from tierstore.sim import TraceRecorder

REFERENCE = "fp4_checkpoint"
UPGRADE = "fp4_tier"  # what a pool slot or a gate fire serves: tierstore's FP4 tier
GATE_TAUS = (0.4, 0.6, 0.75, 1.0)
POOL_FRACTIONS = (0.10, 0.25, 0.50)
GATED_POOL_FRACTION = 0.25
TRACED = ("fp4_checkpoint", "w2_sym")


@dataclass(frozen=True)
class Configuration:
    name: str
    base: str  # a precision of variants.PRECISIONS
    pool_fraction: float = 0.0  # share of all (layer, expert) pairs held at FP4
    gate_tau: float | None = None

    @property
    def fp4_prefill(self) -> bool:
        return self.gate_tau is not None  # gated serving runs its prefill at FP4 (design: no 2-bit KV)


def _configurations() -> list[Configuration]:
    configs = [Configuration(p, p) for p in ("fp4_checkpoint", "fp4_tier", "w2_sym", "w2_asym")]
    configs += [Configuration(f"w2_sym+pool{f:.2f}", "w2_sym", f) for f in POOL_FRACTIONS]
    configs += [Configuration(f"w2_sym+gate{t:.2f}", "w2_sym", 0.0, t) for t in GATE_TAUS]
    configs += [Configuration(f"w2_sym+pool{GATED_POOL_FRACTION:.2f}+gate{t:.2f}", "w2_sym", GATED_POOL_FRACTION, t)
                for t in GATE_TAUS]
    return configs


CONFIGURATIONS = _configurations()
"""A runtime-backed configuration (tierstore's dynamic FP4 pool and gate, once their API exists)
joins by providing the same three results per configuration: teacher-forced scores, gated decode
scores and greedy generations; everything downstream (metrics, detector, traces) is shared."""


@dataclass
class EvalSettings:
    windows: int = 64  # teacher-forced validation windows of the training length
    decode_windows: int = 16
    decode_len: int = 256
    prompts: int = 16
    prompt_len: int = 32
    new_tokens: int = 128
    pool_calibration_windows: int = 16
    batch_size: int = 16


class Lab:
    """The loaded checkpoint, its expert variants and the evaluation data."""

    def __init__(self, checkpoint: Path, device: torch.device, dtype: torch.dtype, settings: EvalSettings,
                 corpus_root: Path | None):
        self.checkpoint, self.device, self.settings = checkpoint, device, settings
        self.training = json.loads((checkpoint / "quality_training.json").read_text(encoding="utf-8"))
        corpus = Corpus(corpus_root, self.training.get("corpus_packages", ()))
        require_same_corpus(self.training["corpus_hash"], corpus.corpus_hash, f"evaluation of {checkpoint}")
        self.corpus_hash = corpus.corpus_hash
        self.tokenizer = load_tokenizer_file(checkpoint / "tokenizer.json")
        if tokenizer_hash(self.tokenizer) != self.training["tokenizer_hash"]:
            raise CorpusMismatchError(f"{checkpoint}/tokenizer.json is not the tokenizer the model was trained with")
        seq_len = self.training["preset"]["seq_len"]
        val_texts = corpus.texts("validation")
        val_ids = encode_documents(self.tokenizer, val_texts)
        self.windows = validation_windows(val_ids, seq_len, settings.windows)  # [n, L]
        self.decode_windows = validation_windows(val_ids, settings.decode_len, settings.decode_windows)  # [m, D]
        self.prompts = prompt_set(self.tokenizer, val_texts, settings.prompts, settings.prompt_len)  # [p, P]
        calibration = leading_windows(self.tokenizer, corpus.texts("train"), seq_len, settings.pool_calibration_windows)
        self.model, self.control, self.layers = load_model(checkpoint, dtype, device)
        self.experts = CheckpointExperts(checkpoint, dtype, device)
        self.num_experts = self.experts.stacked[REFERENCE][0][0].shape[0]
        self.hot_order = torch.zeros(0, dtype=torch.int64, device=device)  # no pool until ranked
        self.hot_order = self._hot_order(calibration)

    def configure(self, config: Configuration) -> None:
        pools = self._pool_masks(config.pool_fraction)
        for index, layer in enumerate(self.layers):
            layer.configure(self.experts.stacked[config.base][index], self.experts.stacked[UPGRADE][index], pools[index])

    def _pool_masks(self, fraction: float) -> list[torch.Tensor]:
        masks = torch.zeros(len(self.layers) * self.num_experts, dtype=torch.bool, device=self.device)
        masks[self.hot_order[: round(fraction * masks.numel())]] = True
        return list(masks.view(len(self.layers), self.num_experts))

    def _hot_order(self, windows: torch.Tensor) -> torch.Tensor:
        """(layer * E + expert) keys, most routed first under the reference (ties: lower key first)."""
        self.configure(Configuration(REFERENCE, REFERENCE))
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64, device=self.device)
        self.control.start_capture()
        with torch.no_grad():
            for chunk in windows.split(self.settings.batch_size):
                self.model(input_ids=chunk.to(self.device))
                for layer, routing in enumerate(self.control.stop_capture()):
                    counts[layer] += torch.bincount(routing.reshape(-1), minlength=self.num_experts)
                self.control.start_capture()
        self.control.stop_capture()
        flat = counts.reshape(-1)
        return torch.argsort(-flat * flat.numel() + torch.arange(flat.numel(), device=self.device))


def _decode_metrics(result: DecodeResult, reference: DecodeResult, targets: torch.Tensor) -> dict:
    metrics = compare(result.logits, reference.logits, targets)
    decode_fired = result.fired[:, 1:]  # the first scored position comes from the prefill
    metrics["fire_rate"] = float(decode_fired.float().mean()) if decode_fired.numel() else 0.0
    return metrics


def _gap_closure(rows: dict[str, dict], configs: list[Configuration]) -> None:
    """Add, to each gated row, the share of its ungated twin's agreement gap it closes, and per fire."""
    by_name = {c.name: c for c in configs}
    for name, row in rows.items():
        config = by_name[name]
        if config.gate_tau is None:
            continue
        twin = next(c.name for c in configs if c.gate_tau is None and c.base == config.base
                    and c.pool_fraction == config.pool_fraction)
        gap = 1.0 - rows[twin]["agreement"]
        closed = (row["agreement"] - rows[twin]["agreement"]) / gap if gap > 0 else None
        row["ungated_twin"] = twin
        row["agreement_gap_closed"] = closed
        row["gap_closed_per_fire_rate"] = closed / row["fire_rate"] if closed is not None and row["fire_rate"] else None


def _generation_rows(lab: Lab, configs: list[Configuration], trace_dir: Path | None, log) -> dict:
    s = lab.settings
    prompts = lab.prompts.to(lab.device)
    lab.configure(Configuration(REFERENCE, REFERENCE))
    reference_text = GatedDecoder(lab.model, lab.control, None).greedy(prompts, s.new_tokens)
    text = torch.cat([prompts, reference_text.tokens], dim=1)  # [p, P + N]
    targets = text[:, s.prompt_len:]
    rows = {}
    for config in configs:
        lab.configure(config)
        decoder = GatedDecoder(lab.model, lab.control, config.gate_tau, config.fp4_prefill)
        scored = decoder.score(text, s.prompt_len)
        own = decoder.greedy(prompts, s.new_tokens)
        flags = [degeneration.is_degenerate(row.tolist()) for row in own.tokens]
        judged = [f for f in flags if f is not None]
        rows[config.name] = {
            **_decode_metrics(scored, reference_text, targets),
            "own_fire_rate": float(own.fired[:, 1:].float().mean()) if own.fired.shape[1] > 1 else 0.0,
            "degenerate_share": sum(judged) / len(judged) if judged else None, "judged": len(judged),
            "distinct_4gram_fraction_mean": sum(degeneration.distinct_ngram_fraction(r.tolist()[-degeneration.WINDOW:])
                                                for r in own.tokens) / len(own.tokens),
            "samples": [{"prompt": lab.tokenizer.decode(p.tolist()), "continuation": lab.tokenizer.decode(r.tolist())}
                        for p, r in zip(lab.prompts[:3], own.tokens[:3].cpu())],
        }
        if trace_dir is not None and config.name in TRACED:
            rows[config.name]["trace"] = str(_save_trace(lab, config, own, trace_dir))
        log(f"generation {config.name}: {json.dumps({k: v for k, v in rows[config.name].items() if k != 'samples'})}")
    _gap_closure(rows, configs)
    return rows


def _save_trace(lab: Lab, config: Configuration, result: DecodeResult, trace_dir: Path) -> Path:
    """One request per prompt; one trace token per decode step, with the step's top-1 probability."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    routing = torch.stack(result.routing).cpu()  # [steps, L, p, k]
    confidence = torch.softmax(result.logits[:, 1:], dim=-1).amax(dim=-1).cpu()  # [p, steps]
    recorder = TraceRecorder(routing.shape[1], routing.shape[3], lab.num_experts, source="benchmarks/quality",
                             configuration=config.name, checkpoint=lab.checkpoint.name, corpus_hash=lab.corpus_hash)
    for row in range(routing.shape[2]):
        recorder.new_request()
        for step in range(routing.shape[0]):
            recorder.record_step(routing[step, :, row].numpy(), confidence=confidence[row, step].numpy())
    return recorder.save(trace_dir / f"quality-{config.name}.npz")


def evaluate(checkpoint: Path, device: torch.device, dtype: torch.dtype, settings: EvalSettings,
             corpus_root: Path | None = None, trace_dir: Path | None = None,
             configs: list[Configuration] | None = None, log=print) -> dict:
    started = time.monotonic()
    configs = configs or CONFIGURATIONS
    lab = Lab(checkpoint, device, dtype, settings, corpus_root)
    log(f"loaded {checkpoint} ({time.monotonic() - started:.0f} s)")
    targets = lab.windows[:, 1:].to(device)
    lab.configure(Configuration(REFERENCE, REFERENCE))
    reference = teacher_forced_logits(lab.model, lab.control, lab.windows, settings.batch_size, device)
    heldout = {}
    for config in (c for c in configs if c.gate_tau is None):
        lab.configure(config)
        heldout[config.name] = compare(teacher_forced_logits(lab.model, lab.control, lab.windows, settings.batch_size,
                                                             device), reference, targets)
        log(f"heldout {config.name}: {json.dumps(heldout[config.name])}")
    decode_ids = lab.decode_windows.to(device)
    lab.configure(Configuration(REFERENCE, REFERENCE))
    decode_reference = GatedDecoder(lab.model, lab.control, None).score(decode_ids, 1)
    heldout_decode = {}
    for config in configs:
        lab.configure(config)
        result = GatedDecoder(lab.model, lab.control, config.gate_tau, config.fp4_prefill).score(decode_ids, 1)
        heldout_decode[config.name] = _decode_metrics(result, decode_reference, decode_ids[:, 1:])
        log(f"heldout_decode {config.name}: {json.dumps(heldout_decode[config.name])}")
    _gap_closure(heldout_decode, configs)
    generation = _generation_rows(lab, configs, trace_dir, log)
    reports = [{"layer": r["layer"], "expert": r["expert"], "projection": r["projection"], "numel": r["numel"],
                "zero_mode": r["zero_mode"], "sym": r["sym"], "asym": r["asym"], "best_sym_levels": r["best_sym_levels"]}
               for r in lab.experts.reports]
    return {
        "format": "tierstore-quality-v1",
        "provenance": provenance(device), "dtype": str(dtype).removeprefix("torch."),
        "checkpoint": str(checkpoint), "corpus_hash": lab.corpus_hash, "tokenizer_hash": lab.training["tokenizer_hash"],
        "training": {k: lab.training[k] for k in ("steps", "tokens", "final_validation_loss", "train_seconds")},
        "settings": asdict(settings),
        "configurations": [asdict(c) for c in configs],
        "reference": REFERENCE, "upgrade_tier": UPGRADE,
        "degeneration_detector": {"window": degeneration.WINDOW, "ngram": degeneration.NGRAM,
                                  "max_distinct_fraction": degeneration.MAX_DISTINCT_FRACTION},
        "heldout": heldout, "heldout_decode": heldout_decode, "generation": generation,
        "codebook": {"summary": summarise_codebook_reports(lab.experts.reports), "tensors": reports},
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--corpus-root", type=Path, default=None)
    for field, value in asdict(EvalSettings()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args(argv)
    settings = EvalSettings(**{f: getattr(args, f) for f in asdict(EvalSettings())})
    result = evaluate(args.checkpoint, torch.device(args.device), getattr(torch, args.dtype), settings,
                      args.corpus_root, args.trace_dir, log=lambda line: print(line, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
