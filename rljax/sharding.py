"""The device mesh and the one table that maps logical axis names to mesh axes.

Parameters and key activations carry logical axis names (`vocab`, `embed`, `mlp`, `heads`, `kv`,
`batch`, `length`, ...); `LOGICAL_RULES` maps each to mesh axes of the mesh
`("data", "fsdp", "tensor")`, and `logical_to_sharding` turns a tree of names into `NamedSharding`s.

Divisibility: `check_divisibility` lists every mesh axis that the rules assign to a dimension it does
not divide (the run's start-up makes that an error, `rljax.config.validate_runtime`, unless
`mesh.allow_replication`). `logical_to_spec` itself drops such a mesh axis (and uses a mesh axis at most
once per array), so a caller that opted in gets that dimension replicated over it instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axes, in order of preference (flax lm1b / t5x style, kept short on purpose).
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "length": (),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    # Activations keep their hidden dimension whole: their rows are split over (data, fsdp) instead,
    # and FSDP gathers each layer's weights (not the batch).
    "act_embed": (),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv": ("tensor",),
    "head_dim": (),
    "layers": (),
    "norm": (),
}


class LogicalAxes(tuple):
    """A tuple of logical axis names (one per array dimension) that also knows the array's shape.

    A pytree *leaf* (a tuple subclass is not a JAX pytree node), equal to the plain tuple of its names;
    `shape` lets `logical_to_sharding` skip mesh axes that do not divide a dimension.
    """

    shape: tuple[int, ...] | None

    def __new__(cls, names: Sequence[str | None], shape: Sequence[int] | None = None):
        obj = super().__new__(cls, tuple(names))
        if shape is not None and len(shape) != len(obj):
            raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
        obj.shape = None if shape is None else tuple(int(s) for s in shape)
        return obj


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` with axes `("data", "fsdp", "tensor")` over `devices` (default: all devices).

    One size may be -1 (the rest of the devices). The product of the sizes must equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"at most one mesh size may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"mesh data={data} fsdp={fsdp} tensor={tensor}: {len(devices)} devices are not "
                f"divisible by {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} devices, "
            f"but {len(devices)} devices are available"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def logical_to_spec(
    names: Sequence[str | None],
    mesh: Mesh,
    rules: dict[str, tuple[str, ...]] = LOGICAL_RULES,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry logical `names` (None = replicated).

    Mesh axes of size 1, mesh axes already used by an earlier dimension and (when `shape` is known,
    given or from a `LogicalAxes`) mesh axes that do not divide the dimension are skipped.
    """
    if shape is None and isinstance(names, LogicalAxes):
        shape = names.shape
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        if name is not None and name not in rules:
            raise KeyError(f"unknown logical axis {name!r}; rules know: {', '.join(sorted(rules))}")
        axes = []
        size = None if shape is None else shape[dim]
        for axis in rules[name] if name is not None else ():
            n = mesh.shape[axis]
            if (
                n == 1
                or axis in used
                or (size is not None and size % (n * math.prod(mesh.shape[a] for a in axes)))
            ):
                continue
            axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def logical_to_sharding(
    logical_axes_tree: Any, mesh: Mesh, rules: dict[str, tuple[str, ...]] = LOGICAL_RULES
) -> Any:
    """Tree of tuples of logical names (e.g. `rljax.models.param_logical_axes(config)`) -> the same tree
    of `NamedSharding`s on `mesh` (see `logical_to_spec` for the skipping rules)."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, logical_to_spec(names, mesh, rules)),
        logical_axes_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def logical_constraint(
    x: jax.Array, names: Sequence[str | None], mesh: Mesh, rules: dict[str, tuple[str, ...]] = LOGICAL_RULES
) -> jax.Array:
    """`with_sharding_constraint` of an activation `x` by logical names (inside jit)."""
    spec = logical_to_spec(names, mesh, rules, shape=x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class DivisibilityProblem:
    """Mesh axis `axis` (size `axis_size`) assigned by the rules to dimension `dim` (logical `name`, of
    `size`; `left` of it per shard of the mesh axes `before` already placed on that dimension) of the
    tensor at `path`, which it does not divide. `valid` are the sizes of `axis` that every tensor
    sharded on it allows."""

    path: str
    dim: int
    name: str
    size: int
    before: tuple[str, ...]
    left: int
    axis: str
    axis_size: int
    valid: tuple[int, ...]

    def __str__(self) -> str:
        size = (
            f"{self.size}"
            if not self.before
            else f"{self.size}, {self.left} per {'x'.join(self.before)} shard"
        )
        return (
            f"{self.path}: dimension {self.dim} ({self.name!r}, size {size}) is not divisible by mesh axis "
            f"{self.axis}={self.axis_size} (valid {self.axis} sizes: {', '.join(map(str, self.valid))})"
        )


def _placements(
    axes: LogicalAxes, sizes: Mapping[str, int], rules: dict[str, tuple[str, ...]]
) -> Iterator[tuple[int, str, tuple[str, ...], int, str, bool]]:
    """`(dim, logical name, mesh axes placed before, size left, mesh axis, divides)` for each mesh axis of
    size > 1 the rules try on each dimension, in `logical_to_spec`'s order (which skips an axis that
    does not divide, and an axis already used by an earlier dimension)."""
    used: set[str] = set()
    for dim, name in enumerate(axes):
        if name is None:
            continue
        if name not in rules:
            raise KeyError(f"unknown logical axis {name!r}; rules know: {', '.join(sorted(rules))}")
        left, placed = axes.shape[dim], ()
        for axis in rules[name]:
            n = sizes[axis]
            if n == 1 or axis in used:
                continue
            yield dim, name, placed, left, axis, left % n == 0
            if left % n == 0:
                used.add(axis)
                left, placed = left // n, (*placed, axis)


def divisibility_problems(
    logical_axes_tree: Any,
    mesh_or_sizes: Mesh | Mapping[str, int],
    rules: dict[str, tuple[str, ...]] = LOGICAL_RULES,
) -> list[DivisibilityProblem]:
    """Every (tensor, dimension, mesh axis) where the rules assign a mesh axis of size > 1 to a dimension
    it does not divide. Leaves are `LogicalAxes` with shapes (e.g. `rljax.models.param_logical_axes`);
    leaves without a shape are not checked. Paths are dotted tree paths (`layers.q_proj.kernel`)."""
    sizes = dict(mesh_or_sizes.shape) if isinstance(mesh_or_sizes, Mesh) else dict(mesh_or_sizes)
    is_leaf = lambda x: isinstance(x, tuple)  # noqa: E731
    leaves, _ = jax.tree_util.tree_flatten_with_path(logical_axes_tree, is_leaf=is_leaf)
    found, sizes_on = [], {}
    for key_path, axes in leaves:
        if getattr(axes, "shape", None) is None:
            continue
        path = jax.tree_util.keystr(key_path, simple=True, separator=".")
        for dim, name, before, left, axis, divides in _placements(axes, sizes, rules):
            sizes_on.setdefault(axis, []).append(left)
            if not divides:
                found.append((path, dim, name, axes.shape[dim], before, left, axis))
    return [
        DivisibilityProblem(*where, sizes[where[-1]], divisors(math.gcd(*sizes_on[where[-1]])))
        for where in found
    ]


def check_divisibility(
    logical_axes_tree: Any,
    mesh_or_sizes: Mesh | Mapping[str, int],
    rules: dict[str, tuple[str, ...]] = LOGICAL_RULES,
) -> list[str]:
    """One line per mesh axis the rules assign to a dimension it does not divide (see
    `divisibility_problems`), naming the tensor, the logical axis, the size, the mesh axis and the valid
    sizes for it, e.g. `layers.k_proj.kernel: dimension 2 ('kv', size 4) is not divisible by mesh axis
    tensor=8 (valid tensor sizes: 1, 2, 4)`. Empty when every sharded dimension divides."""
    return [str(p) for p in divisibility_problems(logical_axes_tree, mesh_or_sizes, rules)]


def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of `n`, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)
