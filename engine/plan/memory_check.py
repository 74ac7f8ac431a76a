"""Before anything is allocated: does a run (or a model file to write) fit in what the machine
has?  The needs are the memory plan's figures (`memory_plan.plan_memory`: dense weights,
experts, KV for the run's tokens, scratch, the host arena) plus what the run itself holds on the
host (the prompt's ids, the logits it keeps); what is available is the device's free memory
(CUDA) or the host's available memory, lowered by a process limit (`ulimit -v`/`-d`) where one
is set.  A run that does not fit is refused with the two numbers and the setting to change
(`ConfigError`: exit 2 in the CLI), instead of failing inside an allocation.
"""
from __future__ import annotations

import logging
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ConfigError, EngineConfig
from engine.sizes import size_text

log = logging.getLogger(__name__)

IDS_BYTES_PER_TOKEN = 8 + 8 + 28  # the int64 prompt tensor, a list slot and its Python int
HOST_SLACK = 256 << 20  # what a run holds on the host besides the plan's figures (buffers, events)


@dataclass
class Need:
    """Bytes needed on one device (or the host), by part."""

    where: str
    parts: dict[str, int] = field(default_factory=dict)

    def add(self, part: str, n: int) -> None:
        if n > 0:
            self.parts[part] = self.parts.get(part, 0) + n

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {size_text(v)}" for k, v in big[:4])


def _status_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_available() -> int:
    """Bytes this process may still take on the host: MemAvailable (else physical RAM), lowered
    by RLIMIT_AS / RLIMIT_DATA when set (less what the process already uses of them)."""
    from engine.models.experts import physical_ram

    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        avail = physical_ram()
    for res, used_field in ((getattr(resource, "RLIMIT_AS", None), "VmSize"),
                            (getattr(resource, "RLIMIT_DATA", None), "VmData")):
        if res is None:
            continue
        soft, _ = resource.getrlimit(res)
        used = _status_bytes(used_field)
        if soft != resource.RLIM_INFINITY and used is not None:
            avail = min(avail, max(soft - used, 0))
    return avail


def device_available(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available()


def run_needs(source, config: EngineConfig, prompt_tokens: int, decode_tokens: int,
              logits_all: bool, loaded: bool = False) -> list[Need]:
    """What a run of `prompt_tokens` + `decode_tokens` needs where (host first).

    loaded: the weights are in memory already (a Session that is kept between runs, as the
    app's): only what grows with the tokens is counted (KV, ids, logits)."""
    from engine.plan.memory_plan import plan_memory

    tokens = prompt_tokens + decode_tokens
    plan = plan_memory(source, config, tokens)
    host = Need("host")
    by_device: dict[str, Need] = {}
    for d in plan.devices:
        need = host if d.device == "cpu" else by_device.setdefault(d.device, Need(d.device))
        for part, n in (("KV cache", d.kv), ("dense weights", d.dense), ("experts", d.experts),
                        ("scratch", d.scratch), ("attention scores", d.attention)):
            if part in ("KV cache", "attention scores") or not loaded:
                need.add(part, n)
    if not loaded:
        host.add("host expert arena", plan.host_arena)
    host.add("prompt ids", prompt_tokens * IDS_BYTES_PER_TOKEN)
    vocab = source.spec.vocab
    host.add("logits", (prompt_tokens if logits_all else 1) * vocab * 4 * (2 if logits_all else 1))
    host.add("run buffers", HOST_SLACK)
    return [host, *by_device.values()]


def check_fits(needs: Iterable[Need], setting: str, value: object, change: str) -> None:
    """Raise ConfigError naming `setting` when a need exceeds what its device has."""
    for need in needs:
        have = host_available() if need.where == "host" else device_available(torch.device(need.where))
        if need.total > have:
            raise ConfigError(setting, value, "a run that fits in memory",
                              f"it needs {size_text(need.total)} on the {need.where} ({need.describe()}), "
                              f"{size_text(have)} available; {change}")
        log.debug("%s: needs %s of %s", need.where, size_text(need.total), size_text(have))


def check_run(source, config: EngineConfig, prompt_tokens: int, decode_tokens: int, logits_all: bool,
              prompt_setting: str = "--prompt-tokens", loaded: bool = False,
              decode_setting: str = "--decode-tokens") -> None:
    """Refuse a run that cannot fit, naming the setting that makes it large."""
    if decode_tokens > prompt_tokens:
        setting, value = decode_setting, decode_tokens
        change = f"lower {setting} (the KV cache holds every generated token)"
    else:
        setting, value = prompt_setting, prompt_tokens
        change = f"lower {setting} (KV and logits grow with the tokens), or spread the layers over more devices"
    check_fits(run_needs(source, config, prompt_tokens, decode_tokens, logits_all, loaded), setting, value, change)


def check_output(flag: str, path: Path, nbytes: int, change: str = "") -> None:
    """Refuse an output file larger than the free space of its folder (before the run)."""
    from engine.io.atomic_file import free_bytes

    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = free_bytes(folder)
    if free is not None and nbytes > free:
        raise ConfigError(flag, str(path), "an output that fits on its disk",
                          f"it will be {size_text(nbytes)}, {size_text(free)} free on {folder}"
                          + (f"; {change}" if change else ""))


def check_make_model(recipe, path: Path) -> None:
    """make-model: the largest tensor must fit in the host's memory, the file on its disk."""
    from engine.io.synth import write_needs

    file_bytes, peak, tensor = write_needs(recipe)
    moe = recipe.spec().is_moe
    flag, value = ("--experts", recipe.n_experts) if moe else ("--ffn", recipe.ffn)
    change = "lower --experts or --expert-ffn" if moe else "lower --ffn, --hidden or --layers"
    have = host_available()
    if peak > have:
        raise ConfigError(flag, value, "a model whose largest tensor fits in memory",
                          f"writing {tensor} needs {size_text(peak)} on the host, {size_text(have)} available; "
                          f"{change}")
    check_output("make-model PATH", path, file_bytes, change)
