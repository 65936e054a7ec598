"""The CPU engine-wait plugin: vLLM's shared-memory queue readers sleep instead of spinning, a reader that
just read and whose notification was lost finds the data within RECHECK_MS (vLLM itself re-checks every
5 s), and an idle reader does not poll."""

from __future__ import annotations

import time

import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path

from art_ray.serving import cpu_engine_wait


def test_a_reader_sleeps_at_once_and_rechecks_within_the_bound() -> None:
    cpu_engine_wait.register()
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        assert reader.busy_loop_s == 0  # no sched_yield loop on the cores the worker computes on
        reader.record_read()
        # no notification comes (as when the publisher dropped it): the reader is back to re-check the
        # shared flag within the bound, not after vLLM's 5 s
        start = time.monotonic()
        reader.wait(timeout_ms=5000)
        assert time.monotonic() - start < 0.5
        # a reader idle for longer sleeps as long as vLLM asks (a paused engine does not poll)
        reader.last_read = time.monotonic() - 2 * cpu_engine_wait.RECHECK_AFTER_READ_S
        start = time.monotonic()
        reader.wait(timeout_ms=300)
        assert time.monotonic() - start >= 0.25
    finally:
        for condition in (writer, reader):
            condition.local_notify_socket.close(linger=0)
        reader.read_cancel_socket.close(linger=0)
        reader.write_cancel_socket.close(linger=0)
        context.term()
