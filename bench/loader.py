"""What opening a GGUF costs: graphexec's parser (graphexec/loader/gguf_file.py) against gguf's
GGUFReader, then the whole native load (`load_gguf`: parse, repack the blocks, tokenizer).

    graphexec-bench loader [--path FILE.gguf] [--rounds 3]

Boundary: measurement only, this process, pure Python/numpy (no OpenMP team to disturb).  Sides
alternate each round; the file is read once first so both find it in the page cache.
"""

from __future__ import annotations

import argparse
import time

from bench.stats import spread
from bench.tables import machine_line, table
from graphexec.loader import default_smollm2_gguf
from graphexec.loader.gguf import load_gguf
from graphexec.loader.gguf_file import read_gguf


def _gguf_reader(path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    {key: field.contents() for key, field in reader.fields.items()}


CASES = {
    "gguf.GGUFReader + contents()": _gguf_reader,
    "graphexec read_gguf": read_gguf,
    "graphexec load_gguf (native)": lambda path: load_gguf(path, "bench", weights="native"),
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    path = args.path or default_smollm2_gguf()
    with open(path, "rb") as handle:
        handle.read()
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, case in CASES.items():
            start = time.perf_counter()
            case(path)
            seconds[name].append(time.perf_counter() - start)
    print(f"{machine_line()}\nfile {path}\n")
    print(table(["case", "median s", "min s", "max s"],
                [[name, *(f"{s[k]:.3f}" for k in ("median", "min", "max"))] for name, times in seconds.items()
                 for s in [spread(times)]]))
