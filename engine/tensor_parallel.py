"""Tensor-parallel workers: the target model sharded over N processes, one scheduler.

The Engine (scheduler, proposers, policy, sampler, the unsharded draft model) lives on rank 0. Its
target runner is a ParallelRunner: before each pass it broadcasts the pass's inputs (the forward
items, flattened into one int64 tensor) to ranks 1..N-1, which rebuild the same metadata and run
their shard of the same pass; the shards meet in the model's all-reduces, and rank 0 gathers the
logits (engine/models/parallel.py). KV moves after a tree pass are broadcast the same way. Each
rank's KV cache holds its own KV heads under the block tables rank 0 allocates.

Ranks 1..N-1 are launched by rank 0 as `python -m engine.tensor_parallel` subprocesses on this node
(start_group), or by torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, `env://`). gloo on
CPU, NCCL on CUDA. Any failure of a pass, a worker that exits, or one that does not take part in a
collective within tensor_parallel_timeout seconds (stopped, hung) leaves the group out of step:
WorkerGroupError, which the engine treats as fatal (EngineDeadError), and every waiting client is
answered. On CUDA, NCCL's watchdog enforces the same timeout on the passes' collectives by ending
the process, which the server reports the same way.
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from engine.model_runner import ForwardItem, ModelRunner
from engine.models.parallel import TensorParallel

STOP, FORWARD, MOVE_KV, SIZES = range(4)
ITEM_FIELDS = 6   # per item: tokens, start_pos, table length, num_logits, tree rows, tree cols
# A worker waits in the channel's broadcast between passes, however long the server idles; so does
# rank 0 for the workers to load their shards.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class WorkerGroupError(RuntimeError):
    """The tensor-parallel group is out of step (a worker died, or a pass failed on some rank)."""


# ---- the flat encoding of a pass (bookkeeping, no tensors) ----------------------------------

def encode_items(items: list[ForwardItem]) -> np.ndarray:
    """ForwardItems -> one int64 array: a header row per item, then tokens, tables and tree masks."""
    header, body = [], []
    for item in items:
        tree = item.tree_mask
        rows, cols = (0, 0) if tree is None else tree.shape
        header += [len(item.token_ids), item.start_pos, len(item.block_table), item.num_logits, rows, cols]
        body += [np.asarray(item.token_ids, dtype=np.int64), np.asarray(item.block_table, dtype=np.int64)]
        if tree is not None:
            body.append(tree.astype(np.int64).ravel())
    return np.concatenate([np.asarray([len(items)] + header, dtype=np.int64)] + body)


def decode_items(flat: np.ndarray) -> list[ForwardItem]:
    count = int(flat[0])
    header = flat[1:1 + ITEM_FIELDS * count].reshape(count, ITEM_FIELDS)
    at, items = 1 + ITEM_FIELDS * count, []
    for n, start, width, num_logits, rows, cols in header.tolist():
        tokens, table = flat[at:at + n], flat[at + n:at + n + width].tolist()
        at += n + width
        tree = None
        if rows:
            tree = flat[at:at + rows * cols].reshape(rows, cols).astype(bool)
            at += rows * cols
        items.append(ForwardItem(tokens, start, table, num_logits, tree))
    return items


def encode_move(block_table: list[int], sources: list[int], destinations: list[int]) -> np.ndarray:
    return np.asarray([len(block_table), len(sources), *block_table, *sources, *destinations], dtype=np.int64)


def decode_move(flat: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    width, n = int(flat[0]), int(flat[1])
    rest = flat[2:].tolist()
    return rest[:width], rest[width:width + n], rest[width + n:width + 2 * n]


# ---- the channel: one broadcast of the kind and size, one of the payload ------------------

class Channel:
    """Rank 0 sends, the workers receive, in the same order (torch.distributed broadcasts over a
    group whose wait is unbounded: a worker waits there for the next pass).
    Rank 0 waits `timeout` seconds at most for the workers to take a message: a broadcast completes
    only when every worker receives it, so a stopped or hung worker is a WorkerGroupError."""

    def __init__(self, device: torch.device, group, timeout: float):
        self.device = device   # NCCL broadcasts device tensors; gloo CPU ones
        self.group, self.timeout = group, datetime.timedelta(seconds=timeout)

    def send(self, kind: int, payload: np.ndarray, timeout: datetime.timedelta | None = None) -> None:
        try:
            self._broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64, device=self.device), timeout)
            if len(payload):
                self._broadcast(torch.from_numpy(payload).to(self.device), timeout)
        except Exception as exc:   # a dead peer (gloo raises on the closed connection), or one past the timeout
            raise WorkerGroupError(f"a tensor-parallel worker is gone or stuck: {type(exc).__name__}: {exc}") from exc

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        dist.broadcast(tensor, src=0, group=self.group, async_op=True).wait(timeout or self.timeout)

    def receive(self) -> tuple[int, np.ndarray]:
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0, group=self.group)
        kind, size = head.tolist()
        payload = torch.empty(size, dtype=torch.int64, device=self.device)
        if size:
            dist.broadcast(payload, src=0, group=self.group)
        return kind, payload.cpu().numpy()


class ParallelRunner(ModelRunner):
    """Rank 0's target runner: each pass's inputs go to the workers before it runs its own shard.
    A pass that fails here may have left the workers inside a collective: the group is then
    unusable, so every failure is a WorkerGroupError."""

    def attach(self, workers: "WorkerSet") -> None:
        self.channel, self.workers = workers.channel, workers
        self.decode_grid = None   # a grid's passes would skip the broadcast

    def enable_decode_grid(self, *args, **kwargs) -> None:
        pass

    def forward(self, items: list[ForwardItem], features: torch.Tensor | None = None, return_hidden: bool = False):
        if features is not None:
            raise ValueError("a tensor-parallel target takes no input features")
        self.workers.check()
        self.channel.send(FORWARD, encode_items(items))
        return self._guarded(super().forward, items, return_hidden=return_hidden)

    def move_kv(self, block_table: list[int], sources: list[int], destinations: list[int]) -> None:
        self.workers.check()
        self.channel.send(MOVE_KV, encode_move(block_table, sources, destinations))
        self._guarded(super().move_kv, block_table, sources, destinations)

    @staticmethod
    def _guarded(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise WorkerGroupError(f"a tensor-parallel pass failed: {type(exc).__name__}: {exc}") from exc


def serve(runner: ModelRunner, channel: Channel) -> None:
    """A worker's loop: run each pass rank 0 sends, until STOP."""
    while True:
        kind, payload = channel.receive()
        if kind == STOP:
            return
        if kind == FORWARD:
            ModelRunner.forward(runner, decode_items(payload))
        elif kind == MOVE_KV:
            ModelRunner.move_kv(runner, *decode_move(payload))


# ---- the group: launch, join, stop ---------------------------------------------------------

def torchrun_rank() -> int | None:
    """This process's rank when torchrun launched it (RANK and WORLD_SIZE set), else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:local_rank on a GPU node, the CPU otherwise."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def join_group(rank: int, world_size: int, init_method: str, device: torch.device,
               timeout: float) -> tuple[TensorParallel, Channel]:
    """Join the group and its channel. The default group (the rendezvous, the channel) waits without
    limit; the passes' collectives run in a group of their own that waits `timeout` seconds at most."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=IDLE_TIMEOUT)
    passes = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    return TensorParallel(rank, world_size, passes), Channel(device, None, timeout)


class WorkerSet:
    """The worker subprocesses rank 0 launched (none under torchrun), and the channel to every worker."""

    def __init__(self, processes: list[subprocess.Popen], channel: Channel):
        self.processes, self.channel = processes, channel

    def check(self) -> None:
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]
        if dead:
            raise WorkerGroupError("tensor-parallel worker(s) exited: " +
                                   ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead))

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop and wait for them; kill those that do not."""
        try:
            self.check()
            self.channel.send(STOP, np.zeros(0, dtype=np.int64), datetime.timedelta(seconds=timeout))
        except WorkerGroupError:
            pass
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()


def start_group(config, device: torch.device) -> tuple[TensorParallel, WorkerSet]:
    """Rank 0 joins the group, first launching ranks 1..N-1 on this node unless torchrun did."""
    world_size, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout
    if torchrun_rank() is not None:
        tp, channel = join_group(0, world_size, "env://", device, timeout)
        return tp, WorkerSet([], channel)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])))
    processes = []
    for rank in range(1, world_size):
        process = subprocess.Popen([sys.executable, "-m", "engine.tensor_parallel", str(rank), str(world_size),
                                    init_method, str(os.getpid())], stdin=subprocess.PIPE, env=env)
        process.stdin.write(pickle.dumps(config))
        process.stdin.close()
        processes.append(process)
    tp, channel = join_group(0, world_size, init_method, device, timeout)
    return tp, WorkerSet(processes, channel)


def finish_setup(runner: ParallelRunner, workers: WorkerSet, num_blocks: int, block_size: int) -> None:
    """Give the workers the KV cache's size (they build their runners on it, once their shards are
    loaded: no timeout; each chooses its attention backend from the same config, model and dtype as
    rank 0) and stop them at exit."""
    runner.attach(workers)
    workers.channel.send(SIZES, np.asarray([num_blocks, block_size], dtype=np.int64), IDLE_TIMEOUT)
    atexit.register(workers.stop)


def worker_main(rank: int, world_size: int, init_method: str, config, parent_pid: int | None = None) -> None:
    """Ranks 1..N-1: load this rank's shard, then serve rank 0's passes until it stops."""
    from engine.attention_backends import choose_backend
    from engine.models.loader import load_hf_config, load_model
    from engine.setup import resolve_device, tensor_parallel_dtype

    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    device = rank_device(resolve_device(config.device), rank)
    tp, channel = join_group(rank, world_size, init_method, device, config.tensor_parallel_timeout)
    dtype = tensor_parallel_dtype(config, load_hf_config(config.model), device)
    model = load_model(config.model, dtype, device, tensor_parallel=tp, random_weights=config.load_format == "dummy")
    kind, sizes = channel.receive()
    if kind == STOP:
        return
    num_blocks, block_size = sizes.tolist()
    attention = choose_backend(config.attention_backend, model, block_size, device, dtype)
    serve(ModelRunner(model, num_blocks, block_size, dtype, device, attention), channel)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker rank 0 launched exits when rank 0 is gone (NCCL would wait in its broadcast forever)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":   # a worker launched by start_group; the config comes pickled on stdin
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], pickle.loads(sys.stdin.buffer.read()),
                int(sys.argv[4]))
