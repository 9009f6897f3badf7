"""The collectives of a tensor-parallel group and the loop of ranks 1..N-1.

Contract
- `connect(...) -> Collectives`: one torch.distributed process group per group incarnation, built
  directly (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA) over its own TCPStore on
  127.0.0.1 (all ranks are processes of one node), so a restarted group shares no global state
  with the dead one. Joining waits at most `join_timeout_s`; every collective after that has
  `timeout_s` (a hung rank fails the step; it never hangs).
- `Collectives.all_reduce(x)`: in-place sum over the ranks (the row-parallel o_proj / down_proj
  partials); counts the calls and the seconds spent in them (the benchmark's all-reduce share).
  A failure or timeout -> `GroupFailed` (worker/tp/errors.py).
- The step message rank 0 sends each rank (`encode_step` / `decode_step`): the step's flat inputs
  (`input_ids`, `positions`) and every field of its `AttentionMetadata` (slot mapping, block
  tables, ...): the scheduler's plan, already turned into block ids by rank 0's block manager.
  Ranks 1..N-1 hold no scheduler, block manager or sampler.
- `rank_main(rank, size, config, port, conn)`: the body of rank r's process: joins the group,
  loads its shard (worker/tp/shard.py through the loader), allocates its own paged KV pool (its
  KV heads only), answers ("ready", num_blocks) or ("error", message) on `conn`, then runs the
  forward of each step message until ("stop",), or until rank 0 is gone (EOF on `conn`), or a
  collective fails (exit code 1: rank 0 sees it and restarts the group). ("logits", hidden): the
  sampled rows' final hidden states; the rank computes its vocabulary slice of their logits
  (`logits_slice`) and gathers it to rank 0. ("reduce", shape, n): n bare all-reduces, for the
  benchmark.
- proven by tests/test_tp_model.py and tests/test_tp_serve.py (a rank killed mid-stream).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import sys
import time

import torch

from worker.attention import AttentionMetadata
from worker.config import EngineConfig
from worker.tp.errors import GroupFailed

log = logging.getLogger(__name__)
HOST = "127.0.0.1"  # one node: the ranks are processes of the worker's node
TIMEOUT_S = 60.0  # every collective
JOIN_TIMEOUT_S = 300.0  # the group's rendezvous: rank processes start (import torch) meanwhile


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:(base + r) for "cuda[:base]" (the devices Ray or the user made
    visible to the worker), else `device` itself (cpu)."""
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


class Collectives:
    def __init__(self, store, pg, rank: int, size: int):
        self.store, self.pg, self.rank, self.size = store, pg, rank, size
        self.reduce_s = 0.0
        self.num_reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            self.pg.allreduce([x]).wait()
        except RuntimeError as exc:
            raise GroupFailed(f"rank {self.rank}: all-reduce failed: {str(exc).splitlines()[0]}") from exc
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()  # honest timing: the reduce itself
        self.reduce_s += time.perf_counter() - start
        self.num_reduces += 1
        return x

    def gather_to_0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape) on rank 0, in rank order; None on the other ranks."""
        from torch.distributed import GatherOptions

        opts = GatherOptions()
        opts.rootRank = 0
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            self.pg.gather([out] if out is not None else [], [x], opts).wait()
        except RuntimeError as exc:
            raise GroupFailed(f"rank {self.rank}: gather failed: {str(exc).splitlines()[0]}") from exc
        return out


def logits_slice(model, hidden: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank r's vocab-parallel share of the logits, (S, V/N): its untied lm_head (loaded as rows
    [r*V/N, (r+1)*V/N) only, worker/tp/shard.py), or those rows of the replicated tied embedding."""
    if model.lm_head is not None:
        return model.lm_head(hidden)
    weight = model.embed_tokens.weight
    n = weight.shape[0] // size
    return torch.nn.functional.linear(hidden, weight[rank * n : (rank + 1) * n])


def new_store(size: int, timeout_s: float = JOIN_TIMEOUT_S):
    from torch.distributed import TCPStore

    return TCPStore(
        HOST, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def connect(
    rank: int,
    size: int,
    device: str,
    port: int = 0,
    store=None,
    timeout_s: float = TIMEOUT_S,
    join_timeout_s: float = JOIN_TIMEOUT_S,
) -> Collectives:
    """Joins the group (blocks until all `size` ranks have, at most `join_timeout_s`: the others may
    still be starting); every collective after that has `timeout_s`."""
    from torch.distributed import ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=join_timeout_s)
    if store is None:
        store = TCPStore(HOST, port, size, False, timeout=timeout)
    if device.startswith("cuda"):
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=HOST)]
        pg = ProcessGroupGloo(store, rank, size, opts)
    pg.set_timeout(datetime.timedelta(seconds=timeout_s))
    return Collectives(store, pg, rank, size)


def install(model, collectives: Collectives) -> None:
    """Every row-parallel projection's output goes through `collectives.all_reduce`."""
    for layer in model.layers:
        layer.self_attn.all_reduce = collectives.all_reduce
        layer.mlp.all_reduce = collectives.all_reduce


def encode_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
    fields = {}
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if f.name == "prepared":
            continue  # backend work each rank redoes from the fields
        fields[f.name] = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
    return ("step", input_ids.cpu().numpy(), positions.cpu().numpy(), fields)


def decode_step(msg: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    _, input_ids, positions, fields = msg
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    meta = AttentionMetadata(**{k: as_tensor(v) if hasattr(v, "dtype") else v for k, v in fields.items()})
    return as_tensor(input_ids), as_tensor(positions), meta


def build_rank_runner(config: EngineConfig, rank: int, collectives: Collectives):
    """Rank r's ModelRunner: its shard, hooked to the group, with its own KV pool."""
    from worker.model.loader import load_model
    from worker.model_runner import ModelRunner

    device = rank_device(config.device, rank)
    size = config.tensor_parallel_size
    loaded = load_model(config.model, config.dtype, device, config.quantization, shard=(rank, size))
    install(loaded.model, collectives)
    config = dataclasses.replace(config, device=device)
    runner = ModelRunner.from_model(config, loaded.model, loaded.eos_token_ids, loaded.name)
    runner.load_s = loaded.load_s
    return runner


def rank_main(rank: int, size: int, config: EngineConfig, port: int, conn) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"tp-rank-{rank} %(levelname)s %(message)s")
    try:
        torch.set_num_threads(config.num_threads)
        collectives = connect(rank, size, rank_device(config.device, rank), port=port)
        runner = build_rank_runner(config, rank, collectives)
        conn.send(("ready", runner.num_blocks))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which fails the start
        try:
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        except OSError:
            pass  # rank 0 is gone already: nobody to tell
        sys.exit(1)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone
            if msg[0] == "stop":
                return
            try:
                with torch.inference_mode():
                    serve_message(msg, runner, collectives, rank, size)
            except GroupFailed as exc:
                log.warning("%s; exiting", exc)
                sys.exit(1)
    finally:
        # Stopped or orphaned: the interpreter's final collection would walk every object torch and
        # the shard allocated (measured 2.7-3.5 s of a rank's exit on 2 vCPUs, which every stop and
        # group restart waited for); frozen, it skips them (as python -m worker does).
        gc.freeze()


def serve_message(msg: tuple, runner, collectives: Collectives, rank: int, size: int) -> None:
    if msg[0] == "step":
        input_ids, positions, meta = decode_step(msg, runner.device)
        runner.model(input_ids, positions, runner.kv_caches, meta, runner.backend)
    elif msg[0] == "logits":  # the sampled rows' hidden states: this rank's vocab slice to rank 0
        hidden = torch.from_numpy(msg[1]).to(runner.device, runner.model.dtype)
        collectives.gather_to_0(logits_slice(runner.model, hidden, rank, size).contiguous())
    elif msg[0] == "reduce":  # benchmarks/tp_bench.py: the collective alone, no compute
        _, shape, count = msg
        for _ in range(count):
            collectives.all_reduce(torch.zeros(shape, dtype=runner.model.dtype, device=runner.device))
