"""The `meridian` command line."""
