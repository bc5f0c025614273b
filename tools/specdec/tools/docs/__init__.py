"""Generators of the documentation site's reference pages (`make docs-gen`)."""
