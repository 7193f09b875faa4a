"""`legorl train`: GRPO training inside real harnesses (no config = the embedded default)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from legorl_jax.commands import add_config_arguments, load_command_config, raise_if_interrupted
from legorl_jax.core import log_redaction
from legorl_jax.core.config import CHAT_ENGINE_KINDS, ConfigError

if TYPE_CHECKING:
    from legorl_jax.train.loop import Trainer

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, demo_default=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs and the table only)")
    parser.add_argument(
        "--verbose", action="store_true", help="also log the in-process rollout server's events (weight loads, trials)"
    )


async def run_until_signalled(trainer: Trainer) -> Path | signal.Signals:
    """The run directory, or the signal that stopped the run. SIGTERM or SIGINT cancels the
    loop, so each part it started stops through its own cleanup: the step in flight is
    abandoned, trials are cancelled (their containers removed), the in-process rollout server
    drains and stops its engine and proxy network, checkpoints finish and the logs close.
    An update or a publish in flight runs on in its thread (`Trainer.busy`); `run` leaves
    without waiting for it. Later signals while stopping are only logged: a second Ctrl-C
    must not cut that short."""
    loop = asyncio.get_running_loop()
    training = asyncio.ensure_future(trainer.run())
    received: list[signal.Signals] = []

    def stop(sig: signal.Signals) -> None:
        if received:
            log.warning("%s: already stopping, waiting for the rollout server's drain", sig.name)
            return
        received.append(sig)
        log.warning("%s: stopping the run at step %d", sig.name, trainer.step)
        training.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await training
    except asyncio.CancelledError:
        if not received or not training.cancelled():
            raise
        return received[0]
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    from legorl_jax.train.coordination import LeaderStoppedError, ProcessFailedError
    from legorl_jax.wiring import trainer as build_trainer

    config = load_command_config(args)
    if config.engine.kind in CHAT_ENGINE_KINDS:
        raise ConfigError(
            f"engine.kind {config.engine.kind}: a chat teacher's turns are re-rendered, not sampled by the policy, "
            "and carry no logprobs, so RL cannot train on them; collect them for fine-tuning (`legorl collect`)"
        )
    log_redaction.configure(logging.WARNING)
    logging.getLogger("legorl_jax").setLevel(logging.INFO)
    if args.verbose:
        logging.getLogger("rollout_server").setLevel(logging.INFO)
    # Before anything touches a device: a multi-host job sees its global devices only after joining.
    leader = join_process_group(config.learner.heartbeat_timeout_s)
    trainer = build_trainer(config, progress=None if leader and not args.no_progress else False)
    print(f"legorl train: run directory {trainer.run_dir}", flush=True)
    raise_if_interrupted()  # from here the loop handles SIGINT: a Ctrl-C dropped during start-up must not be lost
    try:
        outcome = asyncio.run(run_until_signalled(trainer))
    except (LeaderStoppedError, ProcessFailedError) as exc:
        print(f"legorl train: {exc}", file=sys.stderr, flush=True)
        if trainer.busy:  # an update or publish may wait in a collective for the process that is gone
            _leave_now(1)
        return 1
    except Exception:
        if leader:
            raise
        traceback.print_exc()
        _leave_now(1)
    if isinstance(outcome, signal.Signals):
        print(
            f"legorl train: stopped by {outcome.name} after step {trainer.step}; "
            f"run the same command again to resume from the last checkpoint in {trainer.checkpoint_dir}",
            flush=True,
        )
        if trainer.busy:
            # Its thread would hold the exit until the update or publish ends (minutes at scale). Nothing
            # of it counts: the step goes back to the last checkpoint, a publish cut short leaves only a
            # staging directory the next publish removes, and every log is already closed.
            log.warning("leaving the learner's update or publish in flight unfinished: a resumed run redoes it")
            _leave_now(128 + outcome.value)
        if not leader:
            _leave_now(128 + outcome.value)
        return 128 + outcome.value
    if not leader:
        print("legorl train: done; process 0 wrote the run's records", flush=True)
        return 0
    print(f"legorl train: done; metrics in {outcome / 'metrics.jsonl'}, plot {outcome / 'reward.png'}", flush=True)
    return 0


def _leave_now(code: int) -> NoReturn:
    """Leaves at once, not through the interpreter's shutdown, which joins every thread. A
    follower that stops early: JAX's shutdown would wait for process 0 while process 0 may wait
    in a collective for this process; gone, the heartbeat timeout bounds process 0's wait. It
    told process 0 why before (`Trainer.run`). A process stopped by a signal while its learner
    thread still runs: the thread would hold the exit until its work ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join_process_group(heartbeat_timeout_s: int) -> bool:
    """Joins the process group the environment names (docs/multihost.md), logs it, and
    says whether this process leads (process 0, or the only process)."""
    import jax

    from legorl_jax.train.distributed import describe_group, initialize_distributed

    if initialize_distributed(heartbeat_timeout_s=heartbeat_timeout_s):
        log.info("joined the process group: %s", describe_group())
    return jax.process_index() == 0
