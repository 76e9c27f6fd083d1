"""P2PBubbles (bubble.torch_hooks) against the real torch.distributed: what it wraps while
installed, and what it leaves behind."""
from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap

import pytest

import bubble

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
c10d = pytest.importorskip("torch.distributed.distributed_c10d")

from bubble.adapters import PipelineSchedule  # noqa: E402
from bubble.torch_hooks import P2PBubbles  # noqa: E402  (needs torch)


def originals():
    return dist.recv, dist.irecv, dist.P2POp, dist.batch_isend_irecv


def test_a_batched_receive_can_be_made_of_the_wrapped_irecv(job):
    """Megatron and torch.distributed.pipelining build batched receives as
    P2POp(dist.irecv, ...), and torch accepts only its own irecv there: the op made while the
    hooks are installed carries torch's own function."""
    before = originals()
    with bubble.Trainer(job, 0) as trainer, P2PBubbles(trainer):
        assert dist.irecv is not before[1]  # installed
        t = torch.zeros(2)
        for op in (dist.P2POp(dist.irecv, t, 0), dist.P2POp(op=dist.irecv, tensor=t, peer=0),
                   dist.P2POp(dist.isend, t, 0)):
            assert op.op in (c10d.irecv, c10d.isend)
            assert isinstance(op, c10d.P2POp)
            assert op.tensor is t and op.peer == 0
        assert dist.P2POp(dist.irecv, t, 0).op is c10d.irecv
        with pytest.raises((RuntimeError, ValueError)):  # torch's own check still applies
            dist.P2POp(dist.recv, t, 0)
    assert originals() == before


def test_instances_uninstalled_out_of_order_leave_torchs_own_functions(job):
    before = originals()
    with bubble.Trainer(job, 0) as ta, bubble.Trainer(job, 1) as tb:
        a, b = P2PBubbles(ta), P2PBubbles(tb)
        a.install()
        b.install()
        a.uninstall()  # b's wrappers stay on top, and pass a's (now inert) by
        assert dist.irecv is not before[1]
        b.uninstall()
        assert originals() == before
        # In order, as context managers nest, too.
        with a, b:
            pass
        assert originals() == before


class _PendingWork:
    """A receive's Work whose data has not come yet; wait() returns its result."""

    def is_completed(self) -> bool:
        return False

    def wait(self, *args, **kwargs):
        return "received"


def test_a_trainer_closed_under_the_hooks_never_breaks_a_receive(job):
    """A SIGTERM handler may close the trainer while training goes on; the wrapped receive
    still returns its result, and the refused reports are counted instead of raised."""
    trainer = bubble.Trainer(job, 0)
    hooks = P2PBubbles(trainer)
    assert hooks._wait(_PendingWork()) == "received"
    assert (hooks.bubbles, hooks.report_errors) == (1, 0)
    trainer.close()
    assert hooks._wait(_PendingWork()) == "received"
    hooks.iteration()
    assert hooks.bubbles == 1
    assert hooks.report_errors == 2  # the begin (no end for a bubble never begun), the mark
    assert isinstance(hooks.last_report_error, ValueError)


def test_a_newer_torchs_receive_arguments_are_passed_on(job, monkeypatch):
    """torch 2.6 added group_src to recv and irecv: the wrappers pass such arguments on as
    given and still report the receive (here over stand-ins with that signature, as Debian's
    torch 1.13 has none)."""
    calls = []

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        calls.append(("recv", src, group_src))
        return 7

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        calls.append(("irecv", src, group_src))
        return _PendingWork()

    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(dist, "irecv", irecv)
    with bubble.Trainer(job, 0) as trainer, P2PBubbles(trainer) as hooks:
        t = torch.zeros(1)
        assert dist.recv(t, group_src=1) == 7
        assert dist.irecv(t, group_src=1).wait() == "received"
        assert dist.recv(t, 1) == 1  # the torch 1.13 form, through irecv as before
        assert calls == [("recv", None, 1), ("irecv", None, 1), ("irecv", 1, None)]
        assert (hooks.bubbles, hooks.report_errors) == (3, 0)
    assert (dist.recv, dist.irecv) == (recv, irecv)


_SENDER = textwrap.dedent("""
    import datetime, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dist.send(torch.tensor([1.0, 2.0]), dst=1)       # batch 1: a receive alone
    buf = torch.zeros(2)
    dist.recv(buf, src=1)                            # batch 2: a send and two receives
    dist.send(buf * 2, dst=1)
    dist.send(buf * 3, dst=1)
    dist.recv(buf, src=1)                            # batch 3: a send alone
    ok = buf.tolist() == [5.0, 6.0]
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)
""")


def test_a_batched_receive_is_one_bubble_of_the_published_schedule(job, tmp_path):
    """Real batch_isend_irecv over gloo, with a stage of another process: a batch with a
    receive is one bubble of the published schedule, at its receive's wait (torch returns one
    Work per op here; the send's wait is none), and a batch of sends only is none. The data
    come through the wrapped Works unchanged, and uninstall puts torch's function back."""
    store = f"file://{tmp_path}/store"
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, store])
    try:
        dist.init_process_group("gloo", init_method=store, rank=1, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        try:
            before = originals()
            schedule = PipelineSchedule(stages=2, stage=1, micro_batches=2)
            with bubble.Trainer(job, 0) as trainer, \
                    P2PBubbles(trainer, schedule=schedule) as hooks:
                assert hooks.published
                got = torch.zeros(2)
                works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 0)])
                for w in works:
                    w.wait()
                assert got.tolist() == [1.0, 2.0]
                assert hooks.bubbles == 1

                back, back2 = torch.zeros(2), torch.zeros(2)
                works = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, torch.tensor([3.0, 4.0]), 0),
                    dist.P2POp(dist.irecv, back, 0), dist.P2POp(dist.irecv, back2, 0)])
                assert len(works) == 3
                works[0].wait()  # the send's, first as Megatron waits: no bubble
                assert hooks.bubbles == 1
                works[1].wait()  # the first receive's: the batch's bubble
                assert hooks.bubbles == 2
                works[2].wait()  # the second receive's: the batch had its one
                assert hooks.bubbles == 2
                assert (back.tolist(), back2.tolist()) == ([6.0, 8.0], [9.0, 12.0])

                sends = [dist.P2POp(dist.isend, torch.tensor([5.0, 6.0]), 0)]
                works = dist.batch_isend_irecv(sends)
                for w in works:
                    w.wait()
                assert hooks.bubbles == 2
                assert hooks.report_errors == 0
            assert originals() == before
        finally:
            dist.destroy_process_group()
        assert sender.wait(timeout=60) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
