"""Point-to-point transports the algorithms run on: MPI (real processes) and threads."""

from .base import Tag, Transport, View

__all__ = ["Tag", "Transport", "View"]
