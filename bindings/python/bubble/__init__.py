"""libbubble for Python: run side tasks in the bubbles of pipeline-parallel training.

A ctypes binding over the C ABI of libbubble (no compiled extension). The library is found
through $BUBBLE_LIBRARY, then next to this package, then by the system loader.
"""
from __future__ import annotations

from ._lib import MEM_UNKNOWN, lib as _clib
from .errors import (BubbleError, Busy, CallbackFailed, Corrupt, HubFull, HubNotFound,
                     InvalidArgument, InvalidState, OutOfMemory, PermissionDenied, Status,
                     Stopped, SystemCallError, Timeout, TrainerGone, Unsupported, VersionMismatch)
from .grant import GrantBackend, GrantInfo, GrantState, GrantStats, TaskGrant
from .task import OnTrainerExit, Outcome, SideTask, StartInfo, StepInfo, Task, WakeMode
from .trainer import (BubbleKind, ScheduleBubbles, ScheduleKind, TaskInfo, Trainer,
                      TrainerStats)

__all__ = [
    "BubbleError", "BubbleKind", "Busy", "CallbackFailed", "Corrupt", "GrantBackend",
    "GrantInfo", "GrantState", "GrantStats", "HubFull", "HubNotFound", "TaskGrant",
    "InvalidArgument", "InvalidState", "MEM_UNKNOWN", "OnTrainerExit", "OutOfMemory", "Outcome",
    "PermissionDenied", "ScheduleBubbles", "ScheduleKind", "SideTask", "StartInfo", "Status",
    "StepInfo", "Stopped", "SystemCallError", "Task", "TaskInfo", "Timeout", "Trainer",
    "TrainerGone", "TrainerStats", "Unsupported", "VersionMismatch", "WakeMode", "now_ns",
    "library_version", "__version__",
]

__version__ = "0.1.0"


def library_version() -> str:
    """The version of the loaded libbubble ("0.1.0")."""
    return _clib.bb_version().decode()


def now_ns() -> int:
    """CLOCK_MONOTONIC now in nanoseconds: the clock of every libbubble time."""
    return _clib.bb_now_ns()
