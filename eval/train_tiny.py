"""Train a tiny MiniMax-M3 on synthetic long-context retrieval: ``python -m eval.train_tiny --output DIR``.

The model has MiniMax-M3's real sparse-attention hyperparameters (pages of 128 tokens, top-16 pages with the local
page forced, index heads of 128 dims, one index head per KV head) and small everything else (docs/TRAINING.md).
Three stages, as MiniMax trains MiniMax Sparse Attention:

1. all layers dense, loss on the answer tokens only, a curriculum of lengths until the dense retrieval accuracy
   at each phase's lengths reaches the phase's target (or the phase's step budget ends);
2. everything frozen but the indexer's projections and norms, trained with the KL between the indexer's page
   distribution and dense attention's mass per page (``eval.indexer_distillation``);
3. a short sparse fine-tune of everything but the indexer, loss on the answer tokens.

Each stage ends with retrieval accuracy in dense and sparse mode and the indexer's recall (``eval.recall``) at the
evaluation lengths. Everything goes to ``DIR/training_log.jsonl``; the model (bf16 safetensors, config, tokenizer,
model card) to ``DIR`` at the end of every command, loadable with ``AutoModelForCausalLM.from_pretrained`` after
``import minimax_m3``; the resumable state (fp32 weights, optimizer, progress) to ``DIR/training_state/``.

Runs are deterministic from ``--seed``: every batch is generated from ``(seed, stage, step)``, so ``--resume``
continues exactly where the last checkpoint left off (the log is cut back to it). ``--max-minutes`` stops in time
to checkpoint and export (exit status 0; resume with ``--resume``), so a long run fits 9-minute GPU commands.
``--smoke`` runs the same stages at 512-1024 tokens for a few steps (CPU tests).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from indexer.contract import DEFAULT_TOPK, HEAD_DIM, PAGE_SIZE
from minimax_m3 import MiniMaxM3Config, MiniMaxM3ForCausalLM
from minimax_m3.modeling_minimax_m3 import MiniMaxM3SparseMoeBlock

from .cli import UsageError, add_debug_argument, run_main
from .devices import device_argument
from .indexer_distillation import indexer_distillation_loss, indexer_parameter_names
from .layer_inputs import capture_sparse_layer_inputs, single_pass
from .modes import attention_mode, set_attention_mode
from .recall import RecallAccumulator
from .report import checked_output_directory
from .synthetic_retrieval import TASKS, RetrievalBatch, RetrievalDataConfig, RetrievalDataGenerator, build_retrieval_tokenizer
from .training_curves import SUPERSEDED_EVENT, plot_training_curves, read_log

__all__ = ["SEED", "Phase", "TrainingPlan", "FULL_PLAN", "SMOKE_PLAN", "tiny_model_config", "answer_loss",
           "evaluate_retrieval", "Trainer", "main"]

logger = logging.getLogger(__name__)

SEED = 20261201
STAGES = (1, 2, 3)
LOG_FILE = "training_log.jsonl"
STATE_DIRECTORY = "training_state"
SUMMARY_FILE = "training_summary.json"
CURVES_FILE = "training_curves.png"
MAX_POSITIONS = 65536  # evaluation goes to 32K tokens, twice the longest training length
EXPORT_RESERVE_S = 20.0  # kept free of training under --max-minutes: the last checkpoint and the export
UNKNOWN_EVAL_S = 90.0  # assumed duration of an evaluation never timed yet (FlexAttention compiles on first use)


@dataclass(frozen=True)
class Phase:
    """A stage-1 curriculum phase: batches of these lengths until dense accuracy reaches ``target_accuracy`` at
    each of them (checked every ``stage1_eval_every`` steps) or ``max_steps`` are done. ``data`` replaces the
    plan's data configuration (short early phases need fewer lines and a shorter answer distance)."""

    lengths: tuple
    max_steps: int
    target_accuracy: float
    data: Optional[RetrievalDataConfig] = None
    tokens_per_step: Optional[int] = None  # replaces the plan's (very short documents: fewer per step)


@dataclass(frozen=True)
class TrainingPlan:
    name: str
    data: RetrievalDataConfig
    tokens_per_step: int  # batch size = tokens_per_step // length (at least 1); sequences of a batch share their length
    stage1_phases: tuple
    stage1_eval_every: int
    stage1_lr: float
    stage1_warmup_steps: int
    stage2_steps: int
    stage2_lengths: tuple
    stage2_lr: float
    stage3_steps: int
    stage3_lengths: tuple
    stage3_lr: float
    later_warmup_steps: int  # warmup of stages 2 and 3
    eval_lengths: tuple  # stage-end evaluations: dense and sparse accuracy, recall
    eval_documents: int  # per length
    eval_tokens_per_forward: int
    log_every: int
    checkpoint_every_s: float
    # 0 trains stage 1 on the answer tokens only; a positive weight adds the next-token loss over whole documents,
    # without which key-value retrieval stalled at about half the 128-token documents (docs/TRAINING.md)
    stage1_lm_loss_weight: float = 0.0

    def batch_size(self, length: int, tokens_per_step: Optional[int] = None) -> int:
        return max(1, (tokens_per_step or self.tokens_per_step) // length)


FULL_PLAN = TrainingPlan(
    name="full",
    data=RetrievalDataConfig(queries=8, max_pairs=64, min_answer_distance=256),
    tokens_per_step=65536,
    stage1_phases=(
        # Retrieval is learnt first where attention is not diluted over thousands of tokens. In the H200 sweep
        # (docs/TRAINING.md) 128-token documents with 4 pairs were solved after ~4,200 steps with the next-token loss
        # and RoPE theta 1e4, and stayed at ~50 % without either.
        Phase((128,), 6000, 0.9, RetrievalDataConfig(queries=2, max_pairs=4, min_answer_distance=0), 16384),
        Phase((256,), 1500, 0.9, RetrievalDataConfig(queries=4, max_pairs=8, min_answer_distance=32), 32768),
        Phase((512,), 1000, 0.9, RetrievalDataConfig(queries=4, max_pairs=16, min_answer_distance=64)),
        Phase((1024,), 600, 0.9, RetrievalDataConfig(queries=8, max_pairs=32, min_answer_distance=128)),
        Phase((2048,), 400, 0.9),
        Phase((4096,), 300, 0.9),
        Phase((8192,), 200, 0.9),
        Phase((4096, 8192, 16384), 300, 0.95),
    ),
    stage1_eval_every=100,
    stage1_lr=2e-3,
    stage1_warmup_steps=100,
    stage2_steps=300,
    stage2_lengths=(4096, 8192, 16384),
    stage2_lr=3e-3,
    stage3_steps=150,
    stage3_lengths=(4096, 8192, 16384),
    stage3_lr=1e-4,
    later_warmup_steps=20,
    eval_lengths=(2048, 4096, 8192, 16384),
    eval_documents=32,
    eval_tokens_per_forward=65536,
    log_every=10,
    checkpoint_every_s=120.0,
    stage1_lm_loss_weight=1.0,
)

SMOKE_PLAN = TrainingPlan(
    name="smoke",
    data=RetrievalDataConfig(queries=2, max_pairs=8, min_answer_distance=PAGE_SIZE),
    tokens_per_step=512,
    stage1_phases=(Phase((512,), 2, 0.9), Phase((1024,), 2, 0.9)),
    stage1_eval_every=2,
    stage1_lr=1e-3,
    stage1_warmup_steps=2,
    stage2_steps=2,
    stage2_lengths=(1024,),
    stage2_lr=3e-3,
    stage3_steps=1,
    stage3_lengths=(512,),
    stage3_lr=1e-4,
    later_warmup_steps=1,
    eval_lengths=(512, 1024),
    eval_documents=1,
    eval_tokens_per_forward=1024,
    log_every=1,
    checkpoint_every_s=3600.0,
)

def tiny_model_config(vocab_size: int) -> MiniMaxM3Config:
    """Hidden 128, 3 layers: layer 0 full attention + dense MLP (as M3's first layers), layers 1-2 MiniMax Sparse
    Attention with M3's indexer geometry (pages of 128, top-16, index heads of 128 dims, index heads = KV heads)
    and a 4-expert MoE; 4 query heads and 2 KV heads of 64 dims, half of them rotated; tied embeddings.

    RoPE theta is 1e4, not M3's 5e6: a 3-layer model builds each key from the tokens a few positions back, and 16
    rotary frequencies spread up to theta 5e6 leave it few usable ones (the H200 sweep in docs/TRAINING.md). The
    experts run as transformers' ``grouped_mm`` (the default): no host synchronisation in a training step."""
    return MiniMaxM3Config(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, rotary_dim=32, rope_theta=1e4, intermediate_size=64, dense_intermediate_size=384,
        shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.02, moe_layer_freq=[0, 1, 1],
        # exact sparse attention as page-masked dense products: FlexAttention's compiled kernel for this geometry
        # (2 query heads per KV group, head dim 64) asked for more shared memory than an H200 has at 8K tokens
        # (torch 2.11), the per-token gather of the reference is slow; a 3-layer model affords O(T x S)
        sparse_attention_implementation="masked",
        sparse_attention_config={
            "sparse_attention_freq": [0, 1, 1], "sparse_num_index_heads": 2, "sparse_index_dim": HEAD_DIM,
            "sparse_block_size": PAGE_SIZE, "sparse_topk_blocks": DEFAULT_TOPK, "sparse_init_block": 0,
            "sparse_local_block": 1,
        },
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


# ---------------------------------------------------------------------------------------------- losses, metrics
def _answer_logits(model, hidden: torch.Tensor, batch: RetrievalBatch) -> torch.Tensor:
    """fp32 logits ``[N, vocab]`` of the positions that predict the answer tokens: only they go through the LM head."""
    return model.lm_head(hidden[batch.answer_sequence, batch.answer_position - 1]).float()


def answer_logits(model, batch: RetrievalBatch, *, output_page_selections: bool = False):
    """The answer tokens' logits and the forward's page selections (``None`` unless asked)."""
    output = model.model(input_ids=batch.input_ids, use_cache=False, output_page_selections=output_page_selections)
    return _answer_logits(model, output.last_hidden_state, batch), output.page_selections


def answer_loss(model, batch: RetrievalBatch, lm_loss_weight: float = 0.0) -> torch.Tensor:
    """Cross-entropy of the answer tokens; with ``lm_loss_weight > 0`` plus that weight times the mean next-token
    cross-entropy over every position of the documents."""
    hidden = model.model(input_ids=batch.input_ids, use_cache=False).last_hidden_state
    loss = torch.nn.functional.cross_entropy(_answer_logits(model, hidden, batch), batch.answer_tokens)
    if lm_loss_weight > 0:
        every_logit = model.lm_head(hidden[:, :-1]).float()
        language_model = torch.nn.functional.cross_entropy(every_logit.flatten(0, 1), batch.input_ids[:, 1:].flatten())
        loss = loss + lm_loss_weight * language_model
    return loss


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def evaluation_batches(generator: RetrievalDataGenerator, plan: TrainingPlan, seed: int, length: int) -> List[RetrievalBatch]:
    """The fixed evaluation documents of one length (their own random stream, independent of training)."""
    rng = random.Random(f"{seed}/eval/{length}")
    per_forward = max(1, plan.eval_tokens_per_forward // length)
    batches, remaining = [], plan.eval_documents
    while remaining:
        size = min(per_forward, remaining)
        batches.append(generator.sample_batch(rng, length, size))
        remaining -= size
    return batches


def evaluate_retrieval(model, batches: Sequence[RetrievalBatch], mode: str, device: torch.device, *,
                       with_recall: bool = False) -> dict:
    """Teacher-forced exact match: a query is right when every answer token is the argmax. Returns accuracy over
    queries, per task, the answer-token accuracy and, with ``with_recall`` (sparse mode), each sparse layer's
    recall."""
    if with_recall and mode != "sparse":
        raise ValueError(f"recall needs mode 'sparse', got {mode!r}")
    correct_queries = {task: 0 for task in TASKS}
    total_queries = {task: 0 for task in TASKS}
    correct_tokens = total_tokens = 0
    recall = RecallAccumulator()
    with attention_mode(model, mode), torch.no_grad(), _autocast(device):
        for batch in batches:
            batch = batch.to(device)
            capturing = capture_sparse_layer_inputs(model) if with_recall else contextlib.nullcontext([])
            with capturing as captured:
                logits, selections = answer_logits(model, batch, output_page_selections=with_recall)
            right = logits.argmax(-1) == batch.answer_tokens
            per_query = torch.ones(batch.num_queries, dtype=torch.int32, device=device).scatter_reduce(
                0, batch.answer_query, right.to(torch.int32), reduce="amin") == 1
            for task, ok in zip(batch.query_task, per_query.tolist()):
                correct_queries[task] += int(ok)
                total_queries[task] += 1
            correct_tokens += int(right.sum())
            total_tokens += right.numel()
            if with_recall:
                for layer_input, selection in zip(single_pass(model, captured), selections):
                    recall.add(layer_input, selection.flatten(0, 1))  # no padding: every position is a real token
    queries = sum(total_queries.values())
    result = {
        "accuracy": sum(correct_queries.values()) / queries,
        "queries": queries,
        "by_task": {task: correct_queries[task] / total_queries[task] for task in TASKS if total_queries[task]},
        "token_accuracy": correct_tokens / total_tokens,
    }
    if with_recall:
        result["recall"] = [layer.as_dict() for layer in recall.result()]
    return result


# ---------------------------------------------------------------------------------------------- training state
@dataclass
class Progress:
    """Where the run is; saved with every checkpoint. Everything the schedule decides depends only on this."""

    stage: int = 1  # the stage in progress; len(STAGES) + 1 when done
    phase: int = 0  # stage-1 curriculum phase
    phase_step: int = 0
    stage_step: int = 0
    last_phase_eval: int = -1  # phase_step of the last curriculum evaluation in this phase
    phase_passed: bool = False
    stage_evaluated: bool = False  # the current stage's end-of-stage evaluation is logged
    total_steps: int = 0
    window: list = field(default_factory=list)  # losses since the last logged training record
    seconds: Dict[str, float] = field(default_factory=dict)  # measured durations, to plan under --max-minutes

    @property
    def done(self) -> bool:
        return self.stage > len(STAGES)


class StopRequested(Exception):
    """The command's time or step budget is spent; the state is checkpointed and the run can be resumed."""


class Trainer:
    def __init__(self, *, output: Path, plan: TrainingPlan, seed: int, device: torch.device, resume: bool,
                 max_minutes: Optional[float], max_steps: Optional[int], command: Sequence[str]):
        self.output = Path(output)
        self.plan = plan
        self.seed = seed
        self.device = device
        self.started = time.monotonic()
        self.deadline = None if max_minutes is None else self.started + 60.0 * max_minutes
        self.max_steps = max_steps
        self.steps_this_command = 0
        self.state_path = self.output / STATE_DIRECTORY / "state.pt"
        self.log_path = self.output / LOG_FILE
        if self.state_path.exists() and not resume:
            raise UsageError(f"--output {self.output} already holds a training state: pass --resume to continue it "
                             f"or choose another --output")
        if not resume and self.output.exists() and (not self.output.is_dir() or any(self.output.iterdir())):
            held = "a file" if not self.output.is_dir() else ", ".join(sorted(p.name for p in self.output.iterdir())[:5])
            raise UsageError(f"--output {self.output} is not empty (it holds {held}): a new run writes only into a new "
                             f"or empty directory, so no model or log there is replaced; choose another --output")
        if resume and not self.state_path.exists():
            raise UsageError(f"--resume: no training state at {self.state_path}")

        self.tokenizer = build_retrieval_tokenizer(MAX_POSITIONS)
        self._generators: Dict[RetrievalDataConfig, RetrievalDataGenerator] = {}
        torch.manual_seed(seed)
        self.model = MiniMaxM3ForCausalLM(tiny_model_config(len(self.tokenizer))).float().to(device)
        self.indexer_names = set(indexer_parameter_names(self.model))
        self.progress = Progress()
        self.optimizer = None
        self.last_checkpoint = time.monotonic()
        if resume:
            self._load_state()
        else:
            self.output.mkdir(parents=True, exist_ok=True)
            self.log_path.touch(exist_ok=False)  # a new, empty directory: there is no log to lose
            self._log("plan", plan=asdict(plan), seed=seed,
                      parameters=sum(p.numel() for p in self.model.parameters()))
        self._log("command_start", command=list(command), device=str(device), resumed=resume,
                  at=asdict(self.progress) | {"window": None, "seconds": None})

    # ------------------------------------------------------------------ bookkeeping
    def _log(self, event: str, **fields) -> None:
        record = {"event": event, **fields}
        line = json.dumps(record, sort_keys=True)
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        logger.info("%s", line)

    def _optimizer_for_stage(self, stage: int) -> torch.optim.Optimizer:
        """AdamW over the stage's trainable parameters; the others stop requiring gradients."""
        def trainable(name: str) -> bool:
            return (name in self.indexer_names) == (stage == 2)

        parameters = []
        for name, parameter in self.model.named_parameters():
            parameter.requires_grad_(trainable(name))
            if trainable(name):
                parameters.append(parameter)
        lr = {1: self.plan.stage1_lr, 2: self.plan.stage2_lr, 3: self.plan.stage3_lr}[stage]
        return torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def _learning_rate(self) -> float:
        stage, step = self.progress.stage, self.progress.stage_step
        base = {1: self.plan.stage1_lr, 2: self.plan.stage2_lr, 3: self.plan.stage3_lr}[stage]
        warmup = self.plan.stage1_warmup_steps if stage == 1 else self.plan.later_warmup_steps
        return base * min(1.0, (step + 1) / max(1, warmup))

    def save_state(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "plan": self.plan.name,
            "plan_settings": asdict(self.plan),
            "seed": self.seed,
            "progress": asdict(self.progress),
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "log_bytes": self.log_path.stat().st_size,
        }
        staging = self.state_path.with_suffix(".tmp")
        torch.save(state, staging)
        os.replace(staging, self.state_path)
        self.last_checkpoint = time.monotonic()

    def _load_state(self) -> None:
        state = torch.load(self.state_path, map_location=self.device, weights_only=False)
        if (state["plan"], state["seed"]) != (self.plan.name, self.seed):
            raise UsageError(f"the state at {self.state_path} is of plan {state['plan']!r} with seed {state['seed']}; "
                             f"this command asks for plan {self.plan.name!r} with seed {self.seed} (--smoke, --seed)")
        self.model.load_state_dict(state["model"])
        self.progress = Progress(**state["progress"])
        size = self.log_path.stat().st_size
        if size > state["log_bytes"]:  # records written after the checkpoint are redone: mark them, never cut them
            with open(self.log_path, "rb+") as handle:
                handle.seek(size - 1)
                if handle.read(1) != b"\n":  # a record cut short by a kill: end its line
                    handle.write(b"\n")
                    size += 1
            self._log(SUPERSEDED_EVENT, from_byte=state["log_bytes"], to_byte=size)
        current = asdict(self.plan)
        changed = sorted(key for key in current if current[key] != state["plan_settings"].get(key))
        if changed:  # allowed (e.g. a longer phase budget for a stalled curriculum), but the log must say so
            self._log("plan_changed", fields=changed, before={key: state["plan_settings"].get(key) for key in changed},
                      after={key: current[key] for key in changed})
        if not self.progress.done:
            self.optimizer = self._optimizer_for_stage(self.progress.stage)
            if state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])

    def _time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic() - EXPORT_RESERVE_S

    def _check_budget(self, kind: str, default_seconds: float) -> None:
        if self.max_steps is not None and kind == "step" and self.steps_this_command >= self.max_steps:
            raise StopRequested(f"--max-steps {self.max_steps} reached")
        expected = self.progress.seconds.get(kind, default_seconds)
        if self._time_left() < 1.5 * expected:
            raise StopRequested(f"--max-minutes: {max(0.0, self._time_left()):.1f} s left before the export reserve, "
                                f"a {kind} takes ~{expected:.1f} s")

    def _maybe_checkpoint(self) -> None:
        if time.monotonic() - self.last_checkpoint >= self.plan.checkpoint_every_s:
            self.save_state()

    # ------------------------------------------------------------------ steps
    def generator(self, data: Optional[RetrievalDataConfig] = None) -> RetrievalDataGenerator:
        data = self.plan.data if data is None else data
        if data not in self._generators:
            self._generators[data] = RetrievalDataGenerator(self.tokenizer, data)
        return self._generators[data]

    def _batch(self, lengths: Sequence[int], data: Optional[RetrievalDataConfig],
               tokens_per_step: Optional[int]) -> RetrievalBatch:
        rng = random.Random(f"{self.seed}/stage{self.progress.stage}/step{self.progress.stage_step}")
        length = rng.choice(list(lengths))
        batch_size = self.plan.batch_size(length, tokens_per_step)
        return self.generator(data).sample_batch(rng, length, batch_size).to(self.device)

    def _train_step(self, lengths: Sequence[int], data: Optional[RetrievalDataConfig] = None,
                    tokens_per_step: Optional[int] = None) -> None:
        self._check_budget("step", default_seconds=5.0)
        started = time.monotonic()
        stage = self.progress.stage
        batch = self._batch(lengths, data, tokens_per_step)
        lr = self._learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        extra = {}
        with _autocast(self.device):
            if stage == 2:
                loss, per_layer = indexer_distillation_loss(self.model, batch.input_ids)
                extra["kl_by_layer"] = {str(layer): value for layer, value in per_layer.items()}
            else:
                with attention_mode(self.model, "dense" if stage == 1 else "sparse"):
                    loss = answer_loss(self.model, batch, self.plan.stage1_lm_loss_weight if stage == 1 else 0.0)
        loss.backward()
        trainable = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, 1.0))
        self.optimizer.step()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"stage {stage} step {self.progress.stage_step}: loss is {loss_value}")
        seconds = time.monotonic() - started
        self.progress.seconds["step"] = seconds
        self.progress.window.append(loss_value)
        self.progress.stage_step += 1
        self.progress.phase_step += 1
        self.progress.total_steps += 1
        self.steps_this_command += 1
        if self.progress.stage_step % self.plan.log_every == 0:
            self._log("train", stage=stage, step=self.progress.stage_step, length=batch.length,
                      batch_size=batch.input_ids.shape[0], loss=sum(self.progress.window) / len(self.progress.window),
                      last_loss=loss_value, lr=lr, grad_norm=grad_norm, **extra,
                      timing={"step_s": seconds, "tokens_per_s": batch.input_ids.numel() / seconds})
            self.progress.window = []
        self._maybe_checkpoint()

    def _evaluate(self, kind: str, lengths: Sequence[int], modes: Sequence[str],
                  data: Optional[RetrievalDataConfig] = None) -> Dict[int, float]:
        """Evaluate at ``lengths`` in ``modes``; logs one record per (mode, length), returns dense accuracies."""
        self._check_budget(kind, default_seconds=UNKNOWN_EVAL_S)
        started = time.monotonic()
        accuracies = {}
        for length in lengths:
            batches = evaluation_batches(self.generator(data), self.plan, self.seed, length)
            for mode in modes:
                result = evaluate_retrieval(self.model, batches, mode, self.device, with_recall=(mode == "sparse"))
                self._log("eval", kind=kind, stage=self.progress.stage, step=self.progress.stage_step,
                          mode=mode, length=length, **result)
                if mode == "dense":
                    accuracies[length] = result["accuracy"]
        self.progress.seconds[kind] = time.monotonic() - started
        return accuracies

    # ------------------------------------------------------------------ stages
    def run(self, stages: Sequence[int]) -> None:
        """Run the requested ``stages`` in order from where the progress stands."""
        for stage in STAGES:
            if stage < self.progress.stage:
                if stage in stages:
                    logger.info("stage %d is already complete", stage)
                continue
            if stage not in stages:
                later = [s for s in stages if s > stage]
                if later:
                    raise UsageError(f"--stage {later[0]} needs stage {stage} complete first (the run is at stage "
                                     f"{self.progress.stage}, step {self.progress.stage_step})")
                return
            if self.optimizer is None:
                self.optimizer = self._optimizer_for_stage(stage)
            if stage == 1:
                self._run_curriculum()
            else:
                steps = self.plan.stage2_steps if stage == 2 else self.plan.stage3_steps
                lengths = self.plan.stage2_lengths if stage == 2 else self.plan.stage3_lengths
                while self.progress.stage_step < steps:
                    self._train_step(lengths)
            self._finish_stage()

    def _run_curriculum(self) -> None:
        phases = self.plan.stage1_phases
        progress = self.progress
        while progress.phase < len(phases):
            phase = phases[progress.phase]
            due = progress.phase_step > 0 and (
                progress.phase_step % self.plan.stage1_eval_every == 0 or progress.phase_step >= phase.max_steps)
            if due and progress.last_phase_eval != progress.phase_step:
                accuracies = self._evaluate("curriculum", phase.lengths, ("dense",), phase.data)
                progress.phase_passed = all(accuracies[length] >= phase.target_accuracy for length in phase.lengths)
                progress.last_phase_eval = progress.phase_step
            if due and (progress.phase_passed or progress.phase_step >= phase.max_steps):
                self._log("phase_end", stage=1, phase=progress.phase, lengths=list(phase.lengths),
                          steps=progress.phase_step, reached_target=progress.phase_passed)
                progress.phase += 1
                progress.phase_step = 0
                progress.last_phase_eval = -1
                progress.phase_passed = False
                continue
            self._train_step(phase.lengths, phase.data, phase.tokens_per_step)

    def _finish_stage(self) -> None:
        progress = self.progress
        if not progress.stage_evaluated:
            self._evaluate("stage_end", self.plan.eval_lengths, ("dense", "sparse"))
            progress.stage_evaluated = True
        self._log("stage_end", stage=progress.stage, steps=progress.stage_step)
        progress.stage += 1
        progress.stage_step = progress.phase_step = 0
        progress.stage_evaluated = False
        progress.window = []
        self.optimizer = None if progress.done else self._optimizer_for_stage(progress.stage)
        self.save_state()

    # ------------------------------------------------------------------ export
    def export(self) -> Path:
        """The model in bf16 (router in fp32) with config, tokenizer, model card and summary, into ``output``."""
        export_model = MiniMaxM3ForCausalLM(copy.deepcopy(self.model.config))
        export_model.load_state_dict({name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()})
        # the router (gate and correction bias) stays fp32, as the model computes it
        moe_blocks = [m for m in export_model.modules() if isinstance(m, MiniMaxM3SparseMoeBlock)]
        router_modules = {id(m) for m in moe_blocks} | {id(m.gate) for m in moe_blocks}
        for module in export_model.modules():
            if id(module) in router_modules:
                continue
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(torch.bfloat16)
        set_attention_mode(export_model, "sparse")
        export_model.save_pretrained(self.output)
        self.tokenizer.save_pretrained(self.output)
        records = read_log(self.log_path)
        summary = training_summary(records, self.progress, self.plan, self.seed)
        (self.output / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
        (self.output / "README.md").write_text(model_card(summary))
        plot_training_curves(records, self.output / CURVES_FILE)
        return self.output


def training_summary(records: List[dict], progress: Progress, plan: TrainingPlan, seed: int) -> dict:
    """Per completed stage, its steps and end-of-stage evaluation (accuracy per mode, length and task, recall),
    and the commands that produced the run."""
    stages = {}
    for record in records:
        if record["event"] == "eval" and record["kind"] == "stage_end":
            entry = stages.setdefault(str(record["stage"]), {"evaluation": []})
            entry["evaluation"].append({key: record[key] for key in ("mode", "length", "accuracy", "by_task", "recall")
                                        if key in record})
        elif record["event"] == "stage_end":
            stages.setdefault(str(record["stage"]), {"evaluation": []})["steps"] = record["steps"]
    commands = [" ".join(record["command"]) for record in records if record["event"] == "command_start"]
    return {"plan": plan.name, "seed": seed, "complete": progress.done,
            "next": None if progress.done else {"stage": progress.stage, "stage_step": progress.stage_step},
            "stages": stages, "commands": commands}


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def model_card(summary: dict) -> str:
    lines = [
        "# Tiny MiniMax-M3 trained on synthetic long-context retrieval", "",
        "Produced by `python -m eval.train_tiny` (docs/TRAINING.md): hidden 128, 3 layers (layer 0 full attention "
        "and a dense MLP, layers 1-2 MiniMax Sparse Attention with a 4-expert MoE), pages of 128 tokens, top-16 "
        "pages with the local page forced, 2 index heads of 128 dims (one per KV head), FP8 (e4m3) index path, "
        "tied embeddings, bf16 weights (router fp32), RoPE theta 1e4 on half of each 64-dim head. Load it with "
        "`import minimax_m3` and `AutoModelForCausalLM.from_pretrained(this directory)`.", "",
        "## Data and stages", "",
        "Documents of 128 to 16,384 tokens generated on the fly from the seed (`eval.synthetic_retrieval`): "
        "multi-query key-value retrieval (`The value of <adjective-noun> is <5 digits>.` lines, questions at the end) "
        "and pass-key retrieval (one `The pass key is <v>.` line), in public-domain distractor text; answers lie "
        "at least 256 tokens back in the long phases. Stage 1 trains the model with every layer dense (answer "
        "digits plus the next-token loss over the documents, a length curriculum); stage 2 freezes it and trains only "
        "the indexer's projections and norms on the KL between the indexer's page distribution and dense "
        "attention's mass per page, as MiniMax trains MiniMax Sparse Attention; stage 3 (optional) is a short sparse "
        "fine-tune.", "",
        f"Plan `{summary['plan']}`, seed {summary['seed']}; all stages done: {summary['complete']}"
        + ("" if summary["complete"] or summary.get("next") is None
           else f" (next: stage {summary['next']['stage']}, not run)") + ". "
        f"Log: `{LOG_FILE}` (losses, step times, every evaluation); curves: `{CURVES_FILE}`; numbers: "
        f"`{SUMMARY_FILE}`. Commands:", "",
        *[f"    {command}" for command in summary.get("commands", [])], "",
        "## Results at the end of each stage", "",
        "Teacher-forced exact match of all five answer digits on 32 held-out documents per length (about a quarter "
        "of them pass-key documents with one question each, the rest key-value documents with eight). Sparse after "
        "stage 1 is the untrained indexer. Recall: the share of dense attention mass in the selected pages, per "
        "sparse layer, over all rows (over rows with more than 16 causal pages).", "",
        "| after stage | steps | mode | length | pass key | key-value | recall per sparse layer |",
        "|---|---|---|---|---|---|---|",
    ]
    key_value_dense = []
    for stage, entry in sorted(summary["stages"].items()):
        for evaluation in entry["evaluation"]:
            by_task = evaluation.get("by_task", {})
            recall = ", ".join(
                f"{layer['recall']:.3f} ({'-' if layer['recall_beyond_topk'] is None else format(layer['recall_beyond_topk'], '.3f')})"
                for layer in evaluation.get("recall", []))
            if evaluation["mode"] == "dense" and "key_value" in by_task:
                key_value_dense.append(by_task["key_value"])
            lines.append(f"| {stage} | {entry.get('steps', '')} | {evaluation['mode']} | {evaluation['length']} | "
                         f"{_percent(by_task.get('passkey'))} | {_percent(by_task.get('key_value'))} | {recall} |")
    if key_value_dense and max(key_value_dense) < 0.5:
        lines += ["", "## Limitations", "",
                  "The dense model did not learn key-value retrieval at the evaluated lengths (at most "
                  f"{_percent(max(key_value_dense))} exact match): it copies a value but does not match the key. Pass-key retrieval is learnt, so the indexer's effect shows on the pass-key documents; "
                  "key-value accuracy differences between modes are noise here (docs/ACCURACY.md)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- command line
def _parse_stages(text: str) -> tuple:
    if text == "all":
        return STAGES
    try:
        stages = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stage must be 'all' or stage numbers like '1' or '2,3', got {text!r}") from None
    if not stages or not set(stages) <= set(STAGES):
        raise argparse.ArgumentTypeError(f"--stage must name stages among {STAGES}, got {text!r}")
    return stages


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval.train_tiny", description=__doc__.splitlines()[0].replace("``", "`"))
    parser.add_argument("--output", type=Path, required=True,
                        help="directory of the exported model, the log and the resumable state (training_state/)")
    parser.add_argument("--device", type=device_argument, default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--stage", type=_parse_stages, default=STAGES,
                        help="stages this command may run, e.g. 1 or 2,3 (default: all); each continues where it stopped")
    parser.add_argument("--resume", action="store_true", help="continue the run whose state is in --output")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="checkpoint, export and exit (status 0) before this many minutes have passed")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many training steps in this command")
    parser.add_argument("--smoke", action="store_true", help="the CPU-sized plan: 512-1024 tokens, a few steps per stage")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--lm-loss-weight", type=float, default=None,
                        help="add this weight times the next-token loss over whole documents to stage 1's answer loss "
                             "(default: the plan's, 0: answers only)")
    return add_debug_argument(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: errors in one line (``eval.cli.run_main``); ``run_command`` raises them instead."""
    return run_main(run_command, argv)


def run_command(argv: Optional[Sequence[str]] = None) -> int:
    arguments = build_parser().parse_args(argv)
    checked_output_directory(arguments.output)  # whether it may hold something is the trainer's check
    if arguments.max_minutes is not None and arguments.max_minutes <= 0:
        raise SystemExit("--max-minutes must be positive")
    if arguments.max_steps is not None and arguments.max_steps < 0:
        raise SystemExit("--max-steps must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if arguments.lm_loss_weight is not None and arguments.lm_loss_weight < 0:
        raise SystemExit("--lm-loss-weight must be >= 0")
    command = ["python", "-m", "eval.train_tiny", *(sys.argv[1:] if argv is None else argv)]
    plan = SMOKE_PLAN if arguments.smoke else FULL_PLAN
    if arguments.lm_loss_weight is not None:
        plan = replace(plan, stage1_lm_loss_weight=arguments.lm_loss_weight)
    trainer = Trainer(output=arguments.output, plan=plan, seed=arguments.seed,
                      device=arguments.device, resume=arguments.resume, max_minutes=arguments.max_minutes,
                      max_steps=arguments.max_steps, command=command)
    stopped = None
    try:
        trainer.run(arguments.stage)
    except StopRequested as reason:
        stopped = str(reason)
    trainer._log("command_stop", reason=stopped or ("complete" if trainer.progress.done else "requested stages done"),
                 at={"stage": trainer.progress.stage, "stage_step": trainer.progress.stage_step},
                 timing={"command_s": time.monotonic() - trainer.started})
    trainer.save_state()
    trainer.export()
    if trainer.progress.done:
        print(f"training complete; model in {arguments.output}")
    else:
        print(f"stopped at stage {trainer.progress.stage} step {trainer.progress.stage_step}"
              f"{f' ({stopped})' if stopped else ''}; continue with --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
