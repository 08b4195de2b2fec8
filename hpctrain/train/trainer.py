"""The training loop: build, (resume), step, log, evaluate, checkpoint, summarise.

Steps are counted as completed optimizer steps: the record with `step: k` describes the k-th
update, and a checkpoint at step k resumes with update k+1. The loop is bit-reproducible on
CPU: the data stream and the LR are pure functions of the step, and everything else that
changes (weights, optimizer state, RNG, loss scale) is in the checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint import catalog, resume_changes
from hpctrain.checkpoint import save_load as ckpt
from hpctrain.checkpoint.checkpointer import Checkpointer, save_metrics
from hpctrain.checkpoint.hf_import import load_hf_weights
from hpctrain.checkpoint.writer import Retention
from hpctrain.config.schema import Config
from hpctrain.data.prepare import prepare
from hpctrain.distributed.device import device_name, peak_memory_bytes, reset_peak_memory
from hpctrain.distributed.mesh import Mesh
from hpctrain.metrics.activations import ActivationMeter
from hpctrain.metrics.moe import drop_moe_metrics, moe_metrics
from hpctrain.metrics.plot import plot_run
from hpctrain.metrics.throughput import batch_counts, flops_utilization, peak_bf16_flops
from hpctrain.models.compile import CompileWatch
from hpctrain.parallel.context.step import shard_batches, take_cp_bytes
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import eval_loss
from hpctrain.train import continuation, nonfinite
from hpctrain.train.exports import Exporter
from hpctrain.train.feed import Feed
from hpctrain.train.optim import lr_at, set_lr
from hpctrain.train.outputs import (
    NoPrediction,
    Prediction,
    make_loggers,
    never_stop,
    step_profiler,
    summarize,
)
from hpctrain.train.phases import build_note, first_step_note
from hpctrain.train.setup import build_parallel_state
from hpctrain.train.source_loss import train_loss_hooks
from hpctrain.train.straggler_watch import StragglerWatch
from hpctrain.train.tensor_parallel import take_comm_bytes, tp_step_hooks

log = logging.getLogger(__name__)
HISTORY_STEPS = 1000  # step records kept for the summary's medians


class Trainer:
    """One rank's training run on `mesh`. The launcher's side comes in as arguments, so train
    imports nothing above it: `stop_requested()` is collective and True on every rank once any
    rank was signalled (hpctrain.distributed.preempt); `prediction` is the planner's (task=train
    builds both, hpctrain.dispatch)."""

    def __init__(self, cfg: Config, mesh: Mesh, *, stop_requested: Callable[[], bool] = never_stop,
                 prediction: Prediction | None = None):
        self.cfg, self.mesh, self.run_dir = cfg, mesh, Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        torch.manual_seed(t.seed)
        if mesh.is_logging_rank:
            log.info("%s", build_note(cfg, device_type=mesh.device.type))
        # Built once, passed to checkpointing and metrics (hpctrain.train.setup); the pipeline
        # engine runs the stages when pp > 1.
        self.parallel, self.pipeline = build_parallel_state(cfg, mesh)
        self.model = self.parallel.model  # this rank's shard / stages, full model's names
        self.dp = self.parallel.engine  # the one update path of every layout
        self.optimizer = self.dp.optimizer
        self.tp_hooks = tp_step_hooks(self.model, self.parallel.tp_plan)
        self.activations = ActivationMeter(self.dp.parameter_tensors())  # saved-for-backward bytes
        self.scaler = LossScaler(enabled=t.precision == "fp16")
        # the splits and sampler (hpctrain.train.feed): a mixture's corpora each their own
        self.feed = Feed(cfg, prepare(cfg.data), dp_rank=mesh.coord("dp"))
        self.source_loss, self.train_hooks = train_loss_hooks(  # a mixture's loss_<name>
            [src.name for src in self.feed.sources], tp_hooks=self.tp_hooks,
            pipeline=self.pipeline, device=mesh.device)
        self.peak = peak_bf16_flops(device_name(mesh.device)) if mesh.is_logging_rank else None
        # The recent steps' records only (summary medians, the last loss): nothing per step
        # grows for the whole run; `steps_run` counts them all.
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)
        self.steps_run = 0
        self.init_bytes_read = 0  # read from model.init_from's safetensors (this rank's share)
        self.step = 0
        self.data_offset = 0  # data step = step + data_offset: rollbacks skip bad batches
        self.guard = nonfinite.NonFiniteGuard(t.on_nonfinite)
        self.stop_requested = stop_requested
        self.prediction = prediction if prediction is not None else NoPrediction()
        self.compile_watch = CompileWatch()  # train.compile: compile time, recompilations
        self.checkpointer = Checkpointer(mesh, asynchronous=t.checkpoint_async,
                                         retention=Retention(t.keep, t.keep_every))
        self.exporter = Exporter(self.run_dir, every=t.export_every if mesh.is_logging_rank else 0)
        self.stragglers = StragglerWatch(cfg, mesh, self.run_dir)

    def micro_batches(self, step: int) -> list:
        return self.feed.micro_batches(step + self.data_offset)[0]

    # -- checkpoints -----------------------------------------------------------------------
    def resume(self) -> None:
        """Continue from a checkpoint (train.resume) when there is one; else start from
        model.init_from's weights when set (hpctrain.checkpoint.hf_import), else from the init."""
        mode = self.cfg.train.resume
        # Chosen and verified on rank 0 for every rank; unverified or refused ones are skipped
        # (auto) or stop the run (an explicit directory); another model shape stops it. With
        # none, the run starts from model.init_from's weights when set (a checkpoint wins).
        kw = dict(parallel=self.parallel, model_config=self.cfg.model,
                  accept=resume_changes.acceptor(self.cfg, logging_rank=self.mesh.is_logging_rank))
        loaded = None
        if mode == "auto":
            loaded = ckpt.load_latest(self.run_dir, **kw)
        elif mode != "never":
            found = ckpt.agreed_verified(Path(mode))
            loaded = (found, *ckpt.load(found, **kw))
        if loaded is None:
            if self.cfg.model.init_from:
                self.init_bytes_read = load_hf_weights(self.cfg.model.init_from,
                                                       parallel=self.parallel)
                log.info("initial weights from %s (%d bytes read on this rank)",
                         self.cfg.model.init_from, self.init_bytes_read)
            return
        found, train_state, rank_state = loaded
        if mode not in ("auto", "never") and self.mesh.rank == 0:  # a new line from there
            catalog.set_aside_newer(self.run_dir, step=train_state["step"])
        self.scaler.load_state_dict(rank_state["scaler"])
        self.step = train_state["step"]
        self.data_offset = train_state.get("data_offset", 0)
        self.guard.rollbacks = train_state.get("nonfinite_rollbacks", 0)
        log.info("resumed from %s at step %d (saved at %s)", found.path, self.step,
                 " ".join(f"{k}={v}" for k, v in found.manifest.get("layout", {}).items()))
        change = continuation.schedule_change(self.cfg.optim, step=self.step,
                                              steps=self.cfg.train.steps,
                                              saved_steps=train_state.get("steps"))
        if change and self.mesh.is_logging_rank and self.step < self.cfg.train.steps:
            log.info("%s", change)

    def save(self) -> Path:
        """Collective: save this step's checkpoint — started in the background with
        train.checkpoint_async (`Checkpointer`). A step already saved is not saved again
        (a stop right after a periodic save)."""
        path = ckpt.checkpoint_dir(self.run_dir, self.step)
        if self.checkpointer.last_step == self.step:
            return path
        p, gbs = self.cfg.parallel, self.cfg.train.global_batch_size
        state = {"step": self.step, "steps": self.cfg.train.steps,
                 "data_offset": self.data_offset,
                 "nonfinite_rollbacks": self.guard.rollbacks,
                 "consumed_samples": (self.step + self.data_offset) * gbs,
                 "dp": p.dp, "cp": p.cp, "tp": p.tp, "pp": p.pp, "ep": p.ep, "zero": p.zero,
                 "config": resume_changes.recorded(self.cfg)}
        nonfinite.check_finite_state(self._state_tensors(), path=path, device=self.mesh.device)
        self.checkpointer.save(path, parallel=self.parallel, train_state=state,
                               rank_state={"scaler": self.scaler.state_dict()},
                               model_config=self.cfg.model)
        return path

    # -- one step --------------------------------------------------------------------------
    def train_one(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step
        lr = lr_at(step, cfg.optim, total_steps=cfg.train.steps)
        set_lr(self.optimizer, lr)
        take_comm_bytes(self.parallel.tp_plan)  # drop what eval sent since the last step
        take_cp_bytes(self.parallel.cp_comm)
        drop_moe_metrics(self.model)
        micro, sources = self.feed.micro_batches(step + self.data_offset)
        if self.source_loss is not None:
            self.source_loss.begin(sources, order=self.pipeline and self.pipeline.loss_order())
        data_metrics = self.feed.step_metrics(step + self.data_offset) if (
            self.mesh.is_logging_rank) else {}
        t0 = time.perf_counter()
        self.activations.reset()
        with self.activations:
            if self.pipeline is not None:
                result, step_extra = self._pipeline_step(micro)
            else:
                result, step_extra = self.dp.train_step(
                    shard_batches(micro, group=self.mesh.group("cp")), n_micro=cfg.grad_accum,
                    precision=cfg.train.precision, scaler=self.scaler,
                    grad_clip=cfg.train.grad_clip, **self.train_hooks), {}
        if self.source_loss is not None:
            step_extra.update(self.source_loss.take(batch_group=self.mesh.dp_cp,
                                                    pp_group=self.mesh.group("pp")))
        dt = time.perf_counter() - t0
        step_extra = {**step_extra, "mem_activation_bytes": self.activations.peak_bytes}
        self.step += 1
        return {"loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                "skipped": result.skipped, "nonfinite": result.nonfinite, "step_time_s": dt,
                **self._throughput(micro, dt), **take_comm_bytes(self.parallel.tp_plan),
                **take_cp_bytes(self.parallel.cp_comm),
                **(moe_metrics(self.model, group=self.mesh.dp_cp, device=self.mesh.device,
                               pp_group=self.mesh.group("pp"), sp_group=self.mesh.group("tp")
                               if cfg.parallel.sp else None) if cfg.model.moe.enabled else {}),
                **step_extra, **data_metrics}

    def _throughput(self, micro, dt: float) -> dict[str, Any]:
        """Real tokens/s and MFU of the global batch (padding not counted, attention FLOPs
        from the document lengths), its padding fraction and documents."""
        counts = batch_counts(micro, group=self.mesh.group("dp"), device=self.mesh.device)
        return {"tokens_per_s": counts.tokens / dt,
                "mfu": flops_utilization(counts.flops(self.cfg.model) / dt,
                                         n_devices=self.mesh.dims.world_size,
                                         peak_flops=self.peak),
                "padding_fraction": counts.padding_fraction, "documents": counts.documents}

    def _pipeline_step(self, micro: list):
        """pp > 1: every stage of a dp replica reads the same micro-batches (the first stage
        needs the tokens, the last the targets, every stage the documents) and runs its
        schedule (hpctrain.train.pipeline)."""
        micro = list(shard_batches(micro, group=self.mesh.group("cp")))
        return self.pipeline.train_step(self.dp, micro, scaler=self.scaler,
                                        grad_clip=self.cfg.train.grad_clip)

    def memory_metrics(self) -> dict[str, int]:
        ledger = self.dp.ledger()
        on_device = peak_memory_bytes(self.mesh.device)
        acts = max((m.get("mem_activation_bytes", 0) for m in self.history), default=0)
        # CPU: model states (the ledger) + the largest saved-activation peak of a step
        total = sum(ledger.values()) + acts if self.mesh.device.type == "cpu" else on_device
        return {**ledger, "mem_activation_peak_bytes": acts, "mem_bytes": total,
                "mem_peak_process_bytes": on_device}

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.resume()
        t = self.cfg.train
        logging_rank = self.mesh.is_logging_rank
        if self.step >= t.steps:  # every rank resumed the same step: the same branch
            return self._already_complete()
        loggers, progress = (make_loggers(self.cfg, run_dir=self.run_dir, start_step=self.step)
                             if logging_rank else (None, None))
        if logging_rank:
            continuation.record_restart(self.run_dir, step=self.step, loggers=loggers,
                                        world=self.mesh.dims.world_size,
                                        layout=self.cfg.layout_label)
        reset_peak_memory(self.mesh.device)
        if logging_rank:
            log.info("%s", first_step_note(self.cfg, device_type=self.mesh.device.type,
                                           start=self.step))
        extra: dict[str, Any] = {}
        with step_profiler(self.cfg.train, run_dir=self.run_dir, rank=self.mesh.rank,
                           device=self.mesh.device) as prof:
            while self.step < t.steps:
                self.mesh.heartbeat.step(self.step)  # the hang watchdog times each step
                with self.compile_watch.step():
                    metrics = self.train_one()
                self.history.append(metrics)
                self.steps_run += 1
                if not self._judge(metrics, loggers):
                    metrics.update(self.stragglers.after_step(self.step, loggers))
                    self._after_step(metrics, loggers, progress, extra)
                if prof is not None:
                    prof.step()
                if self._should_stop(extra):
                    break
        self.mesh.heartbeat.idle("final checkpoint")
        if self.pipeline is not None and self.cfg.parallel.timeline:
            extra.update(self.pipeline.write_timeline(self.run_dir, step=self.step) or {})
        try:
            extra["checkpoint"] = str(self.save())
            self.checkpointer.wait()  # sealed before the run reports it
            self.exporter.sealed(self.checkpointer.finished() if logging_rank else [])
        finally:
            self.checkpointer.close()
            extra.update(self.exporter.close())
        extra.update(self.checkpointer.summary())
        return self._finish(loggers, extra) if logging_rank else {}

    def _already_complete(self) -> dict[str, Any]:
        """A re-run of a finished run: nothing trained, saved or rewritten; the logging rank
        says so and returns the run's summary.json as it is."""
        self.checkpointer.close()
        if not self.mesh.is_logging_rank:
            return {}
        log.info("%s", continuation.complete_message(self.run_dir, step=self.step,
                                                     steps=self.cfg.train.steps))
        return continuation.kept_summary(self.run_dir)

    def _should_stop(self, extra: dict[str, Any]) -> bool:
        """train.stop_after reached, or a stop signal on any rank (Slurm preemption or time
        limit, SIGINT/SIGTERM to the local launcher). The signal check is collective
        (`stop_requested`), so every rank stops after the same step and the checkpoint saved
        next is consistent."""
        t = self.cfg.train
        if t.stop_after is not None and self.step >= t.stop_after:
            if self.mesh.is_logging_rank and self.step < t.steps:
                log.info("%s", continuation.stopped_early_message(step=self.step, steps=t.steps))
            return True
        if self.stop_requested():
            extra["stopped_by_signal"] = True
            source = "Slurm" if self.cfg.cluster.launcher == "slurm" else "a signal"
            log.warning("stop requested by %s: checkpointing at step %d", source, self.step)
            return True
        return False

    # -- non-finite steps (train.on_nonfinite, hpctrain.train.nonfinite) ---------------------
    def _judge(self, metrics: dict[str, Any], loggers) -> bool:
        """Apply train.on_nonfinite after a step. Every rank holds the same verdict, so every
        rank takes the same branch. True when a rollback undid the step (no eval, checkpoint
        or progress for it; its record says what was non-finite and where training went)."""
        step = self.step
        action = self.guard.after_step(step, metrics)
        if action == "continue":
            return False
        found = self._last_verified()
        checkpoint = found.path if found is not None else None
        if action == "rollback" and found is None:
            action = self.guard.cannot_roll_back()
        if action == "rollback":
            self._rollback(found)
            metrics["rolled_back_to"] = self.step
        if loggers is not None:
            loggers.log(step, metrics)
        if action == "stop":
            if loggers is not None:
                loggers.close()
            raise self.guard.stop_error(step, metrics, cfg=self.cfg, checkpoint=checkpoint,
                                        device=self.mesh.device)
        return True

    def _last_verified(self) -> ckpt.Verified | None:
        """Collective: the newest verified checkpoint of this run, or None (none, or none
        verifies); a save in flight is sealed first."""
        self.checkpointer.wait()
        try:
            return ckpt.agreed_latest(self.run_dir)
        except ValueError:
            return None

    def _rollback(self, found: ckpt.Verified) -> None:
        """Reload `found` on every rank and skip the data of the steps since it, through the bad
        one: the data step is step + data_offset, so the sampler stays a pure function."""
        bad, path = self.step, found.path
        train_state, rank_state = ckpt.load(found, parallel=self.parallel,
                                            model_config=self.cfg.model)
        self.scaler.load_state_dict(rank_state["scaler"])
        self.step = train_state["step"]
        self.data_offset += bad - self.step
        if self.mesh.is_logging_rank:
            log.warning("step %d non-finite (%s): rolled back to %s, skipping the data of steps "
                        "%d..%d (rollback %d of %d)", bad, self.history[-1]["nonfinite"], path,
                        self.step + 1, bad, self.guard.rollbacks, nonfinite.MAX_ROLLBACKS)

    def _state_tensors(self) -> list[torch.Tensor]:
        """This rank's weights and optimizer state (the engine's shards, or the module's)."""
        return [u.shard for u in self.dp.units] + self.dp.optimizer.tensors()

    def _after_step(self, metrics, loggers, progress, extra) -> None:
        t, step = self.cfg.train, self.step
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            metrics.update(self._evaluate())
            extra["final_eval_loss"] = metrics["eval_loss"]
        self.checkpointer.poll()  # a background save that ended: sealed, or its error raised
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.steps:
            self.save()
        if loggers is None:
            return
        progress.advance(step - 1)
        saves = self.checkpointer.finished()
        self.exporter.sealed(saves)
        metrics.update(self.checkpointer.started_at(step))
        if (step % t.log_every == 0 or step in (1, t.steps) or "eval_loss" in metrics
                or metrics["nonfinite"] or saves or "ckpt_block_s" in metrics
                or "straggler_ranks" in metrics):
            loggers.log(step, {**metrics, **save_metrics(saves), **self.memory_metrics(),
                               **self.prediction.once()})

    def _evaluate(self) -> dict[str, float]:
        """eval_loss over the fixed evaluation set; for a mixture, `eval_loss_<name>` of each
        corpus and eval_loss their mean (hpctrain.train.feed)."""
        out = {}
        for name, batches in self.feed.eval_sets():
            batches = shard_batches(batches, group=self.mesh.group("cp"))
            out[f"eval_loss_{name}" if name else "eval_loss"] = (
                self.pipeline.eval_loss(batches) if self.pipeline is not None else
                eval_loss(self.model, batches, precision=self.cfg.train.precision,
                          dp_group=self.mesh.dp_cp, **self.tp_hooks))
        return out if "eval_loss" in out else {"eval_loss": sum(out.values()) / len(out), **out}

    def _finish(self, loggers, extra: dict[str, Any]) -> dict[str, Any]:
        mem = self.memory_metrics()
        extra.update(peak_memory_bytes=mem["mem_bytes"], device=device_name(self.mesh.device),
                     world_size=self.mesh.dims.world_size, completed_steps=self.step)
        if self.cfg.train.compile != "none":
            extra.update(self.compile_watch.summary())
        plot = (plot_run(self.run_dir / "metrics.jsonl", self.run_dir / "training.png")
                if self.cfg.logger.plot else None)
        extra["plot"] = str(plot) if plot else None
        summary = summarize(list(self.history), cfg=self.cfg, run_dir=self.run_dir, extra=extra,
                            evicted=self.steps_run - len(self.history))
        summary.update(self.prediction.summary(summary, mem))  # predicted vs measured
        loggers.summary(summary)
        loggers.close()  # the CLI prints the summary last (hpctrain.train.outputs.format_summary)
        return summary
