"""What opening a GGUF costs: graphexec's parser (graphexec/loader/gguf_file.py) against gguf's
GGUFReader, then the whole native load (`load_gguf`: parse, repack the blocks, tokenizer).

    graphexec-bench loader [--path FILE.gguf] [--rounds 3]

Boundary: measurement only, this process, pure Python/numpy (no OpenMP team to disturb).  Sides
alternate each round (bench/timing.py); each runs once untimed first, so all find the file in the
page cache.
"""

from __future__ import annotations

import argparse

from bench.tables import machine_line, table
from bench.timing import paired_ms
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
    timed = paired_ms({name: (lambda case=case: case(path)) for name, case in CASES.items()}, args.rounds, 1)
    print(f"{machine_line()}\nfile {path}\n")
    print(table(["case", "median s", "min s", "max s"],
                [[name, *(f"{t[k] / 1e3:.3f}" for k in ("median_ms", "min_ms", "max_ms"))] for name, t in timed.items()]))
