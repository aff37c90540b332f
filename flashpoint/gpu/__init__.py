"""GPU discovery and sharing."""
