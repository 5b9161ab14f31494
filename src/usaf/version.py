"""The package version, importable without the package's public API."""

__version__ = "0.2.0"
