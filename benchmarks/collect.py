"""Bring a device call's results into benchmarks/results/: `python benchmarks/collect.py FILES_AT`.

Each <name>.json and its .png replace the repository's copy (the latest run of those arguments), and each line
of FILES_AT/history/<name>.jsonl is appended to results/history/<name>.jsonl unless a line of the same run (its
"run" id) is there already, so collecting a folder twice adds nothing and no run is lost.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HISTORY, RESULTS  # noqa: E402


def run_key(record: dict) -> tuple:
    return record.get("benchmark"), record.get("run"), record.get("time")


def merge_history(source: Path, target: Path) -> int:
    """Append the runs of `source` (a .jsonl) that `target` lacks; returns how many."""
    have = {run_key(json.loads(line)) for line in target.read_text().splitlines() if line.strip()} \
        if target.exists() else set()
    new = [line for line in source.read_text().splitlines()
           if line.strip() and run_key(json.loads(line)) not in have]
    if new:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a") as out:
            out.write("".join(line + "\n" for line in new))
    return len(new)


def collect(folder: Path, results: Path = RESULTS) -> dict[str, int]:
    """Copy folder's results into `results`; returns {file name: runs added (JSON/PNG copies count 1)}."""
    done = {}
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.png")):
        shutil.copyfile(path, results / path.name)
        done[path.name] = 1
    for path in sorted((folder / HISTORY).glob("*.jsonl")):
        done[f"{HISTORY}/{path.name}"] = merge_history(path, results / HISTORY / path.name)
    return done


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a device call's files_at (what $OUT held)")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"folder: {args.folder} is not a directory")
    for name, added in collect(args.folder).items():
        print(f"{name}: {'copied' if not name.startswith(HISTORY) else f'{added} run(s) added'}")


if __name__ == "__main__":
    main()
