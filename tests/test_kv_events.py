"""KV events (`--kv-events-config`): the recorder over a real radix tree (stored pages chain by
hash, removed after eviction, cleared on reset), SGLang's wire format and framing, the replay
socket, the flag's validation and per-replica ports, and a real server publishing to a real
ZeroMQ subscriber."""

from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest
import zmq

from sgl_tpu.cli import parse_args
from sgl_tpu.config import KV_EVENT_PUBLISHERS, KVEventsConfig, ServerArgs
from sgl_tpu.mem_cache.allocator import PageAllocator
from sgl_tpu.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
)
from sgl_tpu.mem_cache.page_hash import ROOT_HASH, block_hash, chain_hashes
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.server.kv_events import PUBLISHERS, ZmqEventPublisher, offset_endpoint
from sgl_tpu.server.replicas import replica_argv

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
RECV_TIMEOUT_MS = 30_000


def _insert(allocator: PageAllocator, tree: RadixCache, key: list[int]) -> None:
    """Store `key` (page aligned) as a finished request would: fresh pages past the match."""
    ps = allocator.page_size
    match = tree.match_prefix(key)
    pages = allocator.alloc((len(key) - match.prefix_len) // ps)
    slots = np.concatenate([match.slots, allocator.pages_to_slots(pages, len(pages) * ps)])
    prefix_len = tree.insert(key, slots)
    allocator.free(allocator.slots_to_pages(slots[match.prefix_len:prefix_len]))


def _chain(tokens: list[int], page_size: int) -> list[int]:
    """The block hash of every page of `tokens`, from the root."""
    return [block_hash(h) for h in chain_hashes(ROOT_HASH, np.array(tokens), page_size)]


def _pages(stored: list[BlockStored]) -> list[tuple[int, int | None, list[int]]]:
    return [(e.block_hashes[0], e.parent_block_hash, e.token_ids) for e in stored]


# ---- the recorder over a real tree ----------------------------------------------------------

def test_recorder_reports_stores_evictions_and_reset_of_a_real_tree():
    ps = 2
    allocator = PageAllocator(16, ps)
    recorder = KVEventRecorder()
    tree = RadixCache(allocator, listeners=[recorder])
    a = [1, 2, 3, 4, 5, 6]  # pages [1 2] [3 4] [5 6]
    b = [1, 2, 3, 4, 7, 8, 9, 10]  # shares two pages of a, then [7 8] [9 10]
    ha, hb = _chain(a, ps), _chain(b, ps)

    _insert(allocator, tree, a)
    events = recorder.take()
    assert all(isinstance(e, BlockStored) for e in events)
    assert _pages(events) == [(ha[0], None, [1, 2]), (ha[1], ha[0], [3, 4]),
                              (ha[2], ha[1], [5, 6])]
    assert {(e.block_size, e.lora_id, e.medium) for e in events} == {(2, None, "GPU")}
    assert recorder.take() == []  # taken once

    _insert(allocator, tree, b)  # splits a's node: no event for the split, two new pages
    assert hb[:2] == ha[:2]
    assert _pages(recorder.take()) == [(hb[2], hb[1], [7, 8]), (hb[3], hb[2], [9, 10])]
    _insert(allocator, tree, b)  # already cached: nothing
    assert recorder.take() == []

    tree.match_prefix(b)  # b is the more recent: a's last page goes first
    assert tree.evict(2) == 2
    assert recorder.take() == [BlockRemoved(block_hashes=[ha[2]], medium="GPU")]
    assert tree.evict(100) == 8  # the rest: b's own pages, then the shared head
    removed = recorder.take()
    assert [e.block_hashes[0] for e in removed] == [hb[2], hb[3], hb[0], hb[1]]

    _insert(allocator, tree, a)
    _insert(allocator, tree, b)
    recorder.take()
    tree.reset()
    assert recorder.take() == [AllBlocksCleared()]
    tree.check_integrity()


def test_events_follow_a_tree_that_stores_whole_pages_only():
    ps = 4
    allocator = PageAllocator(16, ps)
    recorder = KVEventRecorder()
    tree = RadixCache(allocator, listeners=[recorder])
    key = list(range(100, 110))  # 2 whole pages and 2 tokens
    pages = allocator.alloc(3)
    slots = allocator.pages_to_slots(pages, len(key))
    tree.insert(key, slots)
    allocator.free(pages[2:])
    stored = recorder.take()
    assert [e.token_ids for e in stored] == [key[:4], key[4:8]]


# ---- wire format ----------------------------------------------------------------------------

def test_batch_encodes_as_sglang_arrays_with_tags():
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[-3], parent_block_hash=None, token_ids=[7, 8], block_size=2,
                    lora_id=None, medium="GPU"),
        BlockRemoved(block_hashes=[-3], medium="GPU"), AllBlocksCleared()], attn_dp_rank=1)
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw) == [1.5, [
        ["BlockStored", [-3], None, [7, 8], 2, None, "GPU"],
        ["BlockRemoved", [-3], "GPU"], ["AllBlocksCleared"]], 1]
    assert DECODER.decode(raw) == batch


def test_block_hash_is_a_signed_int64_of_the_page_hash():
    hashes = chain_hashes(ROOT_HASH, np.arange(64), 16)
    values = [block_hash(h) for h in hashes]
    assert all(-2**63 <= v < 2**63 for v in values) and len(set(values)) == 4


# ---- publisher: framing and replay ----------------------------------------------------------

def test_publisher_frames_batches_and_replays_them(tmp_path):
    ctx = zmq.Context.instance()
    pub_addr, replay_addr = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=pub_addr,
                                                 replay_endpoint=replay_addr, topic="kv",
                                                 buffer_steps=2))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.connect(pub_addr)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(replay_addr)
    try:
        batches = [KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i])])
                   for i in range(3)]
        for batch in batches:
            publisher.publish(batch)
        # Replay first: it also tells when the thread has sent all three (and whether the
        # subscription was in place in time; a gap would be filled from it).
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while (frames := dealer.recv_multipart())[1] != (-1).to_bytes(8, "big", signed=True):
            replayed.append((int.from_bytes(frames[1], "big"), DECODER.decode(frames[2])))
        assert replayed == [(1, batches[1]), (2, batches[2])]  # the last buffer_steps
        assert frames == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        # A subscription reaches the PUB socket asynchronously (ZeroMQ's "slow joiner"), so
        # publish until the subscriber hears something; from then on nothing may be missed.
        deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
        published = 3
        while not sub.poll(100):
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            publisher.publish(batches[0])
            published += 1
        publisher.publish(batches[1])
        last_seq = published
        received = []
        while not received or received[-1][0] != last_seq:
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            received.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        # Each batch once, in order, from wherever the subscription took effect.
        expected = [*batches, *[batches[0]] * (published - 3), batches[1]]
        first = received[0][0]
        assert received == list(enumerate(expected))[first:]
    finally:
        sub.close(0)
        dealer.close(0)
        publisher.close()


def test_a_busy_endpoint_fails_clearly():
    holder = zmq.Context.instance().socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(RuntimeError, match=f"cannot open tcp://\\*:{port}"):
            ZmqEventPublisher(KVEventsConfig(publisher="zmq", endpoint=f"tcp://*:{port}"))
    finally:
        holder.close(0)


# ---- --kv-events-config ---------------------------------------------------------------------

def test_flag_parses_sglang_keys_and_rejects_bad_values():
    text = ('{"publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "t", '
            '"replay_endpoint": "tcp://*:6100", "buffer_steps": 5, "hwm": 10, '
            '"max_queue_size": 7}')
    args = parse_args(["--kv-events-config", text])
    assert args.kv_events == KVEventsConfig("zmq", "tcp://*:6000", "tcp://*:6100", 5, 10, 7, "t")
    assert ServerArgs().kv_events is None
    assert ServerArgs(kv_events_config='{"publisher": "null"}').kv_events is None
    for bad, message in (("{publisher: zmq}", "not valid JSON"),
                         ('["zmq"]', "must be a JSON object"),
                         ('{"publisher": "kafka"}', "unknown publisher 'kafka'"),
                         ('{"publisher": "zmq", "snapshot_endpoint": "x"}', "unknown keys"),
                         ('{"publisher": "zmq", "hwm": -1}', "hwm must be an integer"),
                         ('{"publisher": "zmq", "endpoint": 5557}', "endpoint must be")):
        with pytest.raises(ValueError, match=message):
            ServerArgs(kv_events_config=bad)
    assert set(KV_EVENT_PUBLISHERS) == {"null", *PUBLISHERS}


def test_each_replica_publishes_on_its_own_ports():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 3) is None
    args = parse_args(["--dp-size", "2", "--kv-events-config",
                       '{"publisher": "zmq", "endpoint": "tcp://*:6000"}'])
    replicas = [parse_args(replica_argv(args, 31000 + i, i)[3:]).kv_events for i in range(2)]
    assert [(c.endpoint, c.dp_rank) for c in replicas] == [("tcp://*:6000", 0),
                                                           ("tcp://*:6000", 1)]


# ---- a real server --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.backend_independent
def test_server_publishes_prompt_pages_and_cache_flush(tmp_path):
    import requests
    from server_harness import free_port, launch_server

    port = free_port(2)
    config = (f'{{"publisher": "zmq", "endpoint": "tcp://*:{port}", '
              f'"replay_endpoint": "tcp://*:{port + 1}", "topic": "kv"}}')
    server = launch_server("--skip-warmup", "--page-size", "16", "--max-total-tokens", "1024",
                           "--kv-events-config", config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.connect(f"tcp://127.0.0.1:{port}")
    received: dict[int, KVEventBatch] = {}

    def receive_until(done) -> list:
        """Events in order, live; a gap, or silence while the subscription is not yet in
        place, is filled from the replay socket."""
        deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
        while True:
            assert time.monotonic() < deadline, f"no events that end it: {sorted(received)}"
            if sub.poll(1000):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                received[int.from_bytes(seq, "big")] = DECODER.decode(payload)
            if not received or min(received) > 0 or len(received) != max(received) + 1:
                _replay_into(ctx, f"tcp://127.0.0.1:{port + 1}", received)
            events = [e for s in sorted(received) for e in received[s].events]
            if done(events):
                return events

    def generate(ids: list[int]) -> None:
        r = requests.post(server.base_url + "/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
        assert r.status_code == 200, (r.text, server.log_tail())

    try:
        rng = random.Random(0)
        a = [rng.randrange(100, 40000) for _ in range(64)]  # 4 pages
        b = a[:48] + [rng.randrange(100, 40000) for _ in range(20)]  # 3 of them, 1 new page
        ha, hb = _chain(a, 16), _chain(b, 16)
        generate(a)
        generate(b)
        events = receive_until(lambda ev: hb[3] in {e.block_hashes[0] for e in ev
                                                     if isinstance(e, BlockStored)})
        stored = {e.block_hashes[0]: e for e in events if isinstance(e, BlockStored)}
        for i, h in enumerate(ha):  # every page of the first prompt, chained from the root
            assert stored[h].token_ids == a[16 * i:16 * (i + 1)]
            assert stored[h].parent_block_hash == (None if i == 0 else ha[i - 1])
        assert stored[hb[3]].token_ids == b[48:64]
        assert stored[hb[3]].parent_block_hash == ha[2]  # the shared prefix was reused
        assert len(set(stored) & set(hb[:3])) == 3 and len(stored) == len(events)
        assert {received[s].attn_dp_rank for s in received} == {0}

        server.wait_idle()
        assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
        events = receive_until(lambda ev: isinstance(ev[-1], AllBlocksCleared))
    finally:
        sub.close(0)
        server.stop()


def _replay_into(ctx: zmq.Context, addr: str, received: dict[int, KVEventBatch]) -> None:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(addr)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := dealer.recv_multipart())[2]:
            received.setdefault(int.from_bytes(frames[1], "big"), DECODER.decode(frames[2]))
    finally:
        dealer.close(0)
