"""Tensor parallelism: the head-split rule (backend-neutral), the JAX mesh and its shardings,
and the runner channel that drives follower ranks from rank 0's scheduler:

    rank 0 (the scheduler process)                      ranks 1..N-1 (followers)
    Scheduler ──► LeaderRunner ──Runner* call──ROUTER══DEALER──► run_follower loop
                     │ then the same call                           │ the same call
                     ▼                                              ▼
                  local runner (shard 0) ◄══ collectives (torch.distributed / JAX) ══► shard r

Only runner calls cross the channel, never requests: the scheduler's state (queues, radix
cache, deadlines, session retention) lives on rank 0 alone, and every rank's runner sees the
same sequence of steps, so their collectives line up. Only rank 0's results are used.

    calls.py       SeqStep <-> wire message
    channel.py     socket settings (heartbeats) and decoding shared by both ends
    leader.py      FollowerGroup (ROUTER), LeaderRunner (the scheduler's ModelRunner)
    follower.py    connect_to_leader, run_follower (backend-neutral replay loop)
    head_split.py  which tp sizes a model's attention heads allow
    runner_factory.py  the scheduler's runner (single device or rank 0 of a group); the
                   entry of a follower host (`--node-rank` > 0)

    shard_params.py    one rank's slice of the loader's params (numpy; torch ranks)

Each backend's own parts live in its home (sgl_tpu/backends/):

    torch (`--backend torch`, torch.distributed):
    backends/torch/tp.py           TorchTPModelRunner: the Llama decoder with its collectives
    backends/torch/tp_launch.py    checks, then rank 0 and the follower processes (one or
                                   several hosts)
    backends/torch/tp_follower.py  a follower process: connect, load, join, replay

    JAX (`--backend jax`, one SPMD program over a device mesh; one host: no followers):
    backends/jax/mesh.py           the mesh, the weight-name -> PartitionSpec table, host-side
                                   padding
    backends/jax/shard_ops.py      shard_map wrappers: attention/KV write per device,
                                   vocab-parallel embedding, logits gathered before the sampler
    backends/jax/multihost.py      --nnodes: jax.distributed + the runner channel (rank 0 and
                                   followers)
"""
