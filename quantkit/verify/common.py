"""What the stages of `verify` share: the capped listing of findings, one pass/fail check, limits, and what an
engine run is measured on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from ..options import Thresholds

MAX_LISTED = 100  # mismatches / problems listed in full; the rest are counted
SQNR_CAP_DB = 300.0  # an exact match (inf dB) is reported as this, so the report stays valid JSON


def capped_db(db: float) -> float:
    """An SQNR as verify reports and compares it: an exact match (inf) or an all-zero weight reproduced as zero
    (0/0, nan) is SQNR_CAP_DB, an all-zero reference alone -SQNR_CAP_DB."""
    return SQNR_CAP_DB if math.isnan(db) else max(-SQNR_CAP_DB, min(SQNR_CAP_DB, db))


@dataclass
class Check:
    """One pass/fail decision. ok is None when the check was skipped (detail says why)."""

    name: str
    ok: bool | None
    detail: str
    value: float | None = None
    threshold: float | None = None


def _quiet(_line: str) -> None:
    pass


@dataclass(frozen=True)
class RunInputs:
    """What an engine run (verify/vllm_run.py, verify/llamacpp_run.py) is measured on and held to: the token
    samples, the device the reference runs on, greedy steps per prompt, the limits, and where progress lines go."""

    samples: list[torch.Tensor]
    dev: torch.device
    gen_tokens: int
    thresholds: Thresholds
    say: Callable[[str], None] = _quiet


class Listing:
    """A list capped at MAX_LISTED entries; the overflow is counted and summarized at the end."""

    def __init__(self):
        self.items: list = []
        self.more = 0

    def add(self, item) -> None:
        if len(self.items) < MAX_LISTED:
            self.items.append(item)
        else:
            self.more += 1

    def __len__(self):
        return len(self.items) + self.more


def finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def listed(listing: Listing, overflow_template) -> list:
    out = list(listing.items)
    if listing.more:
        msg = f"... and {listing.more} more"
        out.append(msg if overflow_template is None else {**overflow_template, "problem": msg})
    return out


def resolve_device(device: str) -> torch.device:
    """`--device` as a torch device: cpu, or cuda where one is available; anything else refused in one line."""
    import torch

    from ..errors import DeviceError

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {device!r}", hint="use cpu or cuda (cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device cuda requested but no CUDA device is available", hint="use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"unsupported device {device!r}", hint="use cpu or cuda (cuda:N)")
    return dev
