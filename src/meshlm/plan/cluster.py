"""A cluster of one or more GPU types: `--gpu h100:8,a100-80gb:8` or parallel.devices, in rank order.

Ranks are numbered group after group (the first group's ranks come first), as a launcher numbers the
nodes it is given in order. The mesh puts `tp` innermost and `pp` outermost (docs/architecture.md,
"The mesh"), so which device types a group of ranks spans follows from the degrees alone: a TP group
is `tp` neighbouring ranks, a pipeline stage one contiguous block of world/pp ranks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.cards import device_groups
from .hardware import GPU, HardwareError, get_gpu


@dataclass(frozen=True)
class Group:
    """`count` GPUs of one profile, `gpu.gpus_per_node` to a node."""
    card: str       # the name as given (h100, a100-80gb, ...)
    gpu: GPU
    count: int


@dataclass(frozen=True)
class Cluster:
    groups: tuple[Group, ...]

    @property
    def world(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def mixed(self) -> bool:
        return len({g.gpu for g in self.groups}) > 1

    def spec(self) -> str:
        """The cluster as `--gpu` takes it (and parallel.devices lists it)."""
        return ",".join(self.items())

    def items(self) -> list[str]:
        return [f"{g.card}:{g.count}" + ("" if g.gpu.gpus_per_node == 8 else f"/{g.gpu.gpus_per_node}")
                for g in self.groups]

    def starts(self) -> list[int]:
        out, at = [], 0
        for g in self.groups:
            out.append(at)
            at += g.count
        return out

    def types_in(self, first: int, n: int) -> list[Group]:
        """The groups whose ranks [first, first + n) touch, in rank order."""
        return [g for g, s in zip(self.groups, self.starts()) if s < first + n and first < s + g.count]

    def slowest(self, groups: list[Group]) -> Group:
        """The group a collective over these groups waits for: the least peak, then the least HBM."""
        return min(groups, key=lambda g: (g.gpu.peak_flops, g.gpu.hbm_bw, g.gpu.hbm_bytes))

    def fastest(self) -> Group:
        """The fastest type (its group holding the most GPUs when one type is listed twice)."""
        best = max(self.groups, key=lambda g: (g.gpu.peak_flops, g.gpu.hbm_bw, g.gpu.hbm_bytes))
        return Group(best.card, best.gpu, sum(g.count for g in self.groups if g.gpu == best.gpu))

    def describe(self) -> str:
        return " + ".join(f"{g.count} × {g.gpu.name} (ranks {s}-{s + g.count - 1}, {g.gpu.gpus_per_node}/node)"
                          for g, s in zip(self.groups, self.starts()))


def is_mixed_flag(gpu: str | None) -> bool:
    """`--gpu TYPE:COUNT[,...]` rather than one profile name."""
    return bool(gpu) and ":" in gpu


def parse_cluster(items: list[str], key: str = "--gpu", **overrides) -> Cluster:
    """The groups of `items` (cards.device_groups' form), each a profile with `overrides` (the
    --peak-tflops ... flags, applied to every type; --gpus-per-node only where the item gives no /NODE).
    A one-line HardwareError naming `key` on a bad item or an unknown type."""
    try:
        parsed = device_groups(items)
    except ValueError as e:
        raise HardwareError(f"{key}: {e}") from None
    if not parsed:
        raise HardwareError(f"{key}: no device groups given")
    groups = []
    for name, count, node in parsed:
        try:
            gpu = get_gpu(name, **overrides)
        except HardwareError as e:
            raise HardwareError(f"{key}: {str(e).removeprefix('--gpu: ')}") from None
        if node is not None:
            gpu = dataclasses.replace(gpu, gpus_per_node=node)
        if count % gpu.gpus_per_node and count > gpu.gpus_per_node:
            raise HardwareError(f"{key}: {name}:{count} is not whole nodes of {gpu.gpus_per_node} GPUs "
                                f"(give the node size: {name}:{count}/N)")
        groups.append(Group(name, gpu, count))
    return Cluster(tuple(groups))


def check_world(cluster: Cluster, world: int | None, key: str) -> None:
    """The groups must add up to the world size (`key` names where that size came from)."""
    if world is not None and world != cluster.world:
        raise HardwareError(f"{key}: {world} ranks, but the device groups {cluster.spec()} add up to "
                            f"{cluster.world}")


def tp_span(cluster: Cluster, tp: int, key: str = "parallel.tp") -> None:
    """Refuse a layout whose TP group holds two device types (one line naming `key`): TP runs in lock
    step on every matmul, so it would run at the slower card's pace and over the slower link."""
    if tp <= 1:
        return
    for first in range(0, cluster.world, tp):
        kinds = cluster.types_in(first, tp)
        if len({g.gpu for g in kinds}) > 1:
            raise HardwareError(f"{key}: the TP group of ranks {first}-{first + tp - 1} spans "
                                f"{' and '.join(g.card for g in kinds)}; TP stays inside one device type "
                                f"(a smaller tp, or groups in multiples of tp)")


def check_devices(cfg, world: int) -> Cluster | None:
    """parallel.devices against the world size and the layout, before any worker starts (plan/search/auto.py
    `layout_for_run` calls it): known types, the right count, no TP group across two types. A ConfigError-like
    one-line HardwareError naming parallel.devices or parallel.tp; None without devices."""
    if not cfg.parallel.devices:
        return None
    cluster = parse_cluster(list(cfg.parallel.devices), key="parallel.devices")
    if cluster.world != world:
        raise HardwareError(f"parallel.devices: {cluster.spec()} adds up to {cluster.world} GPUs, the world "
                            f"size is {world}")
    tp_span(cluster, cfg.parallel.tp)
    return cluster
