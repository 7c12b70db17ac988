"""A process that runs several jobs in turn reuses the meshes (and process groups) of its current process group:
a new mesh per job made new groups, each keeping three gloo threads until the process ended."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from meshlm.layout import Degrees, build_mesh


@pytest.fixture
def one_rank_group():
    def join():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    assert not dist.is_initialized()
    join()
    try:
        yield join
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_second_job_reuses_the_mesh_and_a_new_group_gets_its_own(one_rank_group):
    first = build_mesh("cpu", Degrees())
    assert build_mesh("cpu", Degrees()) is first  # the same groups: none made for the second job
    dist.destroy_process_group()
    one_rank_group()
    again = build_mesh("cpu", Degrees())
    assert again is not first  # the destroyed group's mesh is never handed out
