"""One trainer rank: a DeepSpeed engine around a PEFT LoRA model of the base model (a Ray actor)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from art_ray import storage
from art_ray.adapters.lora_files import PackedAdapter
from art_ray.colocation import TrainerHandover
from art_ray.cpu_threads import every_core_threads
from art_ray.errors import QuotaExceededError
from art_ray.tinker.types import AdamStep, ForwardBackwardCall
from art_ray.train_config import SFTConfig, TrainConfig
from art_ray.trainer.config import TrainerConfig
from art_ray.trainer.engine import build_engine
from art_ray.trainer.host_memory import host_memory
from art_ray.trainer.packing import PackedRow, PackedStep, segment_attention_mask
from art_ray.trainer.runs import RunStates, RunStatus, group_key
from art_ray.trainer.train_batch import RankBatch, rl_batches, sft_batches
from art_ray.trajectories import Trajectory, TrajectoryGroup
from art_ray.unused_imports import skip_unused_imports

if TYPE_CHECKING:  # torch loads on the rank: the driver imports this module to create the actors
    import torch

    from art_ray.trainer.checkpoint_writer import BackgroundCheckpointEngine
    from art_ray.trainer.step_prefix import StepPrefix
    from art_ray.trainer.tinker_step import ItemOutput

CLIENT_STATE_STEP = "art_ray_step"
# The concurrency group of `captured_adapter`, so the registry's fetch never queues behind a train call
ADAPTER_GROUP = "adapter"
# The concurrency group that waits for a checkpoint's background writes and marks it complete, while the
# next train call runs on the actor's main thread
CHECKPOINT_GROUP = "checkpoint"
# Captured adapters of each run rank 0 holds until the registry fetched them (it does within milliseconds)
KEEP_CAPTURED = 2
# Written last into a checkpoint folder: a folder without it is an interrupted checkpoint, never resumed from
STATE_FILE = "trainer_state.json"


class TrainerWorker:
    """Made remote by the trainer group (`ray.remote(TrainerWorker)`): the plain class stays importable,
    so Ray pickles it by reference instead of by value with torch's module state.

    `config` founds the rank: its base model, LoRA shape and sizes are every run's (art_ray/trainer/runs.py);
    each call that trains, publishes or checkpoints names its run, which goes live first."""

    def __init__(self, config: TrainerConfig, rank: int) -> None:
        skip_unused_imports()  # before transformers and DeepSpeed load
        import torch

        self.config = config
        self.settings = config.settings
        self.rank = rank
        # None: every core this process may run on, a thread pinned to each (colocated: the engine waits
        # while we train)
        self.threads = config.threads or every_core_threads()
        torch.set_num_threads(self.threads)
        torch.manual_seed(self.settings.seed)
        self.on_gpu = config.device == "gpu"
        self.engine: Any = None
        self.checkpoint_writer: BackgroundCheckpointEngine | None = None
        self.handover: TrainerHandover | None = None
        self.tokenizer: Any = None
        self.runs: RunStates | None = None
        self._captured: dict[tuple[str, int], PackedAdapter] = {}
        self._captured_lock = threading.Lock()
        # each run's forward_backward calls that wait for its optim_step
        self._tinker_pending: dict[str, list[ForwardBackwardCall]] = {}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the process group."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> None:
        # DeepSpeed tries MPI discovery unless these are set, inside Ray actors too.
        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.settings.world_size),
                "LOCAL_RANK": "0" if self.on_gpu else str(self.rank),
            }
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.base_model)
        self.engine = build_engine(
            self.config, bf16=self.on_gpu, dist_backend="nccl" if self.on_gpu else "gloo"
        )

        from art_ray.trainer.checkpoint_writer import BackgroundCheckpointEngine

        self.checkpoint_writer = BackgroundCheckpointEngine(self.engine._config)
        self.engine.checkpoint_engine = self.checkpoint_writer
        self.handover = TrainerHandover(self.engine.module, self.engine, self.config.device)
        self.runs = RunStates(self.engine, self.config, host_memory(self.config.device))
        if self.config.colocated:
            self.handover.offload()  # the engines sample first

    def add_run(self, config: TrainerConfig) -> None:
        """Hold another run on this rank (its step-0 adapter, a fresh optimizer state, step 0)."""
        if group_key(config) != group_key(self.config):
            raise ValueError(
                f"run {config.model!r} cannot train on the trainer of {self.config.model!r}: their base "
                "model, LoRA shape or trainer sizes differ"
            )
        self._runs.add(config)

    def remove_run(self, run: str) -> None:
        runs = self._runs
        if runs.live == run:
            others = [name for name in runs.names() if name != run]
            if not others:
                raise ValueError(f"run {run!r} is this trainer's last run")
            runs.activate(others[0])
        runs.remove(run)
        self._tinker_pending.pop(run, None)
        with self._captured_lock:
            for key in [key for key in self._captured if key[0] == run]:
                del self._captured[key]

    def run_status(self) -> list[RunStatus]:
        return self._runs.describe()

    @property
    def _runs(self) -> RunStates:
        assert self.runs is not None, "setup() first"
        return self.runs

    def _live(self, run: str) -> TrainerConfig:
        """Make `run` the live run; its config."""
        self._runs.activate(run)
        return self._runs.config(run)

    def offload(self) -> None:
        """Colocated: give the device back to the engines until the next train call."""
        assert self.handover is not None
        self.handover.offload()

    # --- training -------------------------------------------------------------------------------

    def prepare_rl(
        self, groups: list[TrajectoryGroup], train_config: TrainConfig, max_tokens: int | None = None
    ) -> RankBatch | tuple:
        """Rank 0 only: the call's batch for every rank (a Ray call with num_returns=world_size).
        QuotaExceededError when it packs more than `max_tokens` tokens."""
        row_length = train_config.packed_sequence_length or self.settings.sequence_length
        return self._shards(
            rl_batches(groups, self.tokenizer, train_config, row_length, self.settings.world_size), max_tokens
        )

    def prepare_sft(
        self, trajectories: list[Trajectory], sft_config: SFTConfig, max_tokens: int | None = None
    ) -> RankBatch | tuple:
        return self._shards(
            sft_batches(
                trajectories,
                self.tokenizer,
                sft_config,
                self.settings.sequence_length,
                self.settings.world_size,
            ),
            max_tokens,
        )

    @staticmethod
    def _shards(shards: list[RankBatch], max_tokens: int | None) -> RankBatch | tuple:
        if max_tokens is not None:
            tokens = sum(
                sum(1 for segment in row.segment_ids if segment)
                for shard in shards
                for step in shard.steps
                for row in step.rows
            ) + sum(len(step.prefix) for step in shards[0].steps)  # a step's prefix is computed once
            if tokens > max_tokens:
                raise QuotaExceededError(
                    f"this train call packs {tokens} tokens, over the {max_tokens} tokens a call its run's "
                    "key allows (max_train_tokens): train on fewer trajectories per call"
                )
        return shards[0] if len(shards) == 1 else tuple(shards)

    def train(self, run: str, batch: RankBatch, train_config: TrainConfig) -> Iterator[dict[str, float]]:
        """One train call of `run` on this rank's shard: yields the metrics of each optimizer step
        (identical on every rank)."""
        assert self.handover is not None
        self._live(run)
        self.handover.reload()
        if not batch.steps:
            self._runs.set_step(run, self._runs.step(run) + 1)
            yield {**batch.stats.metrics(), "train/nothing_trainable": 1.0}
            return
        steps = batch.steps
        if train_config.precalculate_logprobs:
            # the policy before the first update: step 0 computes it as it trains (ratio 1); the later
            # steps' is computed now, before anything moves
            steps = [
                PackedStep([row.with_policy_logprobs(None) for row in steps[0].rows], steps[0].prefix),
                *(
                    PackedStep(
                        [
                            row.with_policy_logprobs(policy)
                            for row, policy in zip(step.rows, self._logprobs(step), strict=True)
                        ],
                        step.prefix,
                    )
                    for step in steps[1:]
                ),
            ]
        for index, (step, learning_rate) in enumerate(zip(steps, batch.learning_rates, strict=True)):
            metrics = self._gradient_step(step, train_config, learning_rate)
            metrics.update(batch.stats.metrics())
            metrics["train/gradient_step"] = float(index)
            yield metrics
        self._runs.set_step(run, self._runs.step(run) + 1)

    def _gradient_step(
        self, step: PackedStep, train_config: TrainConfig, learning_rate: float
    ) -> dict[str, float]:
        start = time.perf_counter()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = learning_rate
        self.engine.train()
        # every rank computes the step's prefix, rows or not: under ZeRO-3 each forward gathers parameters
        # with the other ranks
        prefix = self._step_prefix(step, trains=True)
        reference = self._step_prefix(step, trains=False, base=True) if train_config.needs_reference else None
        totals, grad_norm = self._optimizer_step(
            [
                lambda batch=batch: self._forward_backward(batch, train_config, prefix, reference)
                for batch in self._micro_batches(step.rows)
            ],
            train_config.max_grad_norm,
            after_backward=(lambda: prefix.backward(self.engine)) if prefix else None,
        )
        seconds = time.perf_counter() - start
        loss, policy, kl, clip, entropy, old_logprob_diff, tokens, weight = totals.tolist()
        return {
            "loss/train": loss,
            "loss/policy": policy,
            "loss/kl": kl,
            "loss/entropy": entropy / max(weight, 1e-12),
            "loss/clip_fraction": clip / max(weight, 1e-12),
            "loss/old_logprob_diff": old_logprob_diff / max(weight, 1e-12),
            "loss/grad_norm": grad_norm,
            "loss/learning_rate": learning_rate,
            "data/trained_tokens": tokens,
            "throughput/train_tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "time/step_seconds": seconds,
        }

    def _optimizer_step(
        self,
        micro_batches: list[Callable[[], torch.Tensor]],
        max_grad_norm: float | None,
        after_backward: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Run each micro-batch's forward and backward (each returns its totals, summed over ranks here),
        `after_backward`, then one optimizer step; the totals and the gradient norm before clipping."""
        import torch
        import torch.distributed as dist

        # Clipping is per optimizer step. With ZeRO 1-2 the optimizer clips and records the norm; at stage
        # 0 the engine calls clip_fp32_gradients (after the all-reduce) only if clipping is on, so it is
        # always on (a huge bound when disabled) and records the norm it computes.
        clip = max_grad_norm or 1e12
        self.engine.gradient_clipping = lambda: clip
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = clip
        self._grad_norm = math.nan

        def clip_and_record() -> None:
            params = [p for p in self.engine.module.parameters() if p.requires_grad]
            self._grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=clip))

        self.engine.clip_fp32_gradients = clip_and_record
        self.engine.train()
        totals = micro_batches[0]()
        for backward in micro_batches[1:]:
            totals += backward()
        if after_backward is not None:
            after_backward()
        self.engine.step()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:  # fp32 at stage 0: the norm our clip_fp32_gradients recorded
            grad_norm = self._grad_norm
        return totals, float(grad_norm) if grad_norm is not None else math.nan

    def _micro_batches(self, rows: list[PackedRow]) -> list[list[PackedRow]]:
        micro = self.settings.micro_batch_rows
        return [rows[i : i + micro] for i in range(0, len(rows), micro)] or [[]]

    def _step_prefix(self, step: PackedStep, trains: bool, base: bool = False) -> StepPrefix | None:
        """The step's shared prefix computed now (None: the step has none); `base`: the base model's."""
        from art_ray.trainer.step_prefix import StepPrefix

        if not step.prefix:
            return None
        with self.engine.module.disable_adapter() if base else contextlib.nullcontext():
            return StepPrefix(self.engine, step.prefix, trains)

    def _inputs(
        self, batch: list[PackedRow], prefix_length: int = 0
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, Callable[..., torch.Tensor | None]]:
        """The model's inputs for a micro-batch (after a step prefix of `prefix_length` tokens), the
        positions that train a token, and a getter of a row field's tensor at those positions."""
        import torch

        from art_ray.trainer.loss import trained_positions

        if not batch:  # this rank has no rows: a zero-weight row keeps the collective ops in step
            batch = [PackedRow.padding(self.settings.sequence_length)]
        device = self.engine.device
        # Rows are padded at their tail only: the micro-batch is computed up to its longest row's last
        # real token (a group of short samples fills ~2/3 of a row; the padding would cost as much).
        used = max(
            max((i for i, segment in enumerate(row.segment_ids) if segment), default=0) + 1 for row in batch
        )

        def tensor(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(row, name)[:used] for row in batch], dtype=dtype, device=device)

        segments = tensor("segment_ids", torch.long)
        inputs = {
            "input_ids": tensor("input_ids", torch.long),
            "position_ids": tensor("position_ids", torch.long),
            "attention_mask": segment_attention_mask(
                segments, tensor("parent_ids", torch.long), prefix_length
            ),
        }
        # The output layer and its log-softmax run only where some row trains a token: prompts and tool
        # output are context, not targets (here ~a quarter of the positions, 6% of a step; with a 150k
        # vocabulary and agent prompts most of the logits' memory).
        keep = trained_positions(tensor("weights", torch.float32))

        def at_trained(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            if not all(getattr(row, name) for row in batch):
                return None
            return tensor(name, dtype)[:, keep]

        return inputs, keep, at_trained

    def _logprobs(self, step: PackedStep) -> list[list[float]]:
        """The current policy's logprob of each of the step's trained tokens (NaN elsewhere), by row and
        position."""
        import torch

        from art_ray.trainer.loss import token_logprobs

        result: list[list[float]] = []
        prefix = self._step_prefix(step, trains=False)
        for batch in self._micro_batches(step.rows):
            inputs, keep, at_trained = self._inputs(batch, prefix.length if prefix else 0)
            with torch.no_grad():
                cache = prefix.cache(len(inputs["input_ids"])) if prefix else None
                logits = self.engine(**inputs, past_key_values=cache, logits_to_keep=keep).logits
                targets, temperatures = at_trained("target_ids", torch.long), at_trained("temperatures")
                logprobs = token_logprobs(logits, targets, temperatures)
            trained = at_trained("weights") > 0
            for index, row in enumerate(batch):
                values = [math.nan] * len(row.input_ids)
                for column, position in enumerate(keep.tolist()):
                    if trained[index, column]:
                        values[position] = float(logprobs[index, column])
                result.append(values)
        return result

    def _forward_backward(
        self,
        batch: list[PackedRow],
        train_config: TrainConfig,
        prefix: StepPrefix | None = None,
        reference_prefix: StepPrefix | None = None,
    ) -> torch.Tensor:
        import torch

        from art_ray.trainer.loss import policy_loss, token_entropy, token_logprobs

        inputs, keep, at_trained = self._inputs(batch, prefix.length if prefix else 0)
        rows = len(inputs["input_ids"])
        targets, segments = at_trained("target_ids", torch.long), at_trained("segment_ids", torch.long)
        temperatures = at_trained("temperatures")
        old_logprobs, advantages, weights = (
            at_trained("old_logprobs"),
            at_trained("advantages"),
            at_trained("weights"),
        )
        reference = None
        if train_config.needs_reference:
            with torch.no_grad(), self.engine.module.disable_adapter():
                cache = reference_prefix.cache(rows) if reference_prefix else None
                ref_logits = self.engine(**inputs, past_key_values=cache, logits_to_keep=keep).logits
                reference = token_logprobs(ref_logits, targets, temperatures)
        cache = prefix.cache(rows) if prefix else None
        logits = self.engine(**inputs, past_key_values=cache, logits_to_keep=keep).logits
        logprobs = token_logprobs(logits, targets, temperatures)
        result = policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            weights,
            train_config,
            reference,
            segments,
            sampler_logprobs=at_trained("sampler_logprobs"),
        )
        # DeepSpeed averages gradients over ranks; weights already sum to 1 over the global batch.
        self.engine.backward(result.loss * self.settings.world_size, scale_wrt_gas=False)
        if prefix is not None:
            prefix.gather()
        with torch.no_grad():
            entropy = (token_entropy(logits, temperatures) * weights).sum()
            # how far the ratio's denominator is from this policy: at a call's first step (before any
            # update) the sampler's distance from the trainer, ~0 when both compute the same distribution
            drift = (logprobs - old_logprobs).abs()
            drift = torch.where(torch.isnan(old_logprobs), torch.zeros_like(drift), drift)
            old_logprob_diff = (drift * weights).sum()
        return torch.tensor(
            [
                result.loss.item(),
                result.policy_loss.item(),
                result.kl.item(),
                result.clip_fraction.item() * weights.sum().item(),
                entropy.item(),
                old_logprob_diff.item(),
                result.trained_tokens.item(),
                weights.sum().item(),
            ],
            dtype=torch.float64,
        )

    # --- the Tinker API (art_ray/trainer/tinker_step.py) -------------------------------------------

    def tinker_forward_backward(self, run: str, call: ForwardBackwardCall) -> list[tuple[int, ItemOutput]]:
        """Each of this rank's data's (index, outputs) under the run's current adapter; unless
        `forward_only`, the call waits on the run for its optim_step, which makes its gradients."""
        import torch

        from art_ray.trainer.tinker_step import check_call, loss_items, micro_batch_loss

        check_call(call, self._vocab_size(), self.settings.sequence_length)
        self._live(run)
        assert self.handover is not None
        self.handover.reload()
        indexed = list(enumerate(loss_items(call)))[self.rank :: self.settings.world_size]
        micro = self.settings.micro_batch_rows
        outputs: list[tuple[int, ItemOutput]] = []
        self.engine.eval()
        with torch.no_grad():
            for start in range(0, len(indexed), micro):
                chunk = indexed[start : start + micro]
                _, results = micro_batch_loss(self.engine, [item for _, item in chunk], self.engine.device)
                outputs.extend((index, result) for (index, _), result in zip(chunk, results, strict=True))
        if not call.forward_only:
            self._tinker_pending.setdefault(run, []).append(call)
        return outputs

    def tinker_optim_step(self, run: str, step: AdamStep) -> dict[str, float]:
        """The run's waiting forward_backward calls' gradients (their losses summed), then one AdamW step
        with `step`'s settings; the run's step counter advances."""
        from art_ray.trainer.tinker_step import loss_items, micro_batch_loss, padding_item

        self._live(run)
        assert self.handover is not None
        self.handover.reload()
        items = [item for call in self._tinker_pending.pop(run, []) for item in loss_items(call)]
        world, micro = self.settings.world_size, self.settings.micro_batch_rows
        mine = items[self.rank :: world]
        # every rank runs as many micro-batches as the rank with the most (zero-loss padding)
        count = max(1, math.ceil(math.ceil(len(items) / world) / micro))
        batches = [mine[i * micro : (i + 1) * micro] or [padding_item()] for i in range(count)]
        for group in self.engine.optimizer.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )

        def backward(batch: list) -> torch.Tensor:  # type: ignore[type-arg]
            import torch

            loss, _ = micro_batch_loss(self.engine, batch, self.engine.device)
            # DeepSpeed averages gradients over ranks; Tinker's loss is their sum
            self.engine.backward(loss * world, scale_wrt_gas=False)
            return torch.tensor([loss.item()], dtype=torch.float64)

        totals, grad_norm = self._optimizer_step(
            [lambda batch=batch: backward(batch) for batch in batches], step.grad_clip_norm or None
        )
        self._runs.set_step(run, self._runs.step(run) + 1)
        return {
            "loss:sum": float(totals[0]),
            "grad_norm:mean": grad_norm,
            "learning_rate:mean": step.learning_rate,
            "data:sum": float(len(items)),
        }

    def _vocab_size(self) -> int:
        return int(self.engine.module.get_input_embeddings().num_embeddings)

    # --- adapter and checkpoints ----------------------------------------------------------------

    def adapter_tensors(self, run: str) -> dict[str, torch.Tensor]:
        """The run's current adapter in PEFT state-dict form (gathered from all ranks under ZeRO-3)."""
        from peft import get_peft_model_state_dict

        self._live(run)
        module = self.engine.module
        if self.settings.zero_stage == 3:
            import deepspeed

            params = [p for p in module.parameters() if p.requires_grad]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                state = get_peft_model_state_dict(module)
                return {name: tensor.detach().float().cpu().clone() for name, tensor in state.items()}
        state = get_peft_model_state_dict(module)
        return {name: tensor.detach().float().cpu().clone() for name, tensor in state.items()}

    def publish_adapter(self, run: str, registry: ray.actor.ActorHandle | None) -> list[ray.ObjectRef] | None:
        """Every rank (a ZeRO-3 gather needs them all); rank 0 then keeps the packed adapter and tells the
        registry, which fetches it with `captured_adapter`: the object is created once, by this rank, and
        owned by the registry (the caller of the task that returned it), so it outlives this rank. Returns
        at once with [the publish call's ref] (its result: how many replicas serve the step)."""
        from art_ray.adapters.lora_files import pack_adapter

        adapter = self.adapter_tensors(run)
        if self.rank != 0 or registry is None:
            return None
        config, step = self._runs.config(run), self._runs.step(run)
        with self._captured_lock:
            self._captured[(run, step)] = pack_adapter(adapter)
            for old in sorted(key for key in self._captured if key[0] == run)[:-KEEP_CAPTURED]:
                del self._captured[old]
        published = registry.publish.remote(
            run,
            step,
            config.base_model,
            config.settings.lora.model_dump(),
            ray.get_runtime_context().current_actor,
            config.settings.keep_versions,
        )
        return [published]

    @ray.method(concurrency_group=ADAPTER_GROUP)
    def captured_adapter(self, run: str, step: int) -> PackedAdapter:
        """The adapter rank 0 captured of `run` at `step` (its own thread: answered while the next step
        trains)."""
        with self._captured_lock:
            if (run, step) not in self._captured:
                raise LookupError(f"step {step} of {run} is no longer held by the trainer")
            return self._captured[(run, step)]

    def save_checkpoint(self, run: str, folder: str) -> None:
        """Every rank saves its DeepSpeed state (adapter, optimizer), and rank 0 the PEFT adapter folder
        a replica can serve; remote roots get it uploaded. Returns once the state is copied: the files
        are written in the background (`checkpoint_written`), and the group marks the checkpoint complete
        once every rank's are."""
        import torch

        from art_ray.adapters.lora_files import write_peft_adapter

        config = self._live(run)
        client_state = {CLIENT_STATE_STEP: self._runs.step(run), "torch_rng": torch.get_rng_state()}
        adapter = self.adapter_tensors(run)  # under ZeRO-3 a gather every rank takes part in
        remote = "://" in folder
        target = tempfile.mkdtemp(prefix="art-ray-checkpoint-") if remote else folder
        self.engine.save_checkpoint(
            target, tag="deepspeed", client_state=client_state, exclude_frozen_parameters=True
        )
        writer = self.checkpoint_writer
        assert writer is not None
        if self.rank == 0:
            spec, base_model = config.settings.lora, config.base_model
            writer.submit(lambda: write_peft_adapter(Path(target) / "adapter", adapter, spec, base_model))
        if remote:

            def upload() -> None:
                try:
                    storage.upload_dir(Path(target), folder)
                finally:
                    shutil.rmtree(target, ignore_errors=True)

            writer.submit(upload)

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def checkpoint_written(self, saved: None) -> None:
        """Once this rank's files of the checkpoint whose `save_checkpoint` call is `saved` are written
        (the argument orders this call after it) and those of any earlier one; raises a write's error."""
        assert self.checkpoint_writer is not None
        self.checkpoint_writer.wait()

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def mark_checkpoint_complete(self, folder: str, step: int, *written: None) -> None:
        """Called on rank 0 with every rank's `checkpoint_written` as arguments, so it runs after all of
        them (and maybe while the next step trains: the step is the checkpoint's, not the rank's now)."""
        storage.write_text(f"{folder}/{STATE_FILE}", json.dumps({"step": step, "saved_at": time.time()}))

    def load_checkpoint(
        self, run: str, folder: str, optimizer: bool = True, as_step: int | None = None
    ) -> int:
        """The checkpoint's adapter, step and RNG into `run`, and its optimizer state unless `optimizer` is
        False (then the run's own stays); the step. `as_step`: the run keeps that step instead of the
        checkpoint's (a rollback trains on from an older version's weights; published steps never repeat)."""
        import torch

        self._live(run)
        with tempfile.TemporaryDirectory() as staging:
            local = folder if "://" not in folder else str(storage.download_dir(folder, Path(staging)))
            _, client_state = self.engine.load_checkpoint(
                local, tag="deepspeed", load_module_strict=False, load_optimizer_states=optimizer
            )
        step = int(client_state[CLIENT_STATE_STEP]) if as_step is None else as_step
        self._runs.set_step(run, step)
        torch.set_rng_state(client_state["torch_rng"])
        return step

    def get_step(self, run: str) -> int:
        return self._runs.step(run)
