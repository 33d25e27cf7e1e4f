"""A checkpoint directory's safetensors files: which files, which tensor each holds, and reading them.

Only headers are read until a tensor is asked for; every failure is a ValueError naming the file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"  # a sharded checkpoint's list of its files


def safetensors_files(path) -> list[Path]:
    """The weight files of the checkpoint directory `path`: exactly those its index lists where it has one (a
    sharded save; a listed file that is absent is an incomplete checkpoint), else every *.safetensors file."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a checkpoint directory (str or os.PathLike), got {type(path).__name__}")
    index = Path(path) / INDEX
    if not index.is_file():
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"path {str(path)!r} has no *.safetensors files")
        odd = [f.name for f in files if not f.is_file()]  # a FIFO would block the open until someone writes it
        if odd:
            raise ValueError(f"path {str(path)!r} holds {odd[:5]}, which are not regular files")
        return files
    try:
        listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"index {str(index)!r} is not a readable safetensors index (a JSON object whose "
                         f"'weight_map' maps tensor names to file names): {err!r}") from err
    bad = [f for f in listed if not isinstance(f, str) or Path(f).name != f]
    if bad or not listed:
        raise ValueError(f"index {str(index)!r} must list the file names of its directory, got {bad[:5] or listed}")
    missing = [f for f in listed if not (Path(path) / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete: {INDEX} lists {missing[:5]} ({len(missing)} of "
                         f"its {len(listed)} files), which the directory lacks")
    return [Path(path) / f for f in listed]


def open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # safetensors raises its own types for truncated or garbage files
        raise ValueError(f"weights file {str(file)!r} is not a readable safetensors file: {err}") from err


def _read(f, file: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as err:
        raise ValueError(f"weights file {str(file)!r}: tensor {name!r} cannot be read: {err}") from err


def tensor_files(files) -> dict[str, Path]:
    """{tensor name: the file holding it} for `files`, from their headers: no tensor is read. A tensor in two
    files is refused: which one a load takes is an accident of their order (a stale file beside a new save)."""
    located = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in located:
                    raise ValueError(f"tensor {name!r} is in two weight files, {located[name].name!r} and "
                                     f"{file.name!r} (a stale file beside a new save?); a checkpoint holds each "
                                     "tensor once. Nothing was copied")
                located[name] = file
    return located


def read_tensor(file: Path, name: str) -> torch.Tensor:
    with open_safetensors(file) as f:
        return _read(f, file, name)


def iter_files(files):
    """(name, tensor) for every tensor of `files`, one file open at a time."""
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                yield name, _read(f, file, name)


def iter_safetensors(path):
    """(name, tensor) for every tensor of the checkpoint directory `path` (its safetensors_files, each tensor in
    one of them: tensor_files)."""
    files = safetensors_files(path)
    tensor_files(files)
    yield from iter_files(files)
