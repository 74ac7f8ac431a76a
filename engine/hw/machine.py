"""What the machine has, told without importing torch: physical RAM and an upper bound on the
CUDA devices torch could see.  `strata-bench` checks settings against these before it imports
torch or loads a model, so a `--devices cuda:7` or `--pin-limit-gib 9999` answers at once; the
Session repeats the exact check with torch's own device count when it starts.
"""
from __future__ import annotations

import logging
import os

from engine.config import EngineConfig

log = logging.getLogger(__name__)


def physical_ram() -> int:
    """Bytes of physical memory (POSIX sysconf; GlobalMemoryStatusEx on Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - Windows
        import ctypes

        class MemoryStatusEx(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

        st = MemoryStatusEx()
        st.dwLength = ctypes.sizeof(MemoryStatusEx)
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st))  # type: ignore[attr-defined]
        return int(st.ullTotalPhys)


def visible_list_bound(env_value: str | None) -> int | None:
    """At most how many devices a CUDA_VISIBLE_DEVICES value lets through (None: unset, no bound).
    CUDA reads the list up to its first entry that names no device; an empty value or -1 hides all."""
    if env_value is None:
        return None
    items = [x.strip() for x in env_value.split(",")]
    n = 0
    for item in items:
        if not item or item.startswith("-"):
            break
        n += 1
    return n


def nvml_device_count() -> int | None:
    """NVIDIA devices the driver reports (0 with no driver), or None when nvidia-ml-py is missing
    or NVML answers with an error (then nothing is known)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        not_found = getattr(pynvml, "NVMLError_LibraryNotFound", ())
        driver_missing = getattr(pynvml, "NVMLError_DriverNotLoaded", ())
        if isinstance(exc, not_found) or isinstance(exc, driver_missing):
            return 0  # no NVIDIA driver: torch sees no CUDA device either
        log.info("NVML: %s", exc)
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        log.info("NVML: %s", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def cuda_count_bound() -> int | None:
    """An upper bound on torch.cuda.device_count() (None: no bound known).  Never below the true
    count, so a check against it refuses only devices that cannot exist; a CPU-only torch on a GPU
    machine (count 0) is caught later, by the Session's own check."""
    bounds = [b for b in (nvml_device_count(), visible_list_bound(os.environ.get("CUDA_VISIBLE_DEVICES")))
              if b is not None]
    return min(bounds) if bounds else None


NO_BOUND = 1 << 16  # more CUDA devices than a cuda:N index can name (config allows 4 digits)


def check_machine_early(cfg: EngineConfig) -> None:
    """`EngineConfig.check_machine` with the bounds known before torch is imported (ConfigError)."""
    bound = cuda_count_bound() if any(d.startswith("cuda") for d in cfg.devices) else None
    cfg.check_machine(NO_BOUND if bound is None else bound, physical_ram())
