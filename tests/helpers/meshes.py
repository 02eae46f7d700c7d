"""Mesh shapes with every axis 1 unless given, and small meshes on the first emulated devices."""

import math

import jax
from jax.sharding import Mesh

from lumen_jax.config import MeshConfig
from lumen_jax.generate import ONE_DEVICE  # {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}
from lumen_jax.parallel.mesh import make_mesh


def mesh_shape(**axes: int) -> dict[str, int]:
    """ONE_DEVICE with `axes` set: data, fsdp, context and tensor always named (MeshConfig's fsdp
    defaults to -1, "the rest of the devices"), the other axes where given."""
    return {**ONE_DEVICE, **axes}


def mesh_config(**fields) -> MeshConfig:
    """A MeshConfig whose axes are 1 unless given; `fields` may set any mesh field (zero_stage, ...)."""
    return MeshConfig(**mesh_shape(**fields))


def small_mesh(**axes: int) -> Mesh:
    """The mesh of `axes` (an axis left out has size 1) over the first prod(axes) devices."""
    return make_mesh(axes, jax.devices()[:math.prod(axes.values())])


def one_device_mesh() -> Mesh:
    return small_mesh(**ONE_DEVICE)
