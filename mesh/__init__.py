"""Named N-D meshes of ranks (no numpy dependency)."""

from .index import MeshIndex
from .mesh import AxesArg, Mesh

__all__ = ["Mesh", "MeshIndex", "AxesArg"]
