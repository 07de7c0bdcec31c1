"""The example tasks (``taskfit.examples.digits.DigitsTask``...): their data comes from scikit-learn's bundled sets."""
from __future__ import annotations

from typing import Any

from ..errors import MisconfigurationError


def sklearn_dataset(name: str, **kwargs: Any) -> Any:
    """``sklearn.datasets.<name>()`` (bundled data, no download), or one clear error when scikit-learn is missing."""
    try:
        from sklearn import datasets
    except ImportError:
        raise MisconfigurationError(
            f"The example tasks load scikit-learn's bundled data ({name}), but scikit-learn is not installed.",
            "pip install 'taskfit[examples]' (or pip install scikit-learn); your own TaskModule needs neither.") from None
    return getattr(datasets, name)(**kwargs)
