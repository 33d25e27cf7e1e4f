"""CUDA tensors on the engine's GPU travel by reference: each goes as its storage's key (the sender's
address and size) plus (dtype, shape, stride, storage_offset), and the receiver copies straight out of
the sender's memory. Sharing a storage and opening its handle cost far more than copying a small
tensor, so both ends keep them across updates while consecutive updates send the same storages (a
trainer updates its parameters in place): from the second update on nothing is shared or opened, and
from the third each bucket goes as the same bytes as before. The rules that keep the two ends in step
are commented where each is enforced, on both sides. (Send the parameters themselves: a temporary, say
a cast copy, stays mapped, and so alive in the trainer, until the next update ends.)
"""
from __future__ import annotations

import base64
import binascii
import json

import torch

from .protocol import DTYPES, item_metadata, storage_elements


def _handle(t: torch.Tensor) -> list:
    """JSON-able CUDA IPC handle of the storage under `t` (torch's own fields, bytes as base64)."""
    return [base64.b64encode(f).decode() if isinstance(f, bytes) else f for f in t.untyped_storage()._share_cuda_()]


class ShareBook:
    """The sender's side: which storages the receiver maps now, and the bytes of each bucket it last sent."""

    def __init__(self):
        self.shared: set[tuple[int, int]] = set()  # storages the receiver maps, by (data_ptr, nbytes)
        self.sent: set[tuple[int, int]] = set()  # ... that this update sent
        self.encoded: list[tuple[list, bytes]] = []  # each bucket's metadata and message, last update
        self.encoding: list[tuple[list, bytes]] = []  # ... this update

    def message(self, group: list, position: int) -> bytes:
        """The bucket message for `group`, the `position`-th bucket of this update."""
        meta = []
        for name, t in group:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            item = item_metadata(name, t) | {"stride": list(t.stride()), "storage_offset": t.storage_offset(),
                                             "storage": list(key)}
            if key not in self.shared:
                # Only a storage the receiver does not map carries its handle; it maps it under `key`.
                item["cuda"] = _handle(t)
                self.shared.add(key)
            self.sent.add(key)
            meta.append(item)
        last = self.encoded[position] if position < len(self.encoded) else None
        # The same metadata at the same position goes as the very same bytes: the receiver, seeing them,
        # reuses its checked copy plan without parsing them.
        same = last is not None and last[0] == meta
        raw = last[1] if same else json.dumps({"op": "bucket", "tensors": meta}).encode()
        self.encoding.append((meta, raw))
        return raw

    def commit(self) -> None:
        """An update ended well: the receiver now maps exactly the storages it sent (it let go of the rest)."""
        self.shared, self.sent = self.sent, set()
        self.encoded, self.encoding = self.encoding, []

    def forget(self) -> None:
        """After any error the receiver lets go of every mapping and plan: share everything afresh."""
        self.shared, self.sent = set(), set()
        self.encoded, self.encoding = [], []


class Storages:
    """The receiver's side: the sender's storages it maps (and views of them), under the sender's key."""

    def __init__(self):
        self.mapped: dict[tuple, tuple[torch.UntypedStorage, dict]] = {}
        self.used: set[tuple] = set()  # keys this update referred to

    def tensor(self, item: dict, device: torch.device) -> tuple[str, torch.Tensor]:
        """(name, tensor) of one checked shared item: a view of the sender's storage, mapped once and looked up
        after that (a steady update only looks both up)."""
        if device.type != "cuda":
            raise ValueError(f"weight {item['name']!r} is shared by CUDA IPC (fields 'storage', 'stride'), but "
                             f"this engine runs on {device.type}; CPU tensors go packed in shared memory")
        key = tuple(item["storage"])
        if "cuda" in item:
            # A fresh share is mapped anew even under a known key: a key from an earlier sender process may
            # name other memory.
            self.mapped[key] = (_open(item), {})
        elif key not in self.mapped:
            # Without a handle the storage must still be mapped here: the sender sends a handle again only
            # after an update that did not send this storage, or after an error, and we let go then too.
            raise ValueError(f"weight {item['name']!r} refers to a CUDA storage this receiver no longer maps; "
                             "the sender shares it again on its next send")
        self.used.add(key)
        storage, views = self.mapped[key]
        layout = (item["dtype"], item["storage_offset"], tuple(item["shape"]), tuple(item["stride"]))
        if layout not in views:
            if (item["storage_offset"] + storage_elements(item)) * DTYPES[item["dtype"]].itemsize > storage.nbytes():
                raise ValueError(f"weight {item['name']!r} reaches past its shared storage ({storage.nbytes()} bytes)")
            view = torch.empty(0, dtype=DTYPES[item["dtype"]], device=storage.device)
            views[layout] = view.set_(storage, item["storage_offset"], item["shape"], item["stride"])
        return item["name"], views[layout]

    def keep_used(self) -> None:
        """At the end of an update keep the mappings it used (the next update likely sends the same storages)
        and let go of the rest: the sender, seeing which storages it sent, forgets the same ones."""
        self.mapped = {k: v for k, v in self.mapped.items() if k in self.used}
        self.used = set()

    def clear(self) -> None:
        self.mapped, self.used = {}, set()


def _open(item: dict) -> torch.UntypedStorage:
    try:
        fields = [base64.b64decode(f, validate=True) if isinstance(f, str) else f for f in item["cuda"]]
    except (binascii.Error, ValueError):
        raise ValueError(f"field 'cuda' of weight {item['name']!r} holds a malformed IPC handle") from None
    try:
        return torch.UntypedStorage._new_shared_cuda(*fields)
    except RuntimeError as err:
        raise ValueError(f"field 'cuda' of weight {item['name']!r}: the IPC handle cannot be opened ({err})") from None
