from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bubble
from bubble._lib import lib


def test_status_enum_matches_the_library_names():
    for status in bubble.Status:
        assert lib.bb_status_name(int(status)).decode() == f"BB_{status.name}"
        assert status.description


def test_attach_without_a_trainer_raises_hub_not_found_with_the_library_message(job):
    with pytest.raises(bubble.HubNotFound) as info:
        bubble.Task(job, 0, "orphan")
    assert info.value.status is bubble.Status.E_NOT_FOUND
    assert info.value.message
    assert "BB_E_NOT_FOUND" in str(info.value)
    assert isinstance(info.value, bubble.BubbleError)


def test_a_second_trainer_on_one_hub_raises_busy(job):
    with bubble.Trainer(job, 0):
        with pytest.raises(bubble.Busy) as info:
            bubble.Trainer(job, 0)
        assert info.value.message


def test_a_bad_job_id_raises_invalid_argument():
    with pytest.raises(bubble.InvalidArgument):
        bubble.Trainer("spaces are not allowed", 0)
    with pytest.raises(ValueError):  # InvalidArgument is also a ValueError
        bubble.Trainer("", 0)


def test_a_closed_trainer_refuses_calls_and_closing_twice_is_fine(job):
    t = bubble.Trainer(job, 0)
    t.close()
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.bubble_begin()


def test_a_missing_library_is_an_import_error_that_says_what_to_do():
    env = dict(os.environ, BUBBLE_LIBRARY="/nonexistent/libbubble.so")
    out = subprocess.run([sys.executable, "-c", "import bubble"], env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "BUBBLE_LIBRARY" in out.stderr


def test_library_version_and_clock():
    # The version the project declares (the top CMakeLists.txt) is the one the library reports.
    top = Path(__file__).resolve().parents[3] / "CMakeLists.txt"
    declared = re.search(r"project\(libbubble VERSION ([0-9.]+)", top.read_text()).group(1)
    assert bubble.library_version() == declared
    a = bubble.now_ns()
    assert bubble.now_ns() >= a > 0


def test_a_status_newer_than_the_binding_keeps_its_number():
    from bubble.errors import error_for
    err = error_for(-99, "something new went wrong")
    assert isinstance(err, bubble.BubbleError)
    assert err.status is bubble.Status.E_SYSTEM
    assert err.raw_status == -99
    assert "-99" in str(err) and "something new went wrong" in str(err)
    assert error_for(int(bubble.Status.E_BUSY), "taken").raw_status == int(bubble.Status.E_BUSY)
