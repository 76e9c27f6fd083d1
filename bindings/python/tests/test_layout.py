"""The ctypes structs must match bubble.h exactly; a C compiler tells us what exactly is."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bubble import _lib

HEADER_DIR = Path(__file__).resolve().parents[3] / "capi" / "include"


def c_layout(tmp_path) -> dict[str, int]:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to compute the header's layout")
    lines = []
    for cname, cls in _lib.STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof({cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof({cname}, {field}));')
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <bubble/bubble.h>\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{HEADER_DIR}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_structs_match_the_header(tmp_path):
    expected = c_layout(tmp_path)
    for cname, cls in _lib.STRUCTS.items():
        assert ctypes.sizeof(cls) == expected[cname], cname
        for field, *_ in cls._fields_:
            assert getattr(cls, field).offset == expected[f"{cname}.{field}"], f"{cname}.{field}"


def test_every_function_of_the_header_is_declared():
    header = (HEADER_DIR / "bubble" / "bubble.h").read_text()
    declared = set(re.findall(r"BB_API\b[^;(]*?\b(bb_\w+)\s*\(", header))
    assert declared, "no BB_API function found in bubble.h"
    assert declared == set(_lib._SIGNATURES), (
        f"missing in _lib._SIGNATURES: {sorted(declared - set(_lib._SIGNATURES))}; "
        f"not in bubble.h: {sorted(set(_lib._SIGNATURES) - declared)}")


def test_constants_match_the_header(tmp_path):
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to read the header's constants")
    mine = {"BB_STEP_CONTINUE": _lib.STEP_CONTINUE, "BB_STEP_DONE": _lib.STEP_DONE,
            "BB_TASK_IDLE_NS": _lib.TASK_IDLE_NS, "BB_NAME_MAX": _lib.BB_NAME_MAX,
            "BB_MAX_SLOTS_LIMIT": _lib.BB_MAX_SLOTS_LIMIT, "BB_MEM_UNKNOWN": _lib.MEM_UNKNOWN}
    src = tmp_path / "constants.c"
    src.write_text("#include <stdio.h>\n#include <bubble/bubble.h>\nint main(void) {\n" +
                   "\n".join(f'printf("{n} %llu\\n", (unsigned long long)({n}));' for n in mine) +
                   "\nreturn 0;\n}\n")
    exe = tmp_path / "constants"
    subprocess.run([cc, f"-I{HEADER_DIR}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    header = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    assert header == mine
