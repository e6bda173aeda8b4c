"""The data sources, one module each, found by name (docs/design/sources.md, "Adding a source").

A module of this package is a source when it sets `NAME = "<its own module name>"`; codi.sources.registry
imports it by that name, and codi.schemas.source_names lists them without importing any.
"""
