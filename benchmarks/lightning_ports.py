"""The ported Lightning examples against the originals: the same program, data and seed under Lightning and taskfit.

    pip install lightning 'jsonargparse[signatures]'      # the autoencoder's LightningCLI needs jsonargparse
    python benchmarks/lightning_ports.py                  # autoencoder (10 epochs) and GAN (--quick: 12 epochs)
    python benchmarks/lightning_ports.py --quick          # autoencoder 3 epochs
    python benchmarks/lightning_ports.py --only autoencoder

Without Lightning the script says so and exits 0. Each program runs twice in a fresh process and folder under
./lightning_ports_runs: examples/lightning_<name>.py as it is (taskfit), and the same file with its framework
import lines put back (each changed line sits under a "# was:" comment holding the original) while the data and
torchvision stand-ins stay (taskfit.examples.lightning_stand_ins; the GAN's data module built on
LightningDataModule). The wall times include start-up; the run is seeded as the program seeds it (the
autoencoder: LightningCLI's 1234) or, for the unseeded GAN, with seed_everything(0) before it starts.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
RUNS = os.path.abspath("lightning_ports_runs")
STAND_INS = "taskfit.examples.lightning_stand_ins"
DATA_MODULE = ("from lightning.pytorch import LightningDataModule as _Base; from " + STAND_INS +
               " import mnist_datamodule_class; MNISTDataModule = mnist_datamodule_class(_Base)")


def lightning_source(port: str) -> str:
    """The port with Lightning's own import lines back: a line under ``# was: <original>`` becomes the original where
    that imports Lightning's training API; the data/torchvision stand-ins and the other changed lines stay."""
    lines, out = open(port).read().splitlines(), []
    for i, line in enumerate(lines):
        above = lines[i - 1].strip() if i else ""
        original = above.removeprefix("# was: ") if above.startswith("# was: ") else None
        indent = line[: len(line) - len(line.lstrip())]
        if original and "MNISTDataModule" in original:
            line = indent + DATA_MODULE
        elif original and original.startswith("from lightning.pytorch") and not re.search(
                r"mnist_datamodule|_TORCHVISION_AVAILABLE", original):
            line = indent + original
        out.append(line)
    return "\n".join(out) + "\n"


def run(name: str, framework: str, args: list[str], seed: int | None) -> tuple[str, float, str]:
    """Run one program in a fresh folder; ``(folder, wall seconds, stdout)``."""
    folder = os.path.join(RUNS, f"{name}_{framework}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    port = os.path.join(EXAMPLES, f"lightning_{name}.py")
    script = port if framework == "taskfit" else os.path.join(folder, f"{name}.py")
    if framework == "lightning":
        with open(script, "w") as f:
            f.write(lightning_source(port))
    seeding = "" if seed is None else (
        f"from {'taskfit' if framework == 'taskfit' else 'lightning.pytorch'} import seed_everything; "
        f"seed_everything({seed}); ")
    code = f"import runpy, sys; {seeding}sys.argv = {[script, *args]!r}; runpy.run_path({script!r}, run_name='__main__')"
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{name} under {framework} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return folder, seconds, proc.stdout


def scalar(folder: str, tag: str) -> float:
    """The last value of ``tag`` in any event file under ``folder`` (TensorBoard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for path in sorted(glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True)):
        events = EventAccumulator(path)
        events.Reload()
        if tag in events.Tags()["scalars"]:
            return events.Scalars(tag)[-1].value
    raise KeyError(f"{tag} not logged under {folder}")


def weights(folder: str, pattern: str) -> dict[str, torch.Tensor]:
    """The module's weights in the one checkpoint matching ``pattern`` (either framework's layout)."""
    [path] = glob.glob(os.path.join(folder, "**", pattern), recursive=True)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint.get("state_dict") or checkpoint["module"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def autoencoder(epochs: int) -> list[str]:
    args = [f"--trainer.max_epochs={epochs}"]
    (lit, lit_s, lit_out), (tf, tf_s, tf_out) = (run("autoencoder", f, args, None) for f in ("lightning", "taskfit"))
    lit_loss, tf_loss = scalar(lit, "test_loss_epoch"), scalar(tf, "test/test_loss_epoch")
    grids = sorted(os.path.basename(p) for p in glob.glob(os.path.join(lit, "grid_*.png")))
    same = [g for g in grids if open(os.path.join(lit, g), "rb").read() == open(os.path.join(tf, g), "rb").read()]
    diff = max_difference(weights(lit, "epoch=*.ckpt"), weights(tf, "epoch=*.ckpt"))
    printed = lambda out: out[out.index("tensor("):] if "tensor(" in out else "(none)"  # noqa: E731
    return [f"| autoencoder, {epochs} epochs | {lit_s:.1f} | {tf_s:.1f} | test loss {lit_loss!r} / {tf_loss!r} "
            f"({abs(lit_loss - tf_loss) / lit_loss:.1e} relative); best checkpoint's weights: max difference "
            f"{diff:.1e}; predictions[0] printed: {'the same' if printed(lit_out) == printed(tf_out) else 'DIFFER'}; "
            f"image grids: {len(same)} of {len(grids)} byte-identical |"]


def gan(seed: int) -> list[str]:
    import torch.nn.functional as F
    from taskfit.examples.gan import judge, train_judge
    from taskfit.examples.lightning_gan import GAN
    from taskfit.examples.lightning_stand_ins import MNIST, ToTensor

    (lit, lit_s, _), (tf, tf_s, _) = (run("gan", f, ["--quick"], seed) for f in ("lightning", "taskfit"))
    torch.manual_seed(0)  # the same judge every run
    classifier = train_judge()

    def verdict(state: dict[str, torch.Tensor] | None = None, images: torch.Tensor | None = None) -> str:
        if images is None:
            torch.manual_seed(seed)
            model = GAN()
            if state is not None:
                model.load_state_dict(state)
            model.eval()
            with torch.no_grad():
                images = model(torch.randn(1000, 100, generator=torch.Generator().manual_seed(123)))
        found = judge(classifier, F.interpolate(images.clamp(0, 1), size=(8, 8), mode="area"), threshold=0.5)
        return f"{found['confident']:.2f} sure, entropy {found['class_entropy']:.2f}"

    test = MNIST(".", train=False)
    real = torch.stack([ToTensor()(image) for image in test.data])
    lit_state, tf_state = weights(lit, "epoch=*.ckpt"), weights(tf, "epoch=*.ckpt")
    return [f"| GAN, 12 epochs (--quick), seed {seed} | {lit_s:.1f} | {tf_s:.1f} | digits judge on 1,000 samples "
            f"(share classified with p > 0.5, entropy of the class histogram; ln 10 = 2.30): Lightning "
            f"{verdict(lit_state)}, taskfit {verdict(tf_state)}, untrained {verdict()}, real test digits "
            f"{verdict(images=real)}; weights differ by up to {max_difference(lit_state, tf_state):.2f} (the "
            "shuffled order differs: docs/migrating-lightning.md) |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the autoencoder for 3 epochs instead of 10")
    parser.add_argument("--only", choices=("autoencoder", "gan"))
    parser.add_argument("--seed", type=int, default=0, help="the GAN's seed")
    args = parser.parse_args()
    if importlib.util.find_spec("lightning") is None:
        print("PyTorch Lightning is not installed: `pip install lightning 'jsonargparse[signatures]'` (or `pip install "
              "lightning --no-deps` to keep your torch), then run this script again.")
        return 0
    import lightning

    rows = [f"Lightning {lightning.__version__} against taskfit {__import__('taskfit').__version__}, "
            f"{torch.get_num_threads()} threads; runs under {RUNS}\n",
            "| program | Lightning s | taskfit s | compared |", "|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    if args.only in (None, "autoencoder"):
        if importlib.util.find_spec("jsonargparse") is None:
            print("| autoencoder | - | - | skipped: its LightningCLI needs `pip install 'jsonargparse[signatures]'` |")
        else:
            print("\n".join(autoencoder(3 if args.quick else 10)), flush=True)
    if args.only in (None, "gan"):
        print("\n".join(gan(args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
