"""Stand-ins for what the ported Lightning examples import from outside Lightning's training API, so
that a port changes import lines, not code (examples/lightning_autoencoder.py,
examples/lightning_gan.py).

- The data: torchvision's ``MNIST`` and Lightning's demo ``MNISTDataModule`` serve scikit-learn's
  bundled digits (1,797 images, no download) scaled up from 8x8 to MNIST's 28x28, so the models'
  ``28 * 28`` layers stay as written. ``MNIST(train=True)`` holds 1,500 of them,
  ``MNIST(train=False)`` the other 297.
- torchvision (not installable beside this torch):
  ``transforms.ToTensor``/``Normalize``/``Compose``, ``utils.make_grid`` and ``utils.save_image``
  with torchvision's arguments and pixel arithmetic.
- ``LightningCLI``: the part the autoencoder uses (``--trainer.x=v``, ``--model.x=v``,
  ``--data.x=v`` and ``--seed_everything=n`` overrides, ``run=False``, the configuration saved in
  the run directory); taskfit's own command line is Hydra's (docs/configuration.md).
  ``cli_lightning_logo`` is taskfit's own (``from taskfit import cli_lightning_logo``: a plain
  banner), re-exported here for the ports' import line.

The data module is built by :func:`mnist_datamodule_class` on a given base class, so that
benchmarks/lightning_ports.py can run the very same data under Lightning (on
``LightningDataModule``).
"""
from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split

from .. import cli_lightning_logo  # noqa: F401 (re-exported: the ports import it from here)
from ..callbacks import Callback
from ..datamodule import DataModule
from ..seed import seed_everything
from ..trainer import Trainer
from . import sklearn_dataset

_TORCHVISION_AVAILABLE = True  # the stand-ins below take torchvision's place
TRAIN_IMAGES = 1500  # MNIST(train=True); the remaining 297 digits are MNIST(train=False)
QUICK_EPOCHS = 3  # the examples' smoke run (--quick or TASKFIT_QUICK=1)


def quick(argv: list[str] | None = None) -> bool:
    """The examples' smoke-run switch: ``--quick`` among the arguments, or ``TASKFIT_QUICK=1``."""
    return (
        "--quick" in (sys.argv[1:] if argv is None else argv)
        or os.environ.get("TASKFIT_QUICK") == "1"
    )


# ---- torchvision ---------------------------------------------------------------------------------
class ToTensor:
    """An image of uint8 pixels ``(H, W)`` -> a float tensor ``(1, H, W)`` in [0, 1], as
    torchvision's for MNIST."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.unsqueeze(0).float().div(255)


class Normalize:
    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = mean, std

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        mean, std = torch.tensor(self.mean).view(-1, 1, 1), torch.tensor(self.std).view(-1, 1, 1)
        return (image - mean) / std


class Compose:
    def __init__(self, transforms: list[Callable[[Any], Any]]) -> None:
        self.transforms = transforms

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


def make_grid(
    tensor: torch.Tensor | list[torch.Tensor],
    nrow: int = 8,
    padding: int = 2,
    normalize: bool = False,
    value_range: tuple[float, float] | None = None,
    scale_each: bool = False,
    pad_value: float = 0.0,
) -> torch.Tensor:
    """torchvision.utils.make_grid: ``(B, C, H, W)`` images in rows of ``nrow``, one channel
    repeated to three."""
    if isinstance(tensor, list):
        tensor = torch.stack(tensor)
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() == 3:
        tensor = (torch.cat((tensor, tensor, tensor)) if tensor.size(0) == 1 else tensor).unsqueeze(
            0
        )
    if tensor.size(1) == 1:
        tensor = torch.cat((tensor, tensor, tensor), 1)
    if normalize:
        tensor = tensor.clone()
        for image in (tensor if scale_each else [tensor]):
            low, high = (
                value_range if value_range is not None else (float(image.min()), float(image.max()))
            )
            image.clamp_(min=low, max=high).sub_(low).div_(max(high - low, 1e-5))
    if tensor.size(0) == 1:
        return tensor.squeeze(0)
    count = tensor.size(0)
    columns = min(nrow, count)
    rows = int(math.ceil(count / columns))
    height, width = tensor.size(2) + padding, tensor.size(3) + padding
    grid = tensor.new_full(
        (tensor.size(1), height * rows + padding, width * columns + padding), pad_value
    )
    for k in range(count):
        y, x = divmod(k, columns)
        grid[
            :, y * height + padding : (y + 1) * height, x * width + padding : (x + 1) * width
        ].copy_(tensor[k])
    return grid


def save_image(
    tensor: torch.Tensor | list[torch.Tensor], fp: str, format: str | None = None, **kwargs: Any
) -> None:
    """torchvision.utils.save_image: :func:`make_grid`, then 8-bit RGB pixels (x*255 + 0.5, clamped)
    as a PNG."""
    from PIL import Image  # installed with tensorboard

    grid = make_grid(tensor, **kwargs)
    pixels = grid.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to("cpu", torch.uint8).numpy()
    Image.fromarray(pixels).save(fp, format=format)


transforms = SimpleNamespace(ToTensor=ToTensor, Normalize=Normalize, Compose=Compose)
torchvision = SimpleNamespace(
    transforms=transforms, utils=SimpleNamespace(make_grid=make_grid, save_image=save_image)
)


# ---- the data ------------------------------------------------------------------------------------
class MNIST(Dataset):
    """torchvision's ``MNIST(root, train, transform, target_transform, download)``, serving the
    bundled digits at 28x28: ``data`` holds uint8 images ``(N, 28, 28)``, ``targets`` the labels;
    nothing is read from ``root``."""

    def __init__(self, root: str, train: bool = True, transform: Callable | None = None,
                 target_transform: Callable | None = None, download: bool = False) -> None:
        digits = sklearn_dataset("load_digits")
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False).squeeze(
            1
        )
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
        keep = order[:TRAIN_IMAGES] if train else order[TRAIN_IMAGES:]
        self.data = images[keep].mul(255).round().to(torch.uint8)
        self.targets = torch.tensor(digits.target)[keep]
        self.root, self.train, self.transform, self.target_transform = (
            root,
            train,
            transform,
            target_transform,
        )

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __len__(self) -> int:
        return len(self.data)


def mnist_datamodule_class(base: type) -> type:
    """Lightning's demo ``MNISTDataModule`` (its arguments, splits and loaders) on ``base``
    (taskfit's DataModule here, Lightning's LightningDataModule in benchmarks/lightning_ports.py),
    over :class:`MNIST`. Two defaults are scaled to the data: ``val_split`` 125 of 1,500 (MNIST:
    5,000 of 60,000) and ``num_workers`` 0 (MNIST: 16, for files on disk; these images are in
    memory); pinned memory only where a GPU is."""

    class MNISTDataModule(base):
        name = "mnist"

        def __init__(self, data_dir: str = "./data", val_split: int = 125, num_workers: int = 0,
                     normalize: bool = False, seed: int = 42, batch_size: int = 32) -> None:
            super().__init__()
            self.data_dir, self.val_split, self.num_workers = data_dir, val_split, num_workers
            self.normalize, self.seed, self.batch_size = normalize, seed, batch_size

        @property
        def num_classes(self) -> int:
            return 10

        def prepare_data(self) -> None:
            MNIST(self.data_dir, train=True, download=True)
            MNIST(self.data_dir, train=False, download=True)

        def setup(self, stage: str) -> None:
            dataset = MNIST(
                self.data_dir, train=True, download=False, transform=self.default_transforms
            )
            self.dataset_train, self.dataset_val = random_split(
                dataset,
                [len(dataset) - self.val_split, self.val_split],
                generator=torch.Generator().manual_seed(42),
            )

        def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
            return DataLoader(
                dataset,
                batch_size=self.batch_size,
                shuffle=shuffle,
                num_workers=self.num_workers,
                drop_last=True,
                pin_memory=torch.cuda.is_available(),
            )

        def train_dataloader(self) -> DataLoader:
            return self._loader(self.dataset_train, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return self._loader(self.dataset_val, shuffle=False)

        def test_dataloader(self) -> DataLoader:
            test = MNIST(
                self.data_dir, train=False, download=False, transform=self.default_transforms
            )
            return self._loader(test, shuffle=False)

        @property
        def default_transforms(self) -> Callable:
            if self.normalize:
                return Compose([ToTensor(), Normalize(mean=(0.5,), std=(0.5,))])
            return ToTensor()

    return MNISTDataModule


MNISTDataModule = mnist_datamodule_class(DataModule)


# ---- LightningCLI --------------------------------------------------------------------------------
class SaveConfig(Callback):
    """Lightning's SaveConfigCallback: the parsed configuration as ``config.yaml`` in the run
    directory (rank 0)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def setup(self, trainer: Any, task: Any, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero and trainer.log_dir:
            import yaml  # installed with hydra-core

            os.makedirs(trainer.log_dir, exist_ok=True)
            with open(os.path.join(trainer.log_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(self.config, f, sort_keys=False)


class LightningCLI:
    """What the autoencoder asks of Lightning's ``LightningCLI``: the seed, the model, the data
    module and the Trainer built from their defaults and
    ``--model.x=v``/``--data.x=v``/``--trainer.x=v``/``--seed_everything=n`` (values read as YAML,
    as jsonargparse does), ``trainer_defaults``, the configuration saved at fit start. ``run=False``
    builds them only; ``run=True`` also fits. ``--quick`` (or ``TASKFIT_QUICK=1``):
    ``max_epochs=3``."""

    def __init__(
        self,
        model_class: type,
        datamodule_class: type,
        seed_everything_default: int | bool = True,
        run: bool = True,
        trainer_defaults: dict[str, Any] | None = None,
        save_config_kwargs: dict[str, Any] | None = None,
        args: list[str] | None = None,
    ) -> None:
        import yaml

        argv = sys.argv[1:] if args is None else list(args)
        config: dict[str, Any] = {
            "seed_everything": seed_everything_default,
            "trainer": {},
            "model": {},
            "data": {},
        }
        if quick(argv):
            config["trainer"]["max_epochs"] = QUICK_EPOCHS
        for arg in (a for a in argv if a != "--quick"):
            key, _, value = arg.removeprefix("--").partition("=")
            group, _, name = key.partition(".")
            if group == "seed_everything":
                config["seed_everything"] = yaml.safe_load(value)
            else:
                config[group][name] = yaml.safe_load(value)  # an unknown group: KeyError, naming it
        if config["seed_everything"] is not False:
            seed = config["seed_everything"]
            config["seed_everything"] = seed_everything(
                torch.seed() % 2**31 if seed is True else seed
            )
        self.model = model_class(**config["model"])
        self.datamodule = datamodule_class(**config["data"])
        trainer_args = {**(trainer_defaults or {}), **config["trainer"]}
        if save_config_kwargs is not False:
            callbacks = trainer_args.get("callbacks") or []
            callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
            trainer_args["callbacks"] = [*callbacks, SaveConfig(config)]
        self.trainer = Trainer(**trainer_args)
        if run:
            self.trainer.fit(self.model, datamodule=self.datamodule)

