"""The numpy core: what a rank's numbers become and how they merge, with nothing above it.

Its modules, one line each: docs/architecture.md, "Modules".
"""
