"""The worker's kvcached client keeps commits until the engine sends them (`KVCacheClient.send_commits`), so a
step's commits never run beside the sampling and sending of its outputs. kvcached is unreachable here: a commit
that runs fails its registration at once and still calls its `on_done`."""

from __future__ import annotations

import threading

import torch

from model_worker.block_copy import HostBlockCopy
from model_worker.kvcache_client import CommitJob, KVCacheClient
from radixserve.blocks.geometry import BlockGeometry
from radixserve.transport import PLAINTEXT

GEOMETRY = BlockGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
UNREACHABLE = "127.0.0.1:1"


def test_a_commit_runs_only_once_sent():
    l1_kv = torch.zeros(4, *GEOMETRY.block_shape)
    client = KVCacheClient(UNREACHABLE, PLAINTEXT, "model-a", GEOMETRY, l1_kv, 0.5, HostBlockCopy())
    done = [threading.Event(), threading.Event()]
    try:
        for page, event in enumerate(done):
            client.commit(CommitJob("", tuple(range(8)), page, (page,), event.set))
        assert not done[0].wait(1.0)  # kept: a commit sent at once fails and ends within the 0.5 s deadline
        client.send_commits()
        assert done[0].wait(10) and done[1].wait(10)
    finally:
        client.close()
