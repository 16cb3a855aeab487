"""The device mesh and every sharding looprl uses, in one place (docs/DESIGN.md §3).

Mesh axes `("data", "fsdp", "tensor")`, sizes from `MeshConfig` (-1 = the rest of the devices;
by default pure data parallelism over every visible device of every process).

- **Batches** (rollout rows, the KV cache's B axis, learner micro-batches) are split by rows over
  `data` x `fsdp` (`ROW_AXES`), padded to a multiple of the shard count and cut back after.
- **Parameters and optimizer state** are replicated over `data` and stored sharded over `fsdp`
  along their largest divisible axis (`param_specs`), all-gathered (pure data movement) for use.
- **Compute** runs under `shard_map`: each device runs the one-device program on its rows, no
  contraction axis split, so with the row-invariant kernels (`looprl.kernels`) a row's numbers
  are the same bits on 1 or N devices and replay stays exact on a mesh. Gradients are summed
  over the row axes (`psum`, `psum_scatter`) in another order than on one device: updated
  parameters agree to rounding, not bits. `tensor` > 1 is refused by the config.

`mesh_record` is what a `Schedule` stores; `replay_compatible` says whether a learner may claim
exactness for a rollout recorded on another mesh. Across processes, arrays are built from host
numpy (`jax.make_array_from_callback`) and read back with `process_allgather` (`to_host`).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from looprl.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
ROW_AXES = ("data", "fsdp")


def mesh_shape(data: int = -1, fsdp: int = 1, tensor: int = 1,
               n_devices: int | None = None) -> tuple[int, int, int]:
    """Resolve -1 (the rest of the devices) to sizes whose product is the device count.

    Raises ConfigError naming the `mesh.*` key when the sizes do not fit the devices."""
    n = jax.device_count() if n_devices is None else n_devices
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"config keys {['mesh.' + k for k in free]}: at most one may be -1")
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if n % fixed:
            others = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v != -1)
            raise ConfigError(f"config key 'mesh.{free[0]}' (-1, the rest): {others} = {fixed} "
                              f"devices does not divide the {n} visible devices")
        sizes[free[0]] = n // fixed
    if int(np.prod(list(sizes.values()))) != n:
        raise ConfigError(f"config keys mesh.data/fsdp/tensor: expected sizes whose product is "
                          f"the {n} visible devices, found {sizes}")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_cfg=None, devices=None) -> Mesh:
    """The mesh of `mesh_cfg` (a `looprl.config.MeshConfig`; None: data parallel over all
    devices) over `devices` (default: all devices of all processes)."""
    devices = jax.devices() if devices is None else list(devices)
    kw = {} if mesh_cfg is None else dict(data=mesh_cfg.data, fsdp=mesh_cfg.fsdp,
                                           tensor=mesh_cfg.tensor)
    shape = mesh_shape(**kw, n_devices=len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def row_shards(mesh: Mesh | None) -> int:
    """How many pieces a batch's rows are split into (1 without a mesh)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in ROW_AXES]))


def is_sharded(mesh: Mesh | None) -> bool:
    """True when `mesh` splits anything (more than one device)."""
    return mesh is not None and mesh.size > 1


def row_spec(ndim: int = 1, axis: int = 0) -> P:
    """PartitionSpec splitting axis `axis` of an `ndim`-d array over the row axes."""
    parts: list[Any] = [None] * ndim
    parts[axis] = ROW_AXES
    return P(*parts)


def row_sharding(mesh: Mesh, ndim: int = 1, axis: int = 0) -> NamedSharding:
    return NamedSharding(mesh, row_spec(ndim, axis))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# --- parameters -----------------------------------------------------------------------------

def _leaf_spec(shape, fsdp: int) -> P:
    """fsdp shards the largest axis it divides (ties: the last, i.e. a kernel's output axis);
    a leaf it divides nowhere (norms, the gate bias) stays replicated."""
    if fsdp <= 1 or not shape:
        return P()
    order = sorted(range(len(shape)), key=lambda a: (shape[a], a), reverse=True)
    for a in order:
        if shape[a] % fsdp == 0 and shape[a] >= fsdp:
            parts: list[Any] = [None] * len(shape)
            parts[a] = "fsdp"
            return P(*parts)
    return P()


def param_specs(tree, mesh: Mesh):
    """PartitionSpec per leaf of a parameter (or optimizer state) tree (see module doc).

    Storage sharding only: every consumer all-gathers before use (`gather_fsdp`), so which axis
    is split never changes a contraction."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda a: _leaf_spec(tuple(getattr(a, "shape", np.shape(a))), fsdp),
                        tree)


def param_shardings(tree, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(tree, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def place_params(tree, mesh: Mesh | None):
    """The tree as global jax arrays with `param_shardings` (numpy/jax leaves, any process)."""
    if not is_sharded(mesh):
        return tree
    return jax.tree.map(lambda a, s: put_global(a, s), tree, param_shardings(tree, mesh))


def gather_fsdp(tree, specs):
    """Inside `shard_map`: all-gather the fsdp-sharded leaves (tiled) to full arrays. Its
    transpose is a `psum_scatter`, so gradients come back sharded and summed over fsdp."""
    def one(x, spec):
        for a, name in enumerate(spec):
            if name == "fsdp":
                return jax.lax.all_gather(x, "fsdp", axis=a, tiled=True)
        return x
    return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))


def sum_grads(grads, specs):
    """Inside `shard_map`: the gradient of the global loss from each device's share: `psum` over
    the row axes a leaf is not already summed over (fsdp-sharded leaves were summed over fsdp
    by the all-gather's transpose)."""
    def one(g, spec):
        axes = tuple(a for a in ROW_AXES if a not in tuple(spec))
        return jax.lax.psum(g, axes)
    return jax.tree.map(one, grads, specs, is_leaf=lambda x: isinstance(x, P))


# --- host <-> global arrays -----------------------------------------------------------------

def put_global(host, sharding: NamedSharding):
    """A global jax array with `sharding` from a host array every process holds in full."""
    if isinstance(host, jax.Array):
        if host.sharding == sharding:
            return host
        if not host.is_fully_addressable or host.sharding.device_set == sharding.device_set:
            return jax.device_put(host, sharding)  # reshard on device
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process, sharded) jax array as a full numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def pad_rows(a, n_rows: int, axis: int = 0, fill: str = "zeros"):
    """`a` with its `axis` extended to `n_rows` by zeros or (`fill="first"`) copies of row 0."""
    a = np.asarray(a)
    extra = n_rows - a.shape[axis]
    if extra <= 0:
        return a
    if fill == "first":
        rep = np.take(a, [0] * extra, axis=axis)
    else:
        shape = list(a.shape)
        shape[axis] = extra
        rep = np.zeros(shape, a.dtype)
    return np.concatenate([a, rep], axis=axis)


def padded_rows(n: int, mesh: Mesh | None) -> int:
    k = row_shards(mesh)
    return -(-n // k) * k


# --- sharded calls ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _row_call(fn, static: tuple, mesh: Mesh, n_rep: int, row_axes_in: tuple,
              row_axes_out: tuple):
    fn = functools.partial(fn, **dict(static))

    def spec(axis):
        return P() if axis is None else P(*([None] * axis), ROW_AXES)
    in_specs = tuple([P()] * n_rep + [spec(a) for a in row_axes_in])
    out_specs = tuple(spec(a) for a in row_axes_out)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))


def row_sharded_call(fn, mesh: Mesh, replicated_args: tuple, row_args: tuple, *,
                     static: dict | None = None, row_axes_in: tuple | None = None,
                     row_axes_out: tuple = (0,)):
    """Run `fn(*replicated_args, *row_args, **static)`, the row arrays split over the row axes.

    Every device runs `fn` (the one-device program) on its rows; `replicated_args` (parameter
    trees) are all-gathered to each device. Rows are padded with zeros to a multiple of the
    shard count and the padding dropped from the outputs. The compiled call is cached on `fn`
    (a module-level function) and the hashable values of `static`. Returns a tuple of numpy
    arrays (full, on every process)."""
    row_axes_in = row_axes_in or (0,) * len(row_args)
    n = np.shape(row_args[0])[row_axes_in[0]]
    n_pad = padded_rows(n, mesh)
    rows = [put_global(pad_rows(a, n_pad, ax), row_sharding(mesh, np.ndim(a), ax))
            for a, ax in zip(row_args, row_axes_in)]
    reps = [jax.tree.map(lambda a: put_global(a, replicated(mesh)), r) for r in replicated_args]
    call = _row_call(fn, tuple(sorted((static or {}).items())), mesh, len(replicated_args),
                     tuple(row_axes_in), tuple(row_axes_out))
    outs = call(*reps, *rows)
    return tuple(np.take(to_host(o), np.arange(n), axis=ax) for o, ax in zip(outs, row_axes_out))


# --- records ----------------------------------------------------------------------------------

def mesh_record(mesh: Mesh | None, params=None) -> dict[str, Any]:
    """What a `Schedule` records about where a computation ran (docs/DESIGN.md §3): axis names and
    sizes, device and process counts, the row split, and the parameter shardings.
    `contraction_sharded` is False by construction (all parameters are gathered before use)."""
    if mesh is None:
        return {"axes": {a: 1 for a in AXES}, "devices": 1, "processes": jax.process_count(),
                "row_axes": list(ROW_AXES), "row_shards": 1, "param_sharding": "replicated",
                "contraction_sharded": False, "compute": "single-device"}
    rec = {"axes": {a: int(mesh.shape[a]) for a in AXES}, "devices": int(mesh.size),
           "processes": jax.process_count(), "row_axes": list(ROW_AXES),
           "row_shards": row_shards(mesh), "contraction_sharded": False,
           "compute": "shard_map rows; parameters all-gathered before use"}
    if params is not None and mesh.shape["fsdp"] > 1:
        specs = jax.tree_util.tree_leaves_with_path(
            param_specs(params, mesh), is_leaf=lambda x: isinstance(x, P))
        rec["param_sharding"] = {jax.tree_util.keystr(k): str(s) for k, s in specs
                                 if any(x is not None for x in s)}
    else:
        rec["param_sharding"] = "replicated"
    return rec


def replay_compatible(sampler_mesh: dict | None, learner_mesh: dict | None) -> tuple[bool, str]:
    """May a learner on `learner_mesh` claim bit-exact replay of a rollout sampled on
    `sampler_mesh`? Yes when neither split a contraction axis (each device then ran the
    one-device program on whole rows, and the kernels are row-invariant); otherwise only on an
    identical mesh and sharding. Returns (ok, reason)."""
    s = sampler_mesh or mesh_record(None)
    lr = learner_mesh or mesh_record(None)
    if not s.get("contraction_sharded", False) and not lr.get("contraction_sharded", False):
        return True, "row-split only on both sides (row-invariant kernels)"
    keys = ("axes", "param_sharding", "row_axes")
    if all(s.get(k) == lr.get(k) for k in keys):
        return True, "identical mesh and shardings"
    return False, (f"the rollout's mesh {s.get('axes')} / {s.get('param_sharding')} split a "
                   f"contraction axis and differs from the learner's {lr.get('axes')} / "
                   f"{lr.get('param_sharding')}: replay bits are not claimed")
