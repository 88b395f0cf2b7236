"""The api layer: pydantic v2 models, the single source of truth for every other layer."""
