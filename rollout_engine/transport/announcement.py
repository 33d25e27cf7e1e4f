"""What the receiver checks of tensors a sender describes (name, dtype, shape) before it takes any of their bytes,
and the announced update: a whole model's tensors, named in 'begin' (protocol.py)."""
from __future__ import annotations

import torch

from ..weights import IGNORED_MAX_BYTES
from .protocol import DTYPES, tensor_nbytes


def check_items(table, items: list[dict], where: str) -> None:
    """Each item's name, shape and dtype against the engine's weights (`table`, a WeightTable), before any byte is
    allocated or read: a peer's bucket of a sparse 100 GiB segment was read into host memory in full, then refused.
    A name comes once in `where`, and one the engine ignores holds a small buffer: otherwise the bytes taken would
    not be bounded by the weights (1,024 items naming the embedding, one 'inv_freq' of a TiB)."""
    names, ignored = set(), 0
    for item in items:
        if item["name"] in names:
            raise ValueError(f"weight {item['name']!r} comes twice in {where}; it names each once")
        names.add(item["name"])
        name = table.canonical(item["name"])  # an unknown name: ValueError
        if name is not None:
            table.check(name, torch.empty((), dtype=DTYPES[item["dtype"]]).expand(item["shape"]))
        elif (ignored := ignored + tensor_nbytes(item)) > IGNORED_MAX_BYTES:
            raise ValueError(f"weight {item['name']!r}, which the engine ignores (a rotary inv_freq buffer: "
                             f"head_dim / 2 values), brings {where}'s ignored bytes to {ignored}; at most "
                             f"{IGNORED_MAX_BYTES}")


class Announcement:
    """The tensors a 'begin' announced: every one checked, and together covering every weight the engine holds, or
    the update is refused before any copy (a model whose lm_head is tied to its embedding sends no lm_head.weight,
    which an untied engine holds: its old head would serve with the new model). Buckets then bring only announced
    names, each once, and 'end' is refused until all of them came: a stream cut short is never served."""

    def __init__(self, table, items: list[dict]):
        check_items(table, items, "'begin'")
        self.names = {item["name"] for item in items}
        table.check_whole(self.names, "the announced update")
        self.arrived: set[str] = set()

    def arrive(self, names) -> None:
        """A bucket's names, before any of its bytes are copied."""
        for name in names:
            if name not in self.names:
                raise ValueError(f"weight {name!r} was not announced in 'begin'; an announced update sends exactly "
                                 "the tensors it announced")
            if name in self.arrived:
                raise ValueError(f"weight {name!r} came twice in this update")
            self.arrived.add(name)

    def check_end(self) -> None:
        missing = sorted(self.names - self.arrived)
        if missing:
            raise ValueError(f"'end' came before {len(missing)} of the {len(self.names)} tensors announced in 'begin' "
                             f"(e.g. {missing[:3]}): the update is incomplete")
