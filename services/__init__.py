"""lorabus services: each subpackage runs as `python -m services.<name>`."""
