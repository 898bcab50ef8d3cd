"""heliotrope: a federated multi-cluster GPU job broker."""

__version__ = "0.1.0"
