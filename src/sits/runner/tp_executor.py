"""Tensor parallelism's executor: rank 0 is the engine's runner, ranks 1..N-1 are workers.

`make_runner` gives the engine its runner: a plain `ModelRunner` with one rank, else a
`TensorParallelRunner`, which is rank 0's `ModelRunner` (the engine reads its model, KV
cache size and counters as with one device) and owns N - 1 worker processes (the "spawn"
context of torch.multiprocessing, `run_worker`). First rank 0 places the ranks
(`sits.parallel.topology.plan_ranks`: on CUDA each rank's GPU in the order of the driver's
NVLink/PCIe topology, from rank 0's device on, and its GPU's CPUs, to which every rank's
process binds itself; on the CPU nothing, one log line says so). Every rank joins the default
process group (gloo on a CPU; NCCL on CUDA, with a gloo group beside it for the step
messages) over a TCPStore rank 0 hosts on 127.0.0.1 (port picked by the OS), builds its
`ModelRunner` for its rank, and takes the smallest KV block count of all ranks (exchanged
through the store: rank 0 waits for the workers' loads, however long, as long as they live,
up to `START_TIMEOUT_S`, so the collectives' timeout bounds only the steps). Then each step:

1. rank 0 checks that every worker process lives (a dead one fails the step at once),
2. wakes each worker with a byte on its pipe (a worker waits there without a timeout, so an
   idle engine never trips the collective timeout),
3. sends the `StepPlan`, pickled, to the workers: an all_reduce of its length (the workers
   add 0: it completes only when every worker has finished its previous step, so a hung
   worker fails here within `EngineConfig.tensor_parallel_timeout_s`) and a broadcast of
   the bytes, together with the MoE expert operations rank 0 applied since the previous
   plan (`send_expert_op`: freeze_after, freeze, unfreeze, restore; `runner.expert_ops`),
4. every worker applies those operations, in order, then every rank runs the plan; rank 0's
   `StepResult` is the engine's, the workers drop theirs (each request's sampling is seeded
   alike on every rank, so the ranks agree).

Async scheduling (`launch` / `collect`) keeps that order: rank 0 sends step N+1 before it
collects N, marked to be launched after the step each worker launched last; a worker fills
the plan's placeholder ids from the tokens it sampled itself in N (equal to rank 0's), so no
token crosses the ranks and `collect` reads rank 0's only.

A dead or hung worker, or a collective that fails, raises `TensorParallelWorkerError` (an
`EngineDeadError`), and every later step raises it again: the engine loop's death path then
fails every open request. `shutdown` asks the workers to stop, joins them (killing one past
`_JOIN_S`, or at once after a failure) and leaves the process group.

What the engine asks of rank 0's runner beyond `run`, with more than one rank:
- carried to the workers: everything in the plan (new and finished requests, the host KV
  tier's swap copies `plan.swap_out` / `swap_in`, run by each rank on its own KV cache) and
  the expert operations beside it (each rank restores its own slice, or its own whole
  experts, from the checkpoint);
- read on rank 0 only: the MoE expert counters and health (routing is replicated and the
  experts' non-finite flags are OR-ed over the ranks in each MoE all-reduce, so every rank
  counts the same tokens and its health check freezes the same experts at the same step);
- refused at start (`EngineConfig`): the precision switch (`set_precision`), spare expert
  slots with expert parallelism, async scheduling with load-aware expert placement (`launch`
  does not re-place); off: CUDA graphs (steps run eagerly). A second tensor-parallel engine
  in one process is refused (one default process group per process), and so is a CUDA run
  with more ranks than visible devices.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing.util
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, TensorParallelWorkerError
from sits.core.plan import StepPlan, StepResult
from sits.models.loader import build_meta_model
from sits.parallel import TensorParallel
from sits.parallel.topology import RankBinding, bind_process, plan_ranks
from sits.runner.expert_ops import ExpertOp, apply_expert_op, moe_blocks
from sits.runner.model_info import ModelInfo
from sits.runner.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_WAKE = b"s"  # rank 0 -> worker: a step follows on the process group
_STOP = b"q"  # rank 0 -> worker: leave the group and exit
# How a worker runs a plan, as rank 0 does (`_run_plans`): `ModelRunner.run`, or `launch`
# (async scheduling) without or after the step it launched before.
_RUN, _LAUNCH, _LAUNCH_AFTER = "run", "launch", "launch-after"
_START_POLL_S = 0.01  # the start's poll of the store and the workers' processes, seconds
# Longest start of the workers up to the KV size agreement (loading a big checkpoint takes
# minutes); a worker that exits meanwhile fails the start at once.
START_TIMEOUT_S = 900.0
_BLOCKS_KEY = "sits/num_blocks"
_JOIN_S = 30.0  # a stopped worker exits within this; longer = killed
_PR_SET_NAME = 15  # prctl(2) option: set the calling thread's name

SPAWN_HINT = (
    "workers are spawned and re-import the main module, so a script must build the engine "
    'under `if __name__ == "__main__":`'
)


def make_runner(config: EngineConfig, info: ModelInfo) -> ModelRunner:
    """The engine's runner: `ModelRunner` for one rank, `TensorParallelRunner` for more.

    Raises:
        As `ModelRunner` and `TensorParallelRunner`.
    """
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, info)
    return TensorParallelRunner(config, info)


def check_tensor_parallel_fit(config: EngineConfig, model_dir: str) -> None:
    """Build rank 0's shard of the model on the meta device (no memory, no weights read), so
    that a size the model's shapes do not fit is refused at once, before any worker process
    starts (each would otherwise load its shard and log its own traceback); nothing with one
    rank.

    Raises:
        InvalidParameterError: the size does not divide the heads, KV heads, an intermediate
            size, the experts (expert parallel) or the vocabulary (the message gives the
            numbers).
        UnsupportedModelError: a rank's slice of quantized weights would cut through their
            scale blocks or groups (the message names the module and gives the numbers), or
            the architecture or quantization is not supported.
    """
    if config.tensor_parallel_size == 1:
        return
    tp = TensorParallel(
        rank=0, size=config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel
    )
    build_meta_model(model_dir, quantization=config.quantization, tp=tp)


def check_devices(size: int, device_type: str, num_devices: int) -> None:
    """Refuse more ranks than devices on CUDA (a CPU runs any number of ranks).

    Args:
        size: tensor_parallel_size; device_type: "cuda" or "cpu"; num_devices: CUDA
            devices visible (torch.cuda.device_count()).

    Raises:
        InvalidParameterError: on CUDA, size > num_devices ("tensor_parallel_size").
    """
    if device_type == "cuda" and size > num_devices:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"tensor_parallel_size {size} needs {size} CUDA devices, but {num_devices} "
            f"{'is' if num_devices == 1 else 'are'} visible",
        )


@dataclass(frozen=True, slots=True)
class _Group:
    """How one rank reaches the others (made by `_join_group`).

    Attributes:
        rank, size: this rank and the number of ranks.
        control: the process group of the step messages (None: the default group, gloo).
    """

    rank: int
    size: int
    control: Any


def worker_title(rank: int) -> str:
    """The name of rank `rank`'s worker: its process title in ps and top, and its
    multiprocessing name ("sits-tp-rank1")."""
    return f"sits-tp-rank{rank}"


def _started_key(rank: int) -> str:
    """The store key a worker sets once it runs (`TensorParallelRunner._wait_for`)."""
    return f"sits/started/{rank}"


def _join_group(store: dist.Store, rank: int, config: EngineConfig, device: torch.device) -> _Group:
    """Join the default process group (gloo, or NCCL on CUDA with a gloo group for the step
    messages beside it), every collective bounded by `tensor_parallel_timeout_s`."""
    size = config.tensor_parallel_size
    timeout = timedelta(seconds=config.tensor_parallel_timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return _Group(rank, size, control)


def _worker_blocks(store: dist.Store, rank: int, num_blocks: int) -> int:
    """A worker's side of the KV size agreement: post its block count, then wait (without a
    deadline: rank 0 may still be loading; its exit ends the store and this wait with an
    error) for the smallest of all, which rank 0 posts (`TensorParallelRunner._agree_blocks`)."""
    store.set(f"{_BLOCKS_KEY}/{rank}", str(num_blocks))
    while not store.check([_BLOCKS_KEY]):
        time.sleep(_START_POLL_S)
    return int(store.get(_BLOCKS_KEY))


def _receive_plan(group: _Group) -> tuple[str, StepPlan, tuple[ExpertOp, ...]]:
    """A worker's side of `TensorParallelRunner._send_plan`: the length, then the bytes of
    (how to run it: `_RUN`, `_LAUNCH` or `_LAUNCH_AFTER`; the plan; the expert operations to
    apply before it)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.all_reduce(length, group=group.control)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group.control)
    return pickle.loads(payload.numpy().tobytes())


def _run_plans(conn: Connection, group: _Group, runner: ModelRunner) -> None:
    """A worker's steps: each plan rank 0 sends, after the expert operations that came with
    it, run as rank 0 runs it (`run`, or `launch` after the step this worker launched last,
    whose sampled tokens, the same on every rank, fill the plan's placeholders), until
    `_STOP` or EOF on `conn`."""
    previous: LaunchedStep | None = None  # the step launched last (async scheduling)
    blocks = moe_blocks(runner.model)
    while conn.recv_bytes() == _WAKE:
        mode, plan, expert_ops = _receive_plan(group)
        for op in expert_ops:
            apply_expert_op(blocks, op)
        if mode == _RUN:
            runner.run(plan)
            previous = None
        else:
            assert mode == _LAUNCH or previous is not None, "a launch after no launched step"
            previous = runner.launch(plan, previous if mode == _LAUNCH_AFTER else None)


def name_process(title: str) -> None:
    """Name this process `title` in ps and top: the kernel's name of the calling thread on
    Linux (prctl PR_SET_NAME, at most 15 bytes: /proc/PID/comm, what top and `ps -e` show;
    call from the main thread) and, when the setproctitle package is installed, its command
    line (`ps aux`). Never raises: what fails keeps the old name."""
    with contextlib.suppress(Exception):  # not installed, or it failed: the name only
        import setproctitle

        setproctitle.setproctitle(title)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc or no prctl in it
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def run_worker(
    conn: Connection,
    config: EngineConfig,
    info: ModelInfo,
    rank: int,
    binding: RankBinding,
    store_port: int,
    num_threads: int,
    log_level: int,
) -> None:
    """Worker process entry (rank >= 1): bind to the CPUs of `binding` (`bind_process`), join
    the group, build this rank's `ModelRunner` (on CUDA on cuda:`binding.device_index`), then
    run each plan rank 0 sends until `_STOP` or rank 0's end of `conn` closes. A failure is
    sent to rank 0 as text over `conn`, and the exit code is 1.

    It names itself `worker_title(rank)` ("sits-tp-rank1", `name_process`) and ignores SIGINT
    and SIGTERM, as the engine process does: rank 0 owns shutdown.
    """
    name_process(worker_title(rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    logging.getLogger("sits").setLevel(log_level)
    bind_process(binding, rank)  # before torch starts its threads, which inherit it
    torch.set_num_threads(num_threads)
    exit_code = 0
    try:
        if info.device.type == "cuda":
            assert binding.device_index is not None, "plan_ranks gives every CUDA rank a device"
            torch.cuda.set_device(binding.device_index)
            info = dataclasses.replace(info, device=torch.device("cuda", binding.device_index))
        size = config.tensor_parallel_size
        timeout = timedelta(seconds=config.tensor_parallel_timeout_s)
        store = dist.TCPStore(_HOST, store_port, size, is_master=False, timeout=timeout)
        store.set(_started_key(rank), "1")  # rank 0 waits for these before joining
        group = _join_group(store, rank, config, info.device)
        runner = ModelRunner(
            config, info, rank=rank, agree_num_blocks=lambda n: _worker_blocks(store, rank, n)
        )
        _run_plans(conn, group, runner)
    except EOFError:
        logger.info("rank 0 is gone; exiting")
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the exit code
        logger.exception("tensor-parallel worker failed")
        exit_code = 1
        with contextlib.suppress(OSError):  # rank 0 is gone
            conn.send_bytes(f"{type(exc).__name__}: {exc}".encode())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # What multiprocessing runs when a process's target returns: its finalizers, among them the
    # unlink of each named semaphore this process made (the loader's tqdm bar makes one, a
    # lock, in a spawned process); without it the resource tracker warns at exit of a leaked
    # semaphore and unlinks it itself.
    multiprocessing.util._exit_function()
    logging.shutdown()
    # Nothing is left to flush: skip the interpreter's teardown (seconds with torch loaded),
    # so that rank 0's join is quick.
    os._exit(exit_code)


def _is_collective_error(exc: RuntimeError) -> bool:
    """Whether `exc` comes from torch.distributed: NCCL's are `DistError`s, gloo's plain
    RuntimeErrors naming its sources ("/gloo/transport/tcp/pair.cc: Connection closed by
    peer", "Timed out waiting 60000ms for recv operation")."""
    return isinstance(exc, dist.DistError) or "/gloo/" in str(exc)


@dataclass(slots=True)
class _Worker:
    """A worker process and rank 0's end of its pipe."""

    rank: int
    process: Any  # torch.multiprocessing's SpawnProcess
    conn: Connection


class TensorParallelRunner(ModelRunner):
    """Rank 0's `ModelRunner` and the worker processes of ranks 1..N-1 (module docstring).

    Args:
        config: engine configuration (`tensor_parallel_size` > 1).
        info: the checkpoint's facts; on CUDA rank 0 runs on `info.device`.
        warm_up: as `ModelRunner`.

    Attributes:
        workers: the live worker processes (empty after `shutdown`).
        failure: why the ranks can no longer step, or None.
        bindings: each rank's device and CPUs (`sits.parallel.topology.plan_ranks`).

    Raises:
        InvalidParameterError: more ranks than CUDA devices, or torch.distributed already
            initialised in this process ("tensor_parallel_size").
        TensorParallelWorkerError: a worker failed while the ranks started.
        As `ModelRunner` (rank 0's own load errors).
    """

    def __init__(self, config: EngineConfig, info: ModelInfo, warm_up: bool | None = None):
        size = config.tensor_parallel_size
        num_devices = torch.cuda.device_count() if info.device.type == "cuda" else 0
        check_devices(size, info.device.type, num_devices)
        check_tensor_parallel_fit(config, info.model_dir)
        if dist.is_initialized():
            raise InvalidParameterError(
                "tensor_parallel_size",
                "torch.distributed is already initialised in this process (another "
                "tensor-parallel engine runs here); one per process",
            )
        self.workers: list[_Worker] = []
        self.failure: TensorParallelWorkerError | None = None
        self._expert_ops: list[ExpertOp] = []  # applied here, sent with the next plan
        self.bindings = plan_ranks(size, info.device)
        bind_process(self.bindings[0], 0)
        timeout = timedelta(seconds=config.tensor_parallel_timeout_s)
        self._store = dist.TCPStore(
            _HOST, 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        try:
            self._start_workers(config, info, self.bindings, self._store.port)
            self._wait_for([_started_key(w.rank) for w in self.workers])
            self._group = _join_group(self._store, 0, config, info.device)
            super().__init__(config, info, warm_up, rank=0, agree_num_blocks=self._agree_blocks)
        except BaseException as exc:
            reason = self._worker_failure()
            self.shutdown()
            if reason is not None:
                raise TensorParallelWorkerError(
                    f"tensor-parallel startup failed: {reason}"
                ) from exc
            raise
        # Before multiprocessing's own exit handler, which would SIGTERM (ignored) and join them.
        atexit.register(self.shutdown)
        logger.info("tensor parallel: %d ranks (workers: pids %s)", size, self.worker_pids)

    def _start_workers(
        self, config: EngineConfig, info: ModelInfo, bindings: list[RankBinding], store_port: int
    ) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        log_level = logging.getLogger("sits").getEffectiveLevel()
        for rank in range(1, config.tensor_parallel_size):
            conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=run_worker,
                args=(
                    child_conn,
                    config,
                    info,
                    rank,
                    bindings[rank],
                    store_port,
                    torch.get_num_threads(),
                    log_level,
                ),
                name=worker_title(rank),
                daemon=True,
            )
            process.start()
            child_conn.close()  # the worker holds it: EOF here = the worker is gone
            self.workers.append(_Worker(rank, process, conn))

    def _wait_for(self, keys: list[str]) -> None:
        """Wait until the workers have set every store key of `keys`, polling their processes
        meanwhile, so that a worker dying at its start fails the start at once (and not after
        a collective's timeout).

        Raises:
            TensorParallelWorkerError: a worker exited, or `START_TIMEOUT_S` passed.
        """
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(keys):
            for worker in self.workers:
                if not worker.process.is_alive():
                    raise TensorParallelWorkerError(
                        f"tensor-parallel startup failed: {self._exit_text(worker)} (its log "
                        f"above says why; {SPAWN_HINT})"
                    )
            if time.monotonic() > deadline_s:
                raise TensorParallelWorkerError(
                    f"tensor-parallel startup failed: the workers did not start in "
                    f"{START_TIMEOUT_S:g} s"
                )
            time.sleep(_START_POLL_S)

    def _agree_blocks(self, num_blocks: int) -> int:
        """Rank 0's side of the KV size agreement: wait for every worker's block count, post
        the smallest of all (`_worker_blocks`) and return it."""
        self._wait_for([f"{_BLOCKS_KEY}/{w.rank}" for w in self.workers])
        for worker in self.workers:
            num_blocks = min(num_blocks, int(self._store.get(f"{_BLOCKS_KEY}/{worker.rank}")))
        self._store.set(_BLOCKS_KEY, str(num_blocks))
        return num_blocks

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, by rank."""
        return [w.process.pid for w in self.workers]

    @torch.inference_mode()
    def run(self, plan: StepPlan, while_gpu_runs: Callable[[], None] | None = None) -> StepResult:
        """Send the plan to every worker, then run it here (`ModelRunner.run`).

        Raises:
            TensorParallelWorkerError: a worker is dead, hung past the timeout, or failed (this
                step's or an earlier one's collective).
        """
        self._send_plan(_RUN, plan)
        try:
            return super().run(plan, while_gpu_runs)
        except RuntimeError as exc:  # a collective of the forward, when a peer failed or hung
            failure = self._step_failure(exc)
            if failure is None:
                raise
            raise failure from exc

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None) -> LaunchedStep:
        """Async scheduling: send the plan to every worker, each to launch it after the step
        it launched before when `previous` is given (its own sampled tokens, equal to rank
        0's, fill the placeholders), then launch it here (`ModelRunner.launch`); `collect`
        reads rank 0's tokens only.

        Raises:
            TensorParallelWorkerError: as `run`.
        """
        self._send_plan(_LAUNCH if previous is None else _LAUNCH_AFTER, plan)
        try:
            return super().launch(plan, previous)
        except RuntimeError as exc:
            failure = self._step_failure(exc)
            if failure is None:
                raise
            raise failure from exc

    def send_expert_op(self, op: ExpertOp) -> None:
        """Have every worker apply `op` (already applied on rank 0, between steps) before the
        next plan it runs (`ExpertMonitor` calls it; `runner.expert_ops`)."""
        self._expert_ops.append(op)

    def _step_failure(self, exc: RuntimeError) -> TensorParallelWorkerError | None:
        """The runner's failure when a step's RuntimeError comes from a collective (a peer
        failed or hung) or a worker has failed; None when it is the step's own error."""
        if _is_collective_error(exc) or self._worker_failure() is not None:
            return self._fail(f"a collective of the step failed ({exc})")
        return None

    def _send_plan(self, mode: str, plan: StepPlan) -> None:
        """Wake each worker, then the length (all_reduce: waits for every worker) and the
        pickled bytes (broadcast) of (mode, plan, the expert operations since the previous
        plan) over the control group."""
        if self.failure is not None:
            raise self.failure
        for worker in self.workers:
            if not worker.process.is_alive():
                raise self._fail(self._exit_text(worker))
        payload = pickle.dumps(
            (mode, plan, tuple(self._expert_ops)), protocol=pickle.HIGHEST_PROTOCOL
        )
        self._expert_ops.clear()
        try:
            for worker in self.workers:
                worker.conn.send_bytes(_WAKE)
            control = self._group.control
            length = torch.tensor([len(payload)], dtype=torch.int64)
            dist.all_reduce(length, group=control)
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, control)
        except (OSError, RuntimeError) as exc:  # gloo's failures are RuntimeErrors
            raise self._fail(f"sending the step to the workers failed ({exc})") from exc

    def _fail(self, reason: str) -> TensorParallelWorkerError:
        """Remember and return the error that ends this runner's steps."""
        worker_reason = self._worker_failure()
        if worker_reason is not None and worker_reason not in reason:
            reason = f"{reason}; {worker_reason}"
        self.failure = TensorParallelWorkerError(f"tensor parallel: {reason}")
        logger.error("%s", self.failure)
        return self.failure

    def _worker_failure(self) -> str | None:
        """What the first failed worker said or how it exited; None when all live quietly."""
        for worker in self.workers:
            try:
                if worker.conn.poll(0):
                    said = worker.conn.recv_bytes().decode(errors="replace")
                    return f"rank {worker.rank} failed: {said}"
            except (OSError, EOFError):
                pass  # its pipe closed: the exit code below says how it ended
            if not worker.process.is_alive():
                return self._exit_text(worker)
        return None

    @staticmethod
    def _exit_text(worker: _Worker) -> str:
        process = worker.process
        process.join(0)  # reap it, so its exit code is known
        return f"worker rank {worker.rank} (pid {process.pid}) exited with code {process.exitcode}"

    def shutdown(self) -> None:
        """Stop and join the workers (kill one that outlives `_JOIN_S`, or every one still
        running after a failure: it may be blocked in a collective), then leave the process
        group. Idempotent; later steps raise `TensorParallelWorkerError`. Also run at the
        interpreter's exit when not called before."""
        atexit.unregister(self.shutdown)
        for worker in self.workers:
            with contextlib.suppress(OSError):  # it is gone already
                worker.conn.send_bytes(_STOP)
        for worker in self.workers:
            process = worker.process
            process.join(_JOIN_S if self.failure is None else 0)
            if process.is_alive():  # hung, or blocked in a collective: it ignores SIGTERM
                logger.warning("worker rank %d did not exit; killing it", worker.rank)
                process.kill()
                process.join(_JOIN_S)
            worker.conn.close()
        self.workers = []
        if self.failure is None:
            self.failure = TensorParallelWorkerError("tensor parallel: the runner was shut down")
        if dist.is_initialized():
            dist.destroy_process_group()
