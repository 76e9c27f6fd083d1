#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_control_frame: one input per request type (and a few
streams), each a valid frame encoded from its text form with `capnp encode`.

    python3 tests/fuzz/gen_control_corpus.py      # rewrites tests/fuzz/corpus/fuzz_control_frame/

An input is one byte (bit 0: the fuzzer prepends a valid hello) and then the client's stream.
"""
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCHEMA = os.path.join(ROOT, "schema", "agent.capnp")
OUT = os.path.join(HERE, "corpus", "fuzz_control_frame")

REQUESTS = {
    "submit": '(id = 2, submit = (name = "pagerank", argv = ["/bin/true", "--epochs", "3"], '
              'env = ["A=1", "B=two"], cwd = "/tmp", hub = "auto", gpu = -1, priority = 5, '
              'memNeed = 1048576, mpsPriority = 1, mpsMemLimit = "0=2G"))',
    "submit-hub": '(id = 3, submit = (argv = ["./task"], hub = "job:0"))',
    "list": "(id = 4, list = (all = true))",
    "status": "(id = 5, status = void)",
    "cancel": "(id = 6, cancel = 1)",
    "drain": '(id = 7, drain = (hub = "job:0", undo = false))',
    "undrain": '(id = 8, drain = (hub = "", undo = true))',
    "logs": "(id = 9, logs = (task = 1, stderr = true, maxBytes = 4096))",
    "events": "(id = 10, events = (seconds = 5))",
    "actions": "(id = 11, actions = 20)",
}
HELLO = '(id = 1, hello = (protocolVersion = 1, client = "bubblectl"))'
HELLO_V2 = '(id = 1, hello = (protocolVersion = 2, client = "future"))'


def frame(text):
    body = subprocess.run(["capnp", "encode", "-I/usr/include", SCHEMA, "Request"],
                          input=text.encode(), capture_output=True, check=True).stdout
    return struct.pack("<I", len(body)) + body


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        os.unlink(os.path.join(OUT, f))
    seeds = {}
    for name, text in REQUESTS.items():
        seeds[name] = b"\x01" + frame(text)  # after the fuzzer's hello
    # Whole streams, hello included: a session, a wrong version, a request before hello.
    seeds["stream-session"] = (b"\x00" + frame(HELLO) + frame(REQUESTS["submit"]) +
                               frame(REQUESTS["list"]) + frame(REQUESTS["cancel"]) +
                               frame(REQUESTS["logs"]))
    seeds["stream-bad-version"] = b"\x00" + frame(HELLO_V2)
    seeds["stream-no-hello"] = b"\x00" + frame(REQUESTS["status"])
    seeds["stream-truncated"] = b"\x01" + frame(REQUESTS["submit"])[:-5]
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} inputs to {OUT}")


if __name__ == "__main__":
    sys.exit(main())
