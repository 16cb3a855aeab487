"""Meshes, shardings and multi-process start: `mesh` and `multihost`."""

