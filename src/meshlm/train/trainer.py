"""The training loop. Reads top to bottom: config -> layout -> data -> model -> parallelize -> loop.

Nothing is written into the output directory until every input has been checked
(model, data, degrees, checkpoint), so a bad invocation leaves an existing run
exactly as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch

from meshlm import host_memory, objectives, runtime
from meshlm.checkpoint import continuity, run_dir
from meshlm.checkpoint.saving import SaveAndResume
from meshlm.checkpoint.store import TrainState
from meshlm.config import Config, lora_on, nf4_base, to_toml
from meshlm.data.load import cache_dir, check_enough_blocks
from meshlm.data.sampler import ResumableSampler
from meshlm.errors import Interrupted, MeshlmError, interrupted
from meshlm.heartbeat import Heartbeat
from meshlm.layout import resolve
from meshlm.models.attention import implementation
from meshlm.models.build import check_seq_length, tokenizer_and_config
from meshlm.models.families import facts, tied
from meshlm.models.source import ModelSource
from meshlm.parallel.apply import parallelize
from meshlm.runtime import Runtime, largest_over_ranks, log, memory
from meshlm.train import stopping
from meshlm.train.header import lines as run_header
from meshlm.train.metrics import LogWindow, Sinks, job_peak_flops, lines_above, progress_bar, train_flops
from meshlm.train.schedule import advance_schedule, lr_lambda, scaled_lr

FILE_ONLY = {"console": False}  # runtime.setup_logging: a record for logs/rank-N.log, not the console
# the held-out figures the console line shows after eval_loss, where the objective reports them
EVAL_SHOWN = ("eval_ppl", "eval_rewards/accuracies", "eval_rewards/margins")


def train(cfg: Config) -> dict:
    """Run training in this process (one rank of a job, or the whole job). Returns the last metrics row."""
    runtime.dump_stacks_on_signal()
    rt = runtime.init(cfg.backend, cfg.dist_timeout, want_cuda=_wants_cuda(cfg), cpu_collectives=cfg.cpu_offload)
    runtime.setup_logging(rt)
    try:
        return Trainer(cfg, rt).run()
    except Interrupted:  # its line is the whole story
        raise
    except BaseException:
        runtime.log_exception()
        raise
    finally:
        runtime.shutdown()


def _wants_cuda(cfg: Config) -> bool:
    return cfg.backend != "gloo" and torch.cuda.is_available()


class Trainer:
    """One rank's training run. Components are attributes, made by `setup` in the order their inputs are
    checked: layout, data, model, engine (the parallelized model), optimizer, scheduler, state, checkpoints."""

    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.out = cfg.out

    def run(self) -> dict:
        with runtime.deterministic_on_cpu(self.rt.device):
            self.setup()  # every input checked; nothing written yet
            with self.hold_run_dir():
                self.open_run_dir()
                self.sinks = Sinks(self.cfg, self.rt, self.out, self.state.step)
                try:
                    return self.train()
                finally:
                    self.sinks.close()
                    self.heartbeat.close()

    @contextlib.contextmanager
    def hold_run_dir(self):
        """The run directory's lock (checkpoint/run_dir.py): meshlm's launcher holds it for its ranks; a job started
        any other way takes it on rank 0, and every rank stops with the same line when it is taken."""
        lock, error = None, None
        if run_dir.takes_lock():
            try:
                lock = run_dir.RunLock(self.out).acquire()
            except MeshlmError as e:
                error = str(e)
        runtime.agree_on_error(error)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def setup(self) -> None:
        cfg, rt = self.cfg, self.rt
        run_dir.check(cfg)
        torch.manual_seed(cfg.seed)
        tokenizer, tok_id, mcfg = tokenizer_and_config(cfg)  # the model's config read once for every check
        self.layout = resolve(cfg, rt.world_size, mcfg)
        check_seq_length(cfg, mcfg)
        self.continuity_notes = self.continue_run()
        self.blocks, self.eval_blocks = objectives.training_data(cfg, tokenizer, tok_id)
        self.samples = None
        if cfg.eval_samples:  # meshlm generate's modules only with --eval-samples: none on a plain training rank
            from meshlm.train.samples import EvalSamples

            self.samples = EvalSamples.of(cfg, tokenizer, mcfg)
        self.global_batch = cfg.micro_batch_size * cfg.grad_accum * self.layout.dp
        check_enough_blocks(
            cfg, len(self.blocks), self.global_batch // (cfg.grpo.group_size ** (cfg.objective == "grpo"))
        )
        # Every layout builds on the meta device; parallelize gives this rank only its part (models/materialize.py).
        self.source = source = ModelSource.of_config(cfg, tokenizer, mcfg)
        model = source.on_meta()
        self.attention = implementation(cfg.attention, mcfg, torch.cuda.is_available(), cfg.seq_length)
        if cfg.dropout_off:
            from meshlm.train.dropout import dropout_off  # imported only when chosen

            log.info(f"dropout off: {dropout_off(model)} dropout probabilities set to 0")
        self.fingerprint = source.fingerprint(model)  # LoRA: also the base's source (checkpoints hold adapters)
        embed = model.get_input_embeddings().weight
        head = getattr(model.get_output_embeddings(), "weight", None)
        head_params = head.numel() if head is not None and not tied(model) else 0  # a tied head is not counted
        active = self.fingerprint["parameters"] - _inactive_experts(model)
        self.flops = train_flops(model.config, active, embed.numel(), cfg.seq_length, head_params)
        self.checkpoints = SaveAndResume(cfg, rt, self.fingerprint, self.layout, self.blocks.identity())
        self.engine = parallelize(model, cfg, rt, self.layout)
        # What the loss is (next-token, or DPO and its reference: objectives/), before a checkpoint is loaded
        frozen_copy = lambda: parallelize(source.on_meta(), cfg, rt, self.layout, frozen=True)
        self.engine.objective = objectives.objective(cfg, rt, self.engine, frozen_copy, [self.blocks, self.eval_blocks])
        # before any optimizer state: the peak of building, sharding and loading the model, over all ranks
        self.startup_peak_bytes = largest_over_ranks(memory(rt.device)["mem_peak_bytes"], rt)
        self.lr = scaled_lr(cfg, self.global_batch)
        self.optimizer = self.engine.make_optimizer(
            lr=self.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.state = TrainState()
        self.checkpoints.hold(self.engine, self.optimizer, self.scheduler, self.state)
        self.sampler, self.steps_per_epoch = self.make_sampler()
        if self.steps_per_epoch == 0:
            raise MeshlmError("one epoch holds less than one optimizer step; lower --grad-accum")
        checkpoints = self.checkpoints
        note = continuity.keep_data_order(checkpoints.resumed, checkpoints.data, self.state, self.steps_per_epoch)
        self.continuity_notes += [note] if note else []

    def make_sampler(self):
        """(this rank's sampler, optimizer steps per epoch); GRPO's samples prompts whose completions it generates
        every step (objectives/grpo.py Rollout)."""
        cfg, self.rollout = self.cfg, None
        if cfg.objective == "grpo":
            from meshlm.objectives.grpo_rollout import Rollout

            self.rollout = Rollout(self)
            return self.rollout.sampler(self.layout, self.engine.dp_rank)
        sampler = ResumableSampler(
            len(self.blocks),
            self.layout.dp,
            self.engine.dp_rank,
            shuffle=True,
            seed=cfg.seed,
            batch_size=cfg.micro_batch_size,
        )
        return sampler, sampler.batches_per_epoch // cfg.grad_accum

    def continue_run(self) -> list[str]:
        """Resolve what this run keeps from the one it continues (checkpoint/continuity.py): the global batch on this
        rank count, the learning-rate schedule's span. Returns the lines saying what changed."""
        cfg = self.cfg
        resumed = run_dir.resumed(cfg)
        batch = continuity.keep_global_batch(cfg, self.layout.dp, resumed)
        peak = scaled_lr(cfg, cfg.global_batch_size)

        def lr_at(span: int, step: int) -> float:
            return peak * lr_lambda(dataclasses.replace(cfg, lr_schedule_steps=span))(step)

        schedule = continuity.keep_schedule(cfg, resumed, lr_at)
        return [line for line in (batch, schedule) if line]

    def open_run_dir(self) -> None:
        """Every input is good: from here on we write."""
        cfg, rt = self.cfg, self.rt
        dropped = run_dir.prepare(cfg, self.state.step) if rt.is_main else 0
        runtime.make_run_dir(self.out)
        runtime.attach_log_file(rt, self.out / "logs")
        self.heartbeat = Heartbeat(self.out / "logs", rt.rank)  # the step a rank that stops answering was in
        self.faults = runtime.injected_faults()
        if rt.is_main:
            rerun = (
                f"meshlm train{f' --nproc {rt.world_size}' * (rt.world_size > 1)} --config {self.out / 'config.toml'}"
            )
            header = f"# written by a run on {rt.world_size} rank(s); `{rerun}` reruns it\n"
            # a rerun continues this run: it must not delete it again (--overwrite) nor refuse to resume it
            rerun_cfg = dataclasses.replace(cfg, overwrite=False, resume=True)
            (self.out / "config.toml").write_text(header + to_toml(rerun_cfg))
        self.checkpoints.store.remove_incomplete()
        if self.checkpoints.resume_from:
            log.info(f"resumed from {self.checkpoints.resume_from} at step {self.state.step}")
        if dropped:
            log.info(f"metrics.jsonl: dropped {dropped} row(s) past step {self.state.step}, trained again now")
        for line in self.continuity_notes:
            log.warning(line)
        for line in run_header(self):
            log.info(line)

    def batches(self):
        """This rank's micro-batches from where the state says the epoch stands, to the epoch's end."""
        if self.rollout is not None:
            yield from self.rollout.batches(self.sampler, self.state)
            return
        self.sampler.set_epoch(self.state.epoch, self.state.step_in_epoch * self.cfg.grad_accum)
        for idx in self.sampler:
            yield self.blocks.batch(idx).to(self.rt.device)

    def step_hooks(self, step: int) -> list:
        """Context managers around one step, each saving what it saw afterwards (`save(out, step)`)."""
        hooks = []
        if step == self.cfg.measure_step:
            from meshlm.train.probe import Probe  # the measuring step's probe, imported only for it

            hooks.append(Probe(self.engine, self.optimizer))
        if self.cfg.trace_pipeline and step == self.cfg.max_steps:  # config checked pp > 1
            from meshlm.engines.pipeline import PipelineTrace

            hooks.append(PipelineTrace(self.engine))
        return hooks

    def train_step(self, micro: list) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Forward, backward, clip and (when the gradients are finite and the global batch has a target) the
        optimizer step: (loss, norm, stepped)."""
        step, engine = self.state.step + 1, self.engine
        self.heartbeat.beat(step)
        hooks = self.step_hooks(step)
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                stack.enter_context(hook)
            loss = engine.train_step(micro)
            if self.faults is not None:  # a test's misbehaving rank (train/faults.py)
                loss = self.faults.in_step(step, self.rt.rank, loss, engine.parameters())
            grad_norm = engine.clip_grad_norm(self.cfg.grad_clip)
            # One host sync per step: the norm and the target count are global (reduced), so every rank takes
            # the same decision. Non-finite values never reach the weights or a checkpoint, and a batch with
            # nothing to learn must not move them either (AdamW's momentum and weight decay would). Under
            # --cpu-offload the norm is on the host (the gradients are) while the count is on the GPU.
            finite = torch.isfinite(grad_norm).to(engine.targets.device)
            finite, learned = (bool(x) for x in torch.stack([finite, engine.targets > 0]).tolist())
            if finite and learned:
                self.optimizer.step()
        for hook in hooks:
            hook.save(self.out, step)
        if not learned:
            log.warning(f"step {step}: the global batch has no target token; skipped the update")
        elif not finite:
            self.state.nonfinite_skipped += 1
            stopping.after_nonfinite(self.cfg, step, self.state.nonfinite_skipped)
        return loss, grad_norm, finite and learned

    def train(self) -> dict:
        cfg, state = self.cfg, self.state
        bar = progress_bar(cfg, self.rt, state.step)
        peak = job_peak_flops(cfg, self.rt, self.layout.strategy, cache_dir())
        window = LogWindow(self.rt.device, self.global_batch * cfg.seq_length, self.flops, peak, self.rt.world_size)
        stream, row, first = self.batches(), {}, state.step
        self.last_save, self.stop_early = time.monotonic(), False
        with contextlib.closing(bar) if bar else contextlib.nullcontext(), stopping.StopOnSignal(self.rt) as stop:
            with lines_above(bar):
                while state.step < cfg.max_steps:
                    micro = [next(stream) for _ in range(cfg.grad_accum)]
                    row = self.one_step(micro, window, bar) or row
                    if state.step == first + 1 and self.rt.device.type == "cpu":
                        # loading is over: a step reuses the last one's buffers
                        host_memory.keep_step_buffers(self.engine.weight_sized_temporaries(), nf4_base(cfg.lora))
                    if state.step_in_epoch == 0:
                        stream = self.batches()
                    if self.checkpoints.maybe_save(state.step):
                        window.restart_clock()  # saving is not training time
                        self.last_save = time.monotonic()
                    signum = stop.agreed()
                    if signum:
                        self.stop(signum)
                    if self.stop_early:
                        if cfg.save_final:
                            self.checkpoints.save_once(state.step)
                        break
        if row:
            log.info(f"done: step {state.step}, loss {row['loss']:.4f}, {row['tokens_per_s']:,.0f} tokens/s")
        return row

    def one_step(self, micro: list, window: LogWindow, bar) -> dict:
        """One optimizer step and its bookkeeping; the metrics row when one is due."""
        cfg, state = self.cfg, self.state
        loss, grad_norm, stepped = self.train_step(micro)
        eval_now = cfg.eval_every and ((state.step + 1) % cfg.eval_every == 0 or state.step + 1 == cfg.max_steps)
        log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps or eval_now
        # measured before zero_grad (gradients are model state too), and only for a row
        state_bytes = self.engine.model_state_bytes(self.optimizer) if log_now else 0
        by_kind = self.state_kinds() if log_now else {}
        advance_schedule(self.scheduler, stepped)
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.step_in_epoch += 1
        if state.step_in_epoch == self.steps_per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        if stepped:
            window.add(loss, micro)
        if bar:
            bar.update(1)
        held_out = (self.rollout.evaluate() if self.rollout else self.held_out()) if eval_now else {}  # GRPO: rewards
        if not (window.steps and log_now):
            return {}
        extra = {"model_state_bytes": state_bytes, "startup_peak_bytes": self.startup_peak_bytes}
        return self.log_row(window, grad_norm, {**extra, **by_kind, **held_out}, bar)

    def held_out(self) -> dict:
        """The held-out evaluation and what it decides (--keep-best, early stopping, --eval-samples' completions);
        its modules are imported only by a job that evaluates."""
        from meshlm.train import best, samples
        from meshlm.train.evaluate import evaluate

        cfg, state = self.cfg, self.state
        held_out = evaluate(self.engine, self.eval_blocks, cfg.micro_batch_size, self.rt.device)
        if held_out:  # sft: eval_ppl; dpo: its held-out pairs' reward accuracy and margin
            shown = [f"{k} {held_out[k]:.2f}" for k in EVAL_SHOWN if k in held_out]
            log.info(f"step {state.step}: " + ", ".join([f"eval_loss {held_out['eval_loss']:.4f}", *shown]))
            self.stop_early = best.after_eval(cfg, state, self.checkpoints, held_out["eval_loss"])
            if self.samples:
                rows = self.samples.generate(self.engine, self.rt.device)
                if self.rt.is_main:
                    samples.write(self.out, state.step, rows, self.sinks.wandb)
        return held_out

    def stop(self, signum: int) -> None:
        """Every rank agreed to stop after this step: save first when there is no checkpoint yet or the last one
        is old enough (a run stopped in its first minutes would otherwise lose all of them)."""
        age = time.monotonic() - self.last_save
        after = self.cfg.ckpt_on_signal_after
        latest = self.checkpoints.store.latest()
        if after and (latest is None or (age >= after and latest.name != f"step-{self.state.step}")):
            self.checkpoints.save(self.state.step)
        raise Interrupted(interrupted(signum, self.out), signum)

    def state_kinds(self) -> dict:
        """Model state bytes by kind for the row: LoRA's frozen base and adapters; a mixture of experts' experts
        (the largest rank's: pipeline stages hold different layers)."""
        kinds = {}
        if lora_on(self.cfg.lora):
            from meshlm.parallel.lora import state_breakdown

            kinds = state_breakdown(self.engine, self.optimizer)
        if self.engine.routers is not None:
            from meshlm.parallel.expert import expert_state_bytes  # a mixture of experts only

            mine = expert_state_bytes(self.engine.module, self.optimizer)
            kinds["expert_state_bytes"] = largest_over_ranks(mine, self.rt)
        return kinds

    def log_row(self, window: LogWindow, grad_norm: torch.Tensor, extra: dict, bar) -> dict:
        mean_loss = self.engine.mean_over_dp(window.loss_sum / window.steps).item()  # the one host sync per row
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"loss is {mean_loss} at step {self.state.step}")
        row = window.row(
            self.state.step,
            mean_loss,
            self.scheduler.get_last_lr()[0],
            float(grad_norm),
            {
                **extra,
                "target_tokens": int(self.engine.targets),
                "padding_fraction": float(self.engine.pad_tokens) / window.tokens_per_step,
                **memory(self.rt.device),
                **self.engine.metrics(),
                **self.engine.objective.metrics(self.engine),
            },
        )
        self.sinks.log(row)
        # DPO's bar also shows how often chosen beats rejected: its loss alone says little about progress
        shown = {"loss": f"{mean_loss:.4f}", "tok_s": f"{row['tokens_per_s']:,.0f}"}
        shown |= {"acc": f"{row['rewards/accuracies']:.2f}"} if "rewards/accuracies" in row else {}
        shown |= {"reward": f"{row['reward']:.3f}"} if "reward" in row else {}  # GRPO: what it learns to raise
        if bar:
            bar.set_postfix(shown)
        # the log file gets a line per row, so `tail -f logs/rank-0.log` follows the run; the console has the bar
        log.info(f"step {self.state.step}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), extra=FILE_ONLY)
        return row


def _inactive_experts(model: torch.nn.Module) -> int:
    """A mixture of experts' weights a token does not use (k of E run); parallel/expert.py is imported only then."""
    if not facts(model.config).experts:
        return 0
    from meshlm.parallel.expert import inactive_expert_params

    return inactive_expert_params(model)
