"""The actor runtime: typed mailboxes, ask/tell in one loop and across processes, timeouts,
supervision of handlers and of child processes, tensors as raw frames, trace records."""
from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import msgspec
import numpy as np
import pytest
import torch

from actors.runtime import (ActorDied, AskTimeout, MailboxFull, MessageRejected, Node, RemoteError)
from actors.runtime.faults import Faults, InjectFault
from actors.runtime.errors import ChildStartError
from actors.runtime.child import EXIT_GRACE_S
from actors.runtime.process import NodeSpec, decode_info, start_child, system_actor
from actors.runtime.system import SYSTEM_ACTOR, GetTelemetry, Shutdown
from actors.runtime.tracing import to_chrome_trace
from helpers import run_async
from runtime_fixtures import (Arrays, Count, Crash, Echo, EchoActor, Echoed, Sleep, Unrelated)
from transport.codec import Codec, Header
from transport.zmq_channel import ZmqTransport, endpoint


# -- in one event loop -------------------------------------------------------------------------

def test_local_tell_then_ask_sees_messages_in_order():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        for _ in range(5):
            ref.tell(Count())
        reply = await ref.ask(Echo("hi"), timeout=5)
        await node.stop()
        return reply
    assert run_async(main()) == Echoed("hi", 5)


def test_local_message_outside_protocol_is_rejected_with_clear_error():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        with pytest.raises(MessageRejected) as err:
            ref.tell(Unrelated(1))
        with pytest.raises(MessageRejected):
            await ref.ask(Unrelated(1))
        await node.stop()
        return str(err.value)
    text = run_async(main())
    assert "Unrelated" in text and "echo" in text and "Echo" in text


def test_local_ask_times_out():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        t0 = time.monotonic()
        with pytest.raises(AskTimeout, match="Sleep"):
            await ref.ask(Sleep(2.0), timeout=0.2)
        elapsed = time.monotonic() - t0
        await node.stop()
        return elapsed
    assert run_async(main()) < 1.0


def test_crashing_handler_is_reported_with_actor_and_message_and_actor_resumes():
    async def main():
        node = Node("n")
        failures = []
        node.failure_listeners.append(failures.append)
        ref = node.spawn("echo", EchoActor)
        ref.tell(Count())
        with pytest.raises(RemoteError) as err:
            await ref.ask(Crash("boom"))
        ref.tell(Crash("told, not asked"))
        reply = await ref.ask(Echo("after"))
        await node.stop()
        return err.value, failures, reply
    err, failures, reply = run_async(main())
    assert err.actor == "echo" and err.message_type == "Crash" and err.error_type == "ValueError"
    assert "boom" in err.remote_traceback
    assert [(f.actor, f.message_type, str(f.error)) for f in failures] == [
        ("echo", "Crash", "boom"), ("echo", "Crash", "told, not asked")]
    assert reply == Echoed("after", 1)  # state kept: the default policy resumes


def test_system_lane_is_served_before_queued_user_messages():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        ref.tell(Sleep(0.2))
        await asyncio.sleep(0.05)  # the Sleep is being handled; the rest queue behind it
        for _ in range(100):
            ref.tell(Count())
        from actors.runtime import Ping
        pong = await ref.ask(Ping(), timeout=5)
        await node.stop()
        return pong
    pong = run_async(main())
    assert pong.handled == 1 and pong.mailbox_depth == 100


def test_a_full_user_lane_refuses_at_once_and_the_system_lane_still_gets_through():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        node.cells["echo"].mailbox.capacity = 3
        ref.tell(Sleep(0.2))
        await asyncio.sleep(0.05)  # the Sleep is being handled; the rest queue behind it
        for _ in range(3):
            ref.tell(Count())
        with pytest.raises(MailboxFull, match="3 messages"):
            ref.tell(Count())
        from actors.runtime import Ping
        pong = await ref.ask(Ping(), timeout=5)
        await node.stop()
        return pong
    assert run_async(main()).mailbox_depth == 3


def test_trace_records_one_span_per_handled_message_and_export_to_chrome_trace():
    async def main():
        node = Node("n")
        ref = node.spawn("echo", EchoActor)
        ref.tell(Count())
        await ref.ask(Echo("x"))
        _, records = node.tracer.snapshot()
        await node.stop()
        return records
    records = run_async(main())
    kinds = [(r.actor, r.msg_type, r.status) for r in records]
    assert ("echo", "Count", "ok") in kinds and ("echo", "Echo", "ok") in kinds
    assert all(r.enqueue_ns <= r.start_ns <= r.end_ns for r in records)
    trace = to_chrome_trace(records)
    assert any(e["ph"] == "X" and e["name"] == "Echo" for e in trace["traceEvents"])


# -- the wire ----------------------------------------------------------------------------------

def test_large_arrays_travel_as_zero_copy_frames_small_ones_inline():
    codec = Codec()
    big = np.arange(100_000, dtype=np.float32)
    msg = Arrays(big, torch.ones(3, 4, dtype=torch.bfloat16), np.arange(4))
    frames = codec.encode(Header(0, "a", "n", "", 1, 0, "Arrays", 0, 0), msg)
    assert len(frames) == 3  # header, body, one raw frame for the big array
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.float32), big)
    assert len(frames[1]) < 1000  # nothing big was inlined in the body
    back = codec.decode(Arrays, [frames[1], bytes(frames[2])])
    assert np.array_equal(back.array, big) and back.tensor.dtype == torch.bfloat16
    assert torch.equal(back.tensor, msg.tensor) and np.array_equal(back.small, np.arange(4))


# -- across processes --------------------------------------------------------------------------

async def _parent_with_child(env, entry: str = "runtime_fixtures:echo_entry", **heartbeat):
    ipc_dir = tempfile.mkdtemp(prefix="troupe-test-")
    node = Node("parent", ZmqTransport(endpoint(ipc_dir, "parent")))
    system_actor(node)
    spec = NodeSpec("child", entry, b"cfg", ipc_dir, "parent",
                    {"parent": endpoint(ipc_dir, "parent")}, **heartbeat)
    child, ready = await start_child(node, spec, ready_timeout=60, env=env)
    return node, child, ready


def test_cross_process_ask_tell_and_arrays(child_env):
    async def main():
        node, child, ready = await _parent_with_child(child_env)
        try:
            ref = node.ref("echo", "child")
            for _ in range(3):
                ref.tell(Count())
            echoed = await ref.ask(Echo("remote"), timeout=10)
            big = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
            t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            arrays = await ref.ask(Arrays(big, t, np.arange(3)), timeout=10)
            chunk = await node.ref("_system", "child").ask(GetTelemetry(), timeout=10)
            return decode_info(ready, dict), echoed, arrays, big, t, chunk
        finally:
            await child.stop()
            await node.stop()
    info, echoed, arrays, big, t, chunk = run_async(main())
    assert info == {"config": "cfg"}
    assert echoed == Echoed("remote", 3)
    assert np.array_equal(arrays.array, big * 2) and torch.equal(arrays.tensor, t + 1)
    assert {"Count", "Echo", "Arrays"} <= {r.msg_type for r in chunk.spans}
    assert {r.sender for r in chunk.spans if r.msg_type == "Echo"} == {"parent/"}    # sent from outside any actor
    assert chunk.node == "child" and chunk.pid != os.getpid() and chunk.cursor.spans >= 3


def _stop(child_env, entry: str) -> tuple[int, float]:
    """A child running ``entry`` stopped: its exit code, and the seconds its stop took."""
    async def main():
        node, child, _ = await _parent_with_child(child_env, entry)
        try:
            t0 = time.monotonic()
            code = await child.stop(timeout=EXIT_GRACE_S + 25.0)
            return code, time.monotonic() - t0
        finally:
            await node.stop()
    return run_async(main())


def test_a_stopped_child_exits_although_one_of_its_threads_never_ends(child_env):
    """Its node stops, its threads get a grace period, and the process exits on its own with its
    code: neither killed by its parent after the stop timeout nor left behind as an orphan."""
    code, seconds = _stop(child_env, "runtime_fixtures:stuck_thread_entry")
    assert code == 0 and seconds < EXIT_GRACE_S + 20.0


def test_a_stopped_child_with_an_idle_thread_pool_exits_without_waiting_out_the_grace(child_env):
    """A pool's idle workers are told to end as the process exits (as the interpreter's exit tells
    them), so a child with one exits at once instead of after the threads' grace period."""
    code, seconds = _stop(child_env, "runtime_fixtures:idle_pool_entry")
    assert code == 0 and seconds < EXIT_GRACE_S


def test_a_child_that_fails_to_start_fails_its_start_with_the_reason(child_env):
    async def main():
        ipc_dir = tempfile.mkdtemp(prefix="troupe-test-")
        node = Node("parent", ZmqTransport(endpoint(ipc_dir, "parent")))
        system_actor(node)
        spec = NodeSpec("child", "runtime_fixtures:failing_entry", b"port 1", ipc_dir, "parent",
                        {"parent": endpoint(ipc_dir, "parent")})
        try:
            with pytest.raises(ChildStartError) as err:
                await start_child(node, spec, ready_timeout=60, env=child_env)
            return str(err.value)
        finally:
            await node.stop()
    message = run_async(main())
    assert "process 'child'" in message and "failed to start: ValueError: cannot start with port 1" in message


def test_a_child_whose_node_is_shut_down_while_its_entry_still_runs_exits_at_once(child_env):
    """Its node closing (its parent dying, a Shutdown, a second SIGTERM) ends an entry still at
    work (a model loading, an engine core waiting for other machines): the process does not wait
    for the entry to finish first."""
    async def main():
        ipc_dir = tempfile.mkdtemp(prefix="troupe-test-")
        node = Node("parent", ZmqTransport(endpoint(ipc_dir, "parent")))
        system_actor(node)
        spec = NodeSpec("child", "runtime_fixtures:endless_entry", b"cfg", ipc_dir, "parent",
                        {"parent": endpoint(ipc_dir, "parent")})
        try:
            starting = asyncio.ensure_future(start_child(node, spec, ready_timeout=120, env=child_env))
            await asyncio.sleep(3.0)                 # the child is running its entry
            t0 = time.monotonic()
            node.ref(SYSTEM_ACTOR, "child").tell(Shutdown(reason="stop while starting"))
            with pytest.raises(ChildStartError) as err:
                await asyncio.wait_for(starting, 60)
            return str(err.value), time.monotonic() - t0
        finally:
            await node.stop()
    message, seconds = run_async(main())
    assert "exited with code 0 before it was ready" in message and seconds < 30


def test_an_ask_reaching_a_stopping_node_whose_actor_is_gone_fails_as_its_death_not_as_a_rejection():
    """A worker whose machine died stops its actors before its process ends: a step that reaches it
    then is answered as the worker's death (recomputed on the replacement), while a node that is
    not stopping still rejects a message to an actor it never had."""
    async def main():
        ipc_dir = tempfile.mkdtemp(prefix="troupe-test-")
        a = Node("a", ZmqTransport(endpoint(ipc_dir, "a")))
        b = Node("b", ZmqTransport(endpoint(ipc_dir, "b")))
        a.connect("b", endpoint(ipc_dir, "b"))
        b.connect("a", endpoint(ipc_dir, "a"))
        try:
            with pytest.raises(MessageRejected, match="no actor named 'echo'"):
                await a.ref("echo", "b").ask(Echo("x"), timeout=10)
            b.stopping = True                      # as node.stop() is under way
            with pytest.raises(ActorDied, match="stopped with node 'b'"):
                await a.ref("echo", "b").ask(Echo("x"), timeout=10)
        finally:
            await a.stop()
            await b.stop()
    run_async(main())


def test_cross_process_wrong_type_rejected_and_remote_error_raised(child_env):
    async def main():
        node, child, _ = await _parent_with_child(child_env)
        try:
            untyped = node.ref("echo", "child")              # the receiver's decoder refuses
            with pytest.raises(MessageRejected, match="Unrelated"):
                await untyped.ask(Unrelated(3), timeout=10)
            from runtime_fixtures import EchoProtocol
            typed = node.ref("echo", "child", protocol=EchoProtocol)  # refused before sending
            with pytest.raises(MessageRejected, match="accepts"):
                typed.tell(Unrelated(3))
            with pytest.raises(RemoteError) as err:
                await untyped.ask(Crash("remote boom"), timeout=10)
            with pytest.raises(AskTimeout):
                await untyped.ask(Sleep(3), timeout=0.3)
            return err.value
        finally:
            await child.stop()
            await node.stop()
    err = run_async(main())
    assert err.actor == "echo" and "remote boom" in err.remote_traceback


def test_dead_child_process_detected_within_a_second(child_env):
    async def main():
        node, child, _ = await _parent_with_child(child_env)
        try:
            ref = node.ref("echo", "child")
            asking = asyncio.ensure_future(ref.ask(Sleep(30), timeout=60))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            with pytest.raises(ActorDied, match="SIGKILL"):
                await asking
            detected = time.monotonic() - t0
            with pytest.raises(ActorDied):
                ref.tell(Count())
            return detected, child.returncode
        finally:
            await node.stop()
    detected, rc = run_async(main())
    assert detected < 1.0 and rc == -signal.SIGKILL


FAST_HEARTBEAT = dict(heartbeat_s=0.2, hung_after_s=2.0)


def test_a_long_busy_step_is_not_a_hang_but_a_stalled_idle_child_is_killed(child_env):
    """The heartbeat comes from a thread of the child: a step that holds the event loop for
    twice the hang limit while computing is left alone; a loop stuck without using CPU is
    killed once the limit passes."""
    async def main():
        env = {**child_env, "TROUPE_FAULT_INJECTION": "1"}
        node, child, _ = await _parent_with_child(env, **FAST_HEARTBEAT)
        try:
            system = node.ref("_system", "child")
            await system.ask(InjectFault("stall", seconds=4.0, busy=True), timeout=30)
            survived = child.returncode is None and await node.ref("echo", "child").ask(Echo("x"), timeout=10)
            t0 = time.monotonic()
            with pytest.raises(ActorDied):
                await system.ask(InjectFault("stall", seconds=30.0, busy=False), timeout=60)
            return survived, time.monotonic() - t0, child.returncode
        finally:
            await child.stop()
            await node.stop()
    survived, killed_after, rc = run_async(main())
    assert survived == Echoed("x", 0)
    assert 2.0 <= killed_after < 5.0 and rc == -signal.SIGKILL


def test_injected_faults_raise_in_a_handler_drop_frames_and_kill_a_process(child_env):
    async def main():
        env = {**child_env, "TROUPE_FAULT_INJECTION": "1"}
        node, child, _ = await _parent_with_child(env)
        try:
            system, echo = node.ref("_system", "child"), node.ref("echo", "child")
            assert await system.ask(InjectFault("raise", actor="echo", message_type="Echo"), timeout=10)
            with pytest.raises(RemoteError, match="injected fault: echo handling Echo"):
                await echo.ask(Echo("a"), timeout=10)
            after_raise = await echo.ask(Echo("b"), timeout=10)          # the actor resumed
            assert await system.ask(InjectFault("drop", count=1), timeout=10)
            with pytest.raises(AskTimeout):                              # its reply is lost
                await echo.ask(Echo("c"), timeout=1.0)
            after_drop = await echo.ask(Echo("d"), timeout=10)
            assert not await system.ask(InjectFault("kill", node="nowhere"), timeout=10)
            with pytest.raises(ActorDied):
                await system.ask(InjectFault("kill"), timeout=10)
            await asyncio.wait_for(child.exited, 10)
            return after_raise, after_drop, child.returncode
        finally:
            await child.stop()
            await node.stop()
    after_raise, after_drop, rc = run_async(main())
    assert after_raise == Echoed("b", 0) and after_drop == Echoed("d", 0) and rc == -signal.SIGKILL


def test_fault_injection_is_refused_unless_enabled(child_env):
    async def main():
        node, child, _ = await _parent_with_child(child_env)
        try:
            with pytest.raises(RemoteError, match="fault injection is off"):
                await node.ref("_system", "child").ask(InjectFault("kill"), timeout=10)
            return child.returncode
        finally:
            await child.stop()
            await node.stop()
    assert run_async(main()) is None


def test_child_exits_when_parent_dies(child_env, tmp_path):
    """A parent process that is SIGKILLed leaves no child behind (death pipe)."""
    import subprocess
    import sys
    script = tmp_path / "parent.py"
    here = os.path.dirname(os.path.abspath(__file__))
    tests_dir = os.path.dirname(here)
    root = os.path.dirname(tests_dir)
    script.write_text(
        "import asyncio, sys, uvloop\n"
        f"sys.path[:0] = {[root, tests_dir, here]!r}\n"
        "from test_runtime import _parent_with_child\n"
        "async def main():\n"
        "    node, child, _ = await _parent_with_child(None)\n"
        "    print(child.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "uvloop.run(main())\n")
    env = {**os.environ, **child_env}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, cwd=root)
    try:
        child_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            try:  # reap if it was reparented to us (it is not our child, so this may fail)
                os.waitpid(child_pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.05)
        else:
            os.kill(child_pid, signal.SIGKILL)
            pytest.fail("child outlived its parent by more than 5 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_restart_policy_gives_a_fresh_actor_and_escalates_past_the_intensity_limit():
    from runtime_fixtures import Restarting

    async def main():
        node = Node("n", max_restarts=2, restart_window_s=60)
        ref = node.spawn("r", Restarting)
        ref.tell(Count())
        ref.tell(Count())
        with pytest.raises(RemoteError):
            await ref.ask(Crash("first"))
        fresh = await ref.ask(Echo("after restart"))      # state was reset by the restart
        with pytest.raises(RemoteError):
            await ref.ask(Crash("second"))
        assert not node.closed.done()
        with pytest.raises(RemoteError):
            await ref.ask(Crash("third"))                 # a third restart within the window
        code = await asyncio.wait_for(node.closed, 5)
        await node.stop()
        return fresh, code
    fresh, code = run_async(main())
    assert fresh == Echoed("after restart", 0) and code == 1


def test_escalating_actor_stops_its_node_with_nonzero_code():
    from runtime_fixtures import Escalating

    async def main():
        node = Node("n")
        ref = node.spawn("e", Escalating)
        ref.tell(Crash("fatal"))
        code = await asyncio.wait_for(node.closed, 5)
        await node.stop()
        return code
    assert run_async(main()) == 1


def test_a_drop_armed_for_one_message_type_loses_only_its_frames():
    faults = Faults()
    faults.arm(InjectFault("drop", message_type="ModelRunnerOutput", count=2))
    faults.arm(InjectFault("drop", count=1))
    assert [faults.take_drop(t) for t in ("TraceRecords", "ModelRunnerOutput", "TraceRecords",
                                          "ModelRunnerOutput", "ModelRunnerOutput")] == [True, True, False, True, False]
    assert not faults.drops


def test_a_childs_first_sigterm_waits_for_its_parent_and_a_second_or_the_grace_stops_it():
    """A child's SIGTERM handler: the first signal leaves the node running (its parent's graceful
    stop shuts it down), the grace running out or a second signal stop it with code 143."""
    from actors.runtime.child import on_sigterm

    async def main():
        waiting = Node("waits")
        handle = on_sigterm(waiting, "frontend", grace_s=0.2)
        handle()
        await asyncio.sleep(0.05)
        still_running = not waiting.closed.done()
        code_after_grace = await asyncio.wait_for(asyncio.shield(waiting.closed), 5)
        twice = Node("twice")
        handle = on_sigterm(twice, "frontend", grace_s=60)
        handle()
        handle()
        code_twice = await asyncio.wait_for(asyncio.shield(twice.closed), 5)
        await waiting.stop()
        await twice.stop()
        return still_running, code_after_grace, code_twice

    assert run_async(main()) == (True, 143, 143)
