"""Data kept apart from the task: a small ``DataModule`` (Lightning's ``LightningDataModule``) and
``DataSource``, where one entry point's loaders come from: loaders passed to
fit/validate/test/predict, a data module, or the TaskModule's own ``*_dataloader`` methods. Whatever
the source, a plain DataLoader is re-created around taskfit's resumable sampler (data.py), so exact
resume and ddp sharding work for all of them.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from .callback import default_hook
from .errors import MisconfigurationError
from .init_args import AttributeDict, recorded_init_args, select_hparams
from .module import TaskModule

LOADERS = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
           "predict": "predict_dataloader"}


class DataModule:
    """The data of a task in a class of its own (Lightning's ``LightningDataModule``): pass it as
    ``trainer.fit(task, datamodule=dm)``. The Trainer calls ``prepare_data()`` (once per machine,
    rank 0 first: downloads), ``setup(stage)`` (every process: splits, transforms), the
    ``*_dataloader()`` methods and ``teardown(stage)``; ``state_dict()``/``load_state_dict()`` are
    saved in checkpoints and restored on resume. Its ``__init__`` arguments are recorded in
    :attr:`hparams`, as a TaskModule's.
    """

    trainer: Any = None  # the Trainer of its current or last run (kept after it, as Lightning's)

    def __new__(cls, *args: Any, **kwargs: Any) -> "DataModule":
        self = super().__new__(cls)
        self.__dict__["_hparams"] = AttributeDict(recorded_init_args(cls, args, kwargs))
        return self

    # Lightning's hooks of a data module: TaskModule's no-ops (@default_hook: the hook table leaves
    # them out unless a subclass writes its own). prepare_data: downloads, once per machine, before
    # setup; setup(stage): splits and transforms, in every process; teardown(stage): after a run of
    # stage ended normally.
    prepare_data = TaskModule.prepare_data
    setup = TaskModule.setup
    teardown = TaskModule.teardown

    # the loaders, as a TaskModule's: train_dataloader is required for fit, the others return None
    # (skipped)
    train_dataloader = TaskModule.train_dataloader
    val_dataloader = TaskModule.val_dataloader
    test_dataloader = TaskModule.test_dataloader
    predict_dataloader = TaskModule.predict_dataloader

    @default_hook
    def on_exception(self, exception: BaseException) -> None:
        """An entry point ended by ``exception``."""

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> DataModule:
        """A data module of datasets (each one, or a list of them), as Lightning's
        ``from_datasets``: DataLoaders of ``batch_size`` with ``num_workers``, the training one
        shuffled (not an IterableDataset). ``datamodule_kwargs`` go to ``cls()``, and
        ``batch_size``/``num_workers`` too where its ``__init__`` takes them (as Lightning's)."""
        import inspect

        from torch.utils.data import DataLoader, IterableDataset

        def make(ds: Any, shuffle: bool) -> Any:
            shuffle = shuffle and not isinstance(ds, IterableDataset)  # (an error for DataLoader)
            return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)

        def loaders(datasets: Any, shuffle: bool) -> Any:
            if isinstance(datasets, (list, tuple)):
                return [make(ds, shuffle) for ds in datasets]
            return make(datasets, shuffle)

        own_init = cls.__init__ is not object.__init__
        params = inspect.signature(cls.__init__).parameters if own_init else {}
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name, value in (("batch_size", batch_size), ("num_workers", num_workers)):
            if takes_all or name in params:
                datamodule_kwargs.setdefault(name, value)
        datamodule = cls(**datamodule_kwargs)
        for name, datasets, shuffle in (
            ("train_dataloader", train_dataset, True),
            ("val_dataloader", val_dataset, False),
            ("test_dataloader", test_dataset, False),
            ("predict_dataloader", predict_dataset, False),
        ):
            if datasets is not None:
                datamodule.__dict__[name] = lambda datasets=datasets, shuffle=shuffle: loaders(
                    datasets, shuffle
                )
        return datamodule

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (sent to ddp workers) without its trainer."""
        return {k: v for k, v in self.__dict__.items() if k != "trainer"}

    def __str__(self) -> str:
        """Lightning's summary of the loaders: one ``{Train dataloader: size=64}`` line per loader
        method (``None`` where it gives none or fails, ``NA`` for a dataset without a length,
        ``1. size=.. ; 2. ...`` for several loaders)."""
        names = ("Train", "Validation", "Test", "Predict")
        return os.linesep.join(f"{{{name} dataloader: {_loaders_info(self, method)}}}"
                               for name, method in zip(names, LOADERS.values()))

    def state_dict(self) -> dict[str, Any]:
        """What this data module needs to continue after a resume (plain containers, numbers,
        tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @property
    def hparams(self) -> AttributeDict:
        """The ``__init__`` arguments (``self.hparams.batch_size``), or those
        :meth:`save_hyperparameters` chose."""
        return self.__dict__["_hparams"]

    def save_hyperparameters(
        self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True
    ) -> None:
        """Lightning's call: keep only ``args`` (names) in :attr:`hparams`, or all but
        ``ignore``."""
        select_hparams(self, args, ignore)


def _loaders_info(datamodule: DataModule, method: str) -> str:
    """``size=N`` of the loader ``method`` returns, or of each of several; ``None`` for none."""
    try:
        loaders = getattr(datamodule, method)()
    except Exception:  # not set up yet, or not defined (Lightning: None)
        return "None"
    if loaders is None:
        return "None"
    if hasattr(loaders, "dataset"):
        return _size(loaders)
    several = loaders.values() if isinstance(loaders, dict) else loaders
    return " ; ".join(f"{i}. {_size(loader)}" for i, loader in enumerate(several, start=1))


def _size(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    return f"size={len(dataset) if hasattr(dataset, '__len__') else 'NA'}"


class DataSource:
    """Where an entry point's loaders come from, per loader as Lightning decides: loaders passed to
    the entry point, else the data module's methods, else the task's. Passing both loaders and a
    data module is an error."""

    def __init__(
        self,
        task: Any,
        fn: str,
        datamodule: Any = None,
        train: Any = None,
        val: Any = None,
        loaders: Any = None,
    ) -> None:
        # fit(task, dm): Lightning accepts it here too
        if isinstance(train, DataModule) and datamodule is None:
            datamodule, train = train, None
        if isinstance(loaders, DataModule) and datamodule is None:
            datamodule, loaders = loaders, None
        passed = [name for name, value in (("train_dataloaders", train), ("val_dataloaders", val),
                                           ("dataloaders", loaders)) if value is not None]
        for name, value in (
            ("train_dataloaders", train),
            ("val_dataloaders", val),
            ("dataloaders", loaders),
        ):
            # fit(task, "last"): taskfit's order before Lightning's
            if isinstance(value, (str, os.PathLike)):
                raise MisconfigurationError(
                    f"Trainer.{fn}(task, {value!r}): the second argument is {name} (Lightning's "
                    "order), not a "
                    "checkpoint.", f"name it: trainer.{fn}(task, ckpt_path={value!r}).")
        if datamodule is not None and passed:
            raise MisconfigurationError(
                f"Trainer.{fn}() got both {passed[0]}= and datamodule=.",
                f"pass one of them: the loaders, or a DataModule whose {LOADERS[fn]}() returns "
                "them.")
        if datamodule is not None and not isinstance(datamodule, DataModule):
            raise MisconfigurationError(
                f"Trainer.{fn}(datamodule=...) got {type(datamodule).__name__}, not a "
                "taskfit.DataModule.",
                "subclass taskfit.DataModule (Lightning's LightningDataModule: the same methods), "
                f"or pass the loaders themselves: Trainer.{fn}(task, "
                f"{'train_dataloaders' if fn == 'fit' else 'dataloaders'}=...).")
        self.task, self.datamodule = task, datamodule
        self.passed = {"train_dataloader": train, "val_dataloader": val if fn == "fit" else None,
                       LOADERS[fn]: loaders if fn != "fit" else train}
        # Lightning's rule: fit validates only a task that has a validation step (here also the
        # default one: forward and the task's own loss); a GAN's val_dataloader from a shared data
        # module is then not used.
        self.skip_val = (
            fn == "fit"
            and isinstance(task, TaskModule)
            and not (
                callable(getattr(type(task), "validation_step", None))
                or type(task).loss is not TaskModule.loss
            )
        )
        if self.skip_val and self.defines("val_dataloader"):
            warnings.warn(f"{type(task).__name__} defines no validation_step (nor a loss for the "
                          "default one), so fit does not validate, although "
                          f"{self.owner}.val_dataloader() is defined (Lightning: 'Skipping val "
                          "loop'). HINT: define validation_step(self, batch, batch_idx) to "
                          "validate.", stacklevel=3)

    def _get(self, method: str) -> Any:
        if self.passed.get(method) is not None:
            return self.passed[method]
        # Lightning's `model.val_dataloader = None`: no such loader
        fn = getattr(self.datamodule if self.datamodule is not None else self.task, method)
        return None if fn is None else fn()

    def defines(self, method: str) -> bool:
        """The loader of ``method`` is passed, or the data module's or task's own method (not the
        base's None, nor an attribute set to None as Lightning's ``model.val_dataloader = None``
        turns it off)."""
        if self.passed.get(method) is not None:
            return True
        source = self.datamodule if self.datamodule is not None else self.task
        if getattr(source, method, None) is None:
            return False
        return getattr(type(source), method, None) is not getattr(TaskModule, method)

    def provides(self, method: str) -> bool:
        """The loader of ``method`` comes from somewhere other than the task (check_task then does
        not ask it)."""
        return self.passed.get(method) is not None or self.datamodule is not None

    def train_dataloader(self) -> Any:
        return self._get("train_dataloader")

    def val_dataloader(self) -> Any:
        return None if self.skip_val else self._get("val_dataloader")

    def test_dataloader(self) -> Any:
        return self._get("test_dataloader")

    def predict_dataloader(self) -> Any:
        return self._get("predict_dataloader")

    @property
    def owner(self) -> str:
        """Who defines the loaders (for error messages)."""
        return type(self.datamodule if self.datamodule is not None else self.task).__name__
