"""Tensor parallelism: one worker spans `--tensor-parallel-size` ranks (docs/tensor-parallel.md).

shard.py slices the checkpoint per rank; group.py is the collective group and the rank processes;
runner.py the rank-0 runner; engine.py restarts the whole group when a rank dies.
"""
