"""The two failures of a tensor-parallel group (torch-free: worker/server.py maps them to gRPC).

- `GroupFailed`: a rank process died, or a collective failed or ran past its timeout; raised from
  the step on rank 0 (worker/tp/group.py). The group is then restarted whole (worker/tp/engine.py).
- `GroupUnavailable`: what each stream in flight at that moment ends with; the gRPC server answers
  it with UNAVAILABLE (the router routes around the worker until its health is SERVING again).
"""


class GroupFailed(RuntimeError):
    """A rank died, or a collective failed or timed out (rank 0's step raises it)."""


class GroupUnavailable(RuntimeError):
    """Ends each stream in flight when its group failed (answered UNAVAILABLE)."""
