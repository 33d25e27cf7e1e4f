"""ShardStage: one update call's shards of fused fp8 layers that came without all their siblings.

An Fp8Linear (qkv, gate_up) has one scale over its shards. A group that holds only some of a layer's shards
quantizes them as it always has (with the siblings' scales as they are: its cached copy plan is unchanged),
and keeps a copy of them here (on the layer's device, in their own dtype: a transport reuses its bucket's
buffer after the group). Once the call has brought every shard of the layer, the layer is quantized again
from the copies, in one quantize over all its shards: its scale comes from the new values only, and what
the earlier groups' scales did to the first shards is overwritten, so a complete update is a fresh load
however the groups cut it. At the end of the call, a layer still incomplete whose shards came in more than
one group is quantized again from its copies with its siblings as they are, as one group holding them would.
Which shards are kept is a function of the group's names alone (`incomplete_shards`). Past `limit` bytes the
oldest layer's copies are dropped: it keeps what its groups wrote (the behaviour without the stage), so
memory stays bounded under any order. A call that fails drops the stage; every name was counted as begun
before its group's copy (WeightStore._copy), so all are stale as after any copy that failed part way.
"""
from __future__ import annotations

import torch


def incomplete_shards(table, names) -> list[str]:
    """The names, among a group's `names`, of shards of fp8 layers that the group holds only some of."""
    present: dict = {}
    for name in names:
        if name in table.fp8:
            present.setdefault(table.fp8[name][0], []).append(name)
    return [n for layer, held in present.items() if len(held) < len(layer.shards) for n in held]


class ShardStage:
    """The kept shards of one update call of one model (see the module)."""

    def __init__(self, table, ops, limit: int):
        self.table, self.ops, self.limit = table, ops, limit
        self.layers: dict = {}  # Fp8Linear -> {name: a copy of its source}, oldest first
        self.groups: dict = {}  # Fp8Linear -> how many groups its kept shards came in
        self.nbytes = 0

    def add(self, group, sharded: bool) -> None:
        """After the group's copy: forget layers it quantized whole (what was kept of them came earlier), keep
        its `staged` shards, quantize the layers now whole, then drop the oldest while over `limit`."""
        if self.layers:
            for name in group.names:
                if name in self.table.fp8 and name not in group.staged:
                    self._pop(self.table.fp8[name][0])
        if not group.staged:
            return
        latest = {self.table.canonical(n): t for n, t in group.pairs}  # resolve's rule: the last pair wins
        whole, seen = [], set()
        for name in group.staged:
            source = latest[name] if sharded else self.table.rank_slice(name, latest[name])
            copy = torch.empty(source.shape, dtype=source.dtype, device=self.table.destination(name).device)
            copy.copy_(source)
            layer = self.table.fp8[name][0]
            shards = self.layers.setdefault(layer, {})
            self.groups[layer] = self.groups.get(layer, 0) + (layer not in seen)
            seen.add(layer)
            self.nbytes += copy.nbytes - (shards[name].nbytes if name in shards else 0)
            shards[name] = copy
            if len(shards) == len(layer.shards):
                whole.append(layer)
        self._quantize(whole)
        while self.nbytes > self.limit and self.layers:
            self._pop(next(iter(self.layers)))

    def finish(self) -> None:
        """The end of a call that did not fail: incomplete layers that came in more than one group."""
        self._quantize([layer for layer in self.layers if self.groups[layer] > 1])
        self.drop()

    def drop(self) -> None:
        """Let go of every kept copy (a call that failed: its names are stale, nothing is quantized again)."""
        self.layers, self.groups, self.nbytes = {}, {}, 0

    def _pop(self, layer) -> dict:
        shards = self.layers.pop(layer, {})
        self.groups.pop(layer, None)
        self.nbytes -= sum(t.nbytes for t in shards.values())
        return shards

    def _quantize(self, layers) -> None:
        """ops.quantize_shards_plan (as WeightTable.copy_plan's) over the kept shards of `layers`, at once."""
        jobs = []
        for layer in layers:
            shards = self._pop(layer)
            jobs.append(layer.loading({self.table.fp8[name][1]: tensor for name, tensor in shards.items()}))
        if jobs:
            self.ops.quantize_shards_plan(jobs)()
