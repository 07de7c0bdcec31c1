"""Line charts as RGB images, drawn with Pillow (which tensorboard requires), for a figure in
TensorBoard's Images tab and a PNG file without matplotlib: the learning-rate finder's
loss-against-lr curve (trainer/tune.py).

Why not matplotlib: it is not a dependency of taskfit, and a range test's curve needs only a
polyline, axes with decade ticks and a marked point.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 78, 24, 44, 58  # margins around the plot area (pixels)


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:
        return ImageFont.load_default()


def _ticks(low: float, high: float, log: bool) -> list[float]:
    """Tick positions: every decade on a log axis (at most 8), else about 5 round numbers."""
    if log:
        first, last = math.ceil(math.log10(low) - 1e-9), math.floor(math.log10(high) + 1e-9)
        step = max(1, math.ceil((last - first + 1) / 8))
        return [10.0 ** e for e in range(first, last + 1, step)]
    span = high - low or abs(high) or 1.0
    step = 10 ** math.floor(math.log10(span / 5))
    step *= next(m for m in (1, 2, 5, 10) if span / (step * m) <= 6)
    return [k * step for k in range(math.ceil(low / step), math.floor(high / step) + 1)]


def _label(value: float, log: bool) -> str:
    if log:
        return f"1e{round(math.log10(value))}"
    return f"{value:.4g}"


def line_chart(
    xs: Sequence[float],
    ys: Sequence[float],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    log_x: bool = False,
    mark: int | None = None,
    mark_label: str = "",
    y_max: float | None = None,
) -> Any:
    """An RGB ``PIL.Image`` of ``ys`` against ``xs`` (non-finite points left out), ``mark`` (an
    index) as a red dot; ``y_max`` cuts the y axis there (higher points are drawn on the top
    edge)."""
    from PIL import Image, ImageDraw

    points = [
        (x, y)
        for x, y in zip(xs, ys)
        if math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x)
    ]
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    small, large = _font(13), _font(16)
    draw.text((WIDTH // 2, 14), title, fill="black", font=large, anchor="mt")
    draw.text(
        ((LEFT + WIDTH - RIGHT) // 2, HEIGHT - 14), xlabel, fill="black", font=small, anchor="mb"
    )
    draw.text((12, (TOP + HEIGHT - BOTTOM) // 2), ylabel, fill="black", font=small, anchor="lm")
    box = (LEFT, TOP, WIDTH - RIGHT, HEIGHT - BOTTOM)
    draw.rectangle(box, outline="black")
    if len(points) < 2:
        draw.text(
            ((box[0] + box[2]) // 2, (box[1] + box[3]) // 2),
            "not enough finite points",
            fill="gray",
            font=small,
            anchor="mm",
        )
        return image
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    x0, x1 = min(fx(p[0]) for p in points), max(fx(p[0]) for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y_max is not None and y0 < y_max < y1:
        y1 = y_max
        points = [(x, min(y, y_max)) for x, y in points]
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    x1 = x1 if x1 > x0 else x0 + 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        return (box[0] + (fx(x) - x0) / (x1 - x0) * (box[2] - box[0]),
                box[3] - (y - y0) / (y1 - y0) * (box[3] - box[1]))

    for tick in _ticks(10 ** x0 if log_x else x0, 10 ** x1 if log_x else x1, log_x):
        px = at(tick, y0)[0]
        draw.line([(px, box[3]), (px, box[1])], fill=(225, 225, 225))
        draw.line([(px, box[3]), (px, box[3] + 5)], fill="black")
        draw.text((px, box[3] + 8), _label(tick, log_x), fill="black", font=small, anchor="mt")
    for tick in _ticks(y0, y1, False):
        py = at(10 ** x0 if log_x else x0, tick)[1]
        draw.line([(box[0], py), (box[2], py)], fill=(225, 225, 225))
        draw.line([(box[0] - 5, py), (box[0], py)], fill="black")
        draw.text((box[0] - 8, py), _label(tick, False), fill="black", font=small, anchor="rm")
    draw.line([at(x, y) for x, y in points], fill=(31, 119, 180), width=2)
    if mark is not None and 0 <= mark < len(xs) and math.isfinite(ys[mark]):
        px, py = at(xs[mark], ys[mark])
        draw.ellipse([px - 6, py - 6, px + 6, py + 6], fill=(214, 39, 40))
        if mark_label:
            draw.text((px + 10, py - 10), mark_label, fill=(214, 39, 40), font=small, anchor="lb")
    return image
