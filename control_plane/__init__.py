"""Meridian's control plane: node registry, API keys and the versioned routing table."""
