"""Tensor-parallel ranks as processes: who is which rank, starting the ranks of one machine, and
joining torch.distributed's process group.

Two ways ranks come to exist:
  torchrun   every rank is started by torchrun (any number of machines); this module reads its
             environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and
             joins with `env://`.  Rank 0 runs the engine, the others the worker loop.
  local      `Engine(parallel.tp_size=N)` outside torchrun: rank 0 (the engine's process) starts
             ranks 1..N-1 as `python -m graphexec.engine.tp_worker` subprocesses on this machine,
             hands each the engine's config on stdin (JSON of plain data, rebuilt through the
             config's own checks; never pickle), and they all join over a local TCP port.
Under torchrun every rank composes its own config from its own command line.

Workers never outlive rank 0: each watches its parent process and exits when it is gone, and a
rank-0 death also breaks their sockets (gloo reports "connection closed" at once).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphexec.errors import ConfigError, WorkerFailedError
from graphexec.parallel.group import TPGroup
from graphexec.parallel.ports import free_port

if TYPE_CHECKING:
    from graphexec.config import EngineConfig

# Loading and capture run in lockstep (capture's forwards all-reduce), and a rank may compile a
# bucket much later than another on a busy machine: start-up waits this long, serving waits
# parallel.timeout_s.
_STARTUP_TIMEOUT_S = 900.0
# How long stop() lets a worker exit on its own before killing it.
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    init_method: str  # "env://" under torchrun, else tcp://127.0.0.1:PORT

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True, eq=False)
class RankContext:
    """What a rank holds once it joined: the model's group and the gloo control group."""

    info: RankInfo
    tp: TPGroup
    control: dist.ProcessGroup


def from_torchrun() -> RankInfo | None:
    """This process's rank when torchrun started it (None otherwise)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env and not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(env):
        return None
    world = int(env["WORLD_SIZE"])
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        init_method="env://",
    )


def check_world(config: EngineConfig, info: RankInfo) -> None:
    if info.world_size != config.parallel.tp_size:
        raise ConfigError(
            f"torchrun started {info.world_size} processes but parallel.tp_size={config.parallel.tp_size}; "
            "they must be equal (--nnodes x --nproc-per-node = parallel.tp_size)"
        )


def rank_config(config: EngineConfig, info: RankInfo) -> EngineConfig:
    """The config a rank runs: on CUDA each rank of a machine takes its own device."""
    device = config.device
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        device = f"cuda:{base + info.local_rank}"
    return replace(config, device=device)


def threads_per_rank(config: EngineConfig, info: RankInfo) -> int:
    if config.parallel.threads_per_rank is not None:
        return config.parallel.threads_per_rank
    return max(1, (os.cpu_count() or 1) // info.local_world_size)


def dist_backend(config: EngineConfig) -> str:
    backend = config.parallel.dist_backend
    if backend == "auto":
        return "nccl" if config.device.startswith("cuda") else "gloo"
    if backend == "nccl" and not config.device.startswith("cuda"):
        raise ConfigError(f"parallel.dist_backend=nccl needs device=cuda, got device={config.device!r}; use gloo or auto")
    return backend


def join(config: EngineConfig, info: RankInfo) -> RankContext:
    """Join the process group (blocks until every rank has); start-up timeouts until `serving`."""
    timeout = datetime.timedelta(seconds=max(_STARTUP_TIMEOUT_S, config.parallel.timeout_s))
    backend = dist_backend(config)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(config.device))
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank, world_size=info.world_size, timeout=timeout)
    world = dist.group.WORLD
    # Step messages are host bytes (step_codec.py): a gloo group, whatever carries the model's tensors.
    control = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return RankContext(info, TPGroup(info.rank, info.world_size, world), control)


def serving(ctx: RankContext, timeout_s: float, device: torch.device | str) -> None:
    """From now on a collective that waits longer than timeout_s fails (a hung rank).  Every rank
    calls it after capture, so it is also where the ranks meet before the first step."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    # A process's first functional collective imports Dynamo (torch._disable_dynamo wraps the op):
    # seconds, unevenly across ranks, so inside the first step it could outlast timeout_s.  An
    # eager engine imports nothing else of the compiler, so pay it here, under start-up timeouts.
    ctx.tp.all_gather(ctx.tp.all_reduce(torch.zeros(1, device=device)))
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in {id(g): g for g in (ctx.tp.group, ctx.control)}.values():
        _set_pg_timeout(timeout, group)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalWorkers:
    """Ranks 1..N-1 on this machine, started by rank 0 (not under torchrun)."""

    def __init__(self, procs: list[subprocess.Popen], info: RankInfo):
        self.procs = procs
        self.info = info  # rank 0's

    @classmethod
    def start(cls, config: EngineConfig) -> LocalWorkers:
        world = config.parallel.tp_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        payload = _dump_config(config)
        procs = []
        for rank in range(1, world):
            info = RankInfo(rank, world, rank, world, init_method)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(config, info)))
            proc = subprocess.Popen(
                [sys.executable, "-m", "graphexec.engine.tp_worker", str(rank), str(world), init_method, str(os.getpid())],
                stdin=subprocess.PIPE,
                env=env,
            )
            proc.stdin.write(payload)
            proc.stdin.close()
            procs.append(proc)
        return cls(procs, RankInfo(0, world, 0, world, init_method))

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every worker that has exited."""
        return [(rank, p.returncode) for rank, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def join_group(self, config: EngineConfig) -> RankContext:
        """Rank 0 joins; a worker that dies before joining fails this at once, not at the timeout."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_try(join, config, self.info)), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and (dead := self.exited()):
                self.stop()
                raise WorkerFailedError(f"tensor-parallel rank(s) exited during start-up (rank, exit code): {dead}")
        outcome = result[0]
        if isinstance(outcome, BaseException):
            self.stop()
            raise outcome
        return outcome

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait for the workers to exit (they do after a STOP message or a broken group), then kill."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as its parent (rank 0) is gone, whatever it is doing.

    Polled, not PR_SET_PDEATHSIG (which data-parallel replicas use, parallel/replicas.py): that
    signal follows the *thread* that started the child, and an Engine may be built on a thread
    that ends long before the process does."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="graphexec-parent-watch", daemon=True).start()


def load_config(stream) -> EngineConfig:
    """The config rank 0 wrote to this worker's stdin (`_dump_config`), checked like a composed one."""
    from graphexec.config import EngineConfig

    try:
        raw = json.load(stream)
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError both
        raise ConfigError(f"a tensor-parallel worker's stdin is not the JSON config rank 0 sends: {error}") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"a tensor-parallel worker's config must be a JSON object, got {type(raw).__name__}")
    return EngineConfig.from_mapping(raw)


def _dump_config(config: EngineConfig) -> bytes:
    return json.dumps(config.to_plain()).encode()


def _try(fn, *args):
    try:
        return fn(*args)
    except BaseException as error:  # handed to the waiting thread
        return error
