"""The control-before-call invariant of ``docs/protocol.md``: a call runs only after every control message
(a cancel message, or one reserved for the verdict on a wedge) its controller sent to the process before it.

The Ray race itself is forced in ``test_pinned.py``
(``test_a_call_sent_after_a_cancel_runs_after_it_even_when_the_cancel_is_late``); these
tests pin the host half: the watermark, its waits on a thread and on a loop, and the
async host's call path.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncrl import Worker, register
from asyncrl._host import CallMsg, Payload, RoleSpec, WorkerHost
from asyncrl._lanes import ControlOrder
from tests.core.kinds import until


async def _true(value: bool) -> bool:
    return value


def test_the_watermark_counts_only_contiguous_messages():
    order = ControlOrder()
    order.done(0)  # an unnumbered message (the local backend's)
    assert order.seen == 0
    order.done(2)
    assert order.seen == 0  # message 1 is not handled yet
    order.done(1)
    assert order.seen == 2
    order.done(2)  # twice: a no-op
    order.done(4)
    order.done(3)
    assert order.seen == 4


def test_a_thread_waits_until_the_messages_before_its_call_were_handled():
    order = ControlOrder()
    woke: list[int] = []
    t = threading.Thread(target=lambda: (order.wait(2, timeout=60), woke.append(order.seen)))
    t.start()
    with order._cond:  # the waiter registered (the condition's wait releases the lock)
        assert order._cond.wait_for(lambda: order.waiting == 1, 60)
    order.done(1)
    assert woke == [] and order.waiting == 1  # still one short
    order.done(2)
    t.join(60)
    assert woke == [2] and order.waiting == 0


def test_a_wait_for_a_message_never_handled_ends_with_a_warning(capsys):
    order = ControlOrder()
    order.wait(1, timeout=0.01)  # (the real bound is CONTROL_WAIT: a process going away)
    assert order.waiting == 0
    assert "control.unseen" in capsys.readouterr().out


async def test_a_loop_waits_until_the_messages_before_its_call_were_handled():
    order = ControlOrder()
    waiter = asyncio.ensure_future(order.wait_async(1, timeout=60))
    await until(lambda: _true(order.waiting == 1), 60)  # the waiter registered
    assert not waiter.done()
    threading.Thread(target=order.done, args=(1,)).start()  # the message may be handled on another thread
    await asyncio.wait_for(waiter, 60)
    assert order.waiting == 0 and order._waiters == []
    await order.wait_async(1, timeout=60)  # caught up: returns at once


class Recorder(Worker):
    def __init__(self) -> None:
        self.log: list[int] = []

    @register()
    async def record(self, x: int) -> int:
        self.log.append(x)
        return x


async def test_the_async_host_refuses_a_call_cancelled_by_a_message_sent_before_a_later_one():
    """On the async host: call #0 was cancelled by message 1; call #1, sent after that
    message, arrives first. It waits for message 1, so #0 (arriving after) is refused
    and #1 runs in its turn."""
    host = WorkerHost(local=True)
    await host.init_workers([RoleSpec(role="r", group="g", cls=Recorder)])
    msg = CallMsg("r", "record", 1, 11, Payload((2,), {}), None, False, True, after=1)
    later = asyncio.ensure_future(host.call(msg))
    await until(lambda: _true(host.control_state()["waiting"] == 1), 60)  # it waits for message 1
    assert host.control_state() == {"seen": 0, "waiting": 1}
    host.cancel_calls([(10, 0)], False, note=1)
    assert await asyncio.wait_for(later, 60) == 2
    with pytest.raises(asyncio.CancelledError):
        await host.call(CallMsg("r", "record", 0, 10, Payload((1,), {}), None, False, True, after=0))
    assert host._workers["r"].log == [2]
    assert host.control_state() == {"seen": 1, "waiting": 0}
    await host.close()
