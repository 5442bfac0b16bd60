"""Which GPU each tensor-parallel rank runs on, and which CPU cores its process may use.

The driver reports the host's topology: the link between every two GPUs (NV# = a bonded set
of # NVLinks, then PCIe paths from the closest to the farthest: PIX, PXB, PHB, NODE, SYS) and
each GPU's CPU and NUMA affinity. It is read through NVML when `pynvml` is importable, else
from `nvidia-smi topo -m` and `nvidia-smi --query-gpu=index,uuid` (a subprocess with a
timeout). From it `plan_ranks` orders the devices (rank 0 keeps the engine's device; each
next rank takes the unused GPU with the best link to the previous one, ties going to a GPU of
rank 0's NUMA node, then to the lowest index: an all-NVSwitch host keeps the identity order)
and gives every rank its GPU's CPU list, which `bind_process` applies with
`os.sched_setaffinity` (intersected with the CPUs the process may use, e.g. a container's).

Invariants:
- Nothing here fails a start: a topology that cannot be read or mapped onto torch's devices
  logs one warning and gives the plain order (rank r on the r-th device from rank 0's) with
  no binding; a binding the kernel refuses logs a warning and leaves the process unbound.
- nvidia-smi and NVML number the GPUs physically; torch numbers the visible ones
  (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): the two are matched by GPU UUID.
- On the CPU there is no topology: one info line says so, and nothing is bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

SMI_TIMEOUT_S = 10.0  # longest wait for one nvidia-smi call, seconds
_PCIE_SCORES = {"PIX": 5, "PXB": 4, "PHB": 3, "NODE": 2, "SYS": 1, "SOC": 1}  # SOC: old SYS
_NVLINK_SCORE = 100  # + the number of links: any NVLink beats any PCIe path
_TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # newer nvidia-smi underlines the header
_FIELD_SEPARATOR = re.compile(r"\t+| {2,}")
# NVML's nvmlDeviceGetTopologyCommonAncestor levels (INTERNAL = one board) as topo -m names
_NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class TopologyError(RuntimeError):
    """The driver's topology could not be read, parsed or matched to torch's devices (logged
    by `plan_ranks` as a warning; the ranks then run in the plain order, unbound)."""


@dataclass(frozen=True, slots=True)
class GpuTopology:
    """The host's GPUs as the driver numbers them.

    Attributes:
        links: links[i][j] is the link kind between GPU i and GPU j ("NV18", "PIX", ..., "X"
            on the diagonal).
        cpu_ids: per GPU, the ids of the CPUs near it, ascending (() = not reported).
        numa_nodes: per GPU, its NUMA node (None = not reported or several).
        uuids: per GPU, its UUID ("GPU-..."), or () when not read.
    """

    links: tuple[tuple[str, ...], ...]
    cpu_ids: tuple[tuple[int, ...], ...]
    numa_nodes: tuple[int | None, ...]
    uuids: tuple[str, ...] = ()

    @property
    def num_gpus(self) -> int:
        return len(self.links)


@dataclass(frozen=True, slots=True)
class RankBinding:
    """Where one rank runs.

    Attributes:
        device_index: torch's CUDA device index of the rank (cuda:device_index); None on the
            CPU.
        cpu_ids: the CPUs its process is bound to, ascending (() = unbound).
        numa_node: its GPU's NUMA node (None = unknown, or the CPU).
    """

    device_index: int | None
    cpu_ids: tuple[int, ...] = ()
    numa_node: int | None = None


def link_score(kind: str) -> int:
    """How good a link is, higher = better: NV# scores 100 + #, then PIX 5, PXB 4, PHB 3,
    NODE 2, SYS 1; anything else ("X", "N/A", unknown) 0."""
    if kind.startswith("NV") and kind[2:].isdigit():
        return _NVLINK_SCORE + int(kind[2:])
    return _PCIE_SCORES.get(kind, 0)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """CPU ids of a list such as "0-47,96-143" (nvidia-smi's CPU Affinity), ascending.

    "N/A" or an empty text gives ().

    Raises:
        TopologyError: a part is not an id or a range "a-b" with a <= b.
    """
    text = text.strip()
    if text in ("", "N/A"):
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise TopologyError(f"bad CPU list {text!r}") from None
        if first > last:
            raise TopologyError(f"bad CPU list {text!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def _fields(line: str) -> list[str]:
    return [f.strip() for f in _FIELD_SEPARATOR.split(line) if f.strip()]


def parse_topo_matrix(text: str) -> GpuTopology:
    """Parse the output of `nvidia-smi topo -m` (tab-separated as printed; runs of two or
    more spaces also separate fields; the legend, NIC rows and columns are skipped).

    Returns:
        GpuTopology with links, CPU lists and NUMA nodes (no UUIDs).

    Raises:
        TopologyError: no GPU header or rows, a row of the wrong length, or a bad CPU list.
    """
    lines = [_fields(_ANSI.sub("", line)) for line in text.splitlines()]
    header_at = next(
        (i for i, f in enumerate(lines) if f and f[0] == "GPU0" and f[1:2] != ["X"]), None
    )
    if header_at is None:
        raise TopologyError("no GPU0 column in the nvidia-smi topo -m output")
    header = lines[header_at]
    devices = [name for name in header if name not in _TRAILING_COLUMNS]
    trailing = header[len(devices) :]
    gpu_columns = [i for i, name in enumerate(devices) if re.fullmatch(r"GPU\d+", name)]
    rows = [f for f in lines[header_at + 1 :] if f and re.fullmatch(r"GPU\d+", f[0])]
    if not rows or len(rows) != len(gpu_columns):
        raise TopologyError(f"{len(gpu_columns)} GPU columns but {len(rows)} GPU rows")
    links, cpu_ids, numa_nodes = [], [], []
    for row in rows:
        values = row[1:]
        if len(values) != len(devices) + len(trailing):
            raise TopologyError(f"row {row[0]} has {len(values)} fields, expected "
                                f"{len(devices) + len(trailing)}")  # fmt: skip
        links.append(tuple(values[i] for i in gpu_columns))
        extra = dict(zip(trailing, values[len(devices) :], strict=True))
        cpu_ids.append(parse_cpu_list(extra.get("CPU Affinity", "")))
        numa = extra.get("NUMA Affinity", "")
        numa_nodes.append(int(numa) if numa.isdigit() else None)
    return GpuTopology(tuple(links), tuple(cpu_ids), tuple(numa_nodes))


def parse_gpu_uuids(text: str) -> dict[int, str]:
    """Map GPU index -> UUID from `nvidia-smi --query-gpu=index,uuid --format=csv,noheader`
    ("0, GPU-1c8b..." per line).

    Raises:
        TopologyError: a line is not "index, uuid".
    """
    uuids: dict[int, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        index, _, uuid = line.partition(",")
        if not index.strip().isdigit() or not uuid.strip():
            raise TopologyError(f"bad nvidia-smi GPU line {line!r}")
        uuids[int(index)] = uuid.strip()
    return uuids


def order_devices(topology: GpuTopology, size: int, first: int = 0) -> list[int]:
    """The GPUs of ranks 0..size-1: `first`, then each time the unused GPU with the best link
    to the previous rank's (`link_score`), ties to a GPU on `first`'s NUMA node, then to the
    lowest index (a greedy chain, so neighbouring ranks share the best links).

    Raises:
        TopologyError: size is larger than the GPUs, or first is not one of them.
    """
    n = topology.num_gpus
    if not 0 <= first < n or size > n:
        raise TopologyError(f"{size} ranks from GPU {first} on a host of {n} GPUs")
    home = topology.numa_nodes[first]
    order = [first]
    unused = [i for i in range(n) if i != first]
    while len(order) < size:
        last = order[-1]
        best = max(
            unused,
            key=lambda j: (link_score(topology.links[last][j]), topology.numa_nodes[j] == home, -j),
        )
        order.append(best)
        unused.remove(best)
    return order


def _normal_uuid(uuid: str) -> str:
    """A UUID as nvidia-smi ("GPU-5b5c...") and torch ("5b5c...") both give it, compared."""
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")


def to_torch_indices(topology: GpuTopology, torch_uuids: Sequence[str]) -> GpuTopology:
    """The topology restricted to torch's visible devices, in torch's numbering.

    Args:
        topology: as the driver numbers the GPUs, with UUIDs.
        torch_uuids: UUID of torch's cuda:0, cuda:1, ... (torch.cuda.get_device_properties).

    Raises:
        TopologyError: the topology has no UUIDs, or a torch device is not among them (a
            MIG instance, for example).
    """
    known = {_normal_uuid(u): i for i, u in enumerate(topology.uuids)}
    physical = []
    for uuid in torch_uuids:
        if _normal_uuid(uuid) not in known:
            raise TopologyError(f"torch device UUID {uuid} is not in the topology")
        physical.append(known[_normal_uuid(uuid)])
    return GpuTopology(
        links=tuple(tuple(topology.links[i][j] for j in physical) for i in physical),
        cpu_ids=tuple(topology.cpu_ids[i] for i in physical),
        numa_nodes=tuple(topology.numa_nodes[i] for i in physical),
        uuids=tuple(topology.uuids[i] for i in physical),
    )


def read_topology_smi(timeout_s: float = SMI_TIMEOUT_S) -> GpuTopology:
    """The topology from `nvidia-smi topo -m` and its GPU UUIDs, each call bounded by
    `timeout_s`.

    Raises:
        TopologyError: nvidia-smi is missing, fails, times out or prints what does not parse.
    """

    def smi(*args: str) -> str:
        try:
            done = subprocess.run(
                ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout_s
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TopologyError(f"nvidia-smi {' '.join(args)}: {exc}") from None
        if done.returncode != 0:
            raise TopologyError(
                f"nvidia-smi {' '.join(args)} exited with {done.returncode}: "
                f"{done.stderr.strip()[:200]}"
            )
        return done.stdout

    topology = parse_topo_matrix(smi("topo", "-m"))
    uuids = parse_gpu_uuids(smi("--query-gpu=index,uuid", "--format=csv,noheader"))
    if sorted(uuids) != list(range(topology.num_gpus)):
        raise TopologyError(f"UUIDs of GPUs {sorted(uuids)}, topology of {topology.num_gpus}")
    ordered = tuple(uuids[i] for i in range(topology.num_gpus))
    return GpuTopology(topology.links, topology.cpu_ids, topology.numa_nodes, ordered)


def _nvml_cpu_ids(nvml: Any, handle: Any, num_cpus: int) -> tuple[int, ...]:
    """A GPU's CPU affinity: NVML's bit mask in 64-bit words, as CPU ids."""
    words = nvml.nvmlDeviceGetCpuAffinity(handle, -(-num_cpus // 64))
    return tuple(w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1)


def _nvml_link(nvml: Any, handles: list, i: int, j: int, num_nvlinks: list[int]) -> str:
    """The topo -m name of the link between GPUs i and j: "NV<n>" when NVLink peer-to-peer
    works (n = GPU i's active NVLinks: exact on an NVSwitch host, where every link reaches
    every peer), else the PCIe level of their common ancestor."""
    if i == j:
        return "X"
    status = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    if status == nvml.NVML_P2P_STATUS_OK and num_nvlinks[i] > 0:
        return f"NV{num_nvlinks[i]}"
    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
    return _NVML_LEVELS.get(int(level), "SYS")


def _nvml_active_links(nvml: Any, handle: Any) -> int:
    count = 0
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            count += nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
        except nvml.NVMLError:  # no such link (or no NVLink at all)
            break
    return count


def read_topology_nvml(nvml: Any, num_cpus: int) -> GpuTopology:
    """The topology through NVML (the `pynvml` module, passed in).

    Args:
        nvml: the pynvml module (or an object with its functions and constants).
        num_cpus: CPUs of the host (os.cpu_count()): the size of the affinity masks.

    Raises:
        TopologyError: an NVML call failed.
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise TopologyError(f"NVML: {exc}") from None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        num_nvlinks = [_nvml_active_links(nvml, h) for h in handles]
        links = tuple(
            tuple(_nvml_link(nvml, handles, i, j, num_nvlinks) for j in range(len(handles)))
            for i in range(len(handles))
        )
        numa_nodes: list[int | None] = []
        for handle in handles:
            try:
                numa_nodes.append(int(nvml.nvmlDeviceGetNumaNodeId(handle)))
            except (AttributeError, nvml.NVMLError):  # an older driver or pynvml
                numa_nodes.append(None)
        uuids = []
        for handle in handles:
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        cpu_ids = tuple(_nvml_cpu_ids(nvml, h, num_cpus) for h in handles)
        return GpuTopology(links, cpu_ids, tuple(numa_nodes), tuple(uuids))
    except nvml.NVMLError as exc:
        raise TopologyError(f"NVML: {exc}") from None
    finally:
        nvml.nvmlShutdown()


def read_topology() -> GpuTopology:
    """The host's topology: NVML when `pynvml` imports, else nvidia-smi.

    Raises:
        TopologyError: as `read_topology_nvml` / `read_topology_smi`.
    """
    try:
        import pynvml
    except ImportError:
        return read_topology_smi()
    return read_topology_nvml(pynvml, os.cpu_count() or 1)


def _cpu_text(cpu_ids: Sequence[int]) -> str:
    """CPU ids as ranges: (0, 1, 2, 5) -> "0-2,5"."""
    parts: list[str] = []
    for cpu in cpu_ids:
        if parts and int(parts[-1].rpartition("-")[2]) == cpu - 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def bindings_from(topology: GpuTopology, size: int, first: int) -> list[RankBinding]:
    """Each rank's GPU (`order_devices`), its CPU list and NUMA node, in torch's numbering.

    Raises:
        TopologyError: as `order_devices`.
    """
    return [
        RankBinding(i, topology.cpu_ids[i], topology.numa_nodes[i])
        for i in order_devices(topology, size, first)
    ]


def plan_ranks(size: int, device: torch.device) -> list[RankBinding]:
    """Where ranks 0..size-1 run: on the CPU `size` unbound ranks (one info log line); on
    CUDA the topology's order from `device` (rank 0's) with each GPU's CPUs, or, when the
    topology cannot be read (a warning says why), the devices from rank 0's on, unbound.

    Args:
        size: ranks (tensor_parallel_size); at most torch.cuda.device_count() on CUDA.
        device: rank 0's device ("cpu", or "cuda[:index]").
    """
    if device.type != "cuda":
        logger.info("tensor parallel on the CPU: no GPU topology, ranks are not bound to cores")
        return [RankBinding(None)] * size
    first = device.index or 0
    num_devices = torch.cuda.device_count()
    try:
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(num_devices)]
        bindings = bindings_from(to_torch_indices(read_topology(), uuids), size, first)
    except TopologyError as exc:
        logger.warning("GPU topology not used (%s): ranks in device order, unbound", exc)
        order = [first, *(i for i in range(num_devices) if i != first)][:size]
        return [RankBinding(i) for i in order]
    logger.info(
        "tensor parallel topology: %s",
        "; ".join(
            f"rank {r} cuda:{b.device_index} CPUs {_cpu_text(b.cpu_ids) or 'any'} NUMA node "
            f"{'?' if b.numa_node is None else b.numa_node}"
            for r, b in enumerate(bindings)
        ),
    )
    return bindings


def bind_process(binding: RankBinding, rank: int) -> tuple[int, ...]:
    """Bind every thread of this process (threads started later inherit it) to the rank's
    CPUs that the process may use; nothing when it has none (the CPU, or none reported).

    Returns:
        The CPUs bound to, ascending; () when left unbound (a warning says why, when it was
        meant to be bound).
    """
    if not binding.cpu_ids:
        return ()
    try:
        allowed = os.sched_getaffinity(0)
        cpus = sorted(set(binding.cpu_ids) & allowed)
        if not cpus:
            logger.warning(
                "rank %d: its GPU's CPUs %s are outside this process's %s; left unbound",
                rank, _cpu_text(binding.cpu_ids), _cpu_text(sorted(allowed)),
            )  # fmt: skip
            return ()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                os.sched_setaffinity(int(tid), cpus)
    except (OSError, AttributeError) as exc:  # no sched_setaffinity or /proc (not Linux)
        logger.warning("rank %d: binding to CPUs %s failed (%s); left unbound",
                       rank, _cpu_text(binding.cpu_ids), exc)  # fmt: skip
        return ()
    numa = "?" if binding.numa_node is None else binding.numa_node
    logger.info("rank %d bound to CPUs %s (NUMA node %s)", rank, _cpu_text(cpus), numa)
    return tuple(cpus)
