"""Meshes, shardings and multi-process start (issue 7): `mesh` and `multihost`."""

