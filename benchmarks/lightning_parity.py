"""Differential runner: the same model, data and seed trained by PyTorch Lightning and by taskfit, side by side.

    pip install lightning                                # or `pip install lightning --no-deps`: keeps your torch
    python benchmarks/lightning_parity.py                # every setting, one Markdown table
    python benchmarks/lightning_parity.py --only sanity  # one setting (--help lists their names)

Without Lightning the script says so and exits 0. Files land under ./lightning_parity_runs (run it from a scratch
directory). The set-up is tests/test_lightning_semantics.py's: a bias-free Linear(1, 1) from zero, SGD, x = 0..17
in batches of 2 (9 training batches per epoch), validation on x = 100..103, the loss the squared error to y = x
(with lr=1.0 the first step lands on w = 1: later losses are 0). A row that differs is a bug or one of the
deliberate differences in docs/migrating-lightning.md ("Where taskfit differs").
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import os
import shutil
import sys
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.abspath("lightning_parity_runs")


# ---- what both frameworks share: the model, its data, its loss, its optimizer -----------------------------------
@dataclasses.dataclass
class Spec:
    n: int = 18                      # training samples x = 0..n-1
    batch_size: int = 2
    val: tuple[int, int] = (100, 4)  # validation samples x = start..start+n-1, batches of 2
    lr: float = 1e-4
    hidden: int = 0                  # > 0: a seeded MLP instead of the zero-initialised line
    scheduler: Callable[[torch.optim.Optimizer], dict] | None = None  # optimizer -> lr_scheduler config
    probe: bool = False              # loss = w (so d(loss)/dw = 1 per micro-batch), lr 0
    log_y: bool = False              # self.log("y", mean of the batch's targets) in training


def make_net(spec: Spec) -> nn.Module:
    torch.manual_seed(0)
    if spec.hidden:
        return nn.Sequential(nn.Linear(1, spec.hidden), nn.Tanh(), nn.Linear(spec.hidden, 1))
    net = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(net.weight)
    return net


def loss_of(net: nn.Module, outputs: torch.Tensor, targets: torch.Tensor, spec: Spec) -> torch.Tensor:
    return net.weight.sum() if spec.probe else ((outputs - targets) ** 2).mean()


def loader(start: int, n: int, batch_size: int) -> DataLoader:
    x = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
    return DataLoader(TensorDataset(x, x.clone()), batch_size=batch_size, shuffle=False)


class Run:
    """What one run observed, recorded the same way in both frameworks."""

    def __init__(self, framework: str, root: str) -> None:
        self.framework, self.root = framework, root
        self.val_steps: list[int] = []       # global step at the end of each validation in fit (no sanity pass)
        self.step_lrs: list[float] = []      # the lr each optimizer step used
        self.grads: list[float] = []         # d(loss)/dw at each optimizer step (the line only)
        self.train_batches = self.epochs = self.sanity_batches = 0
        self.val_seen: list[list[float]] = []  # the x of every validation batch in fit (no sanity pass)
        self.sanity_val_logged: bool | None = None  # val/loss in the metrics at the first training batch
        self.error: BaseException | None = None
        self.trainer = self.module = self.result = None

    def lr_changes(self) -> list[int]:
        """The global steps after which the learning rate changed (the final lr closes the list)."""
        lrs = self.step_lrs + [self.module.opt.param_groups[0]["lr"]]
        return [i for i in range(1, len(lrs)) if lrs[i] != lrs[i - 1]]

    def files(self, suffix: str = "") -> list[str]:
        return sorted(os.path.basename(f) if suffix else os.path.relpath(os.path.join(d, f), self.root)
                      for d, _, fs in os.walk(self.root) for f in fs if f.endswith(suffix))

    def params(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.module.parameters()])


class Shared:
    """The module's parts both frameworks share: a mixin before LightningModule / TaskModule."""

    spec: Spec
    run: Run

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net(self.spec)

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        self.opt = torch.optim.SGD(self.parameters(), lr=0.0 if self.spec.probe else self.spec.lr)
        return self.opt if self.spec.scheduler is None else {"optimizer": self.opt,
                                                             "lr_scheduler": self.spec.scheduler(self.opt)}

    def train_dataloader(self):
        return loader(0, self.spec.n, self.spec.batch_size)

    def val_dataloader(self):
        return loader(*self.spec.val, 2)

    def test_dataloader(self):  # 0..9 in batches of 4, 4, 2
        return loader(0, 10, 4)

    def seen(self, x: torch.Tensor, sanity: bool, fitting: bool) -> None:  # a validation batch
        self.run.sanity_batches += sanity
        if fitting and not sanity:
            self.run.val_seen.append(x[:, 0].tolist())


class Recorder:
    """The callback hooks both frameworks share (same names and arguments): a mixin before their Callback."""

    run: Run

    def on_train_epoch_start(self, trainer, module):
        self.run.epochs += 1

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.run.sanity_val_logged is None:
            metrics = trainer.state.metrics if self.run.framework == "taskfit" else trainer.callback_metrics
            self.run.sanity_val_logged = "val/loss" in metrics

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.run.train_batches += 1

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.run.step_lrs.append(optimizer.param_groups[0]["lr"])
        if isinstance(module.net, nn.Linear) and module.net.weight.grad is not None:
            self.run.grads.append(float(module.net.weight.grad))

    def on_validation_end(self, trainer, module):
        if self.run.framework == "taskfit" and trainer.state.fn == "fit":  # its sanity pass calls no hook
            self.run.val_steps.append(trainer.state.global_step)
        elif self.run.framework == "lightning" and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.run.val_steps.append(trainer.global_step)


QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
             enable_checkpointing=False, num_sanity_val_steps=0)


def framework_classes(framework: str) -> tuple[type, type, Any, type]:
    """(module base, Callback base, callbacks module, Trainer) of one framework; Lightning's imports stay here."""
    if framework == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch import callbacks

        class LitLine(Shared, pl.LightningModule):
            def training_step(self, batch, batch_idx):
                if self.spec.log_y:
                    self.log("y", batch[1].mean(), on_step=False, on_epoch=True)
                return loss_of(self.net, self(batch[0]), batch[1], self.spec)

            def validation_step(self, batch, batch_idx):
                self.seen(batch[0], self.trainer.sanity_checking, self.trainer.state.fn == "fit")
                self.log("val/loss", loss_of(self.net, self(batch[0]), batch[1], self.spec))

            def test_step(self, batch, batch_idx):
                self.log("test/loss", loss_of(self.net, self(batch[0]), batch[1], self.spec))

        return LitLine, pl.Callback, callbacks, pl.Trainer

    from taskfit import TaskModule, Trainer, callbacks

    class Line(Shared, TaskModule):
        def loss(self, outputs, targets):
            stage = self.trainer.state.stage
            if stage in ("sanity", "val"):  # targets == inputs here
                self.seen(targets, stage == "sanity", self.trainer.state.fn == "fit")
            if self.spec.log_y and stage == "train":
                self.log("y", targets.mean(), on_step=False, on_epoch=True)  # the same call as Lightning's side
            return loss_of(self.net, outputs, targets, self.spec)

    return Line, callbacks.Callback, callbacks, Trainer


def run_one(framework: str, setting: str, spec: Spec, callbacks: Callable = lambda module: [],
            entry: str = "fit", **settings) -> Run:
    """Train (or validate/test) ``spec`` with one framework; errors are kept in ``run.error``."""
    root = os.path.join(ROOT, setting, framework)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    run = Run(framework, root)
    module_base, callback_base, callback_module, trainer_class = framework_classes(framework)
    module = type("Task", (module_base,), {"spec": spec, "run": run})
    record = type("Record", (Recorder, callback_base), {"run": run})
    try:
        run.module = module()
        run.trainer = trainer_class(**{**QUIET, "default_root_dir": root, **settings,
                                       "callbacks": [record(), *callbacks(callback_module)]})
        extra = {"verbose": False} if framework == "lightning" and entry != "fit" else {}
        run.result = getattr(run.trainer, entry)(run.module, **extra)
    except Exception as error:  # noqa: BLE001 - the error is what some settings compare
        run.error = error
    return run


def both(setting: str, spec: Spec | None = None, **settings) -> tuple[Run, Run]:
    return tuple(run_one(fw, setting, spec or Spec(), **settings) for fw in ("lightning", "taskfit"))


def error_name(run: Run) -> str:
    kinds = [base.__name__ for base in (ValueError, TypeError, RuntimeError) if isinstance(run.error, base)]
    name = type(run.error).__name__ if run.error is not None else "no error"
    return name if not kinds or kinds[0] == name else f"{name} (a {kinds[0]})"


def row(what: str, runs: tuple[Run, Run], value: Callable[[Run], Any],
        taskfit_value: Callable[[Run], Any] | None = None) -> tuple[str, Any, Any]:
    """A table row: ``value`` of each run (``taskfit_value`` for taskfit's where the names differ), or its error."""
    (lit, tf), taskfit_value = runs, taskfit_value or value
    return (what, f"error: {error_name(lit)}" if lit.error else value(lit),
            f"error: {error_name(tf)}" if tf.error else taskfit_value(tf))


# ---- the settings: each returns rows (what is compared, Lightning's value, taskfit's value[, same?]) -------------
def val_check_interval():
    return [row(f"val_check_interval={interval}, 2 epochs: global steps of validations",
                both(f"vci_{interval}", max_epochs=2, val_check_interval=interval), lambda r: r.val_steps)
            for interval in (0.25, 0.5, 1.0, 4)] + [
        row("check_val_every_n_epoch=2, 4 epochs: validation steps",
            both("cven_2", max_epochs=4, check_val_every_n_epoch=2), lambda r: r.val_steps)]


def vci_20():
    lit, tf = both("vci_20", max_epochs=3, val_check_interval=20)
    same = "yes (both ValueError)" if isinstance(lit.error, ValueError) and isinstance(tf.error, ValueError) else "NO"
    return [("val_check_interval=20 > 9 batches: error type", error_name(lit), error_name(tf), same),
            row("... with check_val_every_n_epoch=None, 3 epochs: validation steps",
                both("vci_20_none", max_epochs=3, val_check_interval=20, check_val_every_n_epoch=None),
                lambda r: r.val_steps)]


def limits():
    return [row("limit_train_batches=0.5 (of 9): training batches run",
                both("limit_train", max_epochs=1, limit_train_batches=0.5), lambda r: r.train_batches),
            row("limit_val_batches=1 (of 2): validation batches run",
                both("limit_val", max_epochs=1, limit_val_batches=1), lambda r: len(r.val_seen))]


def sanity():
    runs = both("sanity", Spec(val=(100, 10)), max_epochs=1, num_sanity_val_steps=2)  # 5 validation batches
    return [row("num_sanity_val_steps=2, 5 val batches: batches in the sanity pass", runs, lambda r: r.sanity_batches),
            row("... sanity val/loss in the metrics at the first training batch", runs, lambda r: r.sanity_val_logged)]


def clipping():
    return [row("gradient_clip_val=0.5 (norm), lr 1e-3, 1 epoch: final weight",
                both("clip", Spec(lr=1e-3), max_epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="norm"),
                lambda r: float(r.params()[0]))]


def schedulers():
    step_lr = lambda **config: lambda opt: {"scheduler": StepLR(opt, step_size=1, gamma=0.5), **config}  # noqa
    plateau = lambda opt: {"scheduler": ReduceLROnPlateau(opt, factor=0.5, patience=0), "monitor": "val/loss"}  # noqa
    rows = [row(f"StepLR({label}), 3 epochs: steps after which the lr changed",
                both("steplr", Spec(lr=1.0, scheduler=config), max_epochs=3), Run.lr_changes)
            for label, config in (("interval=step, frequency=2", step_lr(interval="step", frequency=2)),
                                  ("interval=epoch", step_lr(interval="epoch")))]
    epoch_lrs = lambda r: [r.step_lrs[9], r.step_lrs[18], r.module.opt.param_groups[0]["lr"]]  # noqa: E731
    rows.append(row("ReduceLROnPlateau(val/loss, patience=0), constant loss, 3 epochs: lr after each epoch",
                    both("plateau", Spec(lr=1.0, scheduler=plateau), max_epochs=3), epoch_lrs))
    return rows


def early_stopping():
    runs = both("early_stopping", Spec(lr=1.0), max_epochs=5,
                callbacks=lambda m: [m.EarlyStopping(monitor="val/loss", patience=1, verbose=False)])
    stopped = lambda r: next(c.stopped_epoch for c in r.trainer.callbacks if hasattr(c, "stopped_epoch"))  # noqa
    return [row("EarlyStopping(val/loss, patience=1), constant loss: epochs trained", runs, lambda r: r.epochs),
            row("... EarlyStopping.stopped_epoch", runs, stopped)]


def checkpoints():
    cbs = lambda m: [m.ModelCheckpoint(monitor="val/loss", save_top_k=-1, save_last=False)]  # noqa: E731
    cases = (("check_val_every_n_epoch=2, 4 epochs", dict(max_epochs=4, check_val_every_n_epoch=2)),
             ("val_check_interval=0.5, 2 epochs", dict(max_epochs=2, val_check_interval=0.5)))
    return [row(f"ModelCheckpoint(val/loss, save_top_k=-1, save_last=False), {label}: files",
                both("ckpt", callbacks=cbs, enable_checkpointing=True, **settings), lambda run: run.files(".ckpt"))
            for label, settings in cases]


def epoch_mean():
    return [row("self.log('y', mean target) over batches of 4, 4, 2: the epoch value",
                both("epoch_mean", Spec(n=10, batch_size=4, log_y=True), max_epochs=1),
                lambda r: float(r.trainer.callback_metrics["y"]), lambda r: r.trainer.state.metrics["train/y"])]


def accumulation():
    return [row("accumulate_grad_batches=3, 4 batches, d(loss)/dw = 1: gradient of each group",
                both("accumulate", Spec(n=8, probe=True), max_epochs=1, accumulate_grad_batches=3), lambda r: r.grads)]


def overfit():
    return [row("overfit_batches=2: the x validation sees", both("overfit", max_epochs=1, overfit_batches=2),
                lambda r: r.val_seen)]


def max_steps():
    runs = both("max_steps", max_epochs=5, max_steps=7, enable_checkpointing=True)
    return [row("max_steps=7 (9 batches/epoch): current_epoch / state.epoch after fit", runs,
                lambda r: r.trainer.current_epoch, lambda r: r.trainer.state.epoch),
            row("... global step after fit", runs, lambda r: r.trainer.global_step,
                lambda r: r.trainer.state.global_step),
            row("... default ModelCheckpoint: files", runs, lambda run: run.files(".ckpt"))]


def fast_dev_run():
    runs = both("fast_dev_run", **dict(QUIET, logger=True, enable_checkpointing=True, fast_dev_run=True, max_epochs=5))
    return [row("fast_dev_run=True (logger, checkpointing on): training, validation batches", runs,
                lambda r: (r.train_batches, len(r.val_seen))),
            row("... files written", runs, Run.files)]


def evaluate():
    plain = lambda r: [{k: float(v) for k, v in d.items()} for d in r.result]  # noqa: E731
    return [row(f"trainer.{entry}() on the untrained line: return value", both(entry, entry=entry), plain)
            for entry in ("validate", "test")]


def final_params():
    lit, tf = both("plain", Spec(hidden=8, lr=1e-4), max_epochs=2)
    if lit.error or tf.error:
        return [row("MLP(1-8-1), seed 0, 2 epochs: final parameters", (lit, tf), Run.params)]
    diff = float((lit.params() - tf.params()).abs().max())
    return [("MLP(1-8-1), seed 0, lr 1e-4, 2 epochs: sum of final parameters", float(lit.params().sum()),
             float(tf.params().sum()), f"{'yes' if diff <= 1e-6 else 'NO'} (max abs diff {diff:.3g})")]


SETTINGS = {f.__name__: f for f in (val_check_interval, vci_20, limits, sanity, clipping, schedulers,
                                    early_stopping, checkpoints, epoch_mean, accumulation, overfit, max_steps,
                                    fast_dev_run, evaluate, final_params)}


# ---- the table -------------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def close(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-6 (relative), element by element."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = list(a.items()), list(b.items())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SETTINGS, metavar="NAME", help="run one setting: " + ", ".join(SETTINGS))
    args = parser.parse_args()
    if importlib.util.find_spec("lightning") is None:
        print("PyTorch Lightning is not installed: `pip install lightning` (or `pip install lightning --no-deps` "
              "to keep your torch), then run this script again.")
        return 0
    import lightning
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "taskfit"):  # quiet: the table is the output
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(f"Lightning {lightning.__version__} against taskfit {__import__('taskfit').__version__}; "
          f"runs under {ROOT}\n")
    print("| setting | what is compared | Lightning | taskfit | same? |\n|---|---|---|---|---|")
    differ = 0
    for name in ([args.only] if args.only else SETTINGS):
        for line in SETTINGS[name]():
            what, lit, tf = line[:3]
            same = line[3] if len(line) > 3 else ("yes" if close(lit, tf) else "NO")
            differ += not same.startswith("yes")
            print(f"| {name} | {what} | {fmt(lit)} | {fmt(tf)} | {same} |", flush=True)
    print(f"\n{differ} row(s) differ; see docs/migrating-lightning.md for the deliberate differences.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
