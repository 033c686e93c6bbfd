"""Persistence of the control plane: SQLAlchemy models, engine and Alembic migrations."""
