"""The training loop. Reads top to bottom: config -> data -> model -> parallelize -> loop.

Nothing is written into the output directory until every input has been checked
(model, data, degrees, checkpoint), so a bad invocation leaves an existing run
exactly as it was.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from meshlm import runtime
from meshlm.config import Config, to_toml
from meshlm.data.load import cache_dir, load_blocks
from meshlm.data.sampler import ResumableSampler
from meshlm.errors import MeshlmError
from meshlm.models.build import build_model, fingerprint, load_tokenizer, model_config, check_seq_length
from meshlm.parallel import lora
from meshlm.parallel.apply import build_device, parallelize, plan_degrees
from meshlm.plan.measure import Probe
from meshlm.runtime import Runtime, log
from meshlm.train import faults
from meshlm.train.checkpoint import Checkpointer, TrainState
from meshlm.train.metrics import Sinks, memory, peak_flops, train_flops_per_token


def lr_lambda(cfg: Config):
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak at max_steps."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def scaled_lr(cfg: Config, global_batch: int) -> float:
    ratio = global_batch / cfg.base_batch_size
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.scale_lr]


def train(cfg: Config) -> dict:
    """Run training in this process (one rank of a job, or the whole job). Returns the last metrics row."""
    runtime.dump_stacks_on_signal()
    rt = runtime.init(cfg.backend, cfg.dist_timeout, want_cuda=_wants_cuda(cfg))
    runtime.setup_logging(rt)
    try:
        return Trainer(cfg, rt).run()
    except BaseException:
        runtime.log_exception()
        raise
    finally:
        runtime.shutdown()


def _wants_cuda(cfg: Config) -> bool:
    if cfg.backend == "gloo":
        return False
    return torch.cuda.is_available()


class Trainer:
    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.out = cfg.out

    def run(self) -> dict:
        cfg, rt = self.cfg, self.rt
        torch.manual_seed(cfg.seed)
        if rt.device.type == "cpu":
            torch.use_deterministic_algorithms(True, warn_only=True)

        # -- inputs, checked before anything is written
        tokenizer, tok_id = load_tokenizer(cfg)
        strategy, degrees = plan_degrees(cfg, rt.world_size)
        check_seq_length(cfg, model_config(cfg, len(tokenizer)))
        blocks = load_blocks(cfg, tokenizer, tok_id)
        global_batch = cfg.micro_batch_size * cfg.grad_accum * degrees.dp
        if len(blocks) < global_batch:
            raise MeshlmError(f"the dataset has {len(blocks)} blocks of {cfg.seq_length} tokens, fewer than one global "
                              f"batch of {global_batch}; use more data or a smaller --micro-batch-size/--seq-length")
        model = build_model(cfg, tokenizer, build_device(cfg, rt))
        fp = fingerprint(model) | lora.base_fingerprint(model, cfg)  # LoRA: checkpoints hold adapters only
        embed_params = model.get_input_embeddings().weight.numel()
        flops_per_token = train_flops_per_token(model.config, fp["parameters"], embed_params, cfg.seq_length)
        ckpt = Checkpointer(self.out / "checkpoints", rt, cfg.keep_last)
        resume_from = ckpt.latest() if cfg.resume else None
        if resume_from:
            ckpt.check_model(resume_from, fp)

        engine = parallelize(model, cfg, rt)
        lr = scaled_lr(cfg, global_batch)
        optimizer = engine.make_optimizer(lr=lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        state = TrainState()
        if resume_from:
            ckpt.load(resume_from, engine.module, optimizer, scheduler, state)

        # -- every input is good: from here on we write
        runtime.make_run_dir(self.out)
        runtime.attach_log_file(rt, self.out / "logs")
        if rt.is_main:
            (self.out / "config.toml").write_text(to_toml(cfg))
        ckpt.remove_incomplete()
        log.info(f"meshlm: strategy {strategy} on {rt.world_size} rank(s) ({rt.backend or 'no process group'}, "
                 f"{rt.device.type}); mesh pp={degrees.pp} dp_replicate={degrees.dp_replicate} "
                 f"dp_shard={degrees.dp_shard} tp={degrees.tp}")
        log.info(f"model {fp['model_type']} with {fp['parameters'] / 1e6:.2f}M parameters; {len(blocks)} blocks of "
                 f"{cfg.seq_length} tokens")
        log.info(f"global batch {global_batch} = micro-batch {cfg.micro_batch_size} x accumulation {cfg.grad_accum} x "
                 f"{degrees.dp} data-parallel ranks; lr {lr:g} (scale-lr {cfg.scale_lr})")

        sampler = ResumableSampler(len(blocks), degrees.dp, engine.dp_rank, shuffle=True, seed=cfg.seed,
                                   batch_size=cfg.micro_batch_size)
        steps_per_epoch = sampler.batches_per_epoch // cfg.grad_accum
        if steps_per_epoch == 0:
            raise MeshlmError("one epoch holds less than one optimizer step; lower --grad-accum")
        sinks = Sinks(cfg, rt, self.out)
        peak = peak_flops(rt.device, cache_dir()) * rt.world_size
        tokens_per_step = global_batch * cfg.seq_length
        try:
            row = self._loop(engine, optimizer, scheduler, state, sampler, steps_per_epoch, blocks, sinks, ckpt, fp,
                             flops_per_token, peak, tokens_per_step)
        finally:
            sinks.close()
        return row

    def _loop(self, engine, optimizer, scheduler, state, sampler, steps_per_epoch, blocks, sinks, ckpt, fp,
              flops_per_token, peak, tokens_per_step) -> dict:
        cfg, rt = self.cfg, self.rt
        bar = _progress(cfg, rt, state.step)
        row: dict = {}
        t_last, steps_since = time.perf_counter(), 0
        loss_sum = torch.zeros((), device=rt.device)

        def batches():
            while True:
                sampler.set_epoch(state.epoch, state.step_in_epoch * cfg.grad_accum)
                for idx in sampler:
                    yield blocks[idx].to(rt.device, dtype=torch.long, non_blocking=True)

        stream = batches()
        while state.step < cfg.max_steps:
            micro = [next(stream) for _ in range(cfg.grad_accum)]
            log_now = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
            probe = Probe(engine, optimizer) if state.step + 1 == cfg.measure_step else None
            trace = _pipeline_trace(engine) if cfg.trace_pipeline and state.step + 1 == cfg.max_steps else None
            with probe or contextlib.nullcontext(), trace or contextlib.nullcontext():
                loss = engine.train_step(micro)
                loss = faults.nonfinite(state.step + 1, loss, engine.parameters())
                faults.in_step(state.step + 1, rt.rank)
                grad_norm = engine.clip_grad_norm(cfg.grad_clip)
                # One host sync per step: the norm is global (gradients are reduced), so every rank takes
                # the same decision, and non-finite values never reach the weights or a checkpoint.
                finite = bool(torch.isfinite(grad_norm).item())
                if finite:
                    optimizer.step()
            if probe:
                probe.save(self.out / "probe" / f"rank-{rt.rank}.json")
            if trace:
                trace.save(self.out, state.step + 1)
            if not finite:
                state.nonfinite_skipped += 1
                _nonfinite(cfg, state.step + 1, state.nonfinite_skipped)
            # measured before zero_grad: gradients are model state too
            state_bytes = engine.model_state_bytes(optimizer) if log_now else 0
            by_kind = lora.state_breakdown(engine, optimizer) if log_now and lora.enabled(cfg) else {}
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.step_in_epoch += 1
            if state.step_in_epoch == steps_per_epoch:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
                stream = batches()
            if finite:
                loss_sum += loss
                steps_since += 1
            if bar:
                bar.update(1)

            if steps_since and log_now:
                mean_loss = engine.mean_over_dp(loss_sum / steps_since).item()  # the one host sync per log line
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"loss is {mean_loss} at step {state.step}")
                dt = time.perf_counter() - t_last
                tps = tokens_per_step * steps_since / dt
                row = {"step": state.step, "loss": mean_loss, "lr": scheduler.get_last_lr()[0],
                       "grad_norm": float(grad_norm), "tokens_per_s": tps, "tokens_per_s_per_rank": tps / rt.world_size,
                       "mfu": tps * flops_per_token / peak, "step_time_s": dt / steps_since,
                       "model_state_bytes": state_bytes, **by_kind, **memory(rt.device), **engine.metrics()}
                sinks.log(row)
                if bar:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tps:,.0f}")
                log.debug(str(row))
                t_last, steps_since = time.perf_counter(), 0
                loss_sum.zero_()

            last = state.step == cfg.max_steps
            if (cfg.ckpt_every and state.step % cfg.ckpt_every == 0) or (last and cfg.save_final):
                path = ckpt.save(state.step, engine.module, optimizer, scheduler, state, fp,
                                 {"strategy": engine.name})
                log.info(f"saved {path}")
                t_last = time.perf_counter()  # saving is not training time
        if bar:
            bar.close()
        if row:
            log.info(f"done: step {state.step}, loss {row['loss']:.4f}, {row['tokens_per_s']:,.0f} tokens/s")
        return row


def _nonfinite(cfg: Config, step: int, skipped: int) -> None:
    """A step whose loss or gradients are NaN/inf is skipped (no optimizer update) while --skip-nonfinite allows."""
    if skipped > cfg.skip_nonfinite:
        allowed = f"skipped {skipped - 1}, --skip-nonfinite allows {cfg.skip_nonfinite}"
        raise MeshlmError(f"loss or gradients are not finite at step {step} ({allowed}); lower --lr, "
                          f"or allow skipping such steps with --skip-nonfinite N")
    log.warning(f"step {step}: loss or gradients are not finite; skipped the update "
                f"({skipped} of --skip-nonfinite {cfg.skip_nonfinite})")


def _pipeline_trace(engine):
    """--trace-pipeline (config checked pp > 1, so the engine is a pipeline's): times the last step's stages."""
    from meshlm.parallel.pipeline import PipelineTrace

    return PipelineTrace(engine)


def _progress(cfg: Config, rt: Runtime, initial: int):
    if not (cfg.progress and rt.is_main):
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=cfg.max_steps, initial=initial, desc="train", file=sys.stdout, dynamic_ncols=True,
                mininterval=0.5 if sys.stdout.isatty() else 10)
