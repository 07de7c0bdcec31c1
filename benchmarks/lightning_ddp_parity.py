"""Differential runner under ddp: tests/ddp_rng_program.py (a seeded MLP with dropout, a noisy
dataset, 2 CPU processes over gloo, 2 epochs) trained by PyTorch Lightning and by taskfit, side by
side.

    pip install lightning --no-deps                    # keeps your torch
    python benchmarks/lightning_ddp_parity.py          # both settings (shuffled, unshuffled loader)

Compared: rank 0's weights after fit (max abs difference), ``torch.rand(1)`` in the launching script
after fit, ``callback_metrics``, and on each rank the samples of epochs 0 and 1 and a draw from its
global RNG at ``on_fit_end``. Without Lightning the script says so and exits 0. Each run is a fresh
``python`` (Lightning's ddp launcher runs the script again for rank 1): about 10 s each.
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import ddp_rng_program  # noqa: E402
import rng_program  # noqa: E402


def rows(lit: dict, tf: dict) -> list[tuple[str, str, str, bool]]:
    """(what, Lightning's, taskfit's, same?) for each compared value."""
    diff = rng_program.max_difference(lit["weights"], tf["weights"])
    out = [("weights after fit: max abs difference", "", f"{diff:.3g}", diff == 0.0),
           ("torch.rand(1) after fit (launching process)", f"{lit['rand_after_fit']:.8g}",
            f"{tf['rand_after_fit']:.8g}", lit["rand_after_fit"] == tf["rand_after_fit"]),
           ("callback_metrics", str(lit["callback_metrics"]), str(tf["callback_metrics"]),
            lit["callback_metrics"] == tf["callback_metrics"])]
    for rank in ("rank0", "rank1"):
        for epoch in (0, 1):
            a, b = lit[rank]["seen"][epoch], tf[rank]["seen"][epoch]
            out.append((f"{rank} samples, epoch {epoch}", str(a), str(b), a == b))
        a, b = lit[rank]["rand"], tf[rank]["rand"]
        out.append((f"{rank} global RNG at on_fit_end (a draw)", f"{a:.8g}", f"{b:.8g}", a == b))
    return out


def main() -> int:
    if importlib.util.find_spec("lightning") is None:
        print("PyTorch Lightning is not installed: `pip install lightning --no-deps`, then run "
              "this script again.")
        return 0
    print("| setting | what is compared | Lightning | taskfit | same? |\n|---|---|---|---|---|")
    differ = 0
    for setting in ddp_rng_program.SETTINGS:
        lit, tf = (ddp_rng_program.run_in_subprocess(name, setting)
                   for name in ("lightning", "taskfit"))
        for what, a, b, same in rows(lit, tf):
            differ += not same
            print(f"| {setting} | {what} | {a} | {b} | {'yes' if same else 'NO'} |", flush=True)
    print(f"\n{differ} row(s) differ.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
