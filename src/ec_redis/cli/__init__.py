"""The ``ec-redis`` command line."""
