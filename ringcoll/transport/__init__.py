"""Point-to-point transports the algorithms run on: MPI (real processes) and threads."""

from .base import Tag, Transport, View, describe_tag

__all__ = ["Tag", "Transport", "View", "describe_tag"]
