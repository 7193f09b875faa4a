#!/usr/bin/env python3
"""Load test of the control plane: the learner's fleet client against many rollout servers.

What runs is the real thing on both sides of the gRPC link: `legorl_jax.fleet.Fleet`
(what `legorl train` dispatches groups and collects trajectories with) in this
process, and N `legorl rollout-server` processes on loopback, each running real
trials: a local sandbox (bubblewrap), the in-process `lego` harness through the
token-capture proxy, and the verifier. Trials cost no model time: every server's
engine is one shared scripted engine (tests/proxy/scripted_engine.py, a TEST
INSTRUMENT reused here: it answers every completion with "Done." and fake
logprobs, so each lego episode is one model call), and the task is `hashflip`
(tests/loop/hashflip: its verifier hashes the agent's final message).

For each host count it runs whole steps (--trials trials in groups of
--group-size) and prints trials/s dispatched and collected, trajectory bytes/s
taken in by the learner side, learner-side CPU seconds per trajectory (this
process's rusage: the fleet client, its gRPC threads, protobuf parsing) and the
p50 / p99 / max time from the step's start to a group's collection ("dispatched" is the trials
over the time to the step's last Rollout call, re-issues included). Every step
checks that every trial asked for came back exactly once, as a trajectory or a
recorded failure status.

Faults (--faults, on the largest host count): a host SIGKILLed mid-step, a host
SIGSTOPped mid-step (a stall: the process holds its connections but answers
nothing), and a slow verifier (1 group in 20 on a task whose verifier sleeps
--slow-verifier-s). Each fault step is reported against a clean step.

The largest host count is started once (each host is ~0.4 GiB resident: 32 need ~13 GiB) and
the smaller counts use its first hosts. All processes share this machine's cores, so the servers' trial work competes
with the learner side: trials/s here is a floor for the control plane, and
the CPU seconds per trajectory (the learner side's own) is what extrapolates.

    .venv/bin/python scripts/bench_fleet.py --hosts 1 2 4 8 16 32 --trials 2048 --faults
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import importlib
import json
import logging
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from legorl_jax.fleet import Fleet, GroupResult, GroupSpec  # noqa: E402
from protos.legorl.v1 import rollout_pb2 as pb  # noqa: E402
from protos.legorl.v1 import rollout_pb2_grpc as pb_grpc  # noqa: E402
from rollout_server.backends.vllm import free_port  # noqa: E402

HASHFLIP = REPO / "tests" / "loop" / "hashflip"
SLOW_TASK = "hashflip-slow"
FAULTS = ("kill", "stop", "slow_verifier")


# ------------------------------------------------------------------ hosts --


def make_tasks(root: Path, slow_verifier_s: float) -> Path:
    """hashflip and a copy whose verifier sleeps first; returns their parent directory."""
    shutil.copytree(HASHFLIP, root / "hashflip")
    slow = root / SLOW_TASK
    shutil.copytree(HASHFLIP, slow)
    toml = slow / "task.toml"
    toml.write_text(toml.read_text().replace('name = "hashflip"', f'name = "{SLOW_TASK}"'))
    test = slow / "tests" / "test.sh"
    lines = test.read_text().splitlines()
    test.write_text("\n".join([lines[0], f"sleep {slow_verifier_s:g}", *lines[1:]]) + "\n")
    return root


def make_model(root: Path) -> Path:
    """A tiny HF checkpoint with the demo tokenizer: what the server is told it serves (nothing computes it)."""
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    return Path(build_tiny_hf_model(root / "model"))


def start_engine(model_dir: Path, log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The scripted engine in its own process (its CPU is not the learner side's); returns it and its URL."""
    port = free_port("127.0.0.1")
    log = (log_dir / "engine.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-engine", str(model_dir), "--engine-port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    return proc, f"http://127.0.0.1:{port}"


def serve_engine(tokenizer_dir: str, port: int) -> None:
    """Runs the scripted engine until killed (the --serve-engine mode)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "tests"))
    scripted = importlib.import_module("proxy.scripted_engine")  # a test instrument, not a package of ours
    engine = scripted.ScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), default="Done.")
    # Thousands of trials: keep no log of them.
    engine.log.prompts, engine.log.bodies, engine.log.replies = _Discard(), _Discard(), _Discard()
    with scripted.ServerThread(engine.app, port=port):
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


class _Discard(list[Any]):
    """A list that keeps nothing appended to it."""

    def append(self, item: Any) -> None:
        pass


def host_command(address: str, model_dir: Path, engine_url: str, tasks_root: Path, capacity: int) -> list[str]:
    sets = {
        "engine.kind": "external",
        "engine.url": engine_url,
        "sandbox.kind": "local",
        "sandbox.network": "none",
        "tasks.demo": "false",
        "tasks.location_roots": f"[{tasks_root}]",
        "fleet.capacity_per_server": str(capacity),
        "rl.sampling.max_tokens": "24",
        "proxy.max_model_calls": "3",
    }
    argv = [sys.executable, "-m", "legorl_jax.cli", "rollout-server", "--address", address, "--model", str(model_dir)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv


def rss_mib(pid: int) -> float:
    """A process's resident set, from /proc (nan once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(kib) / 1024


@dataclasses.dataclass
class Host:
    address: str
    proc: subprocess.Popen[bytes]

    def rss_mib(self) -> float:
        return rss_mib(self.proc.pid)


def start_hosts(count: int, argv_for: Any, log_dir: Path) -> list[Host]:
    hosts = []
    for i in range(count):
        address = f"127.0.0.1:{free_port('127.0.0.1')}"
        log = (log_dir / f"host{i}.log").open("wb")
        proc = subprocess.Popen(argv_for(address), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        hosts.append(Host(address, proc))
    return hosts


async def wait_ready(hosts: Sequence[Host], timeout_s: float) -> None:
    """Until every host answers GetStatus; a host that exits or never answers fails the run."""
    deadline = time.monotonic() + timeout_s
    pending = list(hosts)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} hosts not ready after {timeout_s:.0f}s: see their logs")
        still = []
        for host in pending:
            if host.proc.poll() is not None:
                raise RuntimeError(f"host {host.address} exited with {host.proc.returncode}: see its log")
            async with grpc.aio.insecure_channel(host.address) as channel:
                try:
                    await pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=2.0)
                except grpc.aio.AioRpcError:
                    still.append(host)
        pending = still
        if pending:
            await asyncio.sleep(1.0)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGCONT (a stopped host cannot die of SIGTERM), SIGTERM, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------- step --


class RecordingStub:
    """Wraps a server's stub: records each Rollout call (when, which request, how many trials)."""

    def __init__(self, stub: pb_grpc.RolloutServiceStub, calls: list[tuple[float, str, int]]) -> None:
        self._stub = stub
        self._calls = calls

    def Rollout(self, request: pb.RolloutRequest, **kwargs: Any) -> Any:  # noqa: N802 (the stub's name)
        self._calls.append((time.monotonic(), request.request_id, request.group_size))
        return self._stub.Rollout(request, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def group_specs(trials: int, group_size: int, tasks_root: Path, slow_every: int = 0) -> list[GroupSpec]:
    """`trials` trials as groups of `group_size` (the last may be smaller); every `slow_every`-th on the slow task."""
    harness = pb.HarnessConfig(name="lego", options_json='{"tools": "bash_only", "turn_budget": "short"}')
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24)
    specs = []
    for index, start in enumerate(range(0, trials, group_size)):
        slow = slow_every and index % slow_every == slow_every - 1
        task = pb.TaskRef(location=str(tasks_root / (SLOW_TASK if slow else "hashflip")))
        size = min(group_size, trials - start)
        specs.append(GroupSpec(task=task, harness=harness, group_size=size, sampling=sampling, policy_version=0))
    return specs


@dataclasses.dataclass
class StepStats:
    hosts: int
    trials: int
    wall_s: float
    dispatch_s: float  # step start to the last Rollout call's start
    trajectories: int
    bytes: int
    cpu_s: float
    loop_cpu_s: float  # of that, the event loop's thread (the rest: gRPC's own threads)
    group_done_s: list[float]
    statuses: dict[str, int]
    reissues: int
    phases_s: dict[str, float]  # mean per trial, as the servers timed them
    lost: list[str]  # what the exactly-once check found wrong (empty: nothing)

    def row(self) -> dict[str, Any]:
        done = sorted(self.group_done_s)
        return {
            "hosts": self.hosts,
            "trials": self.trials,
            "wall_s": round(self.wall_s, 2),
            "dispatched_per_s": round(self.trials / max(self.dispatch_s, 1e-9), 1),
            "collected_per_s": round(self.trajectories / self.wall_s, 1),
            "MB_per_s": round(self.bytes / self.wall_s / 1e6, 3),
            "bytes_per_traj": round(self.bytes / max(self.trajectories, 1)),
            "cpu_ms_per_traj": round(1000 * self.cpu_s / max(self.trajectories, 1), 3),
            "loop_cpu_ms_per_traj": round(1000 * self.loop_cpu_s / max(self.trajectories, 1), 3),
            "p50_s": round(_quantile(done, 0.5), 2),
            "p99_s": round(_quantile(done, 0.99), 2),
            "max_s": round(done[-1], 2) if done else 0.0,
            "statuses": self.statuses,
            "reissues": self.reissues,
            "phases_s": self.phases_s,
            "exactly_once": not self.lost,
        }


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _mean_phases(trajectories: Sequence[pb.Trajectory]) -> dict[str, float]:
    names = ("setup_s", "agent_s", "verify_s", "teardown_s")
    n = max(len(trajectories), 1)
    return {k: round(sum(getattr(t.metrics.phase_times, k) for t in trajectories) / n, 3) for k in names}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def check_exactly_once(specs: Sequence[GroupSpec], results: Sequence[GroupResult], calls: Sequence[Any]) -> list[str]:
    """Every group back whole, no request answered with more trajectories than it asked for."""
    problems = []
    if len(results) != len(specs):
        problems.append(f"{len(specs)} groups asked, {len(results)} came back")
    asked = {request_id: size for _, request_id, size in calls}
    got: Counter[str] = Counter()
    for result in results:
        if len(result.trajectories) != result.spec.group_size:
            problems.append(f"{result.group_id}: {len(result.trajectories)} of {result.spec.group_size}")
        if sorted(t.trial_index for t in result.trajectories) != list(range(result.spec.group_size)):
            problems.append(f"{result.group_id}: trial indices not 0..{result.spec.group_size - 1}")
        got.update(t.request_id for t in result.trajectories if t.request_id)
    problems += [
        f"request {r}: {n} trajectories for {asked.get(r, 0)} trials" for r, n in got.items() if n > asked.get(r, 0)
    ]
    return problems


async def run_step(fleet: Fleet, specs: list[GroupSpec], calls: list[Any], fault: Any = None) -> StepStats:
    """One step: every group dispatched at once, collected as each ends (as the training loop does)."""
    calls.clear()
    total = sum(s.group_size for s in specs)
    results: list[GroupResult] = []
    done_s: list[float] = []
    collected = 0
    cpu0, loop0, start = _cpu_s(), time.thread_time(), time.monotonic()
    injector = asyncio.create_task(fault(lambda: collected / total)) if fault else None
    last_print = start
    try:
        async for result in fleet.rollout(specs):
            results.append(result)
            done_s.append(time.monotonic() - start)
            collected += len(result.trajectories)
            if time.monotonic() - last_print > 5.0:
                last_print = time.monotonic()
                print(f"    … {collected}/{total} trials in {last_print - start:.0f}s", file=sys.stderr, flush=True)
    finally:
        if injector is not None:
            injector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await injector
    wall, cpu, loop_cpu = time.monotonic() - start, _cpu_s() - cpu0, time.thread_time() - loop0
    trajectories = [t for r in results for t in r.trajectories]
    return StepStats(
        hosts=len(fleet.addresses),
        trials=total,
        wall_s=wall,
        dispatch_s=max((t for t, _, _ in calls), default=start) - start,
        trajectories=len(trajectories),
        bytes=sum(t.ByteSize() for t in trajectories),
        cpu_s=cpu,
        loop_cpu_s=loop_cpu,
        group_done_s=done_s,
        statuses=dict(Counter(pb.TrialStatus.Name(t.status).removeprefix("TRIAL_STATUS_") for t in trajectories)),
        reissues=sum(r.reissues for r in results),
        phases_s=_mean_phases(trajectories),
        lost=check_exactly_once(specs, results, calls),
    )


@contextlib.asynccontextmanager
async def recording_fleet(addresses: Sequence[str], calls: list[Any], **kwargs: Any) -> Any:
    async with Fleet(addresses, **kwargs) as fleet:
        # The fleet keeps its stubs private; wrapping them is how the bench sees each dispatch.
        for server in fleet._servers:
            server.stub = RecordingStub(server.stub, calls)  # type: ignore[assignment]
        yield fleet


# ----------------------------------------------------------------- faults --


def signal_at(pid: int, sig: signal.Signals, fraction: float) -> Any:
    """A fault: `sig` to `pid` once `fraction` of the step's trials are back."""

    async def inject(progress: Any) -> None:
        while progress() < fraction:
            await asyncio.sleep(0.05)
        os.kill(pid, sig)
        print(f"    sent {sig.name} to host pid {pid} at {progress():.0%} collected", file=sys.stderr, flush=True)

    return inject


# -------------------------------------------------------------------- run --


@dataclasses.dataclass
class Bench:
    """What every step shares: the hosts, the tasks and the options."""

    hosts: list[Host]
    tasks_root: Path
    args: argparse.Namespace
    fleet_kwargs: dict[str, Any]

    async def step(self, count: int, fault: Any = None, slow_every: int = 0) -> StepStats:
        calls: list[Any] = []
        specs = group_specs(self.args.trials, self.args.group_size, self.tasks_root, slow_every)
        addresses = [h.address for h in self.hosts[:count]]
        async with recording_fleet(addresses, calls, **self.fleet_kwargs) as fleet:
            return await run_step(fleet, specs, calls, fault)


async def sweep(bench: Bench, counts: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for count in counts:
        for repeat in range(bench.args.steps):
            print(f"[bench] {count} hosts, step {repeat + 1}/{bench.args.steps}", file=sys.stderr, flush=True)
            row = (await bench.step(count)).row()
            row["host_rss_mib"] = round(max(h.rss_mib() for h in bench.hosts[:count]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


async def faults(bench: Bench, count: int, which: Sequence[str]) -> list[dict[str, Any]]:
    """A clean step, then one per fault; each on `count` hosts, the faulty host the last of them."""
    rows = []
    victim = bench.hosts[count - 1]
    plans: dict[str, tuple[Any, int]] = {
        "clean": (None, 0),
        "kill": (signal_at(victim.proc.pid, signal.SIGKILL, 0.3), 0),
        "stop": (signal_at(victim.proc.pid, signal.SIGSTOP, 0.3), 0),
        "slow_verifier": (None, 20),
    }
    # Kill last: the victim is gone afterwards.
    for name in ["clean", *sorted(which, key=lambda f: f == "kill")]:
        print(f"[bench] fault {name} on {count} hosts", file=sys.stderr, flush=True)
        fault, slow_every = plans[name]
        row = (await bench.step(count, fault, slow_every)).row()
        row["fault"] = name
        rows.append(row)
        print(json.dumps(row), flush=True)
        if name == "stop":
            os.kill(victim.proc.pid, signal.SIGCONT)
    return rows


def print_table(rows: Sequence[dict[str, Any]], title: str) -> None:
    cols = ["fault", "hosts", "trials", "wall_s", "dispatched_per_s", "collected_per_s", "MB_per_s",
            "cpu_ms_per_traj", "loop_cpu_ms_per_traj", "p50_s", "p99_s", "max_s", "reissues", "exactly_once",
            "host_rss_mib"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]
    print(f"\n{title}\n| " + " | ".join(cols) + " | statuses |")
    print("|" + " --- |" * (len(cols) + 1))
    for row in rows:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row["statuses"].items()))
        print("| " + " | ".join(str(row.get(c, "")) for c in cols) + f" | {statuses} |")


def profiled(top: int, work: Any) -> Any:
    """`work()`, under cProfile when `top` > 0: the functions of this process's main thread (the event
    loop the fleet client runs on) with the most own time, printed. Profiling inflates the CPU figures."""
    if top <= 0:
        return work()
    profile = cProfile.Profile()
    try:
        return profile.runcall(work)
    finally:
        print(f"\nlearner side, top {top} functions by own time over the sweep:", file=sys.stderr)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(top)


@contextlib.contextmanager
def fleet_of(args: argparse.Namespace, count: int) -> Iterator[Bench]:
    """The engine and `count` hosts, up; everything stopped and removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        tasks_root = make_tasks(tmp / "tasks", args.slow_verifier_s)
        model_dir = make_model(tmp)
        (tmp / "logs").mkdir()
        engine, url = start_engine(model_dir, tmp / "logs")
        procs.append(engine)
        hosts = start_hosts(count, lambda a: host_command(a, model_dir, url, tasks_root, args.capacity), tmp / "logs")
        procs += [h.proc for h in hosts]
        print(f"[bench] starting the engine and {count} hosts (logs in {tmp / 'logs'})", file=sys.stderr, flush=True)
        asyncio.run(wait_ready(hosts, args.start_timeout_s))
        kwargs = {"rpc_timeout_s": args.rpc_timeout_s, "probe_interval_s": 1.0, "wait_for_servers_s": 30.0}
        yield Bench(hosts, tasks_root, args, kwargs)
    finally:
        stop_processes(procs)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hosts",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32],
        help="host counts to sweep; the most are started once, reused (default: %(default)s)",
    )
    parser.add_argument(
        "--trials", type=int, default=2048, help="trials per step, over all hosts (default: %(default)s)"
    )
    parser.add_argument("--group-size", type=int, default=8, help="trials per group (default: %(default)s)")
    parser.add_argument("--capacity", type=int, default=16, help="trials at once per host (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1, help="steps per host count (default: %(default)s)")
    parser.add_argument(
        "--faults",
        nargs="*",
        choices=FAULTS,
        default=None,
        help="after the sweep, fault steps on the largest host count (no names: all of them)",
    )
    parser.add_argument(
        "--slow-verifier-s",
        type=float,
        default=5.0,
        help="seconds the slow task's verifier sleeps (default: %(default)s)",
    )
    parser.add_argument(
        "--rpc-timeout-s",
        type=float,
        default=3600.0,
        help="the fleet's Rollout deadline (fleet.rpc_timeout_s; default: %(default)s)",
    )
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="how long hosts may take to start")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="profile the sweep's learner side; print the top N"
    )
    parser.add_argument("--json", type=Path, help="also write every row to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (tasks, model, host logs)")
    parser.add_argument("--serve-engine", metavar="TOKENIZER_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--engine-port", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The sweep, then the fault steps; returns their rows."""
    out: dict[str, list[dict[str, Any]]] = {"sweep": [], "faults": []}
    counts = sorted(set(args.hosts))
    with fleet_of(args, counts[-1]) as bench:
        rss = [round(h.rss_mib()) for h in bench.hosts]
        print(f"[bench] host RSS at rest: {min(rss)}–{max(rss)} MiB each", file=sys.stderr, flush=True)
        out["sweep"] = profiled(args.profile, lambda: asyncio.run(sweep(bench, counts)))
        if args.faults is not None:
            out["faults"] = asyncio.run(faults(bench, counts[-1], args.faults or FAULTS))
    print_table(out["sweep"], f"sweep: {args.trials} trials per step, groups of {args.group_size}")
    if out["faults"]:
        print_table(out["faults"], f"faults on {counts[-1]} hosts")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_engine:
        serve_engine(args.serve_engine, args.engine_port)
        return 0
    # SIGTERM unwinds like Ctrl-C, so the hosts and the engine are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The fleet's warnings (a server lost, trials re-issued) with their times, beside the progress lines.
    logging.basicConfig(level=logging.WARNING, format="    %(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    out = run(args)
    broken = [r for r in out["sweep"] + out["faults"] if not r["exactly_once"]]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
