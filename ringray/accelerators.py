"""Accelerators and cluster shapes that ``ringray plan`` knows, with their sources.

    cluster = parse_cluster("4x8xH100")     # 4 nodes x 8 H100 (NVLink inside, InfiniBand across)
    cluster = custom_cluster(tflops=300, link_gbps=100, memory_gib=24)
    peak_flops_of("NVIDIA H100 80GB HBM3")  # 989e12: what the trainer's MFU is taken against

Plain data, no imports from the rest of ringray: the figures have one home here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30


class PlanError(ValueError):
    """A cluster description or job that ``ringray plan`` cannot use; the message names the
    flag or field."""


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One device: memory, dense bf16 peak, and one direction of its links."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense (no sparsity) bf16 tensor-core FLOP/s
    intra_node_bytes_per_second: float  # NVLink, one direction (what a ring send gets)
    inter_node_bytes_per_second: float  # this GPU's own NIC, one direction


# Memory is the datasheet's "80GB"/"141GB" read as GiB (HBM stacks are binary-sized; a driver
# reports a little less, which the plan's reserve covers). The datasheets' NVLink figures are
# both directions together; a ring sends one way, so half.
ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM column): 80GB HBM3, BF16 1,979 TFLOPS with
    # sparsity (989 dense), NVLink 900GB/s. InfiniBand: NVIDIA DGX H100 datasheet, 8x ConnectX-7
    # NDR 400Gb/s, one per GPU.
    "H100": Accelerator(name="H100", memory_bytes=80 * GIB, peak_flops=989e12,
                        intra_node_bytes_per_second=450e9, inter_node_bytes_per_second=400e9 / 8),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM column): 141GB HBM3e, BF16 1,979 TFLOPS with
    # sparsity (989 dense), NVLink 900GB/s. InfiniBand: as the DGX H100 (NVIDIA DGX H200
    # datasheet: 8x ConnectX-7 400Gb/s).
    "H200": Accelerator(name="H200", memory_bytes=141 * GIB, peak_flops=989e12,
                        intra_node_bytes_per_second=450e9, inter_node_bytes_per_second=400e9 / 8),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column): BF16 312 TFLOPS dense (624 with
    # sparsity), NVLink 600GB/s. InfiniBand: NVIDIA DGX A100 datasheet, 8x ConnectX-6 HDR
    # 200Gb/s, one per GPU.
    "A100": Accelerator(name="A100", memory_bytes=80 * GIB, peak_flops=312e12,
                        intra_node_bytes_per_second=300e9, inter_node_bytes_per_second=200e9 / 8),
    # NVIDIA L40S datasheet: 48GB GDDR6, BF16 733 TFLOPS with sparsity (362 dense), PCIe Gen4
    # x16 64GB/s bidirectional and no NVLink. There is no standard NIC per card, so both links
    # are the PCIe figure; give --link-gbps for a real network.
    "L40S": Accelerator(name="L40S", memory_bytes=48 * GIB, peak_flops=362e12,
                        intra_node_bytes_per_second=32e9, inter_node_bytes_per_second=32e9),
    # NVIDIA L4 datasheet: 24GB GDDR6, BF16 242 TFLOPS with sparsity (121 dense), PCIe Gen4 x16
    # 64GB/s bidirectional; links as for the L40S.
    "L4": Accelerator(name="L4", memory_bytes=24 * GIB, peak_flops=121e12,
                      intra_node_bytes_per_second=32e9, inter_node_bytes_per_second=32e9),
}


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of a device named like ``torch.cuda.get_device_name()`` reports it
    (``"NVIDIA H100 80GB HBM3"``), or ``None`` for one not in :data:`ACCELERATORS`. Longer
    names are tried first, so an L40S is not taken for an L4."""
    for key in sorted(ACCELERATORS, key=len, reverse=True):
        if key in device_name.upper():
            return ACCELERATORS[key].peak_flops
    return None


@dataclass(frozen=True, kw_only=True)
class ClusterShape:
    """Nodes of identical accelerators; ``nodes``/``gpus_per_node`` are None for a custom
    device given by its figures alone (one link speed everywhere, no size limit)."""

    accelerator: Accelerator
    nodes: int | None = None
    gpus_per_node: int | None = None

    @property
    def total_devices(self) -> int | None:
        return None if self.nodes is None else self.nodes * self.gpus_per_node

    def describe(self) -> str:
        if self.nodes is None:
            return "a custom device"
        return f"{self.nodes}x{self.gpus_per_node}x{self.accelerator.name}"

    def ring_link(self, cp: int) -> tuple[str, float]:
        """The slowest link a ring of ``cp`` consecutive ranks crosses, and its bytes/s.

        Placement packs a ring onto as few nodes as possible; once it spans nodes, every ring
        step waits for the inter-node hop.
        """
        acc = self.accelerator
        if self.gpus_per_node is None:
            return "custom link", acc.intra_node_bytes_per_second
        if cp <= self.gpus_per_node:
            return "NVLink", acc.intra_node_bytes_per_second
        return "InfiniBand", acc.inter_node_bytes_per_second


_CLUSTER_FORM = "NODESxGPUSxACCELERATOR, e.g. 4x8xH100"


def parse_cluster(text: str) -> ClusterShape:
    """``4x8xH100``: 4 nodes of 8 H100s (NVLink inside a node, InfiniBand between)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*([A-Za-z0-9]+)\s*", text)
    if not match:
        raise PlanError(f"--cluster: {text!r} is not of the form {_CLUSTER_FORM}")
    nodes, gpus, name = int(match[1]), int(match[2]), match[3].upper()
    if nodes < 1 or gpus < 1:
        raise PlanError(f"--cluster: {text!r} needs at least 1 node and 1 GPU per node")
    if name not in ACCELERATORS:
        raise PlanError(f"--cluster: unknown accelerator {match[3]!r}; known: "
                        f"{', '.join(ACCELERATORS)} (or give --gpu-tflops, --link-gbps and "
                        f"--gpu-mem-gib)")
    return ClusterShape(accelerator=ACCELERATORS[name], nodes=nodes, gpus_per_node=gpus)


# What a custom device's figures may be: (smallest, largest, an example). Below the smallest
# the plan's figures print as 0.0 and mean nothing; above the largest (or inf) they overflow.
_CUSTOM_RANGES = {
    "--gpu-tflops": (0.01, 1e6, "989 for an H100"),
    "--link-gbps": (0.01, 1e6, "3600 for NVLink 4, 400 for InfiniBand NDR"),
    "--gpu-mem-gib": (1.0, 1e6, "80 for an H100"),
}


def custom_cluster(*, tflops: float, link_gbps: float, memory_gib: float) -> ClusterShape:
    """A device given by its dense peak (TFLOP/s), ring link (Gb/s, one way) and memory (GiB).

    Raises:
        PlanError: a figure that is not finite or lies outside :data:`_CUSTOM_RANGES`.
    """
    for flag, value in (("--gpu-tflops", tflops), ("--link-gbps", link_gbps),
                        ("--gpu-mem-gib", memory_gib)):
        low, high, example = _CUSTOM_RANGES[flag]
        if not low <= value <= high:  # NaN fails both comparisons
            raise PlanError(f"{flag}: {value:g} is out of range; give a number from {low:g} to "
                            f"{high:g} (e.g. {example})")
    link = link_gbps * 1e9 / 8
    device = Accelerator(
        name="custom",
        memory_bytes=int(memory_gib * GIB), peak_flops=tflops * 1e12,
        intra_node_bytes_per_second=link, inter_node_bytes_per_second=link,
    )
    return ClusterShape(accelerator=device)
