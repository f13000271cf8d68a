"""Budget parsing: bytes, ``"12GiB"``/``"800MB"``, or ``"80%"`` of free device memory."""
from __future__ import annotations

import re

import torch

from remat_plugin.errors import BudgetFormatError

_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": 1024**3,
}
# The budget forms we read, the one sentence every message and help text about a budget quotes.
BUDGET_FORMS = ("bytes as an int (300000000), a size string ('300MiB', '12GiB', '800MB') or a share of free memory "
                "('80%')")


def free_device_bytes(device: torch.device) -> int:
    """Free memory the step may use: CUDA free + reserved-but-unallocated cache; CPU available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def parse_budget(budget: float | str, device: torch.device | str = "cpu") -> int:
    """Resolve a budget to bytes; raise :class:`BudgetFormatError` naming the accepted forms."""
    def bad(reason: str, accepted: str | None = BUDGET_FORMS) -> BudgetFormatError:
        return BudgetFormatError(option="budget", value=budget, reason=reason, accepted=accepted)

    if isinstance(budget, bool):
        raise bad(f"budget {budget!r} is not a budget")
    def whole_bytes(value: float) -> int:
        if value <= 0:
            raise bad(f"budget {budget!r} must be positive")
        if value < 1:  # 0.8 read as bytes is 0: a share of memory was meant
            raise bad(f"budget {budget!r} is less than one byte; for a share of free memory write '{value:.0%}'",
                      accepted=None)
        return int(value)

    if isinstance(budget, (int, float)):
        return whole_bytes(budget)
    if not isinstance(budget, str):
        raise bad(f"budget {budget!r} has type {type(budget).__name__}")
    text = budget.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
    if m:
        share = float(m.group(1))
        if not 0 < share <= 100:
            raise bad(f"budget {budget!r} must be a share in (0%, 100%]", accepted=None)
        return int(free_device_bytes(torch.device(device)) * share / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise bad(f"cannot read budget {budget!r}")
    return whole_bytes(float(m.group(1)) * _UNITS[m.group(2).lower()])
