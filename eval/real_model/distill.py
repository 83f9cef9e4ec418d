"""``distill``: the converted model's new indexer trained on real text by the KL to the dense attention's page mass
(``eval.indexer_distillation``), everything else frozen; resumable, and written atomically.

The objective is ``"history"``: the KL over the history pages the top-k ranks, weighted by their mass. At 8K it
left the sparse model 0.71 % above dense perplexity where MiniMax's KL over every causal page (``"pages"``, which
the tiny model's stage 2 keeps) left 0.97 %, with the same start, data and steps (docs/ACCURACY.md). Each training
window also repeats spans of its own text far back (``DistillationPlan.repeated_spans``): novels seldom make
attention copy from beyond the selected pages, and without them the indexer missed an 8K pass key dense finds.

The indexer starts from each layer's own attention (``initialise_indexer_from_attention``). Every step takes the
next window of the training split (a fixed permutation from the seed), runs the dense forward without gradients and
steps AdamW on the index projections and norms of every sparse layer. The state (indexer, optimizer, step) is saved
every ``checkpoint_every`` steps, at a time limit and on Ctrl-C, through a temporary file; a later run with the same
settings continues from it. The held-out KL over every causal page, comparable between objectives, is measured
before the first step and after the last, with the trained objective's beside it. ``export`` writes only the
indexer's tensors (a few MB) with a JSON record of the run.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..indexer_distillation import indexer_distillation_loss, indexer_parameter_names, initialise_indexer_from_attention
from ..report import atomic_write, write_json
from .corpus import with_repeated_spans

__all__ = ["DistillationPlan", "IndexerDistiller", "held_out_kl", "save_indexer", "load_indexer", "INDEXER_FILE",
           "RECORD_FILE"]

logger = logging.getLogger(__name__)

INDEXER_FILE = "indexer.safetensors"
RECORD_FILE = "indexer.json"
STATE_FILE = "state.pt"
OBJECTIVE = "history"  # eval.indexer_distillation's; recorded in the state, so a run of another is not continued


@dataclass
class DistillationPlan:
    steps: int = 600
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    checkpoint_every: int = 50
    seed: int = 0
    repeated_spans: int = 8  # per training window (``corpus.with_repeated_spans``); held-out windows stay as written

    def __post_init__(self):
        for name in ("steps", "warmup_steps", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name != "warmup_steps" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name != 'warmup_steps' else 0}, got {value!r}")
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        spans = self.repeated_spans
        if not isinstance(spans, int) or isinstance(spans, bool) or spans < 0:
            raise ValueError(f"repeated_spans must be an int >= 0, got {self.repeated_spans!r}")

    def learning_rate_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def held_out_kl(model, windows: Sequence[torch.Tensor], device, objective: str = "pages") -> Dict[str, object]:
    """Mean KL by ``objective`` over ``windows`` (each ``[L]`` token ids): ``{"mean": float, "per_layer": {layer:
    float}}``."""
    per_layer: Dict[int, float] = {}
    for window in windows:
        with torch.no_grad():
            _, layers = indexer_distillation_loss(model, window[None].to(device), objective)
        for layer, value in layers.items():
            per_layer[layer] = per_layer.get(layer, 0.0) + value / len(windows)
    return {"mean": sum(per_layer.values()) / len(per_layer), "per_layer": per_layer}


def _indexer_tensors(model) -> Dict[str, torch.Tensor]:
    parameters = dict(model.named_parameters())
    return {name: parameters[name].detach() for name in indexer_parameter_names(model)}


def save_indexer(model, directory: Path, record: dict) -> Path:
    """The indexer's tensors as ``directory / INDEXER_FILE`` and ``record`` as ``RECORD_FILE``, each written
    atomically (``eval.report``)."""
    from safetensors.torch import save_file

    tensors = {name: tensor.contiguous().cpu() for name, tensor in _indexer_tensors(model).items()}
    target = atomic_write(Path(directory) / INDEXER_FILE, lambda temporary: save_file(tensors, str(temporary)))
    write_json(Path(directory) / RECORD_FILE, record)
    return target


def load_indexer(model, path: Path) -> None:
    """Copy the indexer tensors of ``path`` (a ``save_indexer`` file) into ``model``; they must be exactly the
    model's indexer (names and shapes), else a ``ValueError`` before anything is copied."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"indexer weights {path} do not exist (python -m eval.real_model distill writes them)")
    loaded = load_file(str(path))
    expected = _indexer_tensors(model)
    if set(loaded) != set(expected):
        missing, extra = sorted(set(expected) - set(loaded)), sorted(set(loaded) - set(expected))
        raise ValueError(f"{path} is not this model's indexer: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in loaded.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} is {tuple(tensor.shape)}, the model's is {tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, tensor in loaded.items():
            expected[name].copy_(tensor)


class _StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM during a step only asks the loop to stop after it (the state is then saved)."""

    def __init__(self):
        self.requested = None
        self._previous = {}

    def __enter__(self):
        for number in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[number] = signal.signal(number, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def _handle(self, number, _frame):
        if self.requested is not None:  # a second one: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(number).name

    def __exit__(self, *exc_info):
        for number, handler in self._previous.items():
            signal.signal(number, handler)


class IndexerDistiller:
    """Trains ``model``'s indexer on ``train_windows``; state and outputs under ``output``."""

    def __init__(self, model, train_windows: List[torch.Tensor], held_out_windows: List[torch.Tensor], *,
                 plan: DistillationPlan, output: Path, device, resume: bool = True, description: Optional[dict] = None):
        if not train_windows or not held_out_windows:
            raise ValueError(f"distillation needs training and held-out windows, got {len(train_windows)} and "
                             f"{len(held_out_windows)}")
        self.model, self.plan, self.output, self.device = model, plan, Path(output), torch.device(device)
        self.train_windows, self.held_out_windows = train_windows, held_out_windows
        self.description = dict(description or {})
        self.names = indexer_parameter_names(model)
        trainable = set(self.names)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in trainable)
        parameters = [parameter for name, parameter in model.named_parameters() if name in trainable]
        self.optimizer = torch.optim.AdamW(parameters, lr=plan.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
        order = torch.randperm(len(train_windows), generator=torch.Generator().manual_seed(plan.seed))
        self.order = order.tolist()
        self.step = 0
        self.history: List[dict] = []
        self.kl_before = None
        self.state_path = self.output / STATE_FILE
        if self.state_path.is_file():
            if not resume:
                raise ValueError(f"{self.state_path} holds a run: continue it (resume) or choose another output")
            self._load_state()
        else:
            initialise_indexer_from_attention(model)

    def _settings(self) -> dict:
        return {"plan": asdict(self.plan), "indexer_start": "attention", "objective": OBJECTIVE,
                "train_windows": len(self.train_windows),
                "window_tokens": int(self.train_windows[0].numel()), **self.description}

    def save_state(self) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        state = {"settings": self._settings(), "step": self.step, "history": self.history,
                 "kl_before": self.kl_before, "indexer": {k: v.cpu() for k, v in _indexer_tensors(self.model).items()},
                 "optimizer": self.optimizer.state_dict()}
        atomic_write(self.state_path, lambda temporary: torch.save(state, temporary))

    def _load_state(self) -> None:
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        settings = self._settings()
        changed = sorted(key for key in settings if key != "plan" and state["settings"].get(key) != settings[key])
        plan_before, plan_now = state["settings"]["plan"], settings["plan"]
        plan_before = {"repeated_spans": 0, **plan_before}  # what runs wrote before the plan named it
        changed += [f"plan.{key}" for key in plan_now if key != "steps" and plan_before.get(key) != plan_now[key]]
        if changed:  # only the number of steps may grow between runs
            raise ValueError(f"{self.state_path} was written with other settings ({', '.join(changed)}): continue "
                             f"with the same ones or choose another output")
        with torch.no_grad():
            for name, tensor in _indexer_tensors(self.model).items():
                tensor.copy_(state["indexer"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history, self.kl_before = state["step"], state["history"], state["kl_before"]
        logger.info("continuing %s at step %d of %d", self.state_path, self.step, self.plan.steps)

    def _held_out(self) -> Dict[str, object]:
        """The held-out KL over every causal page (comparable with runs of other objectives), with the trained
        objective's under ``"objective"``."""
        return {**held_out_kl(self.model, self.held_out_windows, self.device),
                "objective": held_out_kl(self.model, self.held_out_windows, self.device, OBJECTIVE)}

    def train_step(self) -> float:
        """One step on the next training window; its KL, the mean over sparse layers."""
        window = self.train_windows[self.order[self.step % len(self.order)]]
        if self.plan.repeated_spans:  # drawn from the step, so a resumed run sees the same windows
            config = self.model.config
            page = config.index_block_size
            generator = torch.Generator().manual_seed(self.plan.seed * 1_000_003 + self.step)
            # sources beyond the pages every row selects, spans of 1/8 to 3/8 of a page (16-48 tokens at 128)
            window = with_repeated_spans(window, generator, spans=self.plan.repeated_spans,
                                         span_tokens=(max(1, page // 8), max(1, 3 * page // 8)),
                                         min_distance=page * config.index_topk_blocks)
        for group in self.optimizer.param_groups:
            group["lr"] = self.plan.learning_rate_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss, per_layer = indexer_distillation_loss(self.model, window[None].to(self.device), OBJECTIVE)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return float(loss.detach()) / len(per_layer)  # the mean over layers, as held_out_kl reports it

    def run(self, max_seconds: Optional[float] = None) -> dict:
        """Train up to ``plan.steps`` (or until ``max_seconds`` or a stop signal); the record of the run so far."""
        start = time.monotonic()
        self.model.eval()  # no dropout; gradients still flow to the indexer
        if self.kl_before is None:
            self.kl_before = self._held_out()
            self.save_state()
        stopped = None
        with _StopSignal() as stop:
            while self.step < self.plan.steps:
                step_start = time.monotonic()
                loss = self.train_step()
                self.history.append({"step": self.step, "kl": loss, "seconds": time.monotonic() - step_start})
                if self.step % 10 == 0 or self.step == self.plan.steps:
                    logger.info("step %d/%d: KL %.4f", self.step, self.plan.steps, loss)
                if stop.requested or (max_seconds is not None and time.monotonic() - start > max_seconds):
                    stopped = stop.requested or f"{max_seconds:.0f} s reached"
                    break
                if self.step % self.plan.checkpoint_every == 0:
                    self.save_state()
        self.save_state()
        record = {"settings": self._settings(), "steps_done": self.step, "complete": self.step >= self.plan.steps,
                  "stopped": stopped, "held_out_kl_before": self.kl_before,
                  "train_kl_first_10": _mean([h["kl"] for h in self.history[:10]]),
                  "train_kl_last_10": _mean([h["kl"] for h in self.history[-10:]]),
                  "seconds_per_step": _mean([h["seconds"] for h in self.history[-50:]])}
        if record["complete"]:
            record["held_out_kl_after"] = self._held_out()
            save_indexer(self.model, self.output, record)
        return record


def _mean(values) -> Optional[float]:
    return sum(values) / len(values) if values else None
