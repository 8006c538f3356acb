"""The tensor-parallel runner channel (sgl_tpu/parallel): the leader publishes every runner
call, followers replay them in order on their own runner (with their own hidden states), and
nobody is left behind: a follower leaves when the leader closes the group or disappears, a
follower that cannot reach a leader says so, a failing follower is reported to the leader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest
from parallel_helpers import RecordingRunner

from sgl_tpu import messages as M
from sgl_tpu.executor.step import ForwardMode, SeqStep
from sgl_tpu.parallel.calls import step_from_msg, step_to_msg
from sgl_tpu.parallel.follower import FollowerConnectError, connect_to_leader, run_follower
from sgl_tpu.parallel.leader import FollowerGroup, FollowerLost, FollowersNotConnected, LeaderRunner
from sgl_tpu.sampling_params import SamplingParams

HELPER = Path(__file__).with_name("parallel_helpers.py")


def _endpoint() -> str:
    return f"ipc://{tempfile.gettempdir()}/sgl_tpu-test-{uuid.uuid4().hex[:12]}"


def _step(i: int, bitmask: bool = False) -> SeqStep:
    return SeqStep(token_ids=np.arange(i, i + 3), prefix_len=16 * i, pages=[i + 1, i + 2, 7],
                   sampling=SamplingParams(temperature=0.5 + i, top_k=3 + i, top_p=0.9,
                                           repetition_penalty=1.1, stop=("x",)),
                   seed=2**40 + i, num_output_tokens=i, counts_row=i + 1, counts_reset=True,
                   sample_valid=bool(i % 2),
                   bitmask=np.array([-1, 5, 2**31 - 1], np.int32) if bitmask else None,
                   return_logprob=False)


RUNNER_MESSAGES = [
    M.RunnerForward(seq=1, mode=2, steps=[step_to_msg(_step(0)), step_to_msg(_step(1, True))]),
    M.RunnerTokenLogprobs(seq=2, hidden_seq=1, target_ids=b"\x01" * 8),
    M.RunnerRowLogits(seq=3, hidden_seq=1, rows=b""),
    M.RunnerWarmup(seq=4),
    M.RunnerShutdown(seq=5),
    M.FollowerHello(rank=2, pid=123, host="h"),
    M.LeaderWelcome(world_size=3),
    M.FollowerReady(rank=2),
    M.FollowerFailed(rank=1, error="boom"),
]


@pytest.mark.parametrize("msg", RUNNER_MESSAGES, ids=lambda m: type(m).__name__)
def test_runner_messages_round_trip(msg):
    decoded = M.decode_runner(M.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


def test_torch_follower_spec_round_trips_as_json():
    spec = M.TorchFollowerSpec(rank=2, world_size=4, leader_endpoint="tcp://h:5001",
                               init_method="tcp://h:5000", model_path=None,
                               server_args={"tp_size": 4, "allow_origins": ["x"]},
                               parent_pid=7, local_rank=0, ranks_per_node=2)
    assert msgspec.json.decode(msgspec.json.encode(spec), type=M.TorchFollowerSpec) == spec


def test_seq_step_survives_the_wire():
    for st in (_step(0), _step(3, bitmask=True)):
        back = step_from_msg(M.decode_runner(M.encode(
            M.RunnerForward(seq=1, mode=1, steps=[step_to_msg(st)]))).steps[0])
        assert list(back.token_ids) == list(st.token_ids) and list(back.pages) == st.pages
        for f in ("prefix_len", "seed", "num_output_tokens", "counts_row", "counts_reset",
                  "sample_valid", "return_logprob"):
            assert getattr(back, f) == getattr(st, f), f
        for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            assert getattr(back.sampling, f) == pytest.approx(getattr(st.sampling, f)), f
        assert (back.bitmask is None) == (st.bitmask is None)
        if st.bitmask is not None:
            assert back.bitmask.tolist() == st.bitmask.tolist()


def test_followers_replay_every_call_in_order():
    group = FollowerGroup(_endpoint(), world_size=3)
    followers = [RecordingRunner(rank=r) for r in (1, 2)]
    exits: dict[int, str] = {}
    threads = [threading.Thread(target=lambda r=r: exits.__setitem__(
        r.rank, run_follower(r, group.endpoint, rank=r.rank, connect_timeout_s=10)))
        for r in followers]
    for t in threads:
        t.start()
    hellos = group.wait_for_followers(10)
    assert sorted(hellos) == [1, 2] and hellos[1].pid == os.getpid()
    leader = RecordingRunner(rank=0)
    runner = LeaderRunner(leader, group)
    runner.warmup()
    extend = runner.forward(ForwardMode.EXTEND, [_step(0), _step(1, bitmask=True)])
    assert extend.token_ids.tolist() == [0, 0]  # rank 0's own result
    runner.token_logprobs(extend.hidden, np.array([4, 5, 6], np.int32))
    decode = runner.forward(ForwardMode.DECODE, [_step(2)])
    assert decode.hidden is None and decode.token_ids.tolist() == [1]
    runner.row_logits(extend.hidden, np.array([2], np.int32))  # the EXTEND's hidden, still
    runner.close()
    for t in threads:
        t.join(10)
    assert exits == {1: "shutdown", 2: "shutdown"}
    assert len(leader.calls) == 5
    for f in followers:
        assert f.calls == leader.calls  # same calls, same order, same arguments


def test_failed_follower_is_reported_to_the_leader():
    group = FollowerGroup(_endpoint(), world_size=2)
    follower = RecordingRunner(rank=1, fail_on_forward=0)
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            run_follower(follower, group.endpoint, rank=1, connect_timeout_s=10)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=follow)
    t.start()
    group.wait_for_followers(10)
    runner = LeaderRunner(RecordingRunner(rank=0), group)
    runner.forward(ForwardMode.DECODE, [_step(0)])
    t.join(10)
    assert errors and "cannot run forward 0" in str(errors[0])
    with pytest.raises(FollowerLost, match="rank 1 failed: RuntimeError: rank 1 cannot run"):
        runner.forward(ForwardMode.DECODE, [_step(0)])
    group.close()


def test_follower_that_cannot_connect_says_where():
    endpoint = _endpoint()
    t0 = time.monotonic()
    with pytest.raises(FollowerConnectError, match=f"rank 3: no leader answered at {endpoint}"):
        connect_to_leader(endpoint, 3, timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_leader_names_the_followers_that_never_came():
    group = FollowerGroup(_endpoint(), world_size=3)
    link = connect_to_leader_async(group.endpoint, 2)
    with pytest.raises(FollowersNotConnected, match=r"rank\(s\) \[1\] did not connect"):
        group.wait_for_followers(1.0)
    link.join(10)
    group.close()


def connect_to_leader_async(endpoint: str, rank: int) -> threading.Thread:
    t = threading.Thread(target=lambda: connect_to_leader(endpoint, rank, timeout_s=5).close())
    t.start()
    return t


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_follower_exits_when_the_leader_process_dies():
    endpoint = _endpoint()
    leader = _spawn("leader", endpoint, "2")
    follower = _spawn("follower", endpoint, "1")
    try:
        assert leader.stdout.readline().strip() == "followers connected"
        assert follower.poll() is None
        leader.send_signal(signal.SIGKILL)  # no shutdown call: the follower must notice
        leader.wait(10)
        out, _ = follower.communicate(timeout=15)
        assert follower.returncode == 0 and out.strip().endswith("leader gone"), out
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.wait()
