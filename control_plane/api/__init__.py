"""HTTP routes of the control plane, one module per responsibility."""
