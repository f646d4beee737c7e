"""A change to the request → token table, the one record both sides of tensor parallelism name:
rank 0's table journals them (graphexec/cache/req_to_token_pool.py), step messages carry them
(graphexec/parallel/step_codec.py), and every other rank replays them into its own table.

    ("span", row, start, slots) | ("points", rows, cols, slots) | ("clear", row)

slots are int64 CPU tensors; rows and cols lists of ints.
"""

TableChange = tuple
