"""The shipped hardware profiles (one YAML per chip), installed as package data: see pyproject.toml."""
