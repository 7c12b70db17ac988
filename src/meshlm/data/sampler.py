"""A distributed sampler that shuffles per epoch, drops the ragged tail, and resumes mid-epoch.

Like torch's DistributedSampler (rank r takes indices r, r+R, r+2R, ... of the
epoch's permutation), so the union of one step's per-rank batches is the same
global batch a single process would draw. Resuming skips consumed indices
arithmetically: no skipped batch is ever loaded.
"""

from __future__ import annotations

import torch


class ResumableSampler:
    def __init__(
        self,
        num_samples: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
    ):
        self.num_samples, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.shuffle, self.seed, self.batch_size = shuffle, seed, batch_size
        self.epoch = 0
        self.start_batch = 0  # batches of this rank already consumed in the current epoch
        global_batch = batch_size * num_replicas
        self.batches_per_epoch = num_samples // global_batch  # drop_last

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        used = self.batches_per_epoch * self.batch_size * self.num_replicas
        mine = order[:used][self.rank :: self.num_replicas]
        for b in range(self.start_batch, self.batches_per_epoch):
            yield mine[b * self.batch_size : (b + 1) * self.batch_size]
