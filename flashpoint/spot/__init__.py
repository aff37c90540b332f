"""Spot VMs: eviction notices, replacement hosts, and what they cost."""
