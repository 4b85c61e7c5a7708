"""Checkpoint manifest hashing: process 0 hashing every file against each process hashing what it wrote.

A step directory is laid out as Orbax writes a save of `--processes`
processes: each writes `--mib / processes` MiB of array data into its own
`state/ocdbt.process_<i>/d/` (files of `--file-mib` MiB), and the few small
files Orbax writes when it finalizes sit beside them. Rows, alternating within
each of `--rounds` rounds (medians shown):
- `one process hashes all`: the manifest as nestor wrote it before, process 0
  hashing every file inside Orbax's finalization, while every other process
  waits at Orbax's commit barrier;
- `each its own`: every process hashes its own files at once (threads stand
  for hosts; hashlib releases the GIL), in Orbax's background save thread,
  then process 0 writes the manifest from their records, hashing only the
  finalization files.

Files are in the page cache (just written), so this is SHA-256's cost, not the disk's.

    python -m bench.manifest --mib 512 --processes 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from nestor.orchestrator.checkpoint.manifest import records, write_manifest, written_by

ITEMS = ("state",)


def lay_out(step_dir: Path, mib: int, processes: int, file_mib: int) -> None:
    """Writes `mib` MiB of random array data, split over `processes` processes' directories, and the
    small files of a finalized save into `step_dir`."""
    rng = np.random.default_rng(0)
    files_per_process = max(1, mib // processes // file_mib)
    for process in range(processes):
        data = step_dir / "state" / f"ocdbt.process_{process}" / "d"
        data.mkdir(parents=True)
        for index in range(files_per_process):
            (data / f"{index:08x}").write_bytes(rng.bytes(file_mib * 2**20))
        (step_dir / "state" / f"ocdbt.process_{process}" / "manifest.ocdbt").write_bytes(rng.bytes(300))
    (step_dir / "state" / "d").mkdir()
    for name in ("_METADATA", "_sharding", "manifest.ocdbt", "d/merged"):
        (step_dir / "state" / name).write_bytes(rng.bytes(16 * 2**10))


def one_process_hashes_all(step_dir: Path, processes: int) -> dict[str, float]:
    """Returns the seconds of process 0 writing the manifest alone (every other process waiting)."""
    start = time.perf_counter()
    write_manifest(step_dir, ITEMS)
    return {"shares": 0.0, "finalization": time.perf_counter() - start}


def each_hashes_its_own(step_dir: Path, processes: int) -> dict[str, float]:
    """Returns the seconds of every process hashing its own files at once (`shares`) and of process 0
    then writing the manifest from their records (`finalization`)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(processes) as pool:
        shares = list(pool.map(lambda process: records(step_dir, written_by(step_dir / "state", process)),
                               range(processes)))
    middle = time.perf_counter()
    write_manifest(step_dir, ITEMS, {name: record for share in shares for name, record in share.items()})
    return {"shares": middle - start, "finalization": time.perf_counter() - middle}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="array data of the checkpoint, all processes")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--file-mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ways = {"one process hashes all": one_process_hashes_all, "each its own": each_hashes_its_own}
    seconds = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(prefix="nestor-manifest-") as directory:
        lay_out(Path(directory), args.mib, args.processes, args.file_mib)
        for _ in range(args.rounds):
            for name, way in ways.items():
                seconds[name].append(way(Path(directory), args.processes))
    print(f"{args.mib} MiB over {args.processes} processes, {args.rounds} rounds (median seconds)")
    print(f"{'':24} {'hashing shares':>15} {'process 0 at finalization':>26}")
    for name, rounds in seconds.items():
        shares, finalization = (statistics.median(r[part] for r in rounds) for part in ("shares", "finalization"))
        print(f"{name:24} {shares:15.3f} {finalization:26.3f}")


if __name__ == "__main__":
    main()
