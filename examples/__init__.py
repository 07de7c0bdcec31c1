"""The example tasks (``taskfit.examples.digits.DigitsTask``...): their data comes from
scikit-learn's bundled sets."""
from __future__ import annotations

from typing import Any

from ..errors import MisconfigurationError


def sklearn_dataset(name: str, **kwargs: Any) -> Any:
    """``sklearn.datasets.<name>()`` (bundled data, no download), or one clear error when
    scikit-learn is missing."""
    try:
        from sklearn import datasets
    except ImportError:
        raise MisconfigurationError(
            f"The example tasks load scikit-learn's bundled data ({name}), but scikit-learn is not "
            "installed.",
            "pip install 'taskfit[examples]' (or pip install scikit-learn); your own TaskModule "
            "needs neither.",
        ) from None
    return getattr(datasets, name)(**kwargs)


def image_grid(images: Any, nrow: int = 8, zoom: int = 4, padding: int = 2) -> Any:
    """``(N, 1, H, W)`` images in [0, 1] as one ``(1, rows*(H*zoom+padding)+padding, ...)`` grid,
    each pixel a ``zoom x zoom`` square, on a dark grey background, for ``SummaryWriter.add_image``
    (CHW) and :func:`save_png` (torchvision not needed)."""
    import torch

    images = images.detach().float().clamp(0, 1).cpu()
    images = images.repeat_interleave(zoom, -2).repeat_interleave(zoom, -1)
    n, _, h, w = images.shape
    rows = -(-n // nrow)
    grid = torch.full((1, rows * (h + padding) + padding, nrow * (w + padding) + padding), 0.3)
    for i, image in enumerate(images):
        top, left = padding + (i // nrow) * (h + padding), padding + (i % nrow) * (w + padding)
        grid[:, top:top + h, left:left + w] = image[:1]
    return grid


def save_png(grids: Any, path: str, gap: int = 6) -> None:
    """Write one or more grids of :func:`image_grid` (stacked top to bottom) as a greyscale PNG,
    with Pillow (installed with tensorboard, which taskfit depends on)."""
    import os

    import torch
    from PIL import Image

    grids = list(grids) if isinstance(grids, (list, tuple)) else [grids]
    width = max(g.shape[-1] for g in grids)
    parts = []
    for i, grid in enumerate(grids):
        parts.append(torch.nn.functional.pad(grid[0], (0, width - grid.shape[-1]), value=1.0))
        if i < len(grids) - 1:
            parts.append(torch.ones(gap, width))
    pixels = (torch.cat(parts) * 255).round().to(torch.uint8).numpy()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(pixels).save(path)  # uint8, 2-D: greyscale
