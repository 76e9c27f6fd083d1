"""P2PBubbles (bubble.torch_hooks) against the real torch.distributed: what it wraps while
installed, and what it leaves behind."""
from __future__ import annotations

import pytest

import bubble

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
c10d = pytest.importorskip("torch.distributed.distributed_c10d")

from bubble.torch_hooks import P2PBubbles  # noqa: E402  (needs torch)


def originals():
    return dist.recv, dist.irecv, dist.P2POp


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
