"""Names Lightning programs import from Lightning's top level that have no work to do in taskfit.

Lightning's own examples start with ``cli_lightning_logo()``; after the guide's rename
(``lightning.pytorch`` -> ``taskfit``) that import must still resolve. The stand-in prints a plain
banner: the name is cosmetic."""
from __future__ import annotations

from ...version import __version__

BANNER = f"taskfit {__version__}"


def cli_lightning_logo() -> None:
    """Lightning's logo printer, as a plain stand-in: a blank line, a one-line banner, a blank
    line."""
    print()
    print(BANNER)
    print()
