"""Rank 0 of a tensor-parallel worker: the group's ranks 1..N-1 and the runner the engine drives.

Contract
- `build_runner(config) -> (ModelRunner, TPGroup)`: the engine's usual `ModelRunner`, unchanged,
  over rank 0's shard wrapped in `LeaderModel`; the scheduler, block manager and sampler run only
  here, once. Each forward first sends the step (its flat inputs and attention metadata, i.e. the
  plan in block ids) to every other rank, then runs rank 0's shard; the shards meet in the
  all-reduces. Logits are vocab-parallel: each rank multiplies the sampled rows' hidden states by
  its slice of the (replicated) lm_head, rank 0 gathers the slices.
- `TPGroup`: starts ranks 1..N-1 as processes of this node (multiprocessing spawn: one process
  per device), each with a pipe for its step messages, written by a sender thread per rank (a
  stuck rank's full pipe blocks that thread, never the engine); the group's collectives; `restart()`
  stops them all (bounded: stop message, join, terminate, kill) and starts a fresh incarnation
  (new store and process group) around rank 0's loaded shard; `stop()` at shutdown.
- KV pools: each rank allocates its own (its KV heads only) from the same per-rank budget
  (--kv-cache-mb is per rank); the block manager uses the smallest pool of the group.
- threads (CPU): --num-threads per rank, default the worker's cores divided by N.
- CUDA graphs and the compiled CPU step are off under TP (enforce_eager): the collectives run
  eagerly (docs/tensor-parallel.md).
- failure modes: a size that does not split the model -> ValueError before any process starts
  (worker/tp/shard.py); a rank that fails to start -> GroupFailed naming it and its error; a rank
  found dead before a step, a broken pipe, or a failed / timed-out collective -> GroupFailed from
  the step (worker/tp/engine.py then restarts the group).
- proven by tests/test_tp_model.py and tests/test_tp_serve.py.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
import time

import torch
import torch.nn as nn

from worker.config import EngineConfig
from worker.host import default_num_threads
from worker.tp.errors import GroupFailed
from worker.tp.group import (
    JOIN_TIMEOUT_S,
    connect,
    encode_step,
    install,
    logits_slice,
    new_store,
    rank_device,
    rank_main,
)
from worker.tp.shard import check_size, read_model_config, shard_mode

log = logging.getLogger(__name__)


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _last_words(conn) -> str:
    """The error a rank reported before it exited, if any (": <message>")."""
    try:
        return f": {conn.recv()[1]}" if conn.poll() else ""
    except (EOFError, OSError):
        return ""


class _Sender:
    """Delivers rank r's messages on a thread of its own, so that rank 0 never blocks on the full
    pipe of a stuck rank: the step's collective times out instead, and `stop()` kills the rank,
    which ends a blocked write."""

    def __init__(self, rank: int, conn):
        self.rank, self.conn, self.error = rank, conn, ""
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"tp-send-{rank}", daemon=True)
        self.thread.start()

    def put(self, msg: tuple) -> None:
        if self.error:
            raise GroupFailed(f"rank {self.rank}: step not delivered ({self.error})")
        self.queue.put(msg)

    def _run(self) -> None:
        while (msg := self.queue.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError as exc:
                self.error = type(exc).__name__
                return

    def close(self, timeout_s: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout_s)


class LeaderModel(nn.Module):
    """Rank 0's shard; each forward first hands the step to the other ranks, and the logits are
    vocab-parallel: every rank computes its slice, rank 0 gathers them."""

    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner = inner
        self._group = group

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        self._group.send(input_ids, positions, meta)
        return self.inner(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self._group.logits(hidden)  # (S, V)
        return logits.float() if upcast else logits

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)  # config, dtype, compute_logits, ...


class TPGroup:
    def __init__(self, config: EngineConfig):
        """`config`: resolved (concrete device, dtype and thread count)."""
        from worker.model.loader import load_model, quantization_mode

        self.config, self.size = config, config.tensor_parallel_size
        check_size(read_model_config(config.model), self.size)
        mode = quantization_mode(config.quantization, config.dtype, torch.device(config.device))
        shard_mode(mode, config.dtype)  # an unsupported quantization fails here, before any process
        self.procs: list = []
        self.conns: list = []
        self.senders: list[_Sender] = []
        self.collectives = None
        self.num_restarts = 0
        store = self._spawn()
        try:  # rank 0 loads while the other ranks start and load theirs
            self.loaded = load_model(
                config.model, config.dtype, rank_device(config.device, 0), config.quantization, (0, self.size)
            )
            self.model = self.loaded.model
            self._join(store)
        except BaseException:
            self.stop()
            raise

    @property
    def rank_blocks(self) -> list[int]:
        return self._rank_blocks

    def _spawn(self):
        ctx = multiprocessing.get_context("spawn")
        store = new_store(self.size)
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, self.size, self.config, store.port, child),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()  # only the rank holds its end: its death is EOF here
            self.procs.append(proc)
            self.conns.append(parent)
            self.senders.append(_Sender(rank, parent))
        return store

    def _connect(self, store):
        """Rank 0 joins the group; a rank process that dies meanwhile fails the start at once
        instead of after the join timeout (the join thread is then left to time out)."""
        box: dict = {}

        def join() -> None:
            try:
                box["collectives"] = connect(0, self.size, rank_device(self.config.device, 0), store=store)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                box["error"] = exc

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for rank, proc in enumerate(self.procs, start=1):
                if thread.is_alive() and not proc.is_alive():
                    said = _last_words(self.conns[rank - 1])
                    raise GroupFailed(f"rank {rank} {_describe(proc.exitcode)} while starting{said}")
        if "error" in box:
            raise GroupFailed(f"rank 0 could not join the group: {box['error']}") from box["error"]
        return box["collectives"]

    def _join(self, store) -> None:
        self.collectives = self._connect(store)
        install(self.model, self.collectives)
        deadline = time.monotonic() + JOIN_TIMEOUT_S + 600  # + loading the shard
        blocks = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise GroupFailed(f"rank {rank} {_describe(proc.exitcode)} while starting")
                if time.monotonic() > deadline:
                    raise GroupFailed(f"rank {rank} not ready within {JOIN_TIMEOUT_S + 600:.0f} s")
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                raise GroupFailed(f"rank {rank} {_describe(proc.join(5) or proc.exitcode)} while starting")
            if kind != "ready":
                raise GroupFailed(value)
            blocks.append(value)
        self._rank_blocks = blocks
        log.info("tensor-parallel group of %d ranks up; rank pids %s", self.size, self.pids())

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise GroupFailed(f"rank {rank} {_describe(proc.exitcode)}")

    def send(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        self._check_alive()
        msg = encode_step(input_ids, positions, meta)
        for sender in self.senders:
            sender.put(msg)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, V) logits of the sampled rows' hidden states (S, C): each rank's vocabulary slice,
        gathered to rank 0."""
        self._check_alive()
        msg = ("logits", hidden.detach().float().cpu().numpy())  # numpy has no bfloat16; exact
        for sender in self.senders:
            sender.put(msg)
        parts = self.collectives.gather_to_0(logits_slice(self.model, hidden, 0, self.size).contiguous())
        return torch.cat(parts, dim=-1)

    def time_all_reduce(self, shape: tuple[int, ...], count: int, dtype: torch.dtype) -> float:
        """Mean seconds of one bare all-reduce of `shape` over the group (every rank doing only
        that): the communication cost without any wait for a slower rank's compute."""
        for sender in self.senders:
            sender.put(("reduce", shape, count + 1))
        x = torch.zeros(shape, dtype=dtype, device=rank_device(self.config.device, 0))
        self.collectives.all_reduce(x)  # warm-up; also lines the ranks up
        start = time.perf_counter()
        for _ in range(count):
            self.collectives.all_reduce(x)
        return (time.perf_counter() - start) / count

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Every rank process ends within about `timeout_s` + 2 s."""
        for sender in self.senders:
            if not sender.error:  # else that rank is gone already
                sender.put(("stop",))
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for sender in self.senders:
            sender.close(1.0)  # a write blocked on a killed rank has failed by now
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.senders = [], [], []
        self.collectives = None

    def restart(self) -> None:
        """A fresh incarnation of ranks 1..N-1 and of the process group; rank 0's shard is kept."""
        self.stop(timeout_s=2.0)
        store = self._spawn()
        try:
            self._join(store)
        except BaseException:
            self.stop()
            raise
        self.num_restarts += 1


def tp_config(config: EngineConfig) -> EngineConfig:
    """Resolved config of every rank: threads divided among the ranks, eager steps."""
    from worker.model_runner import resolved_config

    size = config.tensor_parallel_size
    threads = config.num_threads or max(1, default_num_threads() // size)
    return resolved_config(
        dataclasses.replace(config, num_threads=threads, enforce_eager=True, cpu_compile=False)
    )


def build_runner(config: EngineConfig):
    """(ModelRunner over rank 0's LeaderModel, TPGroup)."""
    from worker.model_runner import ModelRunner

    config = tp_config(config)
    group = TPGroup(config)
    try:
        loaded = group.loaded
        runner = ModelRunner.from_model(
            dataclasses.replace(config, device=rank_device(config.device, 0)),
            LeaderModel(group.model, group),
            loaded.eos_token_ids,
            loaded.name,
        )
    except BaseException:
        group.stop()
        raise
    runner.num_blocks = min([runner.num_blocks, *group.rank_blocks])
    runner.load_s = loaded.load_s
    return runner, group
