"""GPU topology (`sits.parallel.topology`): `nvidia-smi topo -m` texts of three hosts (in
topo/, tab-separated as the driver prints them: an 8 x H200 NVSwitch board over two NUMA
nodes with NICs and an underlined header, a two-socket 4-GPU PCIe box, a 2-GPU NVLink-bridge
box of an older driver without the GPU NUMA ID column) parse to exact links, CPU lists and
NUMA nodes; the rank orders, the torch-numbering map, the NVML reader (a fake module), the
fallbacks that never fail a start, the CPU's one log line and the binding itself."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sits.parallel import topology
from sits.parallel.topology import (
    GpuTopology,
    RankBinding,
    TopologyError,
    bind_process,
    bindings_from,
    link_score,
    order_devices,
    parse_cpu_list,
    parse_gpu_uuids,
    parse_topo_matrix,
    plan_ranks,
    read_topology_nvml,
    read_topology_smi,
    to_torch_indices,
)

TOPO = Path(__file__).parent / "topo"
SOCKET0_H200 = (*range(0, 56), *range(112, 168))
SOCKET1_H200 = (*range(56, 112), *range(168, 224))
SOCKET0_PCIE = (*range(0, 16), *range(32, 48))
SOCKET1_PCIE = (*range(16, 32), *range(48, 64))
UUIDS = tuple(f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4))


def _parse(name: str) -> GpuTopology:
    return parse_topo_matrix((TOPO / name).read_text())


def test_h200x8_nvswitch_two_numa_nodes() -> None:
    topo = _parse("h200x8.txt")
    assert topo.num_gpus == 8
    assert all(topo.links[i][j] == ("X" if i == j else "NV18") for i in range(8) for j in range(8))
    assert topo.cpu_ids == (SOCKET0_H200,) * 4 + (SOCKET1_H200,) * 4
    assert topo.numa_nodes == (0, 0, 0, 0, 1, 1, 1, 1)
    assert order_devices(topo, 8) == [0, 1, 2, 3, 4, 5, 6, 7]  # all NVSwitch: identity
    assert order_devices(topo, 2) == [0, 1]
    # equal links: rank 0's NUMA node first, so four ranks from GPU 4 stay on node 1
    assert order_devices(topo, 4, first=4) == [4, 5, 6, 7]
    assert order_devices(topo, 6, first=2) == [2, 0, 1, 3, 4, 5]
    bindings = bindings_from(topo, 2, 4)
    assert bindings == [RankBinding(4, SOCKET1_H200, 1), RankBinding(5, SOCKET1_H200, 1)]


def test_pcie4_two_sockets_pairs_the_gpus_behind_one_switch() -> None:
    topo = _parse("pcie4.txt")
    assert topo.links == (
        ("X", "SYS", "PIX", "SYS"),
        ("SYS", "X", "SYS", "PIX"),
        ("PIX", "SYS", "X", "SYS"),
        ("SYS", "PIX", "SYS", "X"),
    )
    assert topo.cpu_ids == (SOCKET0_PCIE, SOCKET1_PCIE, SOCKET0_PCIE, SOCKET1_PCIE)
    assert topo.numa_nodes == (0, 1, 0, 1)
    assert order_devices(topo, 4) == [0, 2, 1, 3]
    assert order_devices(topo, 2) == [0, 2]
    assert order_devices(topo, 2, first=1) == [1, 3]
    assert order_devices(topo, 3, first=3) == [3, 1, 0]
    assert [b.device_index for b in bindings_from(topo, 4, 0)] == [0, 2, 1, 3]
    assert [b.numa_node for b in bindings_from(topo, 4, 0)] == [0, 0, 1, 1]


def test_nvlink2_older_driver_without_gpu_numa_id() -> None:
    topo = _parse("nvlink2.txt")
    assert topo.links == (("X", "NV4"), ("NV4", "X"))
    assert topo.cpu_ids == (tuple(range(32)),) * 2
    assert topo.numa_nodes == (0, 0)
    assert order_devices(topo, 2) == [0, 1]
    assert order_devices(topo, 2, first=1) == [1, 0]
    with pytest.raises(TopologyError, match="3 ranks from GPU 0 on a host of 2 GPUs"):
        order_devices(topo, 3)


def test_space_separated_text_parses_alike() -> None:
    text = (TOPO / "pcie4.txt").read_text().replace("\t", "    ")
    assert parse_topo_matrix(text) == _parse("pcie4.txt")


def test_link_scores_and_cpu_lists() -> None:
    kinds = ["NV18", "NV4", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS", "X"]
    assert sorted(kinds, key=link_score, reverse=True) == kinds
    assert [link_score(k) for k in ("NV18", "PIX", "SYS", "SOC", "X", "N/A")] == [
        118,
        5,
        1,
        1,
        0,
        0,
    ]
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("N/A") == () and parse_cpu_list("") == ()
    for bad in ("0-x", "5-3", "a"):
        with pytest.raises(TopologyError, match="bad CPU list"):
            parse_cpu_list(bad)


def test_bad_texts_are_refused() -> None:
    with pytest.raises(TopologyError, match="no GPU0 column"):
        parse_topo_matrix("No devices were found\n")
    rows = (TOPO / "pcie4.txt").read_text().splitlines()
    with pytest.raises(TopologyError, match="4 GPU columns but 3 GPU rows"):
        parse_topo_matrix("\n".join(rows[:4]))
    with pytest.raises(TopologyError, match="row GPU1 has 5 fields, expected 7"):
        parse_topo_matrix("\n".join([rows[0], rows[1], rows[2].rsplit("\t", 3)[0], *rows[3:]]))
    assert parse_gpu_uuids("0, GPU-a\n1, GPU-b\n") == {0: "GPU-a", 1: "GPU-b"}
    with pytest.raises(TopologyError, match="bad nvidia-smi GPU line"):
        parse_gpu_uuids("GPU-a\n")


def _with_uuids(topo: GpuTopology) -> GpuTopology:
    return GpuTopology(topo.links, topo.cpu_ids, topo.numa_nodes, UUIDS[: topo.num_gpus])


def test_torch_numbering_follows_the_uuids() -> None:
    """CUDA_VISIBLE_DEVICES=3,1,0: torch's cuda:0 is the driver's GPU 3 (torch's UUIDs lack
    the "GPU-" prefix)."""
    topo = _with_uuids(_parse("pcie4.txt"))
    seen = to_torch_indices(topo, [UUIDS[3][4:], UUIDS[1][4:].upper(), UUIDS[0]])
    assert seen.links == (("X", "PIX", "SYS"), ("PIX", "X", "SYS"), ("SYS", "SYS", "X"))
    assert seen.cpu_ids == (SOCKET1_PCIE, SOCKET1_PCIE, SOCKET0_PCIE)
    assert seen.numa_nodes == (1, 1, 0)
    assert order_devices(seen, 2, first=0) == [0, 1]
    with pytest.raises(TopologyError, match="MIG-1 is not in the topology"):
        to_torch_indices(topo, ["MIG-1"])


def _fake_smi(outputs: dict[str, str]):
    def run(args, **kwargs):
        assert kwargs["timeout"] == topology.SMI_TIMEOUT_S
        return subprocess.CompletedProcess(args, 0, outputs[args[1]], "")

    return run


def test_nvidia_smi_reader(monkeypatch) -> None:
    uuid_text = "".join(f"{i}, {u}\n" for i, u in enumerate(UUIDS))
    outputs = {"topo": (TOPO / "pcie4.txt").read_text(), "--query-gpu=index,uuid": uuid_text}
    monkeypatch.setattr(topology.subprocess, "run", _fake_smi(outputs))
    assert read_topology_smi() == _with_uuids(_parse("pcie4.txt"))

    def timeout(args, **kwargs):
        raise subprocess.TimeoutExpired(args, kwargs["timeout"])

    monkeypatch.setattr(topology.subprocess, "run", timeout)
    with pytest.raises(TopologyError, match="nvidia-smi topo -m: .*timed out after 10"):
        read_topology_smi()

    def failing(args, **kwargs):
        return subprocess.CompletedProcess(args, 9, "", "Failed to initialize NVML\n")

    monkeypatch.setattr(topology.subprocess, "run", failing)
    with pytest.raises(TopologyError, match="exited with 9: Failed to initialize NVML"):
        read_topology_smi()


class _FakeNvml:
    """The pynvml functions the reader calls, answering as the 4-GPU PCIe box (no NVLink)
    or, with nvlinks > 0, as a host whose GPUs all reach each other over that many links."""

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    class NVMLError(Exception):
        pass

    def __init__(self, nvlinks: int = 0) -> None:
        self.nvlinks = nvlinks
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        if link >= self.nvlinks:
            raise self.NVMLError("Not Supported")
        return 1

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        assert index == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if self.nvlinks else 3  # 3: NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 10 if a % 2 == b % 2 else 50  # SINGLE (PIX) or SYSTEM

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        return handle % 2

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return UUIDS[handle].encode()  # older pynvml returns bytes

    def nvmlDeviceGetCpuAffinity(self, handle: int, num_words: int) -> list[int]:
        assert num_words == 1  # 64 CPUs: one 64-bit word
        cpus = SOCKET0_PCIE if handle % 2 == 0 else SOCKET1_PCIE
        return [sum(1 << c for c in cpus)]


def test_nvml_reader_gives_what_nvidia_smi_gives() -> None:
    nvml = _FakeNvml()
    assert read_topology_nvml(nvml, num_cpus=64) == _with_uuids(_parse("pcie4.txt"))
    assert nvml.shut_down
    switched = read_topology_nvml(_FakeNvml(nvlinks=18), num_cpus=64)
    assert switched.links[0] == ("X", "NV18", "NV18", "NV18")
    assert order_devices(switched, 4) == [0, 2, 1, 3]  # equal links: NUMA node 0 first


def test_cpu_plan_is_one_log_line_and_no_binding(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="sits.parallel.topology"):
        bindings = plan_ranks(2, torch.device("cpu"))
        assert bind_process(bindings[1], 1) == ()
    assert bindings == [RankBinding(None), RankBinding(None)]
    assert [r.getMessage() for r in caplog.records] == [
        "tensor parallel on the CPU: no GPU topology, ranks are not bound to cores"
    ]


def _fake_cuda(monkeypatch, uuids: list[str]) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i][4:])
    )


def test_cuda_plan_orders_and_binds_by_the_topology(monkeypatch, caplog) -> None:
    _fake_cuda(monkeypatch, list(UUIDS))
    monkeypatch.setattr(topology, "read_topology", lambda: _with_uuids(_parse("pcie4.txt")))
    with caplog.at_level(logging.INFO, logger="sits.parallel.topology"):
        bindings = plan_ranks(2, torch.device("cuda", 1))
    assert bindings == [RankBinding(1, SOCKET1_PCIE, 1), RankBinding(3, SOCKET1_PCIE, 1)]
    assert caplog.messages == [
        "tensor parallel topology: rank 0 cuda:1 CPUs 16-31,48-63 NUMA node 1; "
        "rank 1 cuda:3 CPUs 16-31,48-63 NUMA node 1"
    ]


def test_an_unreadable_topology_warns_and_runs_unbound(monkeypatch, caplog) -> None:
    _fake_cuda(monkeypatch, list(UUIDS))

    def missing(args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    monkeypatch.setattr(topology.subprocess, "run", missing)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # not importable
    with caplog.at_level(logging.WARNING, logger="sits.parallel.topology"):
        bindings = plan_ranks(3, torch.device("cuda", 2))
    assert bindings == [RankBinding(2), RankBinding(0), RankBinding(1)]
    (message,) = caplog.messages
    assert message.startswith("GPU topology not used (nvidia-smi topo -m: [Errno 2] No such")
    assert message.endswith("): ranks in device order, unbound")


@pytest.fixture
def _restore_affinity():
    allowed = os.sched_getaffinity(0)
    yield allowed
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), allowed)


def test_binding_sets_every_threads_affinity(_restore_affinity, caplog) -> None:
    allowed = _restore_affinity
    cpu = min(allowed)
    wanted = (cpu, 10_000)  # 10000: not a CPU of this machine, dropped
    with caplog.at_level(logging.INFO, logger="sits.parallel.topology"):
        assert bind_process(RankBinding(0, wanted, 0), 1) == (cpu,)
    assert os.sched_getaffinity(0) == {cpu}
    assert caplog.messages == [f"rank 1 bound to CPUs {cpu} (NUMA node 0)"]


def test_binding_outside_the_allowed_cpus_warns(_restore_affinity, caplog) -> None:
    allowed = _restore_affinity
    with caplog.at_level(logging.WARNING, logger="sits.parallel.topology"):
        assert bind_process(RankBinding(0, (10_000, 10_001)), 2) == ()
    assert os.sched_getaffinity(0) == allowed
    (message,) = caplog.messages
    assert message.startswith("rank 2: its GPU's CPUs 10000-10001 are outside this process's ")
