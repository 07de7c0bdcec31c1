"""The package version (one place: the checkpoint header and ``taskfit.__version__`` read it)."""
__version__ = "0.1.0"
