"""The p2p courier runs calls on one background thread in submission order, hands back their
results and errors, and a call that never finishes raises after the timeout."""

from __future__ import annotations

import datetime
import threading

import pytest

from hpctrain.distributed.comm import Courier

SHORT = datetime.timedelta(seconds=0.2)


def test_calls_run_in_order_off_the_caller_thread():
    courier = Courier(timeout=datetime.timedelta(seconds=10))
    seen: list[tuple[int, str]] = []
    jobs = [courier.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
            for i in range(50)]
    assert [courier.result(j, what="a test call") for j in jobs] == list(range(50))
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"hpctrain-p2p"}
    courier.close()


def test_error_reaches_the_caller_and_the_thread_survives():
    courier = Courier(timeout=datetime.timedelta(seconds=10))
    bad = courier.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        courier.result(bad, what="a failing call")
    assert courier.result(courier.submit(lambda: 7), what="the next call") == 7
    courier.close()


def test_stuck_call_raises_after_the_timeout():
    courier, release = Courier(timeout=SHORT), threading.Event()
    stuck = courier.submit(lambda: release.wait(5))
    with pytest.raises(RuntimeError, match="courier did not issue a stuck call within"):
        courier.result(stuck, what="a stuck call")
    release.set()
    courier.close()
