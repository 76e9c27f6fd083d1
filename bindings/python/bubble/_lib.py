"""Loads libbubble and declares the C ABI of bubble.h for ctypes.

Every struct here mirrors bubble.h field for field; tests/test_layout.py compares sizes and
offsets with what a C compiler computes from the header, so the two cannot drift silently.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_int32, c_int64,
                    c_size_t, c_uint32, c_uint64, c_void_p)
from pathlib import Path

BB_NAME_MAX = 47
BB_MAX_SLOTS_LIMIT = 256
MEM_UNKNOWN = (1 << 64) - 1
UINT64_MAX = (1 << 64) - 1
UINT32_MAX = (1 << 32) - 1
STEP_CONTINUE = 0
STEP_DONE = 1
TASK_IDLE_NS = 100_000_000  # BB_TASK_IDLE_NS


class TrainerOptions(Structure):
    _fields_ = [("size", c_uint32), ("max_slots", c_uint32), ("max_running", c_uint32),
                ("event_capacity", c_uint32), ("runtime_dir", c_char_p),
                ("allow_uid", c_uint32), ("reserved0_", c_uint32)]


class ScheduleC(Structure):
    _fields_ = [("size", c_uint32), ("kind", c_uint32), ("stages", c_uint32),
                ("microbatches", c_uint32), ("chunks", c_uint32), ("stage", c_uint32),
                ("fwd_ns", c_uint64), ("bwd_ns", c_uint64), ("wgrad_ns", c_uint64),
                ("comm_ns", c_uint64), ("bubbles", c_uint32), ("reserved0_", c_uint32)]


class TrainerStatsC(Structure):
    _fields_ = [("size", c_uint32), ("tasks_attached", c_uint32), ("bubbles", c_uint64),
                ("bubble_ns", c_uint64), ("starts", c_uint64), ("pauses", c_uint64),
                ("wakes", c_uint64), ("task_ns_in_bubbles", c_uint64),
                ("task_ns_outside", c_uint64), ("steps", c_uint64),
                ("start_latency_p50_ns", c_uint64), ("start_latency_p99_ns", c_uint64),
                ("pause_latency_p50_ns", c_uint64), ("pause_latency_p99_ns", c_uint64),
                ("tasks_reclaimed", c_uint64), ("tasks_bad", c_uint64),
                ("events_dropped", c_uint64)]


class TaskInfoC(Structure):
    _fields_ = [("size", c_uint32), ("slot", c_uint32), ("id", c_uint64), ("pid", c_int32),
                ("priority", c_int32), ("mem_need", c_uint64), ("min_step_ns", c_uint64),
                ("steps", c_uint64), ("step_ns", c_uint64), ("running", c_uint32),
                ("bad", c_uint32), ("name", c_char * (BB_NAME_MAX + 1)),
                ("ns_in_bubbles", c_uint64), ("ns_outside", c_uint64)]


class TaskOptions(Structure):
    _fields_ = [("size", c_uint32), ("priority", c_int32), ("mem_need", c_uint64),
                ("min_step_ns", c_uint64), ("on_trainer_exit", c_uint32),
                ("wake_mode", c_uint32), ("reattach_timeout_ns", c_uint64),
                ("spin_ns", c_uint64), ("runtime_dir", c_char_p), ("wake_lead_ns", c_uint64)]


class StartInfoC(Structure):
    _fields_ = [("size", c_uint32), ("kind", c_uint32), ("bubble_seq", c_uint64),
                ("begin_ns", c_uint64), ("deadline_ns", c_uint64), ("free_mem", c_uint64),
                ("grant_id", c_uint64), ("grant_ptr", c_void_p), ("grant_bytes", c_uint64)]


class StepInfoC(Structure):
    _fields_ = [("size", c_uint32), ("kind", c_uint32), ("bubble_seq", c_uint64),
                ("deadline_ns", c_uint64), ("time_left_ns", c_uint64),
                ("est_step_ns", c_uint64), ("free_mem", c_uint64),
                ("grant_id", c_uint64), ("grant_ptr", c_void_p), ("grant_bytes", c_uint64)]


class LendOptionsC(Structure):
    _fields_ = [("size", c_uint32), ("backend", c_uint32), ("bytes", c_uint64),
                ("device_ptr", c_uint64), ("device", c_int32), ("max_grants", c_uint32),
                ("alignment", c_uint64), ("auto_grant", c_uint32), ("reserved0_", c_uint32),
                ("clear_grants", c_uint32), ("reserved1_", c_uint32)]


class GrantInfoC(Structure):
    _fields_ = [("size", c_uint32), ("state", c_uint32), ("id", c_uint64),
                ("task_id", c_uint64), ("backend", c_uint32), ("mapped", c_uint32),
                ("bytes", c_uint64), ("offset", c_uint64), ("address", c_uint64),
                ("deadline_ns", c_uint64)]


class GrantStatsC(Structure):
    _fields_ = [("size", c_uint32), ("backend", c_uint32), ("capacity", c_uint64),
                ("granted_bytes", c_uint64), ("requested_bytes", c_uint64),
                ("free_bytes", c_uint64), ("largest_free", c_uint64),
                ("revoking_bytes", c_uint64), ("quarantined_bytes", c_uint64),
                ("active", c_uint32), ("revoking", c_uint32), ("quarantined", c_uint32),
                ("reserved0_", c_uint32), ("grants_made", c_uint64),
                ("grants_failed", c_uint64), ("revokes", c_uint64), ("revokes_acked", c_uint64),
                ("tasks_killed", c_uint64), ("released_dead", c_uint64)]


class TaskGrantC(Structure):
    _fields_ = [("size", c_uint32), ("backend", c_uint32), ("id", c_uint64),
                ("ptr", c_void_p), ("bytes", c_uint64), ("revoke_deadline_ns", c_uint64),
                ("device", c_int32), ("reserved", c_uint32)]


INIT_FN = CFUNCTYPE(c_int, c_void_p)
STEP_FN = CFUNCTYPE(c_int, c_void_p, POINTER(StepInfoC))
FINISH_FN = CFUNCTYPE(None, c_void_p, c_int)


class TaskCallbacks(Structure):
    _fields_ = [("size", c_uint32), ("reserved0_", c_uint32), ("user", c_void_p),
                ("init", INIT_FN), ("step", STEP_FN), ("pause", INIT_FN), ("resume", INIT_FN),
                ("finish", FINISH_FN), ("idle", INIT_FN)]


STRUCTS = {
    "bb_trainer_options_t": TrainerOptions, "bb_trainer_stats_t": TrainerStatsC,
    "bb_schedule_t": ScheduleC,
    "bb_task_info_t": TaskInfoC, "bb_task_options_t": TaskOptions,
    "bb_start_info_t": StartInfoC, "bb_step_info_t": StepInfoC,
    "bb_task_callbacks_t": TaskCallbacks, "bb_lend_options_t": LendOptionsC,
    "bb_grant_info_t": GrantInfoC, "bb_grant_stats_t": GrantStatsC,
    "bb_task_grant_t": TaskGrantC,
}

_trainer_h = c_void_p
_task_h = c_void_p

# name: (restype, argtypes)
_SIGNATURES = {
    "bb_status_name": (c_char_p, [c_int]),
    "bb_status_str": (c_char_p, [c_int]),
    "bb_last_error": (c_char_p, []),
    "bb_version": (c_char_p, []),
    "bb_now_ns": (c_uint64, []),
    "bb_trainer_options_init_sized": (None, [POINTER(TrainerOptions), c_size_t]),
    "bb_trainer_open": (c_int, [c_char_p, c_uint32, POINTER(TrainerOptions),
                                POINTER(_trainer_h)]),
    "bb_trainer_close": (c_int, [_trainer_h]),
    "bb_bubble_begin": (c_int, [_trainer_h, c_uint64, c_uint64, c_int]),
    "bb_bubble_end": (c_int, [_trainer_h]),
    "bb_trainer_iteration": (c_int, [_trainer_h]),
    "bb_schedule_init_sized": (None, [POINTER(ScheduleC), c_size_t]),
    "bb_trainer_set_schedule": (c_int, [_trainer_h, POINTER(ScheduleC)]),
    "bb_trainer_stats": (c_int, [_trainer_h, POINTER(TrainerStatsC)]),
    "bb_trainer_tasks": (c_int, [_trainer_h, POINTER(TaskInfoC), c_size_t, POINTER(c_size_t)]),
    "bb_trainer_stop_task": (c_int, [_trainer_h, c_uint64]),
    "bb_task_options_init_sized": (None, [POINTER(TaskOptions), c_size_t]),
    "bb_task_attach": (c_int, [c_char_p, c_uint32, c_char_p, POINTER(TaskOptions),
                               POINTER(_task_h)]),
    "bb_task_detach": (c_int, [_task_h]),
    "bb_task_wait_start": (c_int, [_task_h, c_int64, POINTER(StartInfoC)]),
    "bb_task_should_pause": (c_int, [_task_h]),
    "bb_task_ack_pause": (c_int, [_task_h]),
    "bb_task_report_step": (c_int, [_task_h, c_uint64]),
    "bb_task_time_left": (c_int, [_task_h, POINTER(c_uint64), POINTER(c_uint64)]),
    "bb_task_callbacks_init_sized": (None, [POINTER(TaskCallbacks), c_size_t]),
    "bb_task_run": (c_int, [_task_h, POINTER(TaskCallbacks)]),
    "bb_lend_options_init_sized": (None, [POINTER(LendOptionsC), c_size_t]),
    "bb_trainer_lend": (c_int, [_trainer_h, POINTER(LendOptionsC)]),
    "bb_trainer_grant": (c_int, [_trainer_h, c_uint64, c_uint64, POINTER(c_uint64)]),
    "bb_trainer_revoke": (c_int, [_trainer_h, c_uint64, c_uint64]),
    "bb_trainer_unlend": (c_int, [_trainer_h, c_uint64]),
    "bb_trainer_task_grant": (c_int, [_trainer_h, c_uint64, POINTER(GrantInfoC)]),
    "bb_trainer_grant_stats": (c_int, [_trainer_h, POINTER(GrantStatsC)]),
    "bb_trainer_read_grant": (c_int, [_trainer_h, c_uint64, c_uint64, c_void_p, c_uint64]),
    "bb_task_grant": (c_int, [_task_h, POINTER(TaskGrantC)]),
    "bb_task_ack_revoke": (c_int, [_task_h]),
}


def _candidates() -> list[str]:
    """Where to look, in order: $BUBBLE_LIBRARY, next to the package, the system loader."""
    env = os.environ.get("BUBBLE_LIBRARY")
    if env:
        # An explicit choice must not silently fall back to another copy of the library.
        return [env]
    here = Path(__file__).resolve().parent
    found = [str(p) for name in ("libbubble.so", "libbubble.so.0")
             for p in (here / name, here.parent / name) if p.exists()]
    system = ctypes.util.find_library("bubble")
    return found + [system or "libbubble.so.0", "libbubble.so"]


# Calls that never block are made holding the GIL (through ctypes.PyDLL). A call through
# ctypes.CDLL gives the GIL up and must take it back afterwards, which can wait a whole switch
# interval (5 ms) while another Python thread runs: too long for a bubble's begin or end. The
# rest (attach, waits, run, close, anything that may wait on the hub's service thread) give it
# up, so other Python threads run meanwhile.
HOLDS_GIL = frozenset({
    "bb_status_name", "bb_status_str", "bb_last_error", "bb_version", "bb_now_ns",
    "bb_trainer_options_init_sized", "bb_schedule_init_sized", "bb_task_options_init_sized",
    "bb_task_callbacks_init_sized", "bb_lend_options_init_sized", "bb_bubble_begin",
    "bb_bubble_end",
    "bb_trainer_iteration", "bb_task_should_pause", "bb_task_report_step", "bb_task_time_left",
})


def _load() -> ctypes.CDLL:
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            holding = ctypes.PyDLL(path)
            break
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    else:
        raise ImportError(
            "libbubble could not be loaded (" + "; ".join(errors) + "). Set BUBBLE_LIBRARY to "
            "the path of libbubble.so, copy it next to the bubble package, or install it where "
            "the system loader finds it.")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(holding if name in HOLDS_GIL else lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
        setattr(lib, name, fn)
    return lib


lib = _load()
path = lib._name
