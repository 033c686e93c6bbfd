"""Alembic migrations of the control plane's database (run by control_plane.db.migrate)."""
