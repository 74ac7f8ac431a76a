"""The last stage's output of one prefill: its digest, the prompt's last logits, all logits.

Both executors collect a prefill's output the same way: the stage that runs the model's last
layer (the main device with prefill-main) calls `StageOutput.add` for every chunk, in chunk
order (engine/pipeline/stage_runtime.py `StageRuntime.finish_chunk`).  A threaded run's `Run` owns one;
a stage process fills its own and sends the result, which the controller takes back as
`StageOutput.received`.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.models.layers import Head


class Digest:
    """md5 of the final normed hidden state bytes (in the compute dtype), in chunk order.

    On CUDA the bytes leave the GPU on a side stream into pinned memory and are hashed by a
    helper thread, so hashing never stalls the last stage (it cost 64% of a chunk inline).
    `Digest.finished(hex)` is one computed elsewhere (a stage process's)."""

    def __init__(self, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        self.md5 = hashlib.md5()
        self.pool: ThreadPoolExecutor | None = None
        self.streams = streams  # the owner's: one side stream per device for its whole life
        self.pending: list[Future] = []
        self._hex: str | None = None

    @classmethod
    def finished(cls, hex_digest: str) -> Digest:
        d = cls({})
        d._hex = hex_digest
        return d

    def add(self, x: torch.Tensor) -> None:
        if self._hex is not None:
            raise RuntimeError("this digest is complete (it was computed in a stage process)")
        if x.device.type != "cuda":
            self.md5.update(x.detach().contiguous().view(torch.uint8).numpy())
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-digest")
        stream = self.streams.get(x.device)
        if stream is None:
            stream = self.streams[x.device] = torch.cuda.Stream(x.device)
        ready = torch.cuda.Event()
        with torch.cuda.device(x.device):
            ready.record()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        x.record_stream(stream)
        self.pending.append(self.pool.submit(self._hash, host, done))

    def _hash(self, host: torch.Tensor, done: torch.cuda.Event) -> None:
        done.synchronize()
        self.md5.update(host.view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        if self._hex is not None:
            return self._hex
        self.close()
        return self.md5.hexdigest()

    def close(self) -> None:
        for f in self.pending:
            f.result()
        self.pending = []
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class StageOutput:
    """What the last layer's output of one prefill gives: digest, logits rows, last logits."""

    def __init__(self, digest: Digest, n_prompt: int, logits_all: bool) -> None:
        self.digest = digest
        self.n_prompt = n_prompt
        self.logits_all = logits_all
        self.rows: list[torch.Tensor] = []  # logits per chunk (logits_all), on the CPU
        self.last_logits: torch.Tensor | None = None  # [vocab] float32 on the CPU
        self._logits: torch.Tensor | None = None

    @classmethod
    def received(cls, hex_digest: str, last_logits: torch.Tensor | None, logits: torch.Tensor | None) -> StageOutput:
        """The output a stage process computed and sent."""
        out = cls(Digest.finished(hex_digest), 0, logits is not None)
        out.last_logits, out._logits = last_logits, logits
        return out

    def add(self, head: Head, x: torch.Tensor, pos: int, n: int) -> None:
        """One chunk's last-layer output: final norm, digest bytes, logits."""
        normed = head.final_norm(x)
        self.digest.add(normed)
        if self.logits_all:
            self.rows.append(head.logits(normed).cpu())
        if pos + n == self.n_prompt:
            self.last_logits = head.logits(normed[-1:]).cpu()[0]

    @property
    def logits(self) -> torch.Tensor | None:
        """[prompt tokens, vocab] float32 on the CPU when asked for (None otherwise)."""
        if self._logits is None and self.logits_all and self.rows:
            self._logits, self.rows = torch.cat(self.rows), []
        return self._logits
