"""Tensor parallelism: this process's rank among the ranks that shard one model, and the
collectives its layers call (`TensorParallel`, `SINGLE` for one process).

Layers take a `TensorParallel` and shard themselves by it (Megatron-LM's layout, Shoeybi et
al. 2019); the process group itself is made by the engine's launcher (or a test) with
`torch.distributed.init_process_group` before any collective runs.
"""

from __future__ import annotations

from sits.parallel.state import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
