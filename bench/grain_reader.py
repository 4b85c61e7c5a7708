"""Random access to token windows: nestor's memory-mapped shards against Grain (the JAX ecosystem's loader).

Needs `grain` (and its `array-record`), which nestor does not depend on:
`pip install grain`. Writes `--tokens` uniform random uint16 ids once as a
nestor shard and as an ArrayRecord file of one record per window, then reads
the same `--reads` random windows of `--width` tokens, three ways in turn per
round: nestor's `TokenStream.read`, a `grain.MapDataset.source` over that
reader, and `grain.sources.ArrayRecordDataSource`. Prints the median time per
window over `--rounds` rounds; files are in the page cache.

    python -m bench.grain_reader
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from nestor.orchestrator.data.shards import FORMAT, LEGACY_SEPARATOR, METADATA, TokenStream, shard_name, write_shard


def main() -> None:
    """Writes the files, times the three readers alternately, prints one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--width", type=int, default=2049, help="tokens per window (seq_len + 1)")
    parser.add_argument("--reads", type=int, default=2000, help="random windows per reader per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import grain
    from array_record.python import array_record_module

    work = Path(tempfile.mkdtemp(prefix="nestor-bench-grain-"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 2**16, args.tokens, dtype=np.uint16)
    count, _ = write_shard(work, shard_name("train", 0), [tokens[:-1]], np.dtype(np.uint16), LEGACY_SEPARATOR)
    shard = {"name": shard_name("train", 0), "tokens": count, "documents": 1}
    (work / METADATA).write_text(json.dumps({"format": FORMAT, "dtype": "uint16", "splits": {"train": {
        "tokens": count, "documents": 1, "shards": [shard]}}}))
    stream = TokenStream([work], "train", "bench")
    windows = count // args.width
    writer = array_record_module.ArrayRecordWriter(str(work / "windows.array_record"), "group_size:1")
    for window in range(windows):
        writer.write(tokens[window * args.width:(window + 1) * args.width].tobytes())
    writer.close()

    class Windows:  # a grain RandomAccessDataSource over nestor's reader
        def __len__(self) -> int:
            return windows

        def __getitem__(self, window: int) -> np.ndarray:
            return stream.read(window * args.width, (window + 1) * args.width)

    over_nestor = grain.MapDataset.source(Windows())
    array_records = grain.sources.ArrayRecordDataSource([str(work / "windows.array_record")])
    readers = {
        "nestor TokenStream (np.memmap slice)": Windows().__getitem__,
        "grain.MapDataset.source over the same reader": over_nestor.__getitem__,
        "grain.sources.ArrayRecordDataSource, one record per window":
            lambda window: np.frombuffer(array_records[window], np.uint16).astype(np.int32),
    }
    order = [int(w) for w in rng.permutation(windows)[:args.reads]]
    seconds: dict[str, list[float]] = {name: [] for name in readers}
    for read in readers.values():
        for window in order[:50]:
            read(window)
    for _ in range(args.rounds):
        for name, read in readers.items():
            started = time.perf_counter()
            for window in order:
                read(window)
            seconds[name].append((time.perf_counter() - started) / len(order))
    print(f"{args.tokens:,} uint16 tokens, {args.reads} random windows of {args.width}, median of {args.rounds} "
          f"alternating rounds; grain {getattr(grain, '__version__', '?')}")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"| {name} | {median * 1e6:.1f} | {1 / median:,.0f} |")


if __name__ == "__main__":
    main()
